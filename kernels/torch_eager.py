"""Eager torch shrink/expand (CPU, CUDA): fast paths, then grouped batched matmuls or the dense laned form.

Per step the metadata (built once, one host sync) says which path runs:
  no adapter   -> shrink returns zeros, expand leaves y alone: no LoRA matmul at all;
  single slot  -> plain matmuls against that slot; tokens with slot -1 get their h row zeroed (exactly zero);
  segments     -> the batch is grouped by slot (few runs of equal slots, as an engine ordering its batch by
                  adapter gives): one matmul per run on row slices of x and y, no gather or scatter;
  laned        -> (small batches, per the measured table) one dense matmul over all S·R lanes, masked;
  grouped      -> tokens sorted by slot once per step, padded per active slot, two batched matmuls; slots with
                  no tokens never enter the batch.
"""

from __future__ import annotations

import torch

from kernels.config import LoRAForm
from kernels.dispatch_table import TorchDispatchTable
from kernels.meta import LoRAKernelMeta


class TorchEagerBackend:
    """h is ``[T, R]`` in token order; expand accumulates into ``y`` in place."""

    traced = False
    laned_output = False

    def __init__(self, table: TorchDispatchTable, max_segment_runs: int = 16, form: LoRAForm = LoRAForm.AUTO) -> None:
        """``max_segment_runs``: AUTO uses segments while a step has ≤ max(this, 2 × active slots) runs (0: never).
        ``form``: AUTO, or a forced SEGMENTS / GROUPED / LANED for every step with an adapter."""
        if max_segment_runs < 0:
            raise ValueError(f"max_segment_runs must be >= 0, got {max_segment_runs}")
        if form not in (LoRAForm.AUTO, LoRAForm.SEGMENTS, LoRAForm.GROUPED, LoRAForm.LANED):
            raise ValueError(f"form must be auto, segments, grouped or laned, got {form!r}")
        self._table = table
        self.max_segment_runs = max_segment_runs
        self.form = form

    def choose_form(self, num_tokens: int, num_slots: int, rank: int, active_slots: int, runs: int) -> LoRAForm:
        if self.form is not LoRAForm.AUTO:
            return self.form
        if active_slots == 1:
            return LoRAForm.SINGLE
        if self.max_segment_runs > 0 and runs <= max(self.max_segment_runs, 2 * active_slots):
            return LoRAForm.SEGMENTS
        if self._table.prefers_laned(num_tokens, num_slots, rank):
            return LoRAForm.LANED
        return LoRAForm.GROUPED

    def shrink(self, x: torch.Tensor, a_stack: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """Semantics::

            h[t] = x[t] @ a_stack[slot[t]].T if slot[t] >= 0 else 0

        Shape: x [T, in], a_stack [S, R, in] -> h [T, R], new tensor.
        """
        num_tokens, rank = x.shape[0], a_stack.shape[1]
        if meta.no_adapter:
            return x.new_zeros(num_tokens, rank)
        if meta.single_slot is not None:
            h = torch.mm(x, a_stack[meta.single_slot].t())
            if not meta.all_assigned:
                h.mul_((meta.token_slots >= 0)[:, None])
            return h
        if meta.segments is not None:
            h = x.new_empty(num_tokens, rank) if meta.all_assigned else x.new_zeros(num_tokens, rank)
            for slot, start, count in meta.segments:
                torch.mm(x[start : start + count], a_stack[slot].t(), out=h[start : start + count])
            return h
        if meta.use_laned:
            assert meta.lane_onehot is not None
            laned = torch.mm(x, a_stack.reshape(-1, a_stack.shape[-1]).t()).view(num_tokens, -1, rank)
            return laned.mul_(meta.lane_onehot).sum(1)  # one nonzero term per row: the sum is exact
        grouping = meta.grouping
        assert grouping is not None
        if not grouping.padded:
            xs = x.index_select(0, grouping.order)
            hs = x.new_empty(xs.shape[0], rank)
            for slot, start, count in grouping.segments:
                torch.mm(xs[start : start + count], a_stack[slot].t(), out=hs[start : start + count])
            return x.new_zeros(num_tokens, rank).index_copy_(0, grouping.order, hs)
        a_active = a_stack if grouping.active_slots.numel() == a_stack.shape[0] else a_stack[grouping.active_slots]
        xg = x.index_select(0, grouping.gather_index).view(a_active.shape[0], grouping.capacity, x.shape[1])
        hg = torch.bmm(xg, a_active.transpose(1, 2)).mul_(grouping.valid)  # [A, C, R], padding rows zero
        return x.new_zeros(num_tokens, rank).index_add_(0, grouping.gather_index, hg.view(-1, rank))

    def expand(
        self, y: torch.Tensor, h: torch.Tensor, bt_stack: torch.Tensor, meta: LoRAKernelMeta, accumulate: bool = True
    ) -> torch.Tensor:
        """Semantics::

            y[t] += h[t] @ bt_stack[slot[t]] for every t with slot[t] >= 0; other rows untouched
            (accumulate=False: y[t] = h[t] @ bt_stack[slot[t]], other rows 0; y is written, never read)

        Shape: y [T, out] (updated in place and returned), h [T, R], bt_stack [S, R, out].
        """
        if meta.no_adapter:
            return y if accumulate else y.zero_()
        rank, out = bt_stack.shape[1], bt_stack.shape[2]
        if meta.single_slot is not None:
            if not meta.all_assigned:
                h = h * (meta.token_slots >= 0)[:, None]
            if accumulate:
                return y.addmm_(h, bt_stack[meta.single_slot])
            return torch.mm(h, bt_stack[meta.single_slot], out=y)
        if meta.segments is not None:
            if not accumulate and not meta.all_assigned:
                _zero_gaps(y, meta.segments)
            for slot, start, count in meta.segments:
                rows = slice(start, start + count)
                if accumulate:
                    y[rows].addmm_(h[rows], bt_stack[slot])
                else:
                    torch.mm(h[rows], bt_stack[slot], out=y[rows])
            return y
        if meta.use_laned:
            assert meta.lane_onehot is not None
            laned = (h[:, None, :] * meta.lane_onehot).view(h.shape[0], -1)  # [T, S·R]
            if accumulate:
                return y.addmm_(laned, bt_stack.reshape(-1, out))
            return torch.mm(laned, bt_stack.reshape(-1, out), out=y)
        if not accumulate:
            y.zero_()
        grouping = meta.grouping
        assert grouping is not None
        if not grouping.padded:
            hs = h.index_select(0, grouping.order)
            delta = y.new_empty(hs.shape[0], out)
            for slot, start, count in grouping.segments:
                torch.mm(hs[start : start + count], bt_stack[slot], out=delta[start : start + count])
            return y.index_add_(0, grouping.order, delta)
        bt_active = bt_stack if grouping.active_slots.numel() == bt_stack.shape[0] else bt_stack[grouping.active_slots]
        hg = h.index_select(0, grouping.gather_index).view(bt_active.shape[0], grouping.capacity, rank)
        delta = torch.bmm(hg.mul_(grouping.valid), bt_active)  # [A, C, out], padding rows exactly zero
        return y.index_add_(0, grouping.gather_index, delta.view(-1, out))


def _zero_gaps(y: torch.Tensor, segments: tuple[tuple[int, int, int], ...]) -> None:
    """Zero the rows of y no segment covers (tokens with slot -1); segments are in token order."""
    cursor = 0
    for _, start, count in segments:
        if start > cursor:
            y[cursor:start].zero_()
        cursor = start + count
    if cursor < y.shape[0]:
        y[cursor:].zero_()
