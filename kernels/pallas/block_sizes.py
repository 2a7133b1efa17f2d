"""Pallas block sizes per problem shape, read from a JSON data file (``kernels/pallas/block_sizes.json``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kernels.tables import by_tokens, load_entries

SHIPPED_TABLE = "block_sizes.json"


@dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the Pallas shrink/expand kernels; each is clamped to the (padded) problem at launch."""

    block_tokens: int
    """Token rows per block; a multiple of 16 (bf16 sublane packing)."""
    block_features: int
    """Tile over the feature axis (shrink: the input features it reduces; expand: the output features)."""
    lane_width: int
    """Lanes per (slot, rank) block: 128 or 256. Small-rank slots share one block (LoRA laning)."""

    def __post_init__(self) -> None:
        if self.block_tokens < 16 or self.block_tokens % 16:
            raise ValueError(f"block_tokens must be a positive multiple of 16, got {self.block_tokens}")
        if self.block_features < 128 or self.block_features % 128:
            raise ValueError(f"block_features must be a positive multiple of 128, got {self.block_features}")
        if self.lane_width not in (128, 256):
            raise ValueError(f"lane_width must be 128 or 256, got {self.lane_width}")


@dataclass(frozen=True)
class BlockSizeEntry:
    """Block sizes of one op ("shrink" or "expand") for one feature count (None: any), up to ``max_tokens``."""

    op: str
    max_tokens: int
    features: int | None
    blocks: BlockSizes

    def __post_init__(self) -> None:
        if self.op not in ("shrink", "expand"):
            raise ValueError(f"block-size entry op must be 'shrink' or 'expand', got {self.op!r}")


def _entry(row: dict) -> BlockSizeEntry:
    blocks = BlockSizes(row["block_tokens"], row["block_features"], row["lane_width"])
    return BlockSizeEntry(op=row["op"], max_tokens=row["max_tokens"], features=row["features"], blocks=blocks)


@dataclass(frozen=True)
class BlockSizeTable:
    """Lookup by (op, features): exact entries if any, else that op's feature-agnostic ones; among them the smallest
    max_tokens ≥ T wins, else the largest."""

    entries: tuple[BlockSizeEntry, ...]
    source: str = ""

    def __post_init__(self) -> None:
        for op in ("shrink", "expand"):
            if not any(e.op == op and e.features is None for e in self.entries):
                raise ValueError(f"block-size table {self.source!r} needs a {op!r} entry with features null")

    @classmethod
    def load(cls, path: str | Path | None = None) -> BlockSizeTable:
        entries, source = load_entries("kernels.pallas", SHIPPED_TABLE, path, "block-size table", _entry)
        return cls(entries, source)

    def lookup(self, op: str, num_tokens: int, features: int) -> BlockSizes:
        exact = [e for e in self.entries if e.op == op and e.features == features]
        pool = exact or [e for e in self.entries if e.op == op and e.features is None]
        return by_tokens(pool, num_tokens).blocks
