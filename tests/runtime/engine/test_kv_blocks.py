"""The KV block pool and the prefix cache's names: hash chains per namespace, refcounts, LRU eviction of free
cached blocks, dropping an adapter's namespace, and the invariants under any sequence of operations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from adapter_manager.runtime.engine.kv_blocks import BlockPool, block_names


def test_names_chain_full_blocks_per_namespace():
    a = block_names(b"A", [1, 2, 3, 4, 5], 2)
    assert len(a) == 2  # the 5 is a partial block: never named
    assert block_names(b"A", [1, 2, 3, 4, 9, 9], 2)[:2] == a  # the same prefix, the same names
    assert block_names(b"A", [1, 2, 3, 5], 2)[1] != a[1]  # one token differs: that block and every later differ
    assert block_names(b"A", [9, 9, 3, 4], 2)[1] != a[1]  # the chain: a block's name depends on all before it
    assert not set(block_names(b"B", [1, 2, 3, 4], 2)) & set(a)  # another adapter never shares a block
    assert block_names(b"A", [3, 4], 2, parent=a[0]) == a[1:]  # continuing a chain from its last name


def test_free_cached_blocks_are_matched_again_and_evicted_least_recently_used():
    pool = BlockPool(4)
    first, second = pool.allocate(2), pool.allocate(2)
    names = block_names(b"N", range(8), 2)
    for block, name in zip(first + second, names, strict=True):
        pool.name(block, name, b"N")
    assert pool.allocate(1) is None and pool.free == 0
    pool.release(first)  # first's blocks: free, cached
    pool.release(second)  # then second's: more recently used
    assert pool.counts().free == 4 and pool.counts().cached == 4
    assert pool.match(names[:2]) == first  # revived: held again, no longer free
    assert pool.free == 2
    pool.release(first)
    taken = pool.allocate(1)  # no nameless block: the least recently released cached one goes, and its name
    assert taken == [second[1]]  # release() frees a sequence's tail first: the tail is evicted before its prefix
    assert pool.match(names[2:4]) == [second[0]]  # the chain is cut where the evicted block was
    assert pool.cached_prefix(names) == (3, 2)  # 3 cached in a row, 2 of them free (matching would take them)


def test_nameless_free_blocks_go_before_any_cached_one():
    pool = BlockPool(3)
    named, plain = pool.allocate(1), pool.allocate(1)
    pool.name(named[0], b"x", b"N")
    pool.release(named)
    pool.release(plain)
    assert pool.allocate(2)[0] in (plain[0], 2) and pool.match([b"x"]) == named


def test_a_name_given_twice_stays_with_its_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.name(a[0], b"same", b"N")
    pool.name(b[0], b"same", b"N")  # two sequences computed the same block side by side
    assert pool.counts().cached == 1 and pool.match([b"same"]) == a


def test_dropping_a_namespace_unnames_its_blocks_free_or_held():
    pool = BlockPool(4)
    held, free = pool.allocate(1), pool.allocate(1)
    other = pool.allocate(1)
    pool.name(held[0], b"h", b"A")
    pool.name(free[0], b"f", b"A")
    pool.name(other[0], b"o", b"B")
    pool.release(free)
    assert pool.drop(b"A") == 2
    assert pool.match([b"h"]) == [] and pool.match([b"f"]) == []  # nothing reads them again
    assert pool.match([b"o"]) == other  # another namespace untouched
    pool.release(held)  # held until its holder let go: then a nameless free block
    assert pool.counts().cached == 1 and pool.free == 3


def test_without_caching_nothing_is_named_or_matched():
    pool = BlockPool(2, caching=False)
    block = pool.allocate(1)
    pool.name(block[0], b"x", b"N")
    pool.release(block)
    assert pool.match([b"x"]) == [] and pool.counts().cached == 0


_OPS = st.lists(
    st.tuples(st.sampled_from(["allocate", "release", "match", "drop"]), st.integers(0, 5), st.integers(0, 2)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(_OPS)
def test_any_sequence_of_operations_keeps_the_pool_consistent(ops):
    """Holders are sequences (lists of held blocks); every block is exactly one of held or free, a free named block
    is matchable, and a held block is never handed out again."""
    pool = BlockPool(6)
    holders: list[list[int]] = []
    spaces = [b"A", b"B", b"C"]
    for op, n, space in ops:
        if op == "allocate":
            blocks = pool.allocate(n)
            if blocks is not None:
                held = {b for h in holders for b in h}
                assert not held & set(blocks)
                names = block_names(spaces[space], range(len(blocks) * 2), 2)
                for block, name in zip(blocks, names, strict=True):
                    pool.name(block, name, spaces[space])
                holders.append(blocks)
        elif op == "release" and holders:
            pool.release(holders.pop(n % len(holders)))
        elif op == "match":
            blocks = pool.match(block_names(spaces[space], range(n * 2), 2))
            holders.append(blocks)
        elif op == "drop":
            pool.drop(spaces[space])
        held = {b for h in holders for b in h}
        counts = pool.counts()
        assert counts.used == len(held) and counts.free == 6 - len(held)
        assert all(pool.holders(b) == sum(h.count(b) for h in holders) for b in range(6))
