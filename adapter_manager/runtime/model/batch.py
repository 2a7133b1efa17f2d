"""One forward step's token batch: prefill chunks and decode tokens of many sequences, flattened and ragged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch


@dataclass(frozen=True)
class SequenceChunk:
    """The tokens one sequence contributes to a step: a prefill (chunk) or a single decode token."""

    cache_row: int
    """The sequence's row of the step's block tables (``ForwardBatch.block_tables``; without them the model's dense
    tables: row r owns blocks ``r·MB .. r·MB + MB - 1``)."""
    start_pos: int
    """Position of the first token (= tokens of this sequence already in the cache)."""
    tokens: tuple[int, ...]
    """Token ids, at positions start_pos, start_pos + 1, ..."""
    slot: int = -1
    """Adapter slot of this sequence, -1 = base model."""

    def __post_init__(self) -> None:
        if self.cache_row < 0 or self.start_pos < 0 or not self.tokens or self.slot < -1:
            raise ValueError(
                f"SequenceChunk needs cache_row >= 0, start_pos >= 0, >= 1 token and slot >= -1; got "
                f"cache_row={self.cache_row}, start_pos={self.start_pos}, {len(self.tokens)} tokens, slot={self.slot}"
            )


@dataclass(frozen=True)
class StaticPadding:
    """How a traced (XLA) step pads its batch to a fixed shape, so every step of one bucket is one graph.

    Padding tokens are token 0 at position 0 in ``spare_row`` with slot -1: they write only the spare KV cache row
    (never a live sequence's) and read only it. Padding entries of ``logits_index`` point at token 0; their logits
    rows are discarded.
    """

    tokens: int
    """T: the token bucket the step's tokens are padded up to."""
    logits: int
    """N: the fixed number of logits rows (the engine's ``max_batch``)."""
    spare_row: int
    """The block-table row padding tokens write through (its every entry the spare block no sequence owns)."""


class SeqSpan(NamedTuple):
    """Where one sequence's tokens lie in the flat batch, for eager attention."""

    cache_row: int
    offset: int
    """First token's index in the flat batch."""
    count: int
    """Tokens of this sequence in the step."""
    end_pos: int
    """Context length after the step: start_pos + count (keys at positions < end_pos are visible)."""


@dataclass(frozen=True)
class ForwardBatch:
    """The model's input for one step; the engine builds one per step (``from_chunks`` does it for the usual case).

    Worked example, two sequences, one prefilling 3 tokens into row 0, one decoding at position 5 in row 2:
      tokens      [a, b, c, d]   positions [0, 1, 2, 5]   cache_rows [0, 0, 0, 2]
      spans       ((0, 0, 3, 3), (2, 3, 1, 6))            logits_index [2, 3] (last token of each)
    """

    tokens: torch.Tensor
    """Shape: [T] int64 token ids."""
    positions: torch.Tensor
    """Shape: [T] int64, each token's position in its sequence."""
    cache_rows: torch.Tensor
    """Shape: [T] int64, each token's row of the block tables."""
    logits_index: torch.Tensor | None
    """Shape: [N] int64, the tokens whose logits are returned; None returns all T."""
    spans: tuple[SeqSpan, ...] | None
    """Per-sequence spans (host ints) for eager attention; None selects the static-shape path (per-token gather
    over the whole cache row with a position mask), the one a traced device needs."""
    slot_indices: torch.Tensor | None = None
    """Shape: [T] int32 on the host, each token's adapter slot (-1 none): what ``LoRAKernelMeta.prepare`` takes."""
    block_tables: torch.Tensor | None = None
    """Shape: [R, MB] int64, row r's KV blocks in order (position p lies in block ``[r, p // BS]``); None: the
    model's dense tables (:meth:`runtime.model.llama.Llama.setup_caches`)."""

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def from_chunks(
        cls,
        chunks: Sequence[SequenceChunk],
        device: torch.device | str = "cpu",
        logits: Literal["last", "all"] = "last",
        static: bool = False,
        padding: StaticPadding | None = None,
        block_tables: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """Flatten the step's chunks in order; ``logits="last"`` asks for each chunk's last token only.

        ``static=True`` leaves ``spans`` out so the forward takes the static-shape attention path. ``padding`` (with
        ``logits="last"``; implies ``static``) pads tokens to ``padding.tokens`` and ``logits_index`` to
        ``padding.logits`` entries; the real tokens and logits rows come first, in chunk order. ``block_tables`` [R, MB]
        (host): the tables the chunks' ``cache_row`` index, moved to ``device`` with the batch.
        """
        if not chunks:
            raise ValueError("a step needs at least one sequence chunk")
        rows = [c.cache_row for c in chunks]
        if len(set(rows)) != len(rows):
            raise ValueError(f"each sequence appears once per step; cache rows {rows} repeat")
        tokens, positions, cache_rows, slots, spans, last = [], [], [], [], [], []
        for chunk in chunks:
            count = len(chunk.tokens)
            spans.append(SeqSpan(chunk.cache_row, len(tokens), count, chunk.start_pos + count))
            tokens.extend(chunk.tokens)
            positions.extend(range(chunk.start_pos, chunk.start_pos + count))
            cache_rows.extend([chunk.cache_row] * count)
            slots.extend([chunk.slot] * count)
            last.append(len(tokens) - 1)
        if padding is not None:
            if logits != "last" or len(tokens) > padding.tokens or len(last) > padding.logits:
                raise ValueError(
                    f"padding to {padding.tokens} tokens / {padding.logits} logits rows needs logits='last' and at "
                    f"most that many; got logits={logits!r}, {len(tokens)} tokens, {len(last)} sequences"
                )
            pad = padding.tokens - len(tokens)
            tokens.extend([0] * pad)
            positions.extend([0] * pad)
            cache_rows.extend([padding.spare_row] * pad)
            slots.extend([-1] * pad)
            last.extend([0] * (padding.logits - len(last)))
            static = True

        def long(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(device)

        return cls(
            tokens=long(tokens),
            positions=long(positions),
            cache_rows=long(cache_rows),
            logits_index=long(last) if logits == "last" else None,
            spans=None if static else tuple(spans),
            slot_indices=torch.tensor(slots, dtype=torch.int32),
            block_tables=None if block_tables is None else block_tables.to(device),
        )
