"""A request served alone against in company: the same-tokens rate of bench_determinism and probes.xla_invariance."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def answers(handles: Sequence) -> list[tuple[list[int], list[float]]]:
    """Each finished request handle's (tokens, logprob of each token)."""
    return [(h.result(timeout=0), [lp.logprob for lp in h.logprobs]) for h in handles]


def same_in_company(serve: Callable[[list], list], batch: list, requests: int) -> dict:
    """``serve(chosen)`` -> :func:`answers` of ``chosen``: the first ``requests`` of ``batch`` served one at a time,
    then all of ``batch`` together; how many of them give the same tokens and the same logprob bits both ways."""
    alone = [serve([request])[0] for request in batch[:requests]]
    together = serve(batch)[:requests]
    return {
        "requests": requests,
        "same_tokens": sum(a[0] == b[0] for a, b in zip(alone, together, strict=True)),
        "same_logprobs": sum(a[1] == b[1] for a, b in zip(alone, together, strict=True)),
    }
