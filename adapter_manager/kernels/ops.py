"""Validating launchers for shrink and expand: check shapes, then call the metadata's backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from adapter_manager.kernels.meta import LoRAKernelMeta
from adapter_manager.kernels.protocol import EagerBackend


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_rows(name: str, rows: torch.Tensor, meta: LoRAKernelMeta, like_name: str, like: torch.Tensor) -> None:
    if rows.dim() != 2 or rows.shape[0] != meta.num_rows:
        raise ValueError(
            f"{name} must have shape [N={meta.num_rows}, features] (N = num_slots·granule + 1 = "
            f"{meta.num_slots}·{meta.granule} + 1), got {_shape(rows)}"
        )
    if rows.shape[1] != like.shape[1]:
        raise ValueError(
            f"{name} features {rows.shape[1]} != {like_name} features {like.shape[1]} ({like_name} {_shape(like)})"
        )
    if rows.dtype != like.dtype or rows.device != like.device:
        raise ValueError(f"{name} is {rows.dtype} on {rows.device}, expected {like.dtype} on {like.device}")


def _check_tokens(name: str, t: torch.Tensor, meta: LoRAKernelMeta) -> None:
    if t.dim() != 2 or t.shape[0] != meta.num_tokens:
        raise ValueError(f"{name} must have shape [T={meta.num_tokens}, features], got {_shape(t)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {t.dtype}")


def shrink(x: torch.Tensor, a_rows: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
    """Project each token onto its adapter's A rows.

    Semantics (s = slot[t], r = r_s, G = granule)::

        h[t, :r] = x[t] @ a_rows[s·G : s·G + r].T   if s >= 0
        h[t, r:] = 0;  h[t] = 0 if s == -1          (stale rows past r are never read)

    Shape: x [T, in]; a_rows [N, in], N = S·G + 1 (last row zero; may be a strided view); returns a new h: [T, R] on
    eager backends, or, laned (``meta.backend.laned_output``), [T, A·R] whose lanes [c·R, (c+1)·R) belong to compact
    slot c (see :mod:`kernels.active_table`), zero outside the token's own compact slot and past its rank. Only the
    same backend's :func:`expand` needs to read h.
    """
    _check_tokens("x", x, meta)
    _check_rows("a_rows", a_rows, meta, "x", x)
    return meta.backend.shrink(x, a_rows, meta)


def shrink_parts(x: torch.Tensor, a_parts: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
    """:func:`shrink` for P projections that share the input x (q/k/v, gate/up), in one call.

    Semantics (s = slot[t], r = r_s, G = granule)::

        h[p, t, :r] = x[t] @ a_parts[s·G : s·G + r, p].T   if s >= 0
        h[p, t, r:] = 0;  h[p, t] = 0 if s == -1
        # h[p] == shrink(x, a_parts[:, p], meta)  (bit for bit where the backend keeps the matmul order)

    Shape: x [T, in]; a_parts [N, P, in], the parts' A rows side by side, e.g. the pool's adjacent column blocks
    ``rows[:, a_q : a_q + 3·in].view(N, 3, in)`` (any strides: a view, never copied); returns a new h: [P, T, R] on
    eager backends (the torch backend runs one matmul per run of tokens for all P parts), or [P, T, A·R] laned.
    ``h[p]`` is what part p's :func:`expand` takes.
    """
    _check_parts(x, a_parts, meta)
    return meta.backend.shrink_parts(x, a_parts, meta)


def _check_parts(x: torch.Tensor, a_parts: torch.Tensor, meta: LoRAKernelMeta) -> None:
    _check_tokens("x", x, meta)
    if a_parts.dim() != 3 or a_parts.shape[0] != meta.num_rows or a_parts.shape[1] < 1:
        raise ValueError(
            f"a_parts must have shape [N={meta.num_rows}, P >= 1, features] (N = num_slots·granule + 1 = "
            f"{meta.num_slots}·{meta.granule} + 1), got {_shape(a_parts)}"
        )
    if a_parts.shape[2] != x.shape[1]:
        raise ValueError(f"a_parts features {a_parts.shape[2]} != x features {x.shape[1]} (x {_shape(x)})")
    if a_parts.dtype != x.dtype or a_parts.device != x.device:
        raise ValueError(f"a_parts is {a_parts.dtype} on {a_parts.device}, expected {x.dtype} on {x.device}")


def expand(
    y: torch.Tensor, h: torch.Tensor, bt_rows: torch.Tensor, meta: LoRAKernelMeta, accumulate: bool = True
) -> torch.Tensor:
    """Add each token's adapter output to y (or, with ``accumulate=False``, write it: y's old values are ignored).

    Semantics (s = slot[t], r = r_s, G = granule)::

        y[t] += h[t, :r] @ bt_rows[s·G : s·G + r]   if s >= 0   (accumulate=False: y[t] = h[t, :r] @ ...)
        y[t] unchanged                              if s == -1  (accumulate=False: y[t] = 0)

    ``accumulate=False`` lets a layer write the LoRA term first and add the base matmul on top with one
    ``addmm_`` (beta=1), so y is never read back by a separate pass.

    Shape: y [T, out]; h as returned by :func:`shrink`; bt_rows [N, out] (B pre-transposed, scale folded in).
    Eager backends (torch, reference) write y in place and return it; traced backends (xla, pallas) leave y as it
    is and return a new tensor. Always use the return value.
    """
    _check_tokens("y", y, meta)
    _check_tokens("h", h, meta)
    _check_rows("bt_rows", bt_rows, meta, "y", y)
    width = meta.active_width * meta.rank if meta.backend.laned_output else meta.rank
    if h.shape[1] != width:
        raise ValueError(f"h must have shape [T={meta.num_tokens}, {width}] for this backend, got {_shape(h)}")
    if h.dtype != y.dtype:
        raise ValueError(f"h is {h.dtype}, expected y's dtype {y.dtype}")
    return meta.backend.expand(y, h, bt_rows, meta, accumulate)


def apply_parts(
    y: torch.Tensor, x: torch.Tensor, a_parts: torch.Tensor, bt_parts: Sequence[torch.Tensor], meta: LoRAKernelMeta
) -> torch.Tensor:
    """Add the LoRA terms of P parts that share the input x (q/k/v, gate/up; P = 1 for o, down) to their column blocks
    of y, in place: shrink and expand of a fused linear in one call where the step is :attr:`LoRAKernelMeta.fused`.

    Semantics (s = slot[t], r = r_s, G = granule, part p's columns [o_p, o_p + out_p) of y, o_p = sum of out_q, q < p)::

        y[t, o_p : o_p + out_p] += (x[t] @ a_parts[s·G : s·G + r, p].T) @ bt_parts[p][s·G : s·G + r]   if s >= 0
        y[t] unchanged                                                                                  if s == -1
        # == expand(y[:, o_p : o_p + out_p], shrink_parts(x, a_parts, meta)[p], bt_parts[p], meta) for each p

    Shape: y [T, >= sum(out_p)] (a view is fine; unit inner stride); x [T, in]; a_parts [N, P, in] (a view of the
    pool); bt_parts P tensors [N, out_p] (views of the pool). Eager backends only; returns y.
    """
    tokens_match = y.shape[0] == x.shape[0] == meta.num_tokens
    if meta.fused and tokens_match and a_parts.dim() == 3 and a_parts.shape[1] == len(bt_parts):
        # the hot path (a step only takes FUSED on a backend with apply_parts): its kernel checks shapes, dtypes,
        # strides and every run's rows and tokens against the operands
        return cast(EagerBackend, meta.backend).apply_parts(y, x, a_parts, bt_parts, meta)
    _check_tokens("y", y, meta)
    _check_parts(x, a_parts, meta)
    if not meta.executor.in_place:
        raise ValueError("apply_parts updates y in place: eager backends only (traced backends: shrink / expand)")
    if a_parts.shape[1] != len(bt_parts):
        raise ValueError(f"a_parts has {a_parts.shape[1]} parts, bt_parts {len(bt_parts)}")
    outs = [bt.shape[1] if bt.dim() == 2 else -1 for bt in bt_parts]
    if min(outs, default=0) < 1 or sum(outs) > y.shape[1]:
        raise ValueError(f"bt_parts must be [N, out] each with sum(out) <= y's {y.shape[1]} columns, got {outs}")
    for bt in bt_parts:
        if bt.shape[0] != meta.num_rows or bt.dtype != y.dtype or bt.device != y.device:
            raise ValueError(
                f"bt_parts must be [N={meta.num_rows}, out] in {y.dtype} on {y.device}, got {_shape(bt)} "
                f"{bt.dtype} on {bt.device}"
            )
    if meta.no_adapter:
        return y
    return cast(EagerBackend, meta.backend).apply_parts(y, x, a_parts, tuple(bt_parts), meta)


def compose_parts(
    y: torch.Tensor, x: torch.Tensor, a_parts: torch.Tensor, bt_parts: Sequence[torch.Tensor], meta: LoRAKernelMeta
) -> torch.Tensor:
    """:func:`apply_parts` as the backend's ``shrink_parts`` then one ``expand`` per part (operands already checked):
    what a backend without a fused form does."""
    h, start = meta.backend.shrink_parts(x, a_parts, meta), 0
    for part, bt in enumerate(bt_parts):
        meta.backend.expand(y[:, start : start + bt.shape[1]], h[part], bt, meta, True)
        start += bt.shape[1]
    return y
