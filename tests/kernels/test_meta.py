"""Batch metadata on row pools: the worked example, the compact active table, buckets, forms and refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adapter_manager.kernels import AdapterRows, LoRAKernelMeta, Segment
from adapter_manager.kernels.reference import ReferenceBackend
from adapter_manager.kernels.torch_eager import TorchEagerBackend
from adapter_manager.kernels.xla_laned import XlaLanedBackend
from tests.kernels._cases import ALWAYS_GROUPED, ALWAYS_LANED


def prepared(slots, slot_rows=None, backend=None, num_slots=4, rank=2, **kwargs):
    backend = backend or TorchEagerBackend(ALWAYS_GROUPED, max_segment_runs=0)
    meta = LoRAKernelMeta.make(backend, num_slots, rank, 16, "cpu", **kwargs)
    slot_rows = dict.fromkeys(range(num_slots), rank) if slot_rows is None else slot_rows
    meta.prepare(torch.tensor(slots, dtype=torch.int32), slot_rows)
    return meta


def test_worked_example_of_the_meta_docstring():
    """S = 6, G = 2, R = 4; slot 0 has rank 3 (spans granules 0 and 1), slot 3 rank 2."""
    args = ([3, -1, 0, 3, 3], {0: 3, 3: 2})
    meta = prepared(*args, backend=XlaLanedBackend(), num_slots=6, rank=4, granule=2)
    assert (meta.num_rows, meta.zero_row, meta.active_buckets) == (13, 12, (1, 4, 6))
    assert meta.active_slots == (0, 3) and meta.active_width == 4
    assert meta.token_compact.tolist() == [1, -1, 0, 1, 1]
    assert meta.gather_rows.dtype == torch.int64
    assert meta.gather_rows.tolist() == [0, 1, 2, 12, 6, 7, 12, 12] + [12] * 8
    assert meta.lane_owner.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    eager = prepared(*args, backend=TorchEagerBackend(ALWAYS_GROUPED), num_slots=6, rank=4, granule=2)
    slot0, slot3 = AdapterRows(0, 0, 3), AdapterRows(3, 6, 2)
    assert eager.segments == (Segment(slot3, 0, 1), Segment(slot0, 2, 1), Segment(slot3, 3, 2))
    assert eager.form.value == "segments" and eager.gather_rows is None


def test_worked_example_of_the_grouping_docstring():
    meta = prepared([2, -1, 0, 2, 2])
    grouping = meta.grouping
    assert meta.active_slots == (0, 2) and not meta.all_assigned
    assert grouping.order.tolist() == [2, 0, 3, 4] and grouping.capacity == 3 and grouping.padded
    assert [(s.adapter.slot, s.start, s.count) for s in grouping.segments] == [(0, 0, 1), (2, 1, 3)]
    assert grouping.gather_index.view(2, 3).tolist() == [[2, 2, 2], [0, 3, 4]]
    assert grouping.valid[:, :, 0].tolist() == [[True, False, False], [True, True, True]]
    assert meta.active_gather_rows().tolist() == [0, 1, 4, 5]  # padded grouping reads the compact table


def test_compact_table_mixed_ranks_and_padding():
    meta = prepared(
        [5, 1, 5, -1, 9], {1: 1, 5: 4, 9: 2, 7: 3}, backend=XlaLanedBackend(), num_slots=10, rank=4, granule=4
    )
    assert meta.active_slots == (1, 5, 9) and meta.active_width == 4  # buckets (1, 4, 10)
    zero = 40
    assert meta.gather_rows.view(4, 4).tolist() == [
        [4, zero, zero, zero],
        [20, 21, 22, 23],
        [36, 37, zero, zero],
        [zero] * 4,
    ]
    assert meta.token_compact.tolist() == [1, 0, 1, -1, 2]


@pytest.mark.parametrize(
    ("num_slots", "expected"),
    [
        (1, (1,)),
        (4, (1, 4)),
        (6, (1, 4, 6)),
        (16, (1, 4, 16)),
        (256, (1, 4, 16, 64, 256)),
        (300, (1, 4, 16, 64, 256, 300)),
    ],
)
def test_default_active_buckets(num_slots, expected):
    assert LoRAKernelMeta.make(XlaLanedBackend(), num_slots, 8, 4, "cpu").active_buckets == expected


@pytest.mark.parametrize(
    ("slots", "width"), [([-1, -1], 1), ([0], 1), ([0, 1], 4), ([0, 1, 2, 3], 4), ([4, 0, 1, 2, 3], 16)]
)
def test_bucket_is_the_smallest_fitting_one(slots, width):
    meta = prepared(slots, backend=XlaLanedBackend(), num_slots=20)
    assert meta.active_width == width
    assert meta.gather_rows.shape == (width * 2,) and meta.lane_owner.shape == (width * 2,)


def test_lane_owner_is_made_once_per_width():
    meta = LoRAKernelMeta.make(XlaLanedBackend(), 20, 2, 8, "cpu")
    rows = dict.fromkeys(range(20), 2)
    meta.prepare(torch.tensor([0, 1], dtype=torch.int32), rows)
    first = meta.lane_owner
    meta.prepare(torch.tensor([5, 3, 5], dtype=torch.int32), rows)
    assert meta.lane_owner is first
    meta.prepare(torch.tensor([5], dtype=torch.int32), rows)
    assert meta.lane_owner is not first and meta.lane_owner.tolist() == [0, 0]


def test_custom_buckets_and_their_refusals():
    meta = prepared([0, 1, 2], backend=XlaLanedBackend(), num_slots=8, active_buckets=(2, 3))
    assert meta.active_width == 3
    with pytest.raises(ValueError, match="more than the largest active bucket 3"):
        prepared([0, 1, 2, 3], backend=XlaLanedBackend(), num_slots=8, active_buckets=(2, 3))
    with pytest.raises(ValueError, match="strictly ascending"):
        LoRAKernelMeta.make(XlaLanedBackend(), 8, 2, 4, "cpu", active_buckets=(4, 2))
    with pytest.raises(ValueError, match="positive ints"):
        LoRAKernelMeta.make(XlaLanedBackend(), 8, 2, 4, "cpu", active_buckets=(0, 2))


def test_granule_defaults_to_rank_and_is_checked():
    meta = LoRAKernelMeta.make(ReferenceBackend(), 5, 8, 4, "cpu")
    assert (meta.granule, meta.num_rows, meta.zero_row) == (8, 41, 40)
    assert LoRAKernelMeta.make(ReferenceBackend(), 5, 8, 4, "cpu", granule=3).num_rows == 16
    with pytest.raises(ValueError, match="granule must be a positive int, got 0"):
        LoRAKernelMeta.make(ReferenceBackend(), 5, 8, 4, "cpu", granule=0)


def test_fast_path_flags():
    assert prepared([-1, -1]).no_adapter
    single = prepared([3, -1, 3], {3: 1})
    assert single.single == AdapterRows(3, 6, 1) and not single.all_assigned and single.grouping is None
    assert prepared([1, 1]).all_assigned
    assert prepared([0, 1, 0, 1]).grouping.padded
    skewed = prepared([0, 0, 0, 0, 0, 1]).grouping
    assert not skewed.padded and skewed.gather_index is None
    assert [(s.adapter.slot, s.start, s.count) for s in skewed.segments] == [(0, 0, 5), (1, 5, 1)]


def test_eager_laned_reads_k_rows_of_the_table():
    backend = TorchEagerBackend(ALWAYS_LANED, max_segment_runs=0)
    meta = prepared([7, 2, 7, -1], {2: 1, 7: 2}, backend=backend, num_slots=20)
    assert meta.active_width == 4 and meta.active_gather_rows().tolist() == [4, 40, 14, 15]
    assert meta.lane_onehot[:, :, 0].tolist() == [[False, True], [True, False], [False, True], [False, False]]


@pytest.mark.parametrize("bad", [[0, 4], [-2, 0]])
def test_prepare_rejects_out_of_range_slots(bad):
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        prepared(bad)


@pytest.mark.parametrize("backend", [ReferenceBackend(), XlaLanedBackend()], ids=["eager", "traced"])
def test_prepare_refuses_bad_slot_rows(backend):
    with pytest.raises(ValueError, match="no entry for slot 2"):
        prepared([0, 2], {0: 1}, backend=backend)
    with pytest.raises(ValueError, match=r"slot_rows\[0\] = 3 is outside 1..rank=2"):
        prepared([0], {0: 3}, backend=backend)
    with pytest.raises(ValueError, match=r"slot_rows\[0\] = 0 is outside"):
        prepared([0], {0: 0}, backend=backend)
    with pytest.raises(ValueError, match=r"slot 3 of rank 2 needs rows \[3, 5\) but the pool has 4"):
        prepared([3], {3: 2}, backend=backend, granule=1)
    with pytest.raises(ValueError, match=r"slot 0 \(rows \[0, 2\)\) overlaps slot 1"):
        prepared([1, 0], {0: 2, 1: 1}, backend=backend, granule=1)
    prepared([0, 2], {0: 2, 2: 2}, backend=backend, granule=1)  # rank 2 spans granules 0 and 1: fine
    assert prepared([1], {1: np.int64(2)}, backend=backend).active_adapters == (AdapterRows(1, 2, 2),)


def test_traced_prepare_refuses_device_indices():
    meta = LoRAKernelMeta.make(XlaLanedBackend(), 4, 2, 4, "cpu")
    on_device = torch.zeros(2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="must be a CPU tensor on a traced backend"):
        meta.prepare(on_device, {0: 2})


def test_prepare_rejects_wrong_dtype_and_length():
    meta = LoRAKernelMeta.make(ReferenceBackend(), 4, 2, 3, "cpu")
    with pytest.raises(ValueError, match="int32"):
        meta.prepare(torch.zeros(2, dtype=torch.int64), {0: 2})
    with pytest.raises(ValueError, match="max_tokens=3"):
        meta.prepare(torch.zeros(4, dtype=torch.int32), {0: 2})
    with pytest.raises(ValueError, match="num_slots"):
        LoRAKernelMeta.make(ReferenceBackend(), 0, 2, 3, "cpu")


def test_prepare_never_walks_the_pool():
    """A 100 000-slot pool: the step's metadata is sized by its active slots, not by S."""
    meta = LoRAKernelMeta.make(XlaLanedBackend(), 100_000, 16, 8, "cpu")
    meta.prepare(torch.tensor([99_999, 7, -1, 7], dtype=torch.int32), {7: 16, 99_999: 3})
    assert meta.active_width == 4 and meta.gather_rows.numel() == 64
    assert meta.gather_rows[16:19].tolist() == [1_599_984, 1_599_985, 1_599_986]
