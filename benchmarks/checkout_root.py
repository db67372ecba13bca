"""Puts the checkout's root on sys.path, for the benchmarks that use the test harness
(tests.harness): run as `python benchmarks/x.py`, a script sees only benchmarks/ and the installed
pdproxy. Import it before anything from `tests` (the import sorter keeps it there: it files this
module with the third-party ones, `tests` with the first-party ones)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # after the script's own directory
