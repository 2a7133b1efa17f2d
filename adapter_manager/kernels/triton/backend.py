"""The triton backend (CUDA): every step with an adapter runs the Triton kernels of :mod:`kernels.triton.kernels`.

Every such step takes the FUSED form: a fused linear's whole LoRA (q/k/v or gate/up, every adapter of the step) is
two launches, one shrink for all parts and one expand for all parts, whatever the number of distinct adapters. Steps of
at most ``bgmv_max_tokens`` tokens (decode) take the BGMV pair, one token per program, driven by a ``[2, T]`` token
table (grid fixed by T: a captured CUDA graph stays valid for any mix of adapters); longer steps (prefill) take the
SGMV pair over the runs of equal slots (tl.dot tiles per run). The step's table is built once per step on the host from
``meta.runs`` and moved to the device on first use (``meta.step_tables``), then shared by every layer.

Operands the kernels do not take (an inner stride other than 1) fall back to the torch forms of the same step (the
metadata sets ``segments`` beside ``runs``), as the cpu backend does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from adapter_manager.kernels.config import LoRAForm
from adapter_manager.kernels.dispatch_table import TorchDispatchTable
from adapter_manager.kernels.meta import LoRAKernelMeta
from adapter_manager.kernels.ops import compose_parts
from adapter_manager.kernels.torch_eager import TorchEagerBackend
from adapter_manager.kernels.triton.block_sizes import TritonBlockTable
from adapter_manager.kernels.triton.kernels import TritonKernels, next_power_of_2

_MIN_DOT = 16
"""tl.dot's smallest tile side: SGMV rank blocks are at least this wide."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class TritonStepTables:
    """One step's device tables: ``tokens`` for BGMV steps, ``runs`` for SGMV steps (the other None)."""

    tokens: torch.Tensor | None
    """Shape: [2, T] int32 on the device: row 0 each token's first pool row, row 1 its rank (0: slot -1)."""
    runs: torch.Tensor | None
    """Shape: [runs, 4] int32 on the device: ``meta.runs`` (start, count, first row, rank)."""
    longest_run: int = 0
    """Tokens in the longest run (SGMV's token-block grid axis)."""


