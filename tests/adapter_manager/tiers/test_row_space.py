"""The unit space: buddy placement, merges and refusals, against a brute force over random alloc/free sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapter_manager.tiers.row_space import Block, RowSpace
from tests.adapter_manager.tiers._brute_force import first_fit, maximal_free_blocks


def test_row_space_worked_example_and_refusals():
    space = RowSpace(8, 4)
    assert [space.alloc(1), space.alloc(2), space.alloc(1), space.alloc(4)] == [0, 2, 1, 4]
    assert space.free_units == 0 and space.alloc(1) is None and space.largest_free() == 0
    space.free(1, 1)
    assert space.free_blocks() == [Block(1, 1)]  # its buddy [0, 1) is allocated: no merge
    space.free(0, 1)
    space.free(2, 2)
    assert space.free_blocks() == [Block(0, 4)] and space.free_units == 4 and space.largest_free() == 4
    copy = space.clone()
    assert copy.alloc(4) == 0 and space.free_blocks() == [Block(0, 4)]  # the copy is independent
    for bad in (3, 0, 8, True):
        with pytest.raises(ValueError, match=rf"units must be a power of two in 1..4, got {bad!r}"):
            space.alloc(bad)
    with pytest.raises(ValueError, match="no block of 2 unit.s. is allocated at 4 .allocated there: 4"):
        space.free(4, 2)
    with pytest.raises(ValueError, match="no block of 1 unit.s. is allocated at 0"):
        space.free(0, 1)
    with pytest.raises(ValueError, match="max_units must be a positive power of two, got 3"):
        RowSpace(6, 3)
    with pytest.raises(ValueError, match=r"num_units must be a positive multiple of max_units \(4\), got 6"):
        RowSpace(6, 4)


@settings(max_examples=300, deadline=None)
@given(
    tops=st.integers(1, 3),
    max_order=st.integers(0, 3),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 1 << 16)), max_size=60),
)
def test_row_space_matches_brute_force(tops, max_order, ops):
    max_units = 1 << max_order
    space, used, allocated = RowSpace(tops * max_units, max_units), [False] * (tops * max_units), {}
    for is_alloc, order, pick in ops:
        if is_alloc or not allocated:
            units = 1 << min(order, max_order)
            expected = first_fit(maximal_free_blocks(used, max_units), units)
            assert space.alloc(units) == expected
            if expected is not None:
                assert expected % units == 0 and not any(used[expected : expected + units])  # aligned, no overlap
                used[expected : expected + units] = [True] * units
                allocated[expected] = units
        else:
            start = sorted(allocated)[pick % len(allocated)]
            units = allocated.pop(start)
            space.free(start, units)
            used[start : start + units] = [False] * units
        assert space.free_blocks() == maximal_free_blocks(used, max_units)
        assert space.free_units == used.count(False) == sum(b.units for b in space.free_blocks())
        assert space.allocated_blocks() == sorted(Block(s, n) for s, n in allocated.items())
    for start, units in list(allocated.items()):
        space.free(start, units)
    assert space.free_blocks() == [Block(t * max_units, max_units) for t in range(tops)]  # merges restore tops
