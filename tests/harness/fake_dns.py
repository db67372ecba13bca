"""Run `pdproxy ...` with some host names answered from a table the test controls.

Tests must not edit /etc/hosts, and a name that resolves to several loopback addresses
(127.0.0.1, .2, .3: Linux routes all of 127/8 to lo) is what a headless Service gives a proxy
replica or an announcer on Kubernetes. So the child process's socket.getaddrinfo answers the
names in the JSON file at PDPROXY_TEST_HOSTS ({"name": ["127.0.0.1", ...]}), read again on
every lookup so that a test can add and remove addresses while the process runs; every other
name goes to the system resolver. This is the only thing replaced: the process is pdproxy's own.

    PDPROXY_TEST_HOSTS=hosts.json python -m tests.harness.fake_dns serve --port ...
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

HOSTS_VARIABLE = "PDPROXY_TEST_HOSTS"

_system_getaddrinfo = socket.getaddrinfo


def table(path: Path) -> dict[str, list[str]]:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def write_table(path: Path, hosts: dict[str, list[str]]) -> None:
    """Replace the table at once (a reader never sees half a file)."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(hosts), encoding="utf-8")
    partial.replace(path)


def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
    path = os.environ.get(HOSTS_VARIABLE)
    if path and isinstance(host, str):
        addresses = table(Path(path)).get(host)
        if addresses is not None:
            if not addresses:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return [
                entry
                for address in addresses
                for entry in _system_getaddrinfo(address, port, *args, **kwargs)
            ]
    return _system_getaddrinfo(host, port, *args, **kwargs)


def main() -> int:
    socket.getaddrinfo = getaddrinfo
    from pdproxy.cli import main as pdproxy_main

    return pdproxy_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
