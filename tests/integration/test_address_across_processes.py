"""An Address sent to another process (the workers, the registry process) is found there as a
dict key: its hash is made again in that process, not carried over (str hashes differ between
processes)."""

from __future__ import annotations

import subprocess
import sys

_PICKLE = "import pickle, sys; from pdproxy.ids import Address; " + (
    "sys.stdout.buffer.write(pickle.dumps([Address('10.0.0.7', 5000)]))"
)
_LOOK_UP = "import pickle, sys; from pdproxy.ids import Address; " + (
    "(sent,) = pickle.loads(sys.stdin.buffer.read()); "
    "table = {Address('10.0.0.7', 5000): 'found'}; "
    "print(table.get(sent, 'missing'), hash(sent) == hash(Address('10.0.0.7', 5000)))"
)


def _run(code: str, seed: str, given: bytes = b"") -> bytes:
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=given,
        capture_output=True,
        timeout=60,
        check=True,
        env={"PYTHONHASHSEED": seed},
    )
    return done.stdout


def test_an_address_pickled_in_one_process_is_a_key_in_another() -> None:
    sent = _run(_PICKLE, seed="1")
    assert _run(_LOOK_UP, seed="2", given=sent).split() == [b"found", b"True"]
