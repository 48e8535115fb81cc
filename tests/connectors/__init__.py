"""The connector plugin system: the registry, the built-in log sink and the example plugin against the contract."""
