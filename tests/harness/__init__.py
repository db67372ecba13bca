"""Test-only helpers, outside the wheel: real vLLM (CPU build) servers and their cached venv, the
tiny model they serve, one bounded install step, and a crowd of held SSE streams."""
