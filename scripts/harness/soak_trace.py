"""The soak benchmark's trace: per request its adapter (Zipf(1) over the whole population, ranked at random, or the
base model), prompt and output lengths and kind, drawn once; each run turns the draws into requests with prompt
tokens of its own (so no run finds another's prompts in the prefix cache) and its own arrival times."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from scripts.harness.soak_client import Answer

KINDS = ("stream", "plain", "cancel")


@dataclass(frozen=True)
class TraceShape:
    """What a request looks like."""

    prompt: tuple[int, int] = (16, 128)  # prompt tokens: uniform in [lo, hi]
    output: tuple[int, int] = (8, 32)  # generated tokens (greedy, ignore_eos): uniform in [lo, hi]
    base_share: float = 0.1  # requests for the base model
    plain_share: float = 0.2  # non-streamed requests
    cancel_share: float = 0.05  # streams the client closes after two chunks
    zipf: float = 1.0


@dataclass(frozen=True)
class Draws:
    """The trace's requests: ``pick`` is a Zipf rank (0 = most popular) or -1 for the base model."""

    pick: np.ndarray  # [n] int
    prompt_len: np.ndarray  # [n] int
    output_len: np.ndarray  # [n] int
    kind: np.ndarray  # [n] index into KINDS

    def __len__(self) -> int:
        return len(self.pick)

    def head(self, n: int) -> Draws:
        return Draws(self.pick[:n], self.prompt_len[:n], self.output_len[:n], self.kind[:n])


def zipf_order(ids: Sequence[str], seed: int) -> list[str]:
    """The population ranked at random: element k is the adapter of Zipf rank k."""
    order = np.random.default_rng(seed).permutation(len(ids))
    return [ids[i] for i in order]


def draw(n: int, population: int, shape: TraceShape, seed: int) -> Draws:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, population + 1) ** shape.zipf
    cdf = np.cumsum(weights / weights.sum())
    pick = np.minimum(np.searchsorted(cdf, rng.random(n)), population - 1)
    pick[rng.random(n) < shape.base_share] = -1
    shares = [1.0 - shape.plain_share - shape.cancel_share, shape.plain_share, shape.cancel_share]
    return Draws(
        pick=pick,
        prompt_len=rng.integers(shape.prompt[0], shape.prompt[1] + 1, n),
        output_len=rng.integers(shape.output[0], shape.output[1] + 1, n),
        kind=rng.choice(len(KINDS), n, p=shares),
    )


def requests(
    draws: Draws,
    model_of: Callable[[int], str],
    vocab: int,
    salt: str,
    arrivals: Sequence[float],
    cancel: bool = True,
) -> list[Answer]:
    """The draws as requests: ``model_of(pick)`` names the model, prompt tokens drawn from ``salt``; without
    ``cancel`` the would-be cancelled streams run to the end (a throughput run)."""
    rng = np.random.default_rng(zlib.crc32(salt.encode()))
    out = []
    for i in range(len(draws)):
        kind = KINDS[draws.kind[i]]
        if kind == "cancel" and not cancel:
            kind = "stream"
        prompt = rng.integers(0, vocab, int(draws.prompt_len[i])).tolist()
        out.append(Answer(kind, model_of(int(draws.pick[i])), prompt, int(draws.output_len[i]), at=arrivals[i]))
    return out


def poisson(n: int, rate: float, seed: int) -> list[float]:
    """n Poisson arrival times (seconds) at `rate` per second."""
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n)).tolist()


def probe_prompt(adapter_id: str, vocab: int, length: int = 48) -> list[int]:
    """The churn's fixed prompt per adapter: three KV blocks, sent before and after each change of the adapter, so
    a stale prefix-cache block would answer the second time."""
    return np.random.default_rng(zlib.crc32(adapter_id.encode())).integers(0, vocab, length).tolist()
