"""The chaos harness: faults injected while a workload runs, and what must hold afterwards."""
