"""The measured table that picks the eager torch backend's form (grouped or dense laned) by the step's active lanes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from adapter_manager.kernels.tables import load_entries

SHIPPED_TABLE = "torch_dispatch.json"


@dataclass(frozen=True)
class DispatchEntry:
    """One measured (k, R) point: the laned form wins up to ``laned_max_tokens`` tokens, grouping beyond."""

    slots: int
    """k, the active slots of the step (the laned form's lanes are k·R, whatever the pool size)."""
    rank: int
    """R, the padded rank."""
    laned_max_tokens: int
    """Largest token count at which laned was measured faster (0: never)."""

    def __post_init__(self) -> None:
        if self.slots < 1 or self.rank < 1 or self.laned_max_tokens < 0:
            raise ValueError(
                f"bad dispatch entry: slots={self.slots}, rank={self.rank}, laned_max_tokens={self.laned_max_tokens}"
            )


@dataclass(frozen=True)
class TorchDispatchTable:
    """Entries keyed by (k, R); a lookup uses the entry with the nearest active lane count k·R (ties: the smaller)."""

    entries: tuple[DispatchEntry, ...]
    """The measured points, at least one."""
    source: str = ""
    """Where the table came from (file path or the shipped resource)."""

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError(f"dispatch table {self.source!r} has no entries")

    @classmethod
    def load(cls, path: str | Path | None = None) -> TorchDispatchTable:
        """Read a table written by ``scripts/bench_kernels.py --write-table``; None reads the shipped one."""
        entries, source = load_entries(__package__, SHIPPED_TABLE, path, "dispatch table", lambda r: DispatchEntry(**r))
        return cls(entries, source)

    def prefers_laned(self, num_tokens: int, active_slots: int, rank: int) -> bool:
        """True when laned was measured faster for ``num_tokens`` tokens over ``active_slots``·``rank`` lanes."""
        lanes = active_slots * rank
        best = min(self.entries, key=lambda e: (abs(e.slots * e.rank - lanes), e.slots * e.rank, e.rank))
        return num_tokens <= best.laned_max_tokens

    def to_json(self, machine: str) -> str:
        rows = [{"slots": e.slots, "rank": e.rank, "laned_max_tokens": e.laned_max_tokens} for e in self.entries]
        return json.dumps({"machine": machine, "entries": rows}, indent=1) + "\n"
