"""The tests run the build they are meant to run.

`make test-compiled` runs the unit and integration tests in a compiled copy of the checkout and
sets PDPROXY_EXPECT_COMPILED=1: there, every hot-path module must come from its compiled
extension, in the test process and in the pdproxy processes the tests start. Everywhere else
none may: a stale extension module beside its .py would shadow every edit of it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from pdproxy.compiled import COMPILED_MODULES, build_description, compiled_modules
from pdproxy.demo.processes import ManagedProcess, pdproxy_command

EXPECT_COMPILED = os.environ.get("PDPROXY_EXPECT_COMPILED") == "1"


def test_this_process_runs_the_expected_build() -> None:
    expected = list(COMPILED_MODULES) if EXPECT_COMPILED else []
    assert compiled_modules() == expected


def test_started_pdproxy_processes_run_the_expected_build(tmp_path: Path) -> None:
    log = tmp_path / "version.log"
    process = ManagedProcess("version", pdproxy_command("--version"), log_path=log).start()
    try:
        assert process.process is not None
        assert process.process.wait(timeout=60) == 0
    except subprocess.TimeoutExpired:
        raise AssertionError("pdproxy --version did not exit within 60 s") from None
    finally:
        process.stop()
    text = log.read_text()
    assert build_description() in text
    if EXPECT_COMPILED:
        assert f"compiled with mypyc: {len(COMPILED_MODULES)} of {len(COMPILED_MODULES)}" in text
    else:
        assert "pure Python" in text


def test_the_compiled_list_names_existing_modules() -> None:
    root = Path(__file__).resolve().parents[2]
    for name in COMPILED_MODULES:
        assert (root / Path(*name.split("."))).with_suffix(".py").is_file(), name
    assert len(set(COMPILED_MODULES)) == len(COMPILED_MODULES)
