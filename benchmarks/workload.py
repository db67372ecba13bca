"""A seeded chat workload with shared system prompts, for the fleet simulator (fleet_sim.py).

Most requests start with one of a few long system prompts (Zipf popularity), followed by a
short user turn; the rest share nothing with anyone. Every request's pairing features come
from pdproxy's own ``request_features`` (pdproxy/proxy/prompt.py) run on a synthetic
``/v1/chat/completions`` body: a system message (fixed text per system prompt) and a user
message (unique text), written in 4-character words so that the proxy's estimate of 4
characters per token is exact. So ``prefix_key`` is exactly what the proxy computes (a blake2b
of the conversation's leading ``prefix_tokens`` x 4 characters, here the system prompt's), and
requests with the same system prompt share it. The simulator itself uses the true token counts
below; the planner sees the proxy's estimates (a few tokens more: role names, separators).

Nothing here depends on the arrival rate: arrivals are unit-rate exponential gaps, scaled by
``1 / rate`` by the simulator, so every load and every policy sees the same requests in order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdproxy.pairing.features import RequestFeatures
from pdproxy.proxy.prompt import request_features

# Three-letter words and a space: one token each by the proxy's 4-characters rule.
WORDS = tuple(a + b + c + " " for a in "bdfgkl" for b in "aeiou" for c in "mnprst")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    system_prompts: int = 20
    system_tokens: tuple[int, int] = (1_000, 2_000)  # uniform, per system prompt
    zipf_s: float = 1.0  # popularity of system prompt k (1-based) is proportional to k^-s
    unshared_fraction: float = 0.2  # requests with no shared prefix at all
    unshared_tokens: tuple[int, int] = (200, 2_000)  # their whole prompt (a pasted document)
    user_tokens: tuple[int, int] = (50, 300)  # the user turn after a system prompt
    output_tokens: tuple[int, int] = (50, 300)  # tokens actually generated
    max_tokens: int = 512  # what the client asks for (a cap, as clients do): decode_tokens
    prefix_tokens: int = 256  # pdproxy's prefix_affinity_tokens default


@dataclass(frozen=True, slots=True)
class Request:
    index: int
    gap: float  # exponential(1) gap before this arrival; divide by the rate for seconds
    system: int | None  # id of the shared system prompt, None when it shares nothing
    shared_tokens: int  # leading tokens it shares with others (the system prompt)
    prompt_tokens: int
    output_tokens: int
    features: RequestFeatures


@dataclass(frozen=True, slots=True)
class Workload:
    spec: WorkloadSpec
    system_lengths: tuple[int, ...]
    popularity: tuple[float, ...]  # share of the shared-prefix requests per system prompt
    requests: tuple[Request, ...]


def _text(rng: random.Random, tokens: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(tokens))


def build_workload(spec: WorkloadSpec, count: int, seed: int) -> Workload:
    rng = random.Random(seed)
    lengths = tuple(rng.randint(*spec.system_tokens) for _ in range(spec.system_prompts))
    system_texts = [_text(rng, n) for n in lengths]
    weights = [(k + 1) ** -spec.zipf_s for k in range(spec.system_prompts)]
    total = sum(weights)
    popularity = tuple(w / total for w in weights)
    requests = []
    for index in range(count):
        gap = rng.expovariate(1.0)
        output = rng.randint(*spec.output_tokens)
        system: int | None
        if rng.random() < spec.unshared_fraction:
            system, shared = None, 0
            user = rng.randint(*spec.unshared_tokens)
            messages = []
        else:
            system = rng.choices(range(spec.system_prompts), weights)[0]
            shared = lengths[system]
            user = rng.randint(*spec.user_tokens)
            messages = [{"role": "system", "content": system_texts[system]}]
        # A unique head makes the turn (and, without a system prompt, the prefix) unique.
        head = _text(rng, min(user, 16))
        messages.append({"role": "user", "content": head + "abc " * (user - min(user, 16))})
        body = {"messages": messages, "max_tokens": spec.max_tokens}
        features = request_features(body, spec.model, chat=True, prefix_tokens=spec.prefix_tokens)
        requests.append(Request(index, gap, system, shared, shared + user, output, features))
    return Workload(spec, lengths, popularity, tuple(requests))
