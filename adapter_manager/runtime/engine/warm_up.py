"""The graphs a traced (XLA) step can trace, as padding-only batches `Engine.warm_up` runs once each.

A traced step's graph depends on three sizes only: its token bucket T, the width A of its compact active-adapter
table, and its logits rows N. N is ``max_batch`` (one row per sequence), or, in a step that scores prompt tokens
(``prompt_logprobs``, the completions API's echo), one row per token: `echo_logits_rows`. Example, buckets (8, 16),
max_batch 4, active buckets (1, 2): (T, A, N) in (8, 1, 4), (8, 1, 8), (8, 2, 4), (8, 2, 8), (16, 1, 4), (16, 1, 16),
(16, 2, 4), (16, 2, 16).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from adapter_manager.kernels import bucket_for

from ..model.batch import ForwardBatch


def echo_logits_rows(tokens: int, max_batch: int) -> int:
    """The logits rows of a traced step of ``tokens`` (its bucket) that scores prompt tokens: one per token, padded
    to at least the ``max_batch`` rows of a plain step."""
    return max(tokens, max_batch)


def warm_up_batches(
    buckets: Sequence[int],
    active_buckets: Sequence[int],
    max_batch: int,
    padding_row: int,
    tables: torch.Tensor,
    device: torch.device | str,
) -> Iterator[tuple[ForwardBatch, int]]:
    """One batch per distinct (token bucket, active width, logits rows), with the number k of distinct slots its
    tokens use (slots 0..k-1, of one pool row each).

    Each batch is padding only: every token writes through the spare table row ``padding_row`` of ``tables`` (the
    engine's static [max_batch + 1, MB] tables, all the spare block: no sequence touched), with
    tokens on k distinct slots and on -1, so it traces the exact graph a real step of that shape traces. Widths no
    real step of a bucket reaches (more adapters than tokens) are skipped.
    """
    for bucket in buckets:
        rows = sorted({max_batch, echo_logits_rows(bucket, max_batch)})
        for width in active_buckets:
            active = min(width, bucket - 1)  # leave one -1 token; a step of T tokens has at most T adapters
            if active < 1 or bucket_for(active, active_buckets) != width:
                continue
            zeros = torch.zeros(bucket, dtype=torch.long)
            slots = torch.arange(bucket, dtype=torch.int32) % (active + 1) - 1  # -1, 0, .., k-1, -1, ..
            for logits in rows:
                batch = ForwardBatch(
                    tokens=zeros.to(device),
                    positions=zeros.to(device),
                    cache_rows=torch.full((bucket,), padding_row, dtype=torch.long).to(device),
                    logits_index=torch.zeros(logits, dtype=torch.long).to(device),
                    spans=None,
                    slot_indices=slots,
                    block_tables=tables.to(device),
                )
                yield batch, active
