"""Fixtures shared by several integration test modules."""

# The HTTP protocol served on a loop in a thread, for the protocol's own test modules.
from tests.integration.test_http_protocol import served  # noqa: F401
