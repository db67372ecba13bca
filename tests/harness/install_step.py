"""One bounded step of installing a venv (pip, venv, an import check), its output to a log."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import IO


def run_install_step(
    argv: list[str],
    out: IO[bytes],
    deadline: float,
    error: type[Exception],
    what: str,
    cwd: Path | None = None,
) -> None:
    """Run `argv` (in `cwd`, if given) to completion before `deadline` (time.monotonic()),
    output to `out`; `error` with a message naming `what` when it runs out of time or fails."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise error(f"{what} ran out of time before {' '.join(argv[:5])}")
    out.write(f"\n$ {' '.join(argv)}\n".encode())
    out.flush()
    try:
        subprocess.run(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=remaining,
            check=True,
            env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        )
    except subprocess.CalledProcessError as exc:
        raise error(f"{' '.join(argv[:6])} failed with exit code {exc.returncode}") from None
    except subprocess.TimeoutExpired:
        raise error(f"{' '.join(argv[:6])} did not finish in time") from None
