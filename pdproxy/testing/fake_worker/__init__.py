"""A fake vLLM worker (prefill or decode) for tests and the demo: no GPU, no model.

    python -m pdproxy fake-worker --role P --port 18100 --kv-port 18101 --proxy 127.0.0.1:30001

It answers vLLM's OpenAI endpoints the way vLLM does (object shapes, ids, SSE framing, validation
errors) with deterministic text, and it imitates P2pNcclConnector's addressing (DESIGN.md
section 2): a prefill worker given a tagged X-Request-Id pushes a small KV payload over ZMQ to
the decode address that vLLM's regex finds in the id, and a decode worker given a tagged id
answers only once that payload arrived, from the prefill address the id names, for the same
prompt. A proxy that tags ids wrongly or sends a leg to the wrong instance gets a loud HTTP 500
instead of a silent success.

Endpoints under /_fake/ let tests in other processes see what arrived (requests, KV traffic,
aborts) and inject failures. Times are `time.monotonic()` ("time", comparable between processes
on one machine) plus `time.time()` ("wall").
"""

from pdproxy.testing.fake_worker.cli import add_cli, main, run_from_args
from pdproxy.testing.fake_worker.config import Geometry, WorkerConfig
from pdproxy.testing.fake_worker.server import run_worker

__all__ = ("Geometry", "WorkerConfig", "add_cli", "main", "run_from_args", "run_worker")
