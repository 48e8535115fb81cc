"""Aggregates: the command runtime, exactly-once commands, idempotency, crash recovery and the domain loader."""
