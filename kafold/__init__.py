"""kafold: Kafka as a practical event store for Python services."""

__version__ = "0.1.0"
