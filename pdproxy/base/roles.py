"""The two roles of a disaggregated instance, one spelling everywhere.

Metrics labels, JSON, logs and settings say "prefill"/"decode" (the member's value). Only the
registry wire (DESIGN.md section 3: stock vLLM sends `"type": "P"`) and the `--role P|D`
command-line options use the letters, through `Role.wire` and `Role.from_wire`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

WireLetter = Literal["P", "D"]
WIRE_LETTERS: tuple[WireLetter, ...] = ("P", "D")


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def wire(self) -> WireLetter:
        """The letter the registry wire's `type` field carries for this role."""
        return "P" if self is Role.PREFILL else "D"

    @property
    def other(self) -> Role:
        """The role this one pairs with."""
        return Role.DECODE if self is Role.PREFILL else Role.PREFILL

    @classmethod
    def from_wire(cls, letter: str) -> Role:
        """The role a wire letter names; ValueError for anything but "P" or "D"."""
        if letter == "P":
            return cls.PREFILL
        if letter == "D":
            return cls.DECODE
        raise ValueError(f"a role is 'P' or 'D', not {letter[:16]!r}")
