"""The KV cache's blocks: a refcounted pool of fixed-size blocks, and the prefix cache that addresses full blocks by
content.

A full block is named by a hash chain (vLLM's prefix caching): ``hash_i = sha256(hash_{i-1} | namespace | tokens
of block i)``, so equal names mean equal tokens from the sequence's first position on, in the same namespace. The
namespace is the adapter and its content digest (and a generation the engine bumps when the adapter is dropped),
or the base model: two adapters never share a block, even for the same text, and an adapter refreshed to new bytes
never reads its old blocks. A block whose last user released it stays addressable until it is reused: free blocks
with a name are evicted least recently used first, nameless free blocks are handed out before any of them.

Worked example, block size 2, namespace N: tokens (5, 6, 7, 8, 9) -> names h0 = H(∅, N, 5 6), h1 = H(h0, N, 7 8)
(the 9 is a partial block, never named). A later request (5, 6, 7, 8, 1, 2) in N matches h0, h1: its first 4
tokens are cached, it computes 2.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from cachetools import LRUCache


def block_names(namespace: bytes, tokens: Sequence[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """The names of the full blocks of ``tokens`` (a sequence from its first position; ``parent``: the name of the
    block before ``tokens[0]`` when they continue a sequence, ``b""`` at its start)."""
    names = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = b",".join(str(t).encode() for t in tokens[start : start + block_size])
        parent = hashlib.sha256(b"|".join((parent, namespace, block))).digest()
        names.append(parent)
    return names


@dataclass(frozen=True)
class BlockCounts:
    """How the pool's blocks are used now."""

    total: int  # blocks in the pool (the cache's spare block not counted)
    used: int  # held by at least one running sequence
    free: int  # not held: nameless, or cached (named, evictable)
    cached: int  # named blocks, held or free: the prefix cache's content


class BlockPool:
    """``num_blocks`` KV blocks, each held by any number of sequences (refcounted), with the prefix cache's names.

    Not thread-safe: the engine calls it under its lock.
    """

    def __init__(self, num_blocks: int, caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.caching = caching
        self._refs = [0] * num_blocks
        self._nameless = list(range(num_blocks - 1, -1, -1))  # free, no name: a stack, block 0 handed out first
        self._evictable: LRUCache = LRUCache(maxsize=num_blocks)  # name -> block, free and named, LRU first
        self._by_name: dict[bytes, int] = {}  # every named block, held or free
        self._name_of: dict[int, bytes] = {}
        self._names_in: dict[bytes, set[bytes]] = {}  # namespace -> names, for drop()
        self._namespace_of: dict[bytes, bytes] = {}  # name -> namespace

    @property
    def free(self) -> int:
        """Blocks an `allocate` can hand out now (nameless ones, then the least recently used cached ones)."""
        return len(self._nameless) + len(self._evictable)

    def counts(self) -> BlockCounts:
        free = self.free
        return BlockCounts(self.num_blocks, self.num_blocks - free, free, len(self._by_name))

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks held once each, or None (nothing taken) when fewer are free. A cached free block handed out
        loses its name."""
        if n > self.free:
            return None
        blocks = []
        for _ in range(n):
            if self._nameless:
                blocks.append(self._nameless.pop())
                continue
            name, block = self._evictable.popitem()
            self._forget(name, block)
            blocks.append(block)
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def match(self, names: Sequence[bytes]) -> list[int]:
        """Hold the cached blocks of the longest prefix of ``names`` present, in order (empty without caching)."""
        blocks = []
        for name in names if self.caching else ():
            block = self._by_name.get(name)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._evictable[name]
            self._refs[block] += 1
            blocks.append(block)
        return blocks

    def cached_prefix(self, names: Sequence[bytes]) -> tuple[int, int]:
        """How many of ``names`` `match` would hold, and how many of those are free now (matching takes them from
        the free blocks), without holding them."""
        count = revived = 0
        for name in names if self.caching else ():
            block = self._by_name.get(name)
            if block is None:
                break
            count += 1
            revived += self._refs[block] == 0
        return count, revived

    def holders(self, block: int) -> int:
        """Sequences holding ``block``."""
        return self._refs[block]

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one hold of each block; a block no sequence holds becomes free (named: cached, most recently used)."""
        for block in reversed(blocks):  # a sequence's tail first: evicted before the prefix it continues
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"block {block} released more often than held"
            if self._refs[block] == 0:
                name = self._name_of.get(block)
                if name is None:
                    self._nameless.append(block)
                else:
                    self._evictable[name] = block

    def name(self, block: int, name: bytes, namespace: bytes) -> None:
        """Name a held, full block (its keys are all written). A name already given to another block (two
        sequences computed the same prefix side by side) is kept there; this block stays nameless."""
        if not self.caching or name in self._by_name or block in self._name_of:
            return
        self._by_name[name] = block
        self._name_of[block] = name
        self._names_in.setdefault(namespace, set()).add(name)
        self._namespace_of[name] = namespace

    def drop(self, namespace: bytes) -> int:
        """Unname every block of ``namespace`` (free ones become nameless; held ones stay with their holders, never
        matched again). Returns the blocks unnamed."""
        names = self._names_in.pop(namespace, set())
        for name in names:
            block = self._by_name[name]
            self._forget(name, block)
            if self._refs[block] == 0:
                del self._evictable[name]
                self._nameless.append(block)
        return len(names)

    def _forget(self, name: bytes, block: int) -> None:
        del self._by_name[name]
        del self._name_of[block]
        names = self._names_in.get(self._namespace_of.pop(name))
        if names is not None:
            names.discard(name)
