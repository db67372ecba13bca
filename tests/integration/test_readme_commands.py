"""README.md's "A fleet by hand", run as written: its commands (the README's fixed ports swapped
for free ones), its curl calls and its Python client snippet, against real processes."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdproxy.demo.processes import ManagedProcess, free_ports, pdproxy_command, wait_until

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## A fleet by hand"
# The README's ports, in the order they are given free stand-ins.
README_PORTS = ("8000", "30001", "8100", "8200", "21001", "22001")
COMMAND_TIMEOUT_S = 30.0


def section() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return text[start:end]


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section(), flags=re.S)


def with_ports(text: str, ports: dict[str, str]) -> str:
    # Whole numbers only, so 8100 never matches inside 18100.
    return re.sub(r"\b(\d{4,5})\b", lambda m: ports.get(m.group(1), m.group(1)), text)


def shell_lines(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


@pytest.fixture
def ports() -> dict[str, str]:
    return dict(zip(README_PORTS, map(str, free_ports(len(README_PORTS))), strict=True))


@pytest.fixture
def fleet(ports: dict[str, str], tmp_path: Path) -> Iterator[list[ManagedProcess]]:
    setup, _requests = blocks("bash")
    commands = [line for line in shell_lines(setup) if line.startswith("pdproxy ")]
    assert [shlex.split(c)[1] for c in commands] == ["serve", "fake-worker", "fake-worker"]
    processes = []
    try:
        for index, command in enumerate(commands):
            argv = shlex.split(with_ports(command, ports))[1:]
            if argv[0] == "serve":  # the README's proxy uses the default HTTP port, 8000
                argv += ["--port", ports["8000"]]
            log = tmp_path / f"process-{index}.log"
            processes.append(ManagedProcess(argv[0], pdproxy_command(*argv), log).start())
        yield processes
    finally:
        for process in processes:
            process.stop()


def run(argv: list[str]) -> str:
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, (argv, done.stderr)
    return done.stdout


def answers_200(url: str) -> bool:
    probe = ["curl", "-sf", "--max-time", "5", url]
    return subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode == 0


def test_the_readme_fleet_by_hand_works_as_written(
    fleet: list[ManagedProcess], ports: dict[str, str]
) -> None:
    _setup, requests = blocks("bash")
    ready, completion, chat, instances = (
        shlex.split(with_ports(line, ports)) for line in shell_lines(requests)
    )
    ready_url = ready[-1]
    wait_until(
        lambda: answers_200(ready_url),
        COMMAND_TIMEOUT_S,
        "/ready to answer 200, as the README says",
        fleet,
    )
    assert json.loads(run(ready)) == {"status": "ready"}

    answer = json.loads(run(completion))
    tagged = (
        f"cmpl-___prefill_addr_127.0.0.1:{ports['21001']}___decode_addr_127.0.0.1:{ports['22001']}_"
    )
    assert answer["id"].startswith(tagged)  # the id the README describes
    assert answer["choices"][0]["text"]

    events = [line for line in run(chat).splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in events[:-1] if e[6:].strip()]
    assert "".join(d.get("content") or "" for d in deltas)

    listed = json.loads(run(instances))
    roles = sorted(item["role"] for item in listed["instances"])
    assert roles == ["decode", "prefill"]

    (snippet,) = blocks("python")
    printed = run([sys.executable, "-c", with_ports(snippet, ports)])
    lines = printed.splitlines()
    assert len(lines) == 2 and all(line.strip() for line in lines), printed
