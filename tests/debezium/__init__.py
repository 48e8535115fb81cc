"""A real Debezium PostgreSQL source for the tests: a Kafka Connect worker assembled from Maven Central, a source
PostgreSQL with logical WAL, and the end-to-end test of kafold projecting what Debezium writes."""
