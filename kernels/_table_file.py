"""Reading a kernel data table: a JSON file shipped inside the package, or one a benchmark wrote elsewhere."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def read_table(shipped: str, path: str | Path | None) -> tuple[str, str]:
    """(text, source) of ``path``, or of the shipped resource ``kernels/<shipped>`` when path is None."""
    if path is None:
        return resources.files("kernels").joinpath(shipped).read_text(), f"kernels/{shipped}"
    return Path(path).read_text(), str(path)
