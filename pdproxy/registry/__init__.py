"""The instance registry: wire messages, the table, and the ZMQ server that feeds it."""
