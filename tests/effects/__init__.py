"""Side-effect connectors (webhook, Kafka, Python): ledger, retries, parking, crashes and outages."""
