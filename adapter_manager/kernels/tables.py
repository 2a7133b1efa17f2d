"""Reading a kernel data table (the torch forms' dispatch table, the Triton and Pallas block sizes): a JSON file
shipped inside the package beside the code that reads it, or one a benchmark wrote elsewhere, as typed entries."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Protocol, TypeVar

E = TypeVar("E")


def read_table(package: str, shipped: str, path: str | Path | None) -> tuple[str, str]:
    """(text, source) of ``path``, or of the resource ``shipped`` of ``package`` (``kernels.triton``) when path is
    None."""
    if path is None:
        return resources.files(package).joinpath(shipped).read_text(), f"{package.replace('.', '/')}/{shipped}"
    return Path(path).read_text(), str(path)


def load_entries(
    package: str, shipped: str, path: str | Path | None, what: str, entry: Callable[[dict], E]
) -> tuple[tuple[E, ...], str]:
    """(entries, source): each row of the table's ``"entries"`` list made into one by ``entry``; a missing key or a
    wrong type is a ValueError naming ``what`` and the source (an entry's own check raises as it does)."""
    text, source = read_table(package, shipped, path)
    try:
        return tuple(entry(row) for row in json.loads(text)["entries"]), source
    except (KeyError, TypeError) as err:
        raise ValueError(f"{what} {source} is malformed: {err}") from err


class _ByTokens(Protocol):
    max_tokens: int


T = TypeVar("T", bound=_ByTokens)


def by_tokens(entries: Sequence[T], num_tokens: int) -> T:
    """Among block-size entries, the one with the smallest ``max_tokens`` >= ``num_tokens``, else the largest."""
    fitting = [e for e in entries if e.max_tokens >= num_tokens]
    return min(fitting, key=lambda e: e.max_tokens) if fitting else max(entries, key=lambda e: e.max_tokens)
