"""Eager torch shrink/expand (CPU, CUDA) on the row pools: fast paths, then grouped or laned forms.

Per step the metadata (built once, one host sync) says which path runs; every path reads the active adapters' pool
rows only (a slice ``a_rows[s·G : s·G + r_s]``, or the compact table's k·R gathered rows), so no cost grows with the
pool size:
  no adapter   -> shrink returns zeros, expand leaves y alone: no LoRA matmul at all;
  single slot  -> plain matmuls against that adapter's row slice; rows of slot -1 tokens zeroed (exactly zero);
  segments     -> the batch is grouped by slot (few runs of equal slots, as an engine ordering its batch by
                  adapter gives): one matmul per run on row slices of x/h/y and the adapter's rows;
  grouped      -> tokens sorted by slot once per step: per-slot matmuls on the sorted rows, or, when padding
                  wastes little, two batched matmuls against the compact table viewed [k, R, F];
  laned        -> (small batches, per the measured table) one dense matmul over the compact table's k·R lanes,
                  masked to each token's compact slot.
h lanes past a token's rank are zero; expand reads only h[:, :r_s] (or multiplies the rest by zero rows).
shrink_parts takes the same forms for P projections sharing x (q/k/v, gate/up) on a [N, P, in] view of the pool:
one matmul per run (a bmm over the parts) or per gathered table for all P, never one per part.
"""

from __future__ import annotations

import torch

from adapter_manager.kernels.config import LoRAForm
from adapter_manager.kernels.dispatch_table import TorchDispatchTable
from adapter_manager.kernels.eager_base import EagerBase
from adapter_manager.kernels.grouping import Segment
from adapter_manager.kernels.meta import LoRAKernelMeta


