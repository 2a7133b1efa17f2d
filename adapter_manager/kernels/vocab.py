"""The vocabulary modules' LoRA, once per step: the embedding's (a gather, then an expand) and the head's (a shrink
and an expand over the logits rows). Trainable tokens arrive here as such a LoRA too (`tiers.vocab`).

Semantics (``a_rows [N, in]``, ``bt_rows [N, out]``: a vocabulary module's rows of the pool, scaling folded into Bt;
rows(t) the pool rows of token t's adapter, none for slot -1)::

    embed_lora:  h[t]      += Σ_{k in rows(t)} a_rows[k, tokens[t]] · bt_rows[k]      # a_rows [N, V], bt_rows [N, H]
    head_lora:   logits[n] += Σ_{k in rows(t_n)} (x[n] · a_rows[k]) · bt_rows[k]       # a_rows [N, H], bt_rows [N, V]

with ``t_n = logits_index[n]`` the token of logits row n (``x = h[logits_index]``, normed). Eager backends: one
gather / matmul pair per active adapter (the rows as a plain slice, its tokens as a slice when they are one run);
the embedding's of a small step (decode: T·r·H ≤ :data:`GATHER_MAX`) gathers every token's rows at once instead, a
few calls whatever the adapters. Traced ones: laned over the step's compact active table (`kernels.active_table`),
static shapes, new tensors.
"""

from __future__ import annotations

import torch

from adapter_manager.kernels.linear_lora import Stacks
from adapter_manager.kernels.meta import LoRAKernelMeta

GATHER_MAX = 1 << 20
"""The most Bt elements (tokens × rank × hidden) the embedding's LoRA gathers per token in one step; past it, or in
the deterministic mode, it runs one matmul per adapter."""


def embed_lora(
    h: torch.Tensor, tokens: torch.Tensor, stacks: Stacks, meta: LoRAKernelMeta, per_token: bool = False
) -> torch.Tensor:
    """Add the embedding LoRA of each token's adapter (the step's executor runs it:
    :meth:`kernels.executor.LinearExecutor.embed`). Shape: h [T, H], tokens [T] int64; returns [T, H] (eager: h,
    written in place). ``per_token``: one row at a time (the deterministic mode: a row's result never depends on
    how many rows share its matmul)."""
    return meta.executor.embed(h, tokens, stacks, meta, per_token)


def head_lora(
    logits: torch.Tensor,
    x: torch.Tensor,
    stacks: Stacks,
    meta: LoRAKernelMeta,
    logits_index: torch.Tensor | None,
    per_token: bool = False,
) -> torch.Tensor:
    """Add the head LoRA of each logits row's adapter (the step's executor runs it). Shape: logits [N, V], x [N, H]
    (the head's input), logits_index [N] int64 (None: N = T, row n is token n); returns [N, V] (eager: logits,
    written in place). ``per_token``: as :func:`embed_lora`'s."""
    return meta.executor.head(logits, x, stacks, meta, logits_index, per_token)


