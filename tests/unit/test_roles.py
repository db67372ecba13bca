"""One role vocabulary: words everywhere, letters only on the registry wire."""

from __future__ import annotations

import pytest

from pdproxy.base.roles import WIRE_LETTERS, Role


def test_roles_are_words_in_labels_and_json() -> None:
    assert [str(role) for role in Role] == ["prefill", "decode"]
    assert f"{Role.DECODE}_timeout" == "decode_timeout"  # error codes are built this way


def test_wire_letters_round_trip() -> None:
    assert [role.wire for role in Role] == list(WIRE_LETTERS) == ["P", "D"]
    assert all(Role.from_wire(role.wire) is role for role in Role)
    assert Role.PREFILL.other is Role.DECODE and Role.DECODE.other is Role.PREFILL


@pytest.mark.parametrize("letter", ["p", "prefill", "", "PD", "X"])
def test_anything_but_a_wire_letter_is_refused(letter: str) -> None:
    with pytest.raises(ValueError, match="'P' or 'D'"):
        Role.from_wire(letter)
