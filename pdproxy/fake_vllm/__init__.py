"""A fake vLLM worker (prefill or decode) for tests and the demo: no GPU, no model.

    python -m pdproxy fake-worker --role P --port 18100 --kv-port 18101 --proxy 127.0.0.1:30001

It answers vLLM's OpenAI endpoints the way vLLM does (object shapes, ids, SSE framing, validation
errors) with deterministic text, and it hands KV over the way its --connector does:

- p2p_nccl imitates P2pNcclConnector's addressing (DESIGN.md section 2): a prefill worker given
  a tagged X-Request-Id pushes a small KV payload over ZMQ to the decode address that vLLM's
  regex finds in the id, and a decode worker given a tagged id answers only once that payload
  arrived, from the prefill address the id names, for the same prompt (kv_push_flow);
- nixl and pdproxy imitate NixlConnector and vLLM's toy proxy: a prefill asked to
  do_remote_decode holds the KV and answers kv_transfer_params saying where it is, and a decode
  given them reads it from that prefill's KV port (kv_pull_flow).

The KV payload carries the prefill's connector and geometry, and a decode checks them against
its own with rules of its own (kv_compat, deliberately not pdproxy's). A proxy that tags ids
wrongly, sends a leg to the wrong instance, garbles kv_transfer_params or pairs incompatible
instances gets a loud HTTP 500 and a kv_failed event instead of a silent success. A decode
asked for no KV computes the prompt itself (a computed_locally event).

A worker announcing in v1 also reports each handoff's statistics to the registry with the "stats"
op, as every TP rank of a PdproxyConnector instance does (kv_stats).

Endpoints under /_fake/ let tests in other processes see what arrived (requests, KV traffic,
aborts), inject failures and force the announced load (POST /_fake/load). Times are
`time.monotonic()` ("time", comparable between processes on one machine) plus `time.time()`
("wall").

Only the command line is imported here: the server needs aiohttp (the `fake-worker` extra), and
`pdproxy --help` must work without it.
"""

from pdproxy.fake_vllm.cli import add_cli, main, run_from_args
from pdproxy.fake_vllm.config import Geometry, WorkerConfig

__all__ = ("Geometry", "WorkerConfig", "add_cli", "main", "run_from_args")
