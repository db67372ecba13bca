"""Real vLLM servers in the registry: announced by the connector with the geometry of their real
VllmConfig, expired when they stop, and announced with real load by the `pdproxy announce`
sidecar."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from pdproxy.demo.fleet import LocalFleet
from pdproxy.demo.processes import ManagedProcess, free_ports, pdproxy_command, wait_until
from tests.harness.vllm_cpu import MODEL_NAME, VllmServer, running_servers
from tests.harness.vllm_env import VllmEnv
from tests.vllm.conftest import RealStack

pytestmark = pytest.mark.vllm

# The tiny model's KV cache as vLLM builds it on CPU: 2 layers of 2 KV heads of 32, fp32, in
# vLLM's CPU block size of 128 and its head-major block interior.
REAL_GEOMETRY = {
    "tp_size": 1,
    "block_size": 128,
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 32,
    "kv_dtype": "float32",
    "is_mla": False,
    "kv_layout": "HND",
}


def test_connector_announces_real_geometry(real_stack: RealStack) -> None:
    servers = (real_stack.prefill, real_stack.decode)

    def idle() -> bool:
        listed = real_stack.instances()
        prefill_load = listed[real_stack.prefill.http_address]["load"]
        return prefill_load.get("prefill_tokens") == 0 and all(
            listed[server.http_address]["load"]["running"] == 0 for server in servers
        )

    # Load is reported every announce interval (1 s): requests of earlier tests (aborted ones
    # included) may still show for one report. A request the connector never saw finish would
    # keep `running` above 0 and fail here.
    wait_until(idle, 10.0, "both servers to announce no running request and no prefill work")
    instances = real_stack.instances()
    for server, role in ((real_stack.prefill, "P"), (real_stack.decode, "D")):
        item = instances[server.http_address]
        assert item["type"] == role
        assert item["source"] == "v1"
        assert item["zmq_address"] == server.zmq_address
        assert item["model"] == MODEL_NAME
        assert item["connector"] == "pdproxy"
        assert item["geometry"] == REAL_GEOMETRY
        assert item["healthy"] is True
        assert item["load"]["running"] == 0
    # The prefill announces its work: after every earlier test's prompts (cached, chunked,
    # aborted), none is left over. A decode announces none.
    assert instances[real_stack.prefill.http_address]["load"]["prefill_tokens"] == 0
    assert "prefill_tokens" not in instances[real_stack.decode.http_address]["load"]
    announced = [r for r in real_stack.prefill.records() if r["event"] == "announcing"]
    assert announced and announced[0]["geometry"] == REAL_GEOMETRY
    # The prefill was given no advertise_host: it announced the local end of its route to the
    # registry (loopback here), not the host's first interface address, and logged it.
    assert announced[0]["zmq_address"] == real_stack.prefill.zmq_address
    log = real_stack.prefill.log_path.read_text(errors="replace")
    assert f"zmq {real_stack.prefill.zmq_address} (host from route to the registry)" in log


def test_a_real_prefill_announces_the_work_it_has_queued(real_stack: RealStack) -> None:
    """A burst of prompts sent straight to the prefill: the work its connector samples for the
    announcer (recorded as "work") rises above 0 while they are queued and computed, never above
    the prompt tokens sent, and is 0 again once they are done."""
    prefill = real_stack.prefill
    before = len(prefill.records("work"))
    client = openai.OpenAI(
        base_url=f"{prefill.url}/v1", api_key="x", max_retries=0, timeout=GENERATION_BOUND_S
    )
    # One request of 24 prompts: they reach the engine together and queue there (two fit a
    # step of --max-num-batched-tokens), where 24 requests of one prompt each may trickle in
    # one by one behind the API server's own work and never queue at all.
    prompts = [" ".join(f"w{index}x{k}" for k in range(120)) for index in range(24)]
    answer = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=1)
    assert answer.usage is not None and len(answer.choices) == len(prompts)
    sent = answer.usage.prompt_tokens

    def settled() -> bool:
        work = prefill.records("work")[before:]
        return bool(work) and work[-1]["prefill_tokens"] == 0

    try:
        wait_until(settled, 10.0, "the prefill's work to be sampled back at 0")
    finally:
        work = [row["prefill_tokens"] for row in prefill.records("work")[before:]]
    print(f"sampled work: {work[:12]}{' ...' if len(work) > 12 else ''}; sent {sent}")
    assert max(work) > 0
    assert max(work) <= sent


def test_stopped_vllm_server_leaves_the_registry_within_the_ttl(
    vllm_env: VllmEnv, vllm_model: Path, tmp_path: Path
) -> None:
    ttl = 6.0
    proxy = LocalFleet(tmp_path / "proxy", [], ["--ttl", str(ttl)]).start()
    try:
        http_port, kv_port = free_ports(2)
        spare = VllmServer(
            "vllm-spare", "kv_consumer", http_port, kv_port, tmp_path, proxy.registry_address
        )
        with running_servers(vllm_env, vllm_model, [spare]):
            wait_until(lambda: spare.http_address in proxy.registered(), 15.0, "registration")
            stopped = time.monotonic()
            spare.stop()
            wait_until(
                lambda: spare.http_address not in proxy.registered(),
                ttl + 2.0,  # the TTL plus one sweep period
                "the stopped server to leave the registry",
            )
            print(
                f"\nstopped vLLM server left the registry after {time.monotonic() - stopped:.1f} s"
            )
    finally:
        proxy.stop()


BARRIER_TIMEOUT_S = 60.0  # one generation of 1,500 tokens takes seconds here
GENERATION_BOUND_S = 60.0
# How long the sidecar may take to report a change of vLLM's load. It announces every 0.3 s, but
# on this machine every process can stop at once for tens of seconds while vLLM's workers spin
# (a 20 s bound failed with the sidecar silent for 21 s and vLLM's own engine idle meanwhile);
# the wait ends as soon as the load is reported.
LOAD_REPORT_BOUND_S = 60.0


def _busy(
    stack: RealStack,
    stop: threading.Event,
    together: threading.Barrier,
    errors: list[BaseException],
) -> None:
    """Keep one long generation running on P, straight to vLLM (not through the proxy).

    The generations start together, round after round: started independently they drifted
    into taking turns on this 2-core machine, so vLLM never ran two at once for long enough to
    be reported. They are not streamed: a client thread that reads a stream chunk by chunk
    competes for the cores with the engine, and on a loaded machine one stream lagged until the
    other had ended."""
    client = openai.OpenAI(
        base_url=f"{stack.prefill.url}/v1", api_key="x", max_retries=0, timeout=GENERATION_BOUND_S
    )
    try:
        while not stop.is_set():
            together.wait(BARRIER_TIMEOUT_S)
            client.completions.create(
                model=MODEL_NAME,
                prompt="Keep going",
                max_tokens=1500,
                extra_body={"ignore_eos": True},
            )
    except threading.BrokenBarrierError:
        if not stop.is_set():  # broken by the test on its way out: not a failure
            errors.append(AssertionError("the other generation never came back to start"))
    except BaseException as exc:
        errors.append(exc)
    finally:
        together.abort()  # whoever waits for this thread's next round would wait in vain


def test_announce_sidecar_reports_real_vllm_load(real_stack: RealStack, tmp_path: Path) -> None:
    proxy = LocalFleet(tmp_path / "proxy", [], ["--ttl", "30"]).start()
    server = real_stack.prefill
    (sidecar_kv,) = free_ports(1)
    sidecar = ManagedProcess(
        "announce",
        pdproxy_command(
            "announce",
            "--role",
            "P",
            "--http-address",
            server.http_address,
            "--zmq-address",
            f"127.0.0.1:{sidecar_kv}",
            "--registry",
            proxy.registry_address,
            "--model",
            MODEL_NAME,
            "--connector",
            "pdproxy",
            "--model-config",
            str(real_stack.model / "config.json"),
            "--tp-size",
            "1",
            "--block-size",
            "128",
            "--kv-layout",
            "HND",
            "--interval",
            "0.3",
        ),
        tmp_path / "announce.log",
    )
    stop = threading.Event()
    errors: list[BaseException] = []
    together = threading.Barrier(2)
    workers = [
        threading.Thread(target=_busy, args=(real_stack, stop, together, errors)) for _ in range(2)
    ]

    def announced() -> dict[str, Any]:
        return next((i for i in proxy.instances() if i["http_address"] == server.http_address), {})

    try:
        sidecar.start()
        wait_until(lambda: bool(announced()), 15.0, "the sidecar's announcement", [sidecar])
        idle = announced()
        assert idle["source"] == "v1" and idle["healthy"] is True
        # config.json plus flags give the same geometry the connector read from vLLM itself.
        assert idle["geometry"] == REAL_GEOMETRY
        assert idle["load"]["running"] == 0 and idle["load"]["waiting"] == 0

        for worker in workers:
            worker.start()
        # The listing that showed both running: under load the proxy may miss one /v1/instances
        # call later (instances() is then empty), so it is kept, not asked for again.
        seen: dict[str, Any] = {}
        # How the proxy's listings fared: a failure then tells a stale sidecar from a proxy
        # that did not list the instance (or did not answer) in the meantime. Each listing
        # with it: (when, running, seconds since the sidecar's last message), so that a sidecar
        # that scrapes rarely, or only between the rounds' generations, shows too.
        listings: list[tuple[float, Any, Any]] = []
        without = 0
        began = time.monotonic()

        def two_running() -> bool:
            nonlocal without
            listed = announced()
            if listed:
                seen.update(listed)
                load = listed.get("load") or {}
                listings.append(
                    (time.monotonic(), load.get("running"), listed.get("last_seen_seconds_ago"))
                )
            else:
                without += 1
            return bool(seen.get("load", {}).get("running") == 2)

        try:
            wait_until(
                two_running,
                LOAD_REPORT_BOUND_S,
                "the sidecar to report two running requests",
                [sidecar],
            )
        except TimeoutError as exc:
            # What was seen instead: the last announced load, what vLLM itself says, and how
            # the two generations fared.
            running = [
                line
                for line in server.metrics_text().splitlines()
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
            ]
            last = f"{time.monotonic() - listings[-1][0]:.1f} s ago" if listings else "never"
            history = [(round(at - began, 1), count, age) for at, count, age in listings[-40:]]
            raise AssertionError(
                f"{exc}\nlast announced: {seen}\nlistings with the instance: {len(listings)}, "
                f"without it: {without}, the last with it {last}\n"
                f"listings (s, running, last message s ago): {history}\nvLLM: {running}\n"
                f"errors: {errors}"
            ) from None
        busy = seen["load"]
        assert busy["kv_usage"] > 0.0
        stop.set()
        for worker in workers:
            worker.join(GENERATION_BOUND_S + 5)
        assert not errors
        wait_until(
            lambda: announced().get("load", {}).get("running") == 0,
            LOAD_REPORT_BOUND_S,
            "the sidecar to report the server idle again",
            [sidecar],
        )
        assert sidecar.stop() == 0
        wait_until(lambda: not announced(), 5.0, "the sidecar's leave")
    finally:
        stop.set()
        for worker in workers:
            if worker.is_alive():
                worker.join(GENERATION_BOUND_S + 5)
        sidecar.stop()
        proxy.stop()
