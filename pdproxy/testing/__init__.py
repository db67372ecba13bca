"""Test doubles for pdproxy: a fake vLLM worker and a fake fleet for tests and the demo."""
