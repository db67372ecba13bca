"""pdproxy: the front door for prefill/decode-disaggregated vLLM fleets."""

__version__ = "0.1.0"
