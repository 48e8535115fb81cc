"""`kafold bench AREA`: each area is a module here exposing add_arguments(parser) and run(args) -> dict of figures."""

# area name -> module (kafold.bench.<module>); a module is imported only when its area runs.
AREAS: dict[str, str] = {"projection": "projection", "daemon": "daemon", "snapshots": "snapshots", "effects": "effects"}
