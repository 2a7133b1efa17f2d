"""Sampling parameters and next-token sampling: greedy, or temperature + top-p with a per-request seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops."""

    max_tokens: int = 16  # tokens to generate at most
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept when sampling
    seed: int | None = None  # sampling seed; the same seed, prompt and adapter give the same tokens
    stop_ids: tuple[int, ...] = ()  # token ids that end the request beside the model's eos ids (the stop is returned)
    ignore_eos: bool = False  # keep generating past the model's end-of-sequence ids (vLLM's ignore_eos)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Semantics::

        greedy:  argmax(logits)
        else:    p = softmax(logits / temperature); keep the smallest top set with mass >= top_p; draw from it

    Shape: logits [V] (any dtype; computed in fp32 on the host). ``generator`` drives the draw (None only for greedy).
    """
    logits = logits.float().cpu()
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < params.top_p  # the first token is always kept
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