def traced_embed(h: torch.Tensor, tokens: torch.Tensor, stacks: Stacks, meta: LoRAKernelMeta) -> torch.Tensor:
    """:func:`embed_lora` laned over the compact active table: a new tensor."""
    token_compact, gather_rows, lane_owner = meta.args()
    picked = stacks.a[gather_rows[None, :], tokens.long()[:, None]]  # [T, A·R]: each lane's A entry for the token
    own = token_compact[:, None] == lane_owner[None, :]
    picked = torch.where(own, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
    return h + (picked @ stacks.bt.index_select(0, gather_rows)).to(h.dtype)


def traced_head(
    logits: torch.Tensor, x: torch.Tensor, stacks: Stacks, meta: LoRAKernelMeta, logits_index: torch.Tensor | None
) -> torch.Tensor:
    """:func:`head_lora` laned over the compact active table: a new tensor."""
    token_compact, gather_rows, lane_owner = meta.args()
    if logits_index is not None:
        token_compact = token_compact.index_select(0, logits_index)
    u = x @ stacks.a.index_select(0, gather_rows).t()  # [N, A·R]
    own = token_compact[:, None] == lane_owner[None, :]
    u = torch.where(own, u, torch.zeros((), dtype=u.dtype, device=u.device))
    return logits + (u @ stacks.bt.index_select(0, gather_rows)).to(logits.dtype)


def eager_embed(
    h: torch.Tensor, tokens: torch.Tensor, stacks: Stacks, meta: LoRAKernelMeta, per_token: bool
) -> torch.Tensor:
    """:func:`embed_lora` on an eager step: h written in place."""
    if meta.no_adapter:
        return h
    held = getattr(stacks, "held", None)
    rows = None if per_token else _token_rows(meta, h.shape[0] * h.shape[1], held)
    if rows is not None:  # [T, r] pool rows per token, the zero row past its adapter's rank (or for none)
        picked = stacks.a[rows, tokens.long()[:, None]]  # [T, r]
        return h.add_(torch.bmm(picked[:, None, :], stacks.bt[rows]).squeeze(1).to(h.dtype))
    for rows, where in _groups(meta, meta.host_slots, h.device, per_token, held):
        picked = stacks.a[rows].index_select(1, tokens[where])  # [r, n]
        delta = (picked.t() @ stacks.bt[rows]).to(h.dtype)  # [n, H]
        if isinstance(where, slice):
            h[where] += delta
        else:
            h.index_add_(0, where, delta)
    return h


def eager_head(
    logits: torch.Tensor,
    x: torch.Tensor,
    stacks: Stacks,
    meta: LoRAKernelMeta,
    logits_index: torch.Tensor | None,
    per_token: bool,
) -> torch.Tensor:
    """:func:`head_lora` on an eager step: logits written in place."""
    if meta.no_adapter:
        return logits
    slots = meta.host_slots
    assert slots is not None
    if logits_index is not None:
        slots = [slots[t] for t in logits_index.tolist()]
    for rows, where in _groups(meta, slots, logits.device, per_token, getattr(stacks, "held", None)):
        delta = ((x[where] @ stacks.a[rows].t()) @ stacks.bt[rows]).to(logits.dtype)  # [n, V]
        if isinstance(where, slice):
            logits[where] += delta
        else:
            logits.index_add_(0, where, delta)
    return logits


def _token_rows(meta: LoRAKernelMeta, elements: int, held: set[int] | None) -> torch.Tensor | None:
    """Each token's pool rows ``[T, r]`` (r the step's highest rank among adapters with rows here), the zero row
    where it has none; None when the gather would pass :data:`GATHER_MAX` (``elements``: T·H) or no adapter has rows."""
    slots = meta.host_slots
    assert slots is not None
    by_slot = {a.slot: a for a in meta.active_adapters if held is None or a.slot in held}
    if not by_slot:
        return None
    width = max(a.rank for a in by_slot.values())
    if elements * width > GATHER_MAX:
        return None
    zero = [meta.zero_row] * width
    table = []
    for slot in slots:
        adapter = by_slot.get(slot)
        table.append(zero if adapter is None else [*range(adapter.first, adapter.first + adapter.rank), *zero][:width])
    return torch.tensor(table, dtype=torch.long).to(meta.device)


def _groups(
    meta: LoRAKernelMeta, slots: list[int] | None, device: torch.device, per_token: bool, held: set[int] | None
):
    """(the adapter's pool rows, its positions in ``slots``: a slice when they are one run, else an index tensor)
    for each active adapter with a position there; ``per_token``: one slice per position. ``held``: the slots whose
    adapter has rows in the module (the pool's `SlotStacks.held`), the others skipped (their rows are zero)."""
    assert slots is not None
    by_slot = {adapter.slot: adapter for adapter in meta.active_adapters}
    if per_token:
        for index, slot in enumerate(slots):
            if slot >= 0 and (held is None or slot in held):
                yield by_slot[slot].rows, slice(index, index + 1)
        return
    positions: dict[int, list[int]] = {}
    for index, slot in enumerate(slots):
        if slot >= 0 and (held is None or slot in held):
            positions.setdefault(slot, []).append(index)
    for slot, where in positions.items():
        rows = by_slot[slot].rows
        if where[-1] - where[0] + 1 == len(where):
            yield rows, slice(where[0], where[-1] + 1)
        else:
            yield rows, torch.tensor(where, dtype=torch.long, device=device)
