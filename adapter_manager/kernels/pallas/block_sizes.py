"""Pallas block sizes per problem shape, read from a JSON data file (``kernels/pallas/block_sizes.json``), each entry
checked against the scoped VMEM of the TPU generations we name (:data:`SCOPED_VMEM`) when the table loads.

VMEM of one kernel call (:meth:`BlockSizeEntry.vmem_bytes`): every input and output block double-buffered by the
Pallas pipeline, plus the fp32 accumulator scratch, each block padded to the (8, 128) tile of 32-bit values (a
(bt, 1) slot column takes a full 128 lanes), at fp32 (the widest dtype served) and at the entry's largest blocks:

    shrink:  2·[slots (bt, 1) + x (bt, F) + A (L, F)] + 2·h (bt, L) + acc (bt, L)
    expand:  2·[slots (bt, 1) + h (bt, L) + Bt (L, F) + y (bt, F)] + 2·out (bt, F) + acc (bt, F)

(bt = block_tokens, F = block_features, or the entry's features when smaller, L = lane_width.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from adapter_manager.kernels.tables import by_tokens, load_entries

SHIPPED_TABLE = "block_sizes.json"
_MIB = 1 << 20
SCOPED_VMEM = {"v5e": 16 * _MIB, "v6e": 32 * _MIB}
"""Default scoped VMEM per kernel (the Mosaic compiler's limit unless a kernel raises it), as JAX documents it for
each generation; an entry must fit the smallest."""


def _tile_bytes(rows: int, cols: int, element: int = 4) -> int:
    """Bytes of a [rows, cols] block in VMEM: padded to whole (8, 128) tiles of 32-bit words."""
    return -(-rows // 8) * 8 * (-(-cols // 128) * 128) * element


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

    def vmem_bytes(self) -> int:
        """VMEM one call with these blocks takes at most (the module's formula: fp32, every block at its largest)."""
        b = self.blocks
        bt, lanes = b.block_tokens, b.lane_width
        features = b.block_features if self.features is None else min(b.block_features, self.features)
        slots = _tile_bytes(bt, 1)
        if self.op == "shrink":
            inputs = slots + _tile_bytes(bt, features) + _tile_bytes(lanes, features)
            return 2 * inputs + 2 * _tile_bytes(bt, lanes) + _tile_bytes(bt, lanes)
        inputs = slots + _tile_bytes(bt, lanes) + _tile_bytes(lanes, features) + _tile_bytes(bt, features)
        return 2 * inputs + 2 * _tile_bytes(bt, features) + _tile_bytes(bt, features)

    def describe(self) -> str:
        b = self.blocks
        return (
            f"{self.op} (features {self.features}, max_tokens {self.max_tokens}: block_tokens {b.block_tokens}, "
            f"block_features {b.block_features}, lane_width {b.lane_width})"
        )


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
        generation, budget = min(SCOPED_VMEM.items(), key=lambda item: item[1])
        for entry in self.entries:
            if entry.vmem_bytes() > budget:
                raise ValueError(
                    f"block-size table {self.source!r}: entry {entry.describe()} needs {entry.vmem_bytes() / _MIB:.2f} "
                    f"MiB of VMEM, over {generation}'s scoped {budget / _MIB:.0f} MiB"
                )

    @classmethod
    def load(cls, path: str | Path | None = None) -> BlockSizeTable:
        entries, source = load_entries(__package__, SHIPPED_TABLE, path, "block-size table", _entry)
        return cls(entries, source)

    def lookup(self, op: str, num_tokens: int, features: int) -> BlockSizes:
        exact = [e for e in self.entries if e.op == op and e.features == features]
        pool = exact or [e for e in self.entries if e.op == op and e.features is None]
        return by_tokens(pool, num_tokens).blocks
