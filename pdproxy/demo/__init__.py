"""`pdproxy demo` (run.py): a real proxy and a fleet of fake vLLM workers (fleet.py), each its own
process, started and stopped by PID (processes.py). The integration tests reuse the last two."""
