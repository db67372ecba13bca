"""pdproxy.ids: the request-id codec and the host validation that keeps vLLM's regexes honest."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pdproxy import ids
from pdproxy.ids import (
    Address,
    AddressError,
    TaggedId,
    build_request_id,
    make_address,
    parse_address,
    parse_request_id,
    validate_host,
    validate_port,
    vllm_decode_address,
    vllm_prefill_address,
)

# Deterministic and load-tolerant: same examples every run, no deadline, no example database.
PROFILE = settings(derandomize=True, database=None, deadline=None)

# vLLM's P2pNcclConnector patterns, restated literally: if ids.py ever drifts from them, the
# pattern test fails instead of the recovery tests silently testing something else.
VLLM_PREFILL_SIDE_PATTERN = r"___decode_addr_(.*):(\d+)"  # prefill worker -> decode address
VLLM_DECODE_SIDE_PATTERN = r"___prefill_addr_(.*):(\d+)___"  # decode worker -> prefill address
VLLM_PREFILL_SIDE = re.compile(VLLM_PREFILL_SIDE_PATTERN)
VLLM_DECODE_SIDE = re.compile(VLLM_DECODE_SIDE_PATTERN)

UID = "0123456789abcdef0123456789abcdef"
SUFFIX = "9f8e7d6c"
P = Address("10.0.0.1", 21001)
D = Address("10.0.0.2", 22001)

# ---------------------------------------------------------------------------------------------
# strategies

_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_alnum = st.sampled_from(_ALNUM)
# [A-Za-z0-9] ([A-Za-z0-9-]* [A-Za-z0-9])?  -- a DNS label, starting and ending alphanumeric
_words = st.one_of(
    _alnum,
    st.builds("{}{}{}".format, _alnum, st.text(alphabet=_ALNUM + "-", max_size=12), _alnum),
)
# ... optionally two of them joined by a single '_'
labels = st.one_of(_words, st.builds("{}_{}".format, _words, _words))
dns_names = st.lists(labels, min_size=1, max_size=6).map(".".join)
ipv4s = st.tuples(*[st.integers(0, 255)] * 4).map(lambda t: ".".join(str(o) for o in t))
hosts = st.one_of(ipv4s, dns_names)
ports = st.integers(min_value=1, max_value=65535)
addresses = st.builds(Address, hosts, ports)
uids = st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)
suffixes = st.text(alphabet="0123456789abcdef", min_size=8, max_size=8)

# Every form in which vLLM's engine sees the id (DESIGN.md section 2).
ENGINE_FORMS: dict[str, Callable[[str, str], str]] = {
    "completion prompt 0": lambda rid, sfx: f"cmpl-{rid}-0-{sfx}",
    "completion prompt 3": lambda rid, sfx: f"cmpl-{rid}-3-{sfx}",
    "chat": lambda rid, sfx: f"chatcmpl-{rid}-{sfx}",
    "n>1 child": lambda rid, sfx: f"1_cmpl-{rid}-0-{sfx}",
    "completion, no randomization": lambda rid, sfx: f"cmpl-{rid}",
    "chat, no randomization": lambda rid, sfx: f"chatcmpl-{rid}",
    "bare": lambda rid, sfx: rid,
}
forms = st.sampled_from(sorted(ENGINE_FORMS))

# A broad alphabet for the safety property: everything that could confuse the regexes.
_BROAD = st.sampled_from(
    [*"aaZZ0099.-__::", " ", "\t", "\n", "[", "]", "é", "\u00a0", "/", "@", "\x00", "\uff41"]
)
broad_text = st.text(alphabet=_BROAD, min_size=0, max_size=24)


def _with_inserted(host: str, junk: str, at: int) -> str:
    at = at % (len(host) + 1)
    return host[:at] + junk + host[at:]


_junk = st.text(alphabet=_BROAD, min_size=1, max_size=3)
# Junk anywhere in a valid host, and junk strictly inside one (alphanumeric at both ends: the
# hosts most likely to slip past a weakened validator).
near_valid_hosts = st.builds(_with_inserted, hosts, _junk, st.integers(0, 300))
spliced_hosts = st.builds("{}{}{}".format, hosts, _junk, hosts)
candidate_hosts = st.one_of(broad_text, near_valid_hosts, spliced_hosts, hosts)


def _accepted(host: str) -> bool:
    try:
        validate_host(host)
    except AddressError:
        return False
    return True


def _vllm_decode_address(engine_id: str) -> tuple[str, int] | None:
    match = VLLM_PREFILL_SIDE.search(engine_id)
    return None if match is None else (match[1], int(match[2]))


def _vllm_prefill_address(engine_id: str) -> tuple[str, int] | None:
    match = VLLM_DECODE_SIDE.search(engine_id)
    return None if match is None else (match[1], int(match[2]))


# ---------------------------------------------------------------------------------------------
# the patterns and the exact id format


def test_ids_uses_vllms_exact_patterns() -> None:
    assert ids.VLLM_PREFILL_SIDE.pattern == VLLM_PREFILL_SIDE_PATTERN
    assert ids.VLLM_DECODE_SIDE.pattern == VLLM_DECODE_SIDE_PATTERN
    assert ids.VLLM_PREFILL_SIDE.flags == VLLM_PREFILL_SIDE.flags
    assert ids.VLLM_DECODE_SIDE.flags == VLLM_DECODE_SIDE.flags


def test_build_request_id_exact_format() -> None:
    assert build_request_id(P, D, UID) == (
        "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_"
        "0123456789abcdef0123456789abcdef"
    )


def test_address_str() -> None:
    assert str(Address("pd-0.svc", 8100)) == "pd-0.svc:8100"


def test_parse_request_id_bare() -> None:
    assert parse_request_id(build_request_id(P, D, UID)) == TaggedId(P, D, UID)


@pytest.mark.parametrize("form", sorted(ENGINE_FORMS))
def test_vllm_regexes_recover_both_addresses_in_every_engine_form(form: str) -> None:
    engine_id = ENGINE_FORMS[form](build_request_id(P, D, UID), SUFFIX)
    assert _vllm_decode_address(engine_id) == ("10.0.0.2", 22001)
    assert _vllm_prefill_address(engine_id) == ("10.0.0.1", 21001)
    assert vllm_decode_address(engine_id) == D
    assert vllm_prefill_address(engine_id) == P
    assert parse_request_id(engine_id) == TaggedId(P, D, UID)


def test_vllm_helpers_return_none_for_untagged() -> None:
    assert vllm_decode_address("cmpl-0123-0-abcd") is None
    assert vllm_prefill_address("cmpl-0123-0-abcd") is None


# ---------------------------------------------------------------------------------------------
# round trip (property)


@settings(PROFILE, max_examples=300)
@given(prefill=addresses, decode=addresses, uid=uids)
def test_round_trip(prefill: Address, decode: Address, uid: str) -> None:
    parsed = parse_request_id(build_request_id(prefill, decode, uid))
    assert parsed is not None
    assert (parsed.prefill, parsed.decode, parsed.uid) == (prefill, decode, uid)
    assert parsed.prefill.host == prefill.host and parsed.prefill.port == prefill.port
    assert parsed.decode.host == decode.host and parsed.decode.port == decode.port


@settings(PROFILE, max_examples=300)
@given(prefill=addresses, decode=addresses, uid=uids, suffix=suffixes, form=forms)
def test_vllm_regexes_recover_generated_addresses(
    prefill: Address, decode: Address, uid: str, suffix: str, form: str
) -> None:
    engine_id = ENGINE_FORMS[form](build_request_id(prefill, decode, uid), suffix)
    assert _vllm_decode_address(engine_id) == (decode.host, decode.port)
    assert _vllm_prefill_address(engine_id) == (prefill.host, prefill.port)
    assert parse_request_id(engine_id) == TaggedId(prefill, decode, uid)


@settings(PROFILE, max_examples=300)
@given(host=hosts, port=ports)
def test_generated_hosts_are_accepted(host: str, port: int) -> None:
    validate_host(host)
    assert make_address(host, port) == Address(host, port)
    assert parse_address(f"{host}:{port}") == Address(host, port)


# ---------------------------------------------------------------------------------------------
# the safety property: whatever validate_host accepts, vLLM's regexes carry unchanged


@settings(PROFILE, max_examples=500)
@given(
    host=candidate_hosts,
    other=addresses,
    port=ports,
    uid=uids,
    suffix=suffixes,
    form=forms,
)
def test_every_accepted_host_survives_vllm_regexes(
    host: str, other: Address, port: int, uid: str, suffix: str, form: str
) -> None:
    event("accepted" if _accepted(host) else "refused")
    if not _accepted(host):
        # Refused hosts can never reach an id.
        with pytest.raises(AddressError):
            make_address(host, port)
        with pytest.raises(AddressError):
            build_request_id(Address(host, port), other, uid)
        with pytest.raises(AddressError):
            build_request_id(other, Address(host, port), uid)
        return
    mine = Address(host, port)
    for prefill, decode in ((mine, other), (other, mine), (mine, mine)):
        engine_id = ENGINE_FORMS[form](build_request_id(prefill, decode, uid), suffix)
        assert _vllm_decode_address(engine_id) == (decode.host, decode.port)
        assert _vllm_prefill_address(engine_id) == (prefill.host, prefill.port)
        assert parse_request_id(engine_id) == TaggedId(prefill, decode, uid)


@settings(PROFILE, max_examples=300)
@given(host=candidate_hosts)
def test_accepted_hosts_have_the_documented_shape(host: str) -> None:
    if not _accepted(host):
        return
    assert host
    assert host.isascii()
    assert len(host) <= 253
    assert ":" not in host and "__" not in host
    assert not any(ch.isspace() for ch in host)
    assert host[0].isalnum() and host[-1].isalnum()
    assert set(host) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_")


# ---------------------------------------------------------------------------------------------
# refused hosts and ports

BAD_HOSTS: list[tuple[str, str]] = [
    ("", "empty host"),
    ("::1", "IPv6"),
    ("fe80::1", "IPv6"),
    ("[::1]", "IPv6"),
    ("[fe80::1%eth0]", "IPv6"),
    ("host:1", "IPv6"),
    ("a___b", "'___'"),
    ("___decode_addr_x", "'___'"),
    ("a__b", "'__'"),
    ("a.__b", "'__'"),
    ("a b", "whitespace"),
    ("a\tb", "whitespace"),
    ("a\nb", "whitespace"),
    (" a", "whitespace"),
    ("a ", "whitespace"),
    ("a\u00a0b", "whitespace"),
    ("-a", "IPv4 address or DNS name"),
    ("a-", "IPv4 address or DNS name"),
    (".a", "IPv4 address or DNS name"),
    ("a.", "IPv4 address or DNS name"),
    ("_a", "IPv4 address or DNS name"),
    ("a_", "IPv4 address or DNS name"),
    ("-", "IPv4 address or DNS name"),
    (".", "IPv4 address or DNS name"),
    ("_", "IPv4 address or DNS name"),
    ("héllo", "IPv4 address or DNS name"),
    ("\uff41", "IPv4 address or DNS name"),  # fullwidth letter: alphanumeric, but not ASCII
    ("例え.jp", "IPv4 address or DNS name"),
    ("a/b", "IPv4 address or DNS name"),
    ("a@b", "IPv4 address or DNS name"),
    ("a\x00b", "IPv4 address or DNS name"),
    ("a" * 254, "longer than 253"),
    ("a." * 126 + "ab", "longer than 253"),
]


@pytest.mark.parametrize(("host", "message"), BAD_HOSTS)
def test_bad_hosts_are_refused_everywhere(host: str, message: str) -> None:
    with pytest.raises(AddressError, match=re.escape(message)):
        validate_host(host)
    with pytest.raises(AddressError, match=re.escape(message)):
        make_address(host, 8100)
    with pytest.raises(AddressError, match=re.escape(message)):
        parse_address(f"{host}:8100")
    with pytest.raises(AddressError, match=re.escape(message)):
        build_request_id(Address(host, 8100), D, UID)
    with pytest.raises(AddressError, match=re.escape(message)):
        build_request_id(P, Address(host, 8100), UID)


@pytest.mark.parametrize("host", ["::1", "fe80::1", "[::1]"])
def test_ipv6_message_is_helpful(host: str) -> None:
    with pytest.raises(AddressError) as info:
        validate_host(host)
    assert "IPv6" in str(info.value)
    assert "IPv4 address or a DNS name" in str(info.value)


@pytest.mark.parametrize("text", ["[::1]:8100", "::1:8100", "fe80::1:8100", "[fe80::1]:21001"])
def test_parse_address_refuses_ipv6_literals(text: str) -> None:
    with pytest.raises(AddressError, match="IPv6"):
        parse_address(text)


@pytest.mark.parametrize(
    "host", ["a", "0", "a" * 253, "10.0.0.1", "a_b", "a-b", "a.b", "a-_b", "A.b-c_d.9", "x_y.z_w"]
)
def test_good_hosts_are_accepted(host: str) -> None:
    validate_host(host)
    assert make_address(host, 1) == Address(host, 1)
    assert make_address(host, 65535) == Address(host, 65535)


@pytest.mark.parametrize("port", [0, 65536, -1, 100000])
def test_bad_ports_are_refused(port: int) -> None:
    with pytest.raises(AddressError, match=r"outside 1\.\.65535"):
        validate_port(port)
    with pytest.raises(AddressError, match=r"outside 1\.\.65535"):
        make_address("10.0.0.1", port)
    with pytest.raises(AddressError, match=r"outside 1\.\.65535"):
        build_request_id(Address("10.0.0.1", port), D, UID)
    with pytest.raises(AddressError, match=r"outside 1\.\.65535"):
        build_request_id(P, Address("10.0.0.1", port), UID)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("10.0.0.1:0", "outside 1..65535"),
        ("10.0.0.1:00000", "outside 1..65535"),
        ("10.0.0.1:65536", "outside 1..65535"),
        ("10.0.0.1:99999", "outside 1..65535"),
        ("10.0.0.1:-1", "not a number"),
        ("10.0.0.1:+1", "not a number"),
        ("10.0.0.1:abc", "not a number"),
        ("10.0.0.1:80a", "not a number"),
        ("10.0.0.1: 80", "not a number"),
        ("10.0.0.1:80 ", "not a number"),
        ("10.0.0.1:", "not a number"),
        ("10.0.0.1:\uff11\uff12", "not a number"),  # fullwidth digits
        ("10.0.0.1:²", "not a number"),
        ("10.0.0.1:123456", "not a number"),
        ("10.0.0.1", "no ':port'"),
        ("", "no ':port'"),
        (":8100", "empty host"),
        (":", "not a number"),
    ],
)
def test_parse_address_refuses_bad_ports(text: str, message: str) -> None:
    with pytest.raises(AddressError, match=re.escape(message)):
        parse_address(text)


@pytest.mark.parametrize("value", [None, 8100, b"10.0.0.1:8100", ("10.0.0.1", 8100)])
def test_parse_address_refuses_non_strings(value: object) -> None:
    with pytest.raises(AddressError, match="must be a string"):
        parse_address(value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.1:1", Address("10.0.0.1", 1)),
        ("10.0.0.1:65535", Address("10.0.0.1", 65535)),
        ("10.0.0.1:08100", Address("10.0.0.1", 8100)),
        ("decode-0.pd.svc.cluster.local:21001", Address("decode-0.pd.svc.cluster.local", 21001)),
        ("my_host:80", Address("my_host", 80)),
    ],
)
def test_parse_address_accepts(text: str, expected: Address) -> None:
    assert parse_address(text) == expected


def test_address_errors_are_value_errors() -> None:
    assert issubclass(AddressError, ValueError)


# ---------------------------------------------------------------------------------------------
# uid


@pytest.mark.parametrize(
    "uid",
    [
        "",
        "0" * 31,
        "0" * 33,
        "0123456789ABCDEF0123456789ABCDEF",
        "0123456789abcdef0123456789abcdeF",
        "g" * 32,
        " " + "0" * 31,
        "0" * 31 + "\n",
        "0x" + "0" * 30,
        "0123456789abcdef-0123456789abcde",
        "\u0660" * 32,  # Arabic-Indic digit zero: a unicode digit, not hex
    ],
)
def test_build_request_id_rejects_bad_uid(uid: str) -> None:
    with pytest.raises(ValueError, match="uid must be 32 lowercase hex"):
        build_request_id(P, D, uid)


@settings(PROFILE, max_examples=300)
@given(uid=st.text(max_size=40))
def test_build_request_id_rejects_any_non_uid(uid: str) -> None:
    if re.fullmatch(r"[0-9a-f]{32}", uid):
        assert build_request_id(P, D, uid).endswith("_" + uid)
        return
    with pytest.raises(ValueError, match="uid"):
        build_request_id(P, D, uid)


# ---------------------------------------------------------------------------------------------
# parse_request_id on untagged or malformed text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello",
        "cmpl-0123456789abcdef-0-deadbeef",
        "chatcmpl-" + UID,
        UID,
        "___prefill_addr_10.0.0.1:21001",
        "___decode_addr_10.0.0.2:22001_" + UID,
        "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001",
        "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_",
        "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_" + UID[:31],
        "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_" + UID.upper(),
        "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001-" + UID,
        "___decode_addr_10.0.0.2:22001___prefill_addr_10.0.0.1:21001_" + UID,
        "___prefill_addr_:21001___decode_addr_10.0.0.2:22001_" + UID,
        "___prefill_addr_10.0.0.1:___decode_addr_10.0.0.2:22001_" + UID,
        "___prefill_addr_10.0.0.1:0___decode_addr_10.0.0.2:22001_" + UID,
        "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:70000_" + UID,
        "___prefill_addr_-bad:21001___decode_addr_10.0.0.2:22001_" + UID,
        "___prefill_addr_10.0.0.1:21001___decode_addr_bad-:22001_" + UID,
        "___prefill_addr_a b:21001___decode_addr_10.0.0.2:22001_" + UID,
        "___prefill_addr_::1:21001___decode_addr_10.0.0.2:22001_" + UID,
        "___PREFILL_ADDR_10.0.0.1:21001___DECODE_ADDR_10.0.0.2:22001_" + UID,
    ],
)
def test_parse_request_id_returns_none_for_untagged(text: str) -> None:
    assert parse_request_id(text) is None


@settings(PROFILE, max_examples=300)
@given(text=st.text(max_size=200))
def test_parse_request_id_without_tag_is_none(text: str) -> None:
    if "___prefill_addr_" in text:
        return
    assert parse_request_id(text) is None


@settings(PROFILE, max_examples=300)
@given(text=st.text(max_size=200))
def test_parse_request_id_never_raises_and_returns_valid_addresses(text: str) -> None:
    for candidate in (text, "___prefill_addr_" + text, text + "___decode_addr_" + text):
        parsed = parse_request_id(candidate)
        if parsed is not None:
            make_address(parsed.prefill.host, parsed.prefill.port)
            make_address(parsed.decode.host, parsed.decode.port)
            assert re.fullmatch(r"[0-9a-f]{32}", parsed.uid)
