"""The kafold.toml loader: validation up front, every problem named with its key and file."""
