"""The parsers a connection holds once it is lost.

A live connection's httptools parser holds the connection's bound methods as its callbacks, and
the connection holds the parser: a reference cycle. A lost connection swaps its parser for one
of these, so it is freed by its reference count instead of waiting for the garbage collector,
whose passes stall the serving loop (docs/performance.md, "A reference cycle per request").
Nothing is ever fed to them: no data arrives after a connection is lost.
"""

from __future__ import annotations

import httptools


class _NoCallbacks:
    """Callbacks for a parser nobody feeds: none."""


CLOSED_REQUEST_PARSER = httptools.HttpRequestParser(_NoCallbacks())
CLOSED_RESPONSE_PARSER = httptools.HttpResponseParser(_NoCallbacks())
