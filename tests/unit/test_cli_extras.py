"""aiohttp is the `fake-worker` extra, not a dependency: the command line works without it, and
`pdproxy fake-worker` / `pdproxy demo` say which pip command installs it instead of failing
with a traceback. Each case runs `pdproxy` in a fresh interpreter where importing aiohttp fails
(a None in sys.modules makes `import aiohttp` raise ImportError), as in a plain install."""

from __future__ import annotations

import subprocess
import sys

from pdproxy.demo.processes import free_ports

TIMEOUT_S = 60  # a command that got past the check would serve: the bound ends it

WITHOUT_AIOHTTP = (
    "import sys; sys.modules['aiohttp'] = None; "
    "from pdproxy.cli import main; sys.exit(main(sys.argv[1:]))"
)


def pdproxy_without_aiohttp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_AIOHTTP, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def test_the_command_line_does_not_import_aiohttp() -> None:
    probe = (
        "import sys; from pdproxy.cli import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=TIMEOUT_S, check=True
    )
    assert done.stdout.strip() == "[]"


def test_fake_worker_without_aiohttp_exits_2_naming_the_extra() -> None:
    http, kv = free_ports(2)
    done = pdproxy_without_aiohttp(
        "fake-worker", "--role", "P", "--port", str(http), "--kv-port", str(kv)
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "fake-worker: the fake worker needs aiohttp: pip install 'pdproxy[fake-worker]'"
    ]
    assert done.stdout == ""


def test_fake_worker_help_without_aiohttp_says_what_to_install() -> None:
    done = pdproxy_without_aiohttp("fake-worker", "--help")
    assert done.returncode == 0, done.stderr
    assert "pip install 'pdproxy[fake-worker]'" in " ".join(done.stdout.split())


def test_demo_without_aiohttp_exits_2_naming_the_extra() -> None:
    port, registry = free_ports(2)
    done = pdproxy_without_aiohttp(
        "demo", "--once", "--port", str(port), "--registry-port", str(registry)
    )
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert "pip install 'pdproxy[demo]'" in line
    assert "starting pdproxy" not in done.stdout  # refused before any process started
