"""PostgreSQL projections: the exactly-once writer, mappings, migrations, rebuilds and faults."""
