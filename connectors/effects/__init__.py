"""Side-effect connectors (webhook, kafka, python): ordered per key, retried, parked, committed after success."""
