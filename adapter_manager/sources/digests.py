"""What an adapter is: the digest of its content, never its name, revision or file times.

    digests = FileDigests()
    digests.sha256(path)                       # a file's sha256, hashed once while its stat is unchanged
    content_digest(config_sha256, weights_sha256)  # the adapter's identity

An adapter's identity is ``sha256("adapter_config.json NUL <sha256> LF adapter_model.safetensors NUL <sha256> LF")``
over its two files' sha256. The same bytes under another commit (or copied to another directory) are the same adapter;
different bytes never are, whatever their size and modification time (what ``cp -p``, ``rsync -a``, ``tar x`` or a
SOURCE_DATE_EPOCH build keep). A hub file in the HF cache costs no hashing when its blob is named by a 64-hex etag:
the hub's etag of an LFS file is its content's sha256. Everything else (local directories, non-LFS hub files such as
the config, whose etag is a git blob sha1) is hashed, once per file while its stat is unchanged.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from pathlib import Path

from cachetools import LRUCache

from .peft_format import CONFIG_NAME, WEIGHTS_NAME

_CHUNK = 1 << 20
_RACY_S = 2.0  # a file changed this recently may change again within its timestamps' granularity: never remembered
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REMEMBERED = 1 << 16  # files whose digests are kept (the least recently used go first)


def content_digest(config_sha256: str, weights_sha256: str) -> str:
    """An adapter's identity from its config's and its weights' sha256 (hex)."""
    lines = f"{CONFIG_NAME}\0{config_sha256}\n{WEIGHTS_NAME}\0{weights_sha256}\n"
    return hashlib.sha256(lines.encode()).hexdigest()


class FileDigests:
    """(sha256, git blob sha1) per file, remembered while (device, inode, size, mtime, ctime) is unchanged; thread-safe.

    A rewrite keeping size and mtime still changes ctime, which no tool sets; like git's "racily clean" rule, a file
    whose mtime or ctime is within `_RACY_S` of now is hashed every time, since it may change again inside one
    timestamp tick without its stat changing.
    """

    def __init__(self) -> None:
        # path -> (stat key, sha256, git oid)
        self._entries: LRUCache[str, tuple[tuple[int, ...], str, str]] = LRUCache(_REMEMBERED)
        self._lock = threading.Lock()

    def sha256(self, path: Path) -> str:
        """The file's content sha256 (hex). A symlink into an HF cache's ``blobs/`` named by a 64-hex etag is that
        etag, unread."""
        target = Path(os.path.realpath(path))
        if target.parent.name == "blobs" and _SHA256.fullmatch(target.name) and target != Path(path):
            return target.name
        return self.digests(target, os.stat(target))[0]

    def digests(self, location: Path, st: os.stat_result) -> tuple[str, str]:
        """The file's (sha256, git blob sha1), given its stat taken just before."""
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with self._lock:
            hit = self._entries.get(str(location))
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        sha256 = hashlib.sha256()
        git = hashlib.sha1(f"blob {st.st_size}\0".encode())
        with open(location, "rb") as f:
            while chunk := f.read(_CHUNK):
                sha256.update(chunk)
                git.update(chunk)
        if time.time() - max(st.st_mtime_ns, st.st_ctime_ns) / 1e9 > _RACY_S:
            with self._lock:
                self._entries[str(location)] = (key, sha256.hexdigest(), git.hexdigest())
        return sha256.hexdigest(), git.hexdigest()
