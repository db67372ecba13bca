"""Which modules the compiled build compiles, and which of them this process runs compiled.

The default install is pure Python. `PDPROXY_COMPILE=1` (setup.py) compiles the modules below
with mypyc: the request path from the accepted connection to the relayed answer, the decisions
it makes on the way (ids, pairing and its policies, outlier state) and the metrics it updates.
Everything else (start-up, the registry, the CLI, the worker side) stays interpreted: it is not
where requests spend their time.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util

# Dotted names. mypyc cannot compile async generators (proxy/app.py has one) nor subclasses of
# most built-in exceptions (proxy/tracing.py has one): the per-request parts of both live in
# modules of their own (proxy/front.py, tracing/w3c.py).
#
# Dataclasses made per request have a hand-written __init__ (init=False) and are not frozen,
# because the generated one runs interpreted: docs/performance.md, "Dataclass constructors".
COMPILED_MODULES = (
    "pdproxy.ids",
    "pdproxy.local_metrics",
    "pdproxy.metrics",
    "pdproxy.pairing.candidates",
    "pdproxy.pairing.features",
    "pdproxy.pairing.inflight",
    "pdproxy.pairing.planner",
    "pdproxy.pairing.policies.base",
    "pdproxy.pairing.policies.least_kv",
    "pdproxy.pairing.policies.least_loaded",
    "pdproxy.pairing.policies.power_of_two",
    "pdproxy.pairing.policies.prefix_affinity",
    "pdproxy.pairing.policies.round_robin",
    "pdproxy.pairing.prefix_cache",
    "pdproxy.pairing.scoreboard",
    "pdproxy.proxy.admission",
    "pdproxy.proxy.api_bodies",
    "pdproxy.http.alarms",
    "pdproxy.proxy.completions",
    "pdproxy.proxy.credentials",
    "pdproxy.http.deadline",
    "pdproxy.proxy.dispatch",
    "pdproxy.proxy.error_shapes",
    "pdproxy.proxy.front",
    "pdproxy.proxy.exchange",
    "pdproxy.http.server_protocol",
    "pdproxy.proxy.kv_params",
    "pdproxy.proxy.lease",
    "pdproxy.proxy.migration_plan",
    "pdproxy.proxy.migration_stream",
    "pdproxy.proxy.prompt",
    "pdproxy.tracing.random_ids",
    "pdproxy.proxy.request",
    "pdproxy.proxy.stream_opening",
    "pdproxy.proxy.rotation",
    "pdproxy.http.slots",
    "pdproxy.tracing.context",
    "pdproxy.http.upstream",
    "pdproxy.tracing.w3c",
    "pdproxy.reliability.outlier",
)


def compiled_modules() -> list[str]:
    """The modules of COMPILED_MODULES that import from an extension module (found without
    importing them)."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    compiled = []
    for name in COMPILED_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None and spec.origin.endswith(suffixes):
            compiled.append(name)
    return compiled


def build_description() -> str:
    """How this process's pdproxy is built, for --version and the start-up log."""
    count = len(compiled_modules())
    if count == 0:
        return "pure Python"
    return f"compiled with mypyc: {count} of {len(COMPILED_MODULES)} hot-path modules"
