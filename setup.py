"""Build hook for the optional compiled build; the project's metadata is in pyproject.toml.

By default pdproxy installs as pure Python. With PDPROXY_COMPILE=1 the hot-path modules listed in
pdproxy/compiled.py are compiled with mypyc into extension modules that the import system finds
before the .py files. That build type-checks the modules, so it needs mypy, a C compiler and
pdproxy's dependencies in the building environment:

    PDPROXY_COMPILE=1 pip install --no-build-isolation .

`make compiled` builds a compiled copy of the checkout in build/compiled (the checkout itself stays
pure Python, so an edit is never shadowed by a stale extension module); `make test` runs the unit
and integration tests against that copy too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup


def _compiled_extensions() -> list[object]:
    if os.environ.get("PDPROXY_COMPILE", "0") != "1":
        return []
    from mypyc.build import mypycify

    root = Path(__file__).resolve().parent
    sys.path.insert(0, str(root))
    from pdproxy.compiled import COMPILED_MODULES

    paths = [str(Path(*name.split(".")).with_suffix(".py")) for name in COMPILED_MODULES]
    return list(mypycify(paths, opt_level="3"))


setup(ext_modules=_compiled_extensions())
