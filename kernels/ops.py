"""Validating launchers for shrink and expand: check shapes, then call the metadata's backend."""

from __future__ import annotations

import torch

from kernels.meta import LoRAKernelMeta


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_stack(name: str, stack: torch.Tensor, meta: LoRAKernelMeta, like: torch.Tensor) -> None:
    if stack.dim() != 3 or stack.shape[0] != meta.num_slots or stack.shape[1] != meta.rank:
        raise ValueError(f"{name} must have shape [S={meta.num_slots}, R={meta.rank}, features], got {_shape(stack)}")
    if stack.dtype != like.dtype or stack.device != like.device:
        raise ValueError(f"{name} is {stack.dtype} on {stack.device}, expected {like.dtype} on {like.device}")


def _check_tokens(name: str, t: torch.Tensor, meta: LoRAKernelMeta) -> None:
    if t.dim() != 2 or t.shape[0] != meta.num_tokens:
        raise ValueError(f"{name} must have shape [T={meta.num_tokens}, features], got {_shape(t)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {t.dtype}")


def shrink(x: torch.Tensor, a_stack: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
    """Project each token onto its adapter's A.

    Semantics::

        h[t] = x[t] @ a_stack[slot[t]].T   if slot[t] >= 0
        h[t] = 0                           if slot[t] == -1

    Shape: x [T, in]; a_stack [S, R, in]; returns a new h, [T, R] or, for laned backends
    (``meta.backend.laned_output``), [T, S·R] with zeros outside the token's own slot's R lanes. Only the same
    backend's :func:`expand` needs to read h.
    """
    _check_tokens("x", x, meta)
    _check_stack("a_stack", a_stack, meta, x)
    if a_stack.shape[2] != x.shape[1]:
        raise ValueError(f"a_stack features {a_stack.shape[2]} != x features {x.shape[1]} (x {_shape(x)})")
    return meta.backend.shrink(x, a_stack, meta)


def expand(
    y: torch.Tensor, h: torch.Tensor, bt_stack: torch.Tensor, meta: LoRAKernelMeta, accumulate: bool = True
) -> torch.Tensor:
    """Add each token's adapter output to y (or, with ``accumulate=False``, write it: y's old values are ignored).

    Semantics::

        y[t] += h[t] @ bt_stack[slot[t]]   if slot[t] >= 0       (accumulate=False: y[t] = h[t] @ bt_stack[slot[t]])
        y[t] unchanged                     if slot[t] == -1      (accumulate=False: y[t] = 0)

    ``accumulate=False`` lets a layer write the LoRA term first and add the base matmul on top with one
    ``addmm_`` (beta=1), so y is never read back by a separate pass.

    Shape: y [T, out]; h as returned by :func:`shrink`; bt_stack [S, R, out] (B pre-transposed, scale folded in).
    Eager backends (torch, reference) write y in place and return it; traced backends (xla, pallas) leave y as it
    is and return a new tensor. Always use the return value.
    """
    _check_tokens("y", y, meta)
    _check_tokens("h", h, meta)
    _check_stack("bt_stack", bt_stack, meta, y)
    width = meta.num_slots * meta.rank if meta.backend.laned_output else meta.rank
    if h.shape[1] != width:
        raise ValueError(f"h must have shape [T={meta.num_tokens}, {width}] for this backend, got {_shape(h)}")
    if bt_stack.shape[2] != y.shape[1]:
        raise ValueError(f"bt_stack features {bt_stack.shape[2]} != y features {y.shape[1]} (y {_shape(y)})")
    if h.dtype != y.dtype:
        raise ValueError(f"h is {h.dtype}, expected y's dtype {y.dtype}")
    return meta.backend.expand(y, h, bt_stack, meta, accumulate)
