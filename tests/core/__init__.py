"""The shared core (kafold/*.py): the envelope, retry, Kafka clients, topics, partitioning and PostgreSQL settings."""
