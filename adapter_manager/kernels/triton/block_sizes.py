"""Triton block sizes per (op, token bucket, rank, features), read from a JSON data file (``block_sizes.json``).

``scripts/bench_kernels.py --device cuda --tune`` times the candidates on a GPU and writes a table of this format; the
shipped one holds untuned defaults (no GPU was lent while it was written).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from adapter_manager.kernels.tables import by_tokens, load_entries

SHIPPED_TABLE = "block_sizes.json"
OPS = ("bgmv_shrink", "bgmv_expand", "sgmv_shrink", "sgmv_expand")


def _power_of_2(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or value < low or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {low}, got {value!r}")


@dataclass(frozen=True)
class TritonBlocks:
    """Tile sizes of one Triton kernel launch; the rank block is clamped to the padded rank at launch."""

    block_tokens: int
    """SGMV: tokens of a run per program (tl.dot needs >= 16); BGMV: 1 (one token per program)."""
    block_rank: int
    """Rank lanes per program (shrink: a grid axis, blocks past a rank return at once; expand: the loop step)."""
    block_features: int
    """Shrink: input features per loop step; expand: output columns per program."""
    split_k: int = 1
    """BGMV shrink: programs splitting the input features of one (token, part), atomically added; 1 elsewhere."""
    num_warps: int = 4

    def __post_init__(self) -> None:
        _power_of_2("block_tokens", self.block_tokens, 1)
        _power_of_2("block_rank", self.block_rank, 1)
        _power_of_2("block_features", self.block_features, 16)
        _power_of_2("split_k", self.split_k, 1)
        _power_of_2("num_warps", self.num_warps, 1)


@dataclass(frozen=True)
class TritonBlockEntry:
    """Block sizes of one op for steps of up to ``max_tokens`` tokens; ``rank`` / ``features`` None match any."""

    op: str
    max_tokens: int
    rank: int | None
    features: int | None
    blocks: TritonBlocks

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"block-size entry op must be one of {', '.join(OPS)}, got {self.op!r}")
        if self.op.startswith("sgmv") and self.blocks.block_tokens < 16:
            raise ValueError(f"{self.op} needs block_tokens >= 16 (tl.dot), got {self.blocks.block_tokens}")
        if self.op != "bgmv_shrink" and self.blocks.split_k != 1:
            raise ValueError(f"split_k applies to bgmv_shrink only, got {self.blocks.split_k} for {self.op}")


def _entry(row: dict) -> TritonBlockEntry:
    blocks = TritonBlocks(
        row["block_tokens"], row["block_rank"], row["block_features"], row.get("split_k", 1), row.get("num_warps", 4)
    )
    return TritonBlockEntry(row["op"], row["max_tokens"], row["rank"], row["features"], blocks)


@dataclass(frozen=True)
class TritonBlockTable:
    """Lookup by (op, T, rank, features): the entries matching rank and features most exactly (both, then one, then
    neither); among them the smallest max_tokens >= T wins, else the largest."""

    entries: tuple[TritonBlockEntry, ...]
    source: str = ""

    def __post_init__(self) -> None:
        for op in OPS:
            if not any(e.op == op and e.rank is None and e.features is None for e in self.entries):
                raise ValueError(f"Triton block-size table {self.source!r} needs a {op!r} entry for any rank/features")

    @classmethod
    def load(cls, path: str | Path | None = None) -> TritonBlockTable:
        entries, source = load_entries(__package__, SHIPPED_TABLE, path, "Triton block-size table", _entry)
        return cls(entries, source)

    def lookup(self, op: str, num_tokens: int, rank: int, features: int) -> TritonBlocks:
        mine = [e for e in self.entries if e.op == op]
        for want_rank, want_features in ((rank, features), (rank, None), (None, features), (None, None)):
            pool = [e for e in mine if e.rank == want_rank and e.features == want_features]
            if pool:
                break
        return by_tokens(pool, num_tokens).blocks

    def to_json(self, note: str) -> str:
        """The table as the JSON file :meth:`load` reads."""
        rows = [
            {
                "op": e.op,
                "max_tokens": e.max_tokens,
                "rank": e.rank,
                "features": e.features,
                "block_tokens": e.blocks.block_tokens,
                "block_rank": e.blocks.block_rank,
                "block_features": e.blocks.block_features,
                "split_k": e.blocks.split_k,
                "num_warps": e.blocks.num_warps,
            }
            for e in self.entries
        ]
        return json.dumps({"note": note, "entries": rows}, indent=1) + "\n"
