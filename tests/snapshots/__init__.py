"""Aggregate snapshots: the record format, local and Spark runs, restore, compaction and the scheduler."""
