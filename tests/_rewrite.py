"""Rewriting a file the way ``cp -p``, ``rsync -a``, ``tar x`` or a SOURCE_DATE_EPOCH build do: other bytes, the same
size and the same modification time."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def keeping_size_and_mtime(path: Path) -> Iterator[None]:
    """Around a rewrite of ``path`` with bytes of the same length: puts its old mtime back, and checks the premise
    (the same size and mtime, other bytes)."""
    before, content = path.stat(), path.read_bytes()
    yield
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert path.read_bytes() != content
