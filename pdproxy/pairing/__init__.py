"""Choosing a (prefill, decode) pair: compatibility, policies, the planner. Pure."""
