"""The `kafold dev` stack (tansu or Apache Kafka, and PostgreSQL): started, reused, restarted and stopped."""
