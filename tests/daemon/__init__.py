"""The daemon: its host, HTTP API, lifecycle, reload and the sink runner it drives."""