def token_table(meta: LoRAKernelMeta) -> torch.Tensor:
    """Shape: [2, T] int32 on the host, from ``meta.runs``: each token's first pool row and rank (0 for slot -1).

    Example: runs ``[(0, 2, 16, 8), (3, 1, 0, 4)]`` over T = 4 -> ``[[16, 16, 0, 0], [8, 8, 0, 4]]``.
    """
    assert meta.runs is not None, "token_table needs a FUSED step"
    runs = meta.runs.numpy()  # [runs, 4] int64; runs are disjoint token ranges
    counts = runs[:, 1]
    owner = np.repeat(np.arange(runs.shape[0]), counts)  # the run of each covered token
    tokens = runs[owner, 0] + np.arange(owner.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    table = np.zeros((2, meta.num_tokens), dtype=np.int32)
    table[:, tokens] = runs[owner][:, 2:].T
    return torch.from_numpy(table)


def _unit(*tensors: torch.Tensor) -> bool:
    return all(t.stride(-1) == 1 for t in tensors)


class TritonBackend(TorchEagerBackend):
    """:class:`TorchEagerBackend` whose steps with an adapter run the Triton kernels (FUSED form)."""

    def __init__(self, table: TorchDispatchTable, blocks: TritonBlockTable, bgmv_max_tokens: int = 64) -> None:
        """``table``: the torch forms' table (fallback operands). ``blocks``: the kernels' block sizes.
        ``bgmv_max_tokens``: steps of at most this many tokens take BGMV (decode), longer ones SGMV."""
        if bgmv_max_tokens < 0:
            raise ValueError(f"bgmv_max_tokens must be >= 0, got {bgmv_max_tokens}")
        super().__init__(table)
        self.kernels = TritonKernels()
        self.blocks = blocks
        self.bgmv_max_tokens = bgmv_max_tokens

    def choose_form(self, num_tokens: int, active_slots: int, rank: int, runs: int) -> LoRAForm:
        return LoRAForm.FUSED

    @property
    def capture_max_tokens(self) -> int:
        """Captured decode steps (:class:`kernels.protocol.DecodeCapture`) take the BGMV kernels, whose grid depends
        on T alone: at most ``bgmv_max_tokens`` tokens."""
        return self.bgmv_max_tokens

    def static_inputs(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """Shape: [2, num_tokens] int32 zeros on ``device``: a BGMV token table of padding tokens (rank 0)."""
        return torch.zeros(2, num_tokens, dtype=torch.int32, device=device)

    def step_inputs(self, meta: LoRAKernelMeta, num_tokens: int) -> torch.Tensor:
        """Shape: [2, num_tokens] int32 on the host: the step's :func:`token_table` (a step with no adapter: none),
        the tokens past the step's padding."""
        host = torch.zeros(2, num_tokens, dtype=torch.int32)
        if meta.form is LoRAForm.FUSED:
            host[:, : meta.num_tokens] = token_table(meta)
        return host

    def bind_inputs(self, meta: LoRAKernelMeta, static: torch.Tensor) -> None:
        """The step's BGMV token table is ``static`` ([2, T] int32 on the device)."""
        meta.step_tables = TritonStepTables(static, None)

    def step_tables(self, meta: LoRAKernelMeta) -> TritonStepTables:
        """The step's device tables, built on the first call of the step and kept in ``meta.step_tables``."""
        tables = meta.step_tables
        if tables is None:
            assert meta.runs is not None, "a FUSED step has its runs table"
            if meta.num_tokens <= self.bgmv_max_tokens:
                tables = TritonStepTables(token_table(meta).to(meta.device), None)
            else:
                runs = meta.runs.to(torch.int32).to(meta.device)
                tables = TritonStepTables(None, runs, int(meta.runs[:, 1].max()))
            meta.step_tables = tables
        assert isinstance(tables, TritonStepTables), f"step_tables is {type(tables).__name__}, not TritonStepTables"
        return tables

    def shrink_all(self, x: torch.Tensor, a_parts: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """The FUSED step's shrink kernel alone (operands unchecked: unit inner strides, one dtype).

        Semantics: ``h[p, t, :r] = x[t] @ a_parts[first : first + r, p].T`` per token (0 elsewhere), one launch for
        every part. Shape: x [T, in], a_parts [N, P, in] -> h [P, T, R] fp32, new tensor."""
        tables = self.step_tables(meta)
        num_tokens, parts, rank, features = x.shape[0], a_parts.shape[1], meta.rank, x.shape[1]
        h = torch.zeros(parts, num_tokens, rank, dtype=torch.float32, device=x.device)
        strides = (x.stride(0), a_parts.stride(0), a_parts.stride(1), h.stride(0), h.stride(1))
        if tables.tokens is not None:
            b = self.blocks.lookup("bgmv_shrink", num_tokens, rank, features)
            block_r = min(b.block_rank, next_power_of_2(rank))
            block_k = min(b.block_features, max(16, next_power_of_2(features)))
            grid = (num_tokens, parts, _cdiv(rank, block_r) * b.split_k)
            self.kernels.bgmv_shrink[grid](
                x, a_parts, h, tables.tokens, num_tokens, features, *strides,
                BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=b.split_k, num_warps=b.num_warps,
            )  # fmt: skip
            return h
        assert tables.runs is not None
        b = self.blocks.lookup("sgmv_shrink", num_tokens, rank, features)
        block_r = max(_MIN_DOT, min(b.block_rank, next_power_of_2(rank)))
        rank_blocks = _cdiv(rank, block_r)
        grid = (tables.runs.shape[0], _cdiv(tables.longest_run, b.block_tokens), parts * rank_blocks)
        self.kernels.sgmv_shrink[grid](
            x, a_parts, h, tables.runs, features, *strides,
            RANK_BLOCKS=rank_blocks, BLOCK_T=b.block_tokens, BLOCK_R=block_r,
            BLOCK_K=min(b.block_features, max(16, next_power_of_2(features))),
            PRECISION=_precision(x.dtype), UPCAST=self._upcast(x.dtype), num_warps=b.num_warps,
        )  # fmt: skip
        return h

    def expand_all(
        self, y: torch.Tensor, h: torch.Tensor, bt_parts: Sequence[torch.Tensor], meta: LoRAKernelMeta
    ) -> None:
        """The FUSED step's expand kernel alone (operands unchecked), y updated in place.

        Semantics: ``y[t, o_p : o_p + out_p] += h[p, t, :r] @ bt_parts[p][first : first + r]`` per token with an
        adapter; one launch for all parts when their Bt are views of one tensor with one row stride (the pool's),
        else one launch per part. Shape: y [T, >= sum(out_p)], h [P, T, R], bt_parts P × [N, out_p]."""
        first = bt_parts[0]
        shared = all(
            bt.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and bt.stride(0) == first.stride(0)
            for bt in bt_parts
        )
        if not shared or len(bt_parts) > 3:
            start = 0
            for part, bt in enumerate(bt_parts):
                self.expand_all(y[:, start : start + bt.shape[1]], h[part : part + 1], [bt], meta)
                start += bt.shape[1]
            return
        tables = self.step_tables(meta)
        num_tokens, rank = y.shape[0], meta.rank
        outs = [bt.shape[1] for bt in bt_parts] + [0] * (3 - len(bt_parts))
        offsets = [(bt.data_ptr() - first.data_ptr()) // first.element_size() for bt in bt_parts[1:]]
        offsets += [0] * (2 - len(offsets))
        op = "bgmv_expand" if tables.tokens is not None else "sgmv_expand"
        b = self.blocks.lookup(op, num_tokens, rank, max(outs))
        block_n = min(b.block_features, max(16, next_power_of_2(max(outs))))
        blocks = [_cdiv(out, block_n) for out in outs]
        args = (*offsets, *outs, first.stride(0), h.stride(0), h.stride(1), y.stride(0), blocks[0], blocks[1])
        if tables.tokens is not None:
            block_r = min(b.block_rank, next_power_of_2(rank))
            self.kernels.bgmv_expand[(num_tokens, sum(blocks))](
                h, y, first, tables.tokens, num_tokens, *args,
                BLOCK_R=block_r, BLOCK_N=block_n, num_warps=b.num_warps,
            )  # fmt: skip
            return
        assert tables.runs is not None
        grid = (tables.runs.shape[0], _cdiv(tables.longest_run, b.block_tokens), sum(blocks))
        self.kernels.sgmv_expand[grid](
            h, y, first, tables.runs, *args,
            BLOCK_T=b.block_tokens, BLOCK_R=max(_MIN_DOT, min(b.block_rank, next_power_of_2(rank))),
            BLOCK_N=block_n, PRECISION=_precision(first.dtype), UPCAST=self._upcast(first.dtype),
            num_warps=b.num_warps,
        )  # fmt: skip

    def _upcast(self, dtype: torch.dtype) -> bool:
        """SGMV's tl.dot on fp32 tiles: interpret mode with bf16 operands (see :mod:`kernels.triton.kernels`)."""
        return self.kernels.interpret and dtype == torch.bfloat16

    def shrink_parts(self, x: torch.Tensor, a_parts: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """Semantics: :func:`kernels.ops.shrink_parts` (one kernel launch for all P parts on FUSED steps).

        Shape: x [T, in], a_parts [N, P, in] -> h [P, T, R] in x's dtype, new tensor.
        """
        if meta.form is not LoRAForm.FUSED or not _unit(x, a_parts):
            return super().shrink_parts(x, a_parts, meta)
        return self.shrink_all(x, a_parts, meta).to(x.dtype)

    def shrink(self, x: torch.Tensor, a_rows: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
        """Semantics: :func:`kernels.ops.shrink`. Shape: x [T, in], a_rows [N, in] -> h [T, R], new tensor."""
        return self.shrink_parts(x, a_rows.unsqueeze(1), meta)[0]

    def expand(
        self, y: torch.Tensor, h: torch.Tensor, bt_rows: torch.Tensor, meta: LoRAKernelMeta, accumulate: bool = True
    ) -> torch.Tensor:
        """Semantics: :func:`kernels.ops.expand` (``accumulate=False`` zeroes y first, then adds).

        Shape: y [T, out] (updated in place, returned), h [T, R], bt_rows [N, out].
        """
        if meta.form is not LoRAForm.FUSED or not _unit(y, h, bt_rows):
            return super().expand(y, h, bt_rows, meta, accumulate)
        if not accumulate:
            y.zero_()
        self.expand_all(y, h.unsqueeze(0), [bt_rows], meta)
        return y

    def apply_parts(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        a_parts: torch.Tensor,
        bt_parts: Sequence[torch.Tensor],
        meta: LoRAKernelMeta,
    ) -> torch.Tensor:
        """Semantics: :func:`kernels.ops.apply_parts`. FUSED steps: one shrink launch (h in fp32) and one expand
        launch for all parts; other forms: shrink_parts, then one expand per part. Shape: y [T, sum(out)] (updated in
        place, returned); x [T, in]; a_parts [N, P, in]; bt_parts P × [N, out_p]."""
        if meta.no_adapter:
            return y
        if meta.form is not LoRAForm.FUSED or not _unit(y, x, a_parts, *bt_parts):
            return compose_parts(y, x, a_parts, bt_parts, meta)
        dtypes = {t.dtype for t in (y, x, a_parts, *bt_parts)}
        if len(dtypes) != 1 or a_parts.shape[2] != x.shape[1] or sum(bt.shape[1] for bt in bt_parts) > y.shape[1]:
            raise ValueError(
                f"apply_parts: y {tuple(y.shape)}, x {tuple(x.shape)}, a_parts {tuple(a_parts.shape)} and bt_parts "
                f"{[tuple(bt.shape) for bt in bt_parts]} must share one dtype (got {sorted(map(str, dtypes))}), "
                "x's features must be a_parts', and sum(out) must fit y"
            )
        self.expand_all(y, self.shrink_all(x, a_parts, meta), bt_parts, meta)
        return y


def _precision(dtype: torch.dtype) -> str | None:
    """tl.dot's input precision: exact fp32 products for fp32 operands (no TF32), the target's default otherwise."""
    return "ieee" if dtype == torch.float32 else None
