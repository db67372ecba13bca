"""Selection policies: one file per policy, all behind the `Policy` protocol; `make_policy`
builds one by the name an operator configures."""

from __future__ import annotations

from typing import Literal

from pdproxy.pairing.policies.base import Policy
from pdproxy.pairing.policies.least_kv import LeastKv
from pdproxy.pairing.policies.least_loaded import LeastLoaded
from pdproxy.pairing.policies.power_of_two import PowerOfTwo
from pdproxy.pairing.policies.prefix_affinity import PrefixAffinity
from pdproxy.pairing.policies.round_robin import RoundRobin

PrefillPolicyName = Literal["round_robin", "least_loaded", "power_of_two", "prefix_affinity"]
DecodePolicyName = Literal["round_robin", "least_loaded", "power_of_two", "least_kv"]


def make_policy(name: str, *, load_factor: float = 1.25, seed: int = 0) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "power_of_two":
        return PowerOfTwo(seed)
    if name == "prefix_affinity":
        return PrefixAffinity(load_factor)
    if name == "least_kv":
        return LeastKv()
    raise ValueError(f"unknown policy {name!r}")


__all__ = ["DecodePolicyName", "Policy", "PrefillPolicyName", "make_policy"]
