"""The local dev stack: the broker and PostgreSQL of `kafold dev` (stack), Apache Kafka's jars and nodes
(apache_kafka), a schema registry for tests (registry_server) and the pytest fixtures on them (fixtures)."""