class TorchEagerBackend(EagerBase):
    """h is ``[T, R]`` in token order; expand accumulates into ``y`` in place."""

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

    def choose_form(self, num_tokens: int, active_slots: int, rank: int, runs: int) -> LoRAForm:
        if self.form is not LoRAForm.AUTO:
            return self.form
        if active_slots == 1:
            return LoRAForm.SINGLE
        if self.max_segment_runs > 0 and runs <= max(self.max_segment_runs, 2 * active_slots):
            return LoRAForm.SEGMENTS
        if self._table.prefers_laned(num_tokens, active_slots, rank):
            return LoRAForm.LANED
        return LoRAForm.GROUPED

    def shrink(self, x: torch.Tensor, a_rows: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """Semantics::

            h[t, :r] = x[t] @ a_rows[s·G : s·G + r].T with s = slot[t] >= 0, r = r_s; every other entry 0

        Shape: x [T, in], a_rows [N, in] -> h [T, R], new tensor.
        """
        num_tokens, rank = x.shape[0], meta.rank
        if meta.no_adapter:
            return x.new_zeros(num_tokens, rank)
        if meta.single is not None:
            adapter = meta.single
            if adapter.rank == rank and meta.all_assigned:
                return torch.mm(x, a_rows[adapter.rows].t())
            h = x.new_zeros(num_tokens, rank)
            torch.mm(x, a_rows[adapter.rows].t(), out=h[:, : adapter.rank])
            if not meta.all_assigned:
                assert meta.token_slots is not None
                h.mul_((meta.token_slots >= 0)[:, None])
            return h
        if meta.segments is not None:
            at, segments = a_rows.t(), meta.segments  # [in, N], a view
            runs = [torch.mm(xs, at[:, seg.adapter.rows]) for seg, xs in zip(segments, _runs(x, meta), strict=True)]
            return _from_runs(runs, meta, (num_tokens, rank))
        if meta.lane_onehot is not None:
            table = a_rows.index_select(0, meta.active_gather_rows())  # [k·R, in]
            laned = torch.mm(x, table.t()).view(num_tokens, -1, rank)  # [T, k, R]
            return laned.mul_(meta.lane_onehot).sum(1)  # one nonzero term per row: the sum is exact
        grouping = meta.grouping
        assert grouping is not None
        if not grouping.padded:
            xs = x.index_select(0, grouping.order)
            hs = x.new_zeros(xs.shape[0], rank)
            for seg in grouping.segments:
                torch.mm(xs[seg.tokens], a_rows[seg.adapter.rows].t(), out=hs[seg.tokens, : seg.adapter.rank])
            return x.new_zeros(num_tokens, rank).index_copy_(0, grouping.order, hs)
        assert grouping.gather_index is not None and grouping.valid is not None
        table = a_rows.index_select(0, meta.active_gather_rows()).view(-1, rank, x.shape[1])  # [k, R, in]
        xg = x.index_select(0, grouping.gather_index).view(table.shape[0], grouping.capacity, x.shape[1])
        hg = torch.bmm(xg, table.transpose(1, 2)).mul_(grouping.valid)  # [k, C, R], padding rows zero
        return x.new_zeros(num_tokens, rank).index_add_(0, grouping.gather_index, hg.view(-1, rank))

    def shrink_parts(self, x: torch.Tensor, a_parts: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """Semantics::

            h[p, t, :r] = x[t] @ a_parts[s·G : s·G + r, p].T with s = slot[t] >= 0, r = r_s; every other entry 0

        One matmul per run of tokens for all P parts: the run's rows ``a_parts[o : o + r]`` ([r, P, in], a view)
        are the batch ``[P, in, r]`` of one ``bmm`` against x broadcast over the parts; the laned and padded grouped
        forms gather the active rows of all parts at once (``[k·R, P, in]``) and run one matmul over them.

        Shape: x [T, in], a_parts [N, P, in] -> h [P, T, R], new tensor.
        """
        num_tokens, rank, parts = x.shape[0], meta.rank, a_parts.shape[1]
        if meta.no_adapter:
            return x.new_zeros(parts, num_tokens, rank)
        if meta.single is not None:
            adapter = meta.single
            if adapter.rank == rank and meta.all_assigned:
                return _parts_mm(x, a_parts[adapter.rows])
            h = x.new_zeros(parts, num_tokens, rank)
            h[:, :, : adapter.rank] = _parts_mm(x, a_parts[adapter.rows])
            if not meta.all_assigned:
                assert meta.token_slots is not None
                h.mul_((meta.token_slots >= 0)[None, :, None])
            return h
        if meta.segments is not None:
            xb, at = x.expand(parts, *x.shape), a_parts.permute(1, 2, 0)  # views [P, T, in], [P, in, N]
            runs = [  # [P, n, r] each
                torch.bmm(xs, at[:, :, seg.adapter.rows])
                for seg, xs in zip(meta.segments, _runs(xb, meta, dim=1), strict=True)
            ]
            return _from_runs(runs, meta, (parts, num_tokens, rank))
        if meta.lane_onehot is not None:
            table = a_parts.index_select(0, meta.active_gather_rows())  # [k·R, P, in]
            laned = torch.mm(x, table.view(-1, x.shape[1]).t())  # [T, k·R·P], columns (lane, part)
            laned = laned.view(num_tokens, -1, rank, parts).mul_(meta.lane_onehot[..., None])  # [T, k, R, P]
            return laned.sum(1).permute(2, 0, 1).contiguous()  # one nonzero term per row: the sum is exact
        grouping = meta.grouping
        assert grouping is not None
        if not grouping.padded:
            xs = x.index_select(0, grouping.order)
            hs = x.new_zeros(parts, xs.shape[0], rank)
            for seg in grouping.segments:
                hs[:, seg.tokens, : seg.adapter.rank] = _parts_mm(xs[seg.tokens], a_parts[seg.adapter.rows])
            return x.new_zeros(parts, num_tokens, rank).index_copy_(1, grouping.order, hs)
        assert grouping.gather_index is not None and grouping.valid is not None
        table = a_parts.index_select(0, meta.active_gather_rows())  # [k·R, P, in]
        table = table.view(-1, rank * parts, x.shape[1])  # [k, R·P, in], rows (lane, part)
        xg = x.index_select(0, grouping.gather_index).view(table.shape[0], grouping.capacity, x.shape[1])
        hg = torch.bmm(xg, table.transpose(1, 2)).mul_(grouping.valid)  # [k, C, R·P], padding rows zero
        h = x.new_zeros(num_tokens, rank * parts).index_add_(0, grouping.gather_index, hg.view(-1, rank * parts))
        return h.view(num_tokens, rank, parts).permute(2, 0, 1).contiguous()

    def expand(
        self, y: torch.Tensor, h: torch.Tensor, bt_rows: torch.Tensor, meta: LoRAKernelMeta, accumulate: bool = True
    ) -> torch.Tensor:
        """Semantics::

            y[t] += h[t, :r] @ bt_rows[s·G : s·G + r] for every t with s = slot[t] >= 0, r = r_s; other rows untouched
            (accumulate=False: y[t] = h[t, :r] @ bt_rows[...], other rows 0; y is written, never read)

        Shape: y [T, out] (updated in place and returned), h [T, R], bt_rows [N, out].
        """
        if meta.no_adapter:
            return y if accumulate else y.zero_()
        rank, out = meta.rank, bt_rows.shape[1]
        if meta.single is not None:
            adapter = meta.single
            h = h[:, : adapter.rank]
            if not meta.all_assigned:
                assert meta.token_slots is not None
                h = h * (meta.token_slots >= 0)[:, None]
            if accumulate:
                return y.addmm_(h, bt_rows[adapter.rows])
            return torch.mm(h, bt_rows[adapter.rows], out=y)
        if meta.segments is not None:
            if not accumulate and not meta.all_assigned:
                _zero_gaps(y, meta.segments)
            for seg, hs, ys in zip(meta.segments, _runs(h, meta), _runs(y, meta), strict=True):
                hs, bt = hs if seg.adapter.rank == rank else hs[:, : seg.adapter.rank], bt_rows[seg.adapter.rows]
                if accumulate:
                    ys.addmm_(hs, bt)
                else:
                    torch.mm(hs, bt, out=ys)
            return y
        if meta.lane_onehot is not None:
            table = bt_rows.index_select(0, meta.active_gather_rows())  # [k·R, out], zero rows past each rank
            laned = (h[:, None, :] * meta.lane_onehot).view(h.shape[0], -1)  # [T, k·R]
            if accumulate:
                return y.addmm_(laned, table)
            return torch.mm(laned, table, out=y)
        if not accumulate:
            y.zero_()
        grouping = meta.grouping
        assert grouping is not None
        if not grouping.padded:
            hs = h.index_select(0, grouping.order)
            delta = y.new_empty(hs.shape[0], out)
            for seg in grouping.segments:
                torch.mm(hs[seg.tokens, : seg.adapter.rank], bt_rows[seg.adapter.rows], out=delta[seg.tokens])
            return y.index_add_(0, grouping.order, delta)
        assert grouping.gather_index is not None and grouping.valid is not None
        table = bt_rows.index_select(0, meta.active_gather_rows()).view(-1, rank, out)  # [k, R, out]
        hg = h.index_select(0, grouping.gather_index).view(table.shape[0], grouping.capacity, rank)
        delta = torch.bmm(hg.mul_(grouping.valid), table)  # [k, C, out], padding rows exactly zero
        return y.index_add_(0, grouping.gather_index, delta.view(-1, out))


def _runs(t: torch.Tensor, meta: LoRAKernelMeta, dim: int = 0) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
    """The segments' token slices of t along ``dim``: one ``split`` when they tile the tokens, else a slice each."""
    assert meta.segments is not None
    if meta.all_assigned:
        return t.split([seg.count for seg in meta.segments], dim)
    return [t.narrow(dim, seg.start, seg.count) for seg in meta.segments]


def _from_runs(runs: list[torch.Tensor], meta: LoRAKernelMeta, shape: tuple[int, ...]) -> torch.Tensor:
    """h of ``shape`` ([..., T, R]) from one matmul output per segment ([..., n, r]): one ``cat`` when the runs tile
    the tokens at full rank, else the runs written into zeros."""
    assert meta.segments is not None
    if meta.all_assigned and all(seg.adapter.rank == meta.rank for seg in meta.segments):
        return torch.cat(runs, dim=-2)
    h = runs[0].new_zeros(shape)
    for seg, run in zip(meta.segments, runs, strict=True):
        h[..., seg.tokens, : seg.adapter.rank] = run
    return h


def _parts_mm(x: torch.Tensor, a_run: torch.Tensor) -> torch.Tensor:
    """One batched matmul of x against every part's rows of one adapter: ``h[p] = x @ a_run[:, p].T``.

    Shape: x [n, in]; a_run [r, P, in] (a strided view of the pool, never copied); returns a new [P, n, r].
    """
    return torch.bmm(x.expand(a_run.shape[1], *x.shape), a_run.permute(1, 2, 0))


def _zero_gaps(y: torch.Tensor, segments: tuple[Segment, ...]) -> None:
    """Zero the rows of y no segment covers (tokens with slot -1); segments are in token order."""
    cursor = 0
    for seg in segments:
        if seg.start > cursor:
            y[cursor : seg.start].zero_()
        cursor = seg.start + seg.count
    if cursor < y.shape[0]:
        y[cursor:].zero_()
