"""Batch metadata, validating launchers, the backend seam and the data tables."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import (
    BackendKind,
    KernelConfig,
    LoRAForm,
    LoRAKernelMeta,
    TorchDispatchTable,
    expand,
    select_backend,
    shrink,
)
from kernels.block_sizes import BlockSizes, BlockSizeTable
from kernels.reference import ReferenceBackend
from kernels.torch_eager import TorchEagerBackend
from kernels.xla_laned import XlaLanedBackend
from tests.kernels.test_eager_backends import ALWAYS_GROUPED


def prepared(slots, backend=None, num_slots=4, rank=2):
    backend = backend or TorchEagerBackend(ALWAYS_GROUPED, max_segment_runs=0)
    meta = LoRAKernelMeta.make(backend, num_slots, rank, 16, "cpu")
    meta.prepare(torch.tensor(slots, dtype=torch.int32))
    return meta


def test_worked_example_of_the_docstrings():
    meta = prepared([2, -1, 0, 2, 2])
    assert meta.slot_counts == (1, 0, 3, 0)
    assert (meta.no_adapter, meta.single_slot, meta.all_assigned) == (False, None, False)
    grouping = meta.grouping
    assert grouping.capacity == 3
    assert grouping.active_slots.tolist() == [0, 2]
    assert grouping.gather_index.view(2, 3).tolist() == [[2, 2, 2], [0, 3, 4]]
    assert grouping.valid[:, :, 0].tolist() == [[True, False, False], [True, True, True]]
    assert meta.lane_slot.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_segments_when_the_batch_is_grouped_by_slot():
    backend = TorchEagerBackend(ALWAYS_GROUPED, max_segment_runs=2)
    meta = prepared([2, 2, -1, 0, 0, 0, 2], backend=backend)
    assert meta.segments == ((2, 0, 2), (0, 3, 3), (2, 6, 1)) and meta.grouping is None and not meta.use_laned
    interleaved = prepared([0, 1, 0, 1, 0, 1], backend=backend)
    assert interleaved.segments is None and interleaved.grouping is not None


def test_fast_path_flags():
    assert prepared([-1, -1]).no_adapter
    single = prepared([3, -1, 3])
    assert single.single_slot == 3 and not single.all_assigned and single.grouping is None
    assert prepared([1, 1]).all_assigned
    assert prepared([0, 1, 0, 1]).grouping.padded
    skewed = prepared([0, 0, 0, 0, 0, 1]).grouping
    assert not skewed.padded and skewed.segments == ((0, 0, 5), (1, 5, 1))


@pytest.mark.parametrize("bad", [[0, 4], [-2, 0]])
def test_prepare_rejects_out_of_range_slots(bad):
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        prepared(bad)


def test_prepare_rejects_wrong_dtype_and_length():
    meta = LoRAKernelMeta.make(ReferenceBackend(), 4, 2, 3, "cpu")
    with pytest.raises(ValueError, match="int32"):
        meta.prepare(torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="max_tokens=3"):
        meta.prepare(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_slots"):
        LoRAKernelMeta.make(ReferenceBackend(), 0, 2, 3, "cpu")


def test_traced_prepare_does_not_inspect_values():
    meta = prepared([0, -1, 3], backend=XlaLanedBackend())
    assert meta.slot_counts is None and meta.token_slots.tolist() == [0, -1, 3]


def test_launchers_name_argument_and_shape():
    meta = prepared([0, 1, -1])
    x, a, bt = torch.randn(3, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 5)
    with pytest.raises(ValueError, match=r"x must have shape \[T=3"):
        shrink(torch.randn(2, 8), a, meta)
    with pytest.raises(ValueError, match=r"a_stack must have shape \[S=4, R=2"):
        shrink(x, torch.randn(4, 3, 8), meta)
    with pytest.raises(ValueError, match="a_stack features 9"):
        shrink(x, torch.randn(4, 2, 9), meta)
    with pytest.raises(ValueError, match="a_stack is torch.bfloat16"):
        shrink(x, a.bfloat16(), meta)
    h = shrink(x, a, meta)
    with pytest.raises(ValueError, match=r"h must have shape \[T=3, 2\]"):
        expand(torch.randn(3, 5), torch.randn(3, 8), bt, meta)
    with pytest.raises(ValueError, match="bt_stack features 5 != y features 6"):
        expand(torch.randn(3, 6), h, bt, meta)
    laned = prepared([0, 1, -1], backend=XlaLanedBackend())
    with pytest.raises(ValueError, match=r"h must have shape \[T=3, 8\]"):
        expand(torch.randn(3, 5), h, bt, laned)


def test_seam_picks_by_device_and_config():
    assert isinstance(select_backend("cpu"), TorchEagerBackend)
    assert isinstance(select_backend("cpu", KernelConfig(backend=BackendKind.REFERENCE)), ReferenceBackend)
    assert isinstance(select_backend("cpu", KernelConfig(backend=BackendKind.XLA)), XlaLanedBackend)
    with pytest.raises(ValueError, match="eager-only"):
        select_backend("xla", KernelConfig(backend=BackendKind.TORCH))
    with pytest.raises(ValueError, match="needs an xla device"):
        select_backend("cpu", KernelConfig(backend=BackendKind.PALLAS))
    with pytest.raises(ValueError, match="device type 'meta'"):
        select_backend("meta")
    with pytest.raises(ValueError, match="xla_backend"):
        KernelConfig(xla_backend=BackendKind.TORCH)


@pytest.mark.parametrize(
    ("slots", "auto", "forced"),
    [
        ([-1, -1], LoRAForm.NONE, LoRAForm.NONE),  # no adapter: nothing to force
        ([3, -1, 3], LoRAForm.SINGLE, LoRAForm.GROUPED),
        ([2, 2, -1, 0, 0], LoRAForm.SEGMENTS, LoRAForm.GROUPED),
    ],
)
def test_the_form_is_chosen_per_step_or_forced_and_recorded(slots, auto, forced, caplog):
    with caplog.at_level("DEBUG", logger="kernels.meta"):
        assert prepared(slots, backend=select_backend("cpu")).form is auto
    assert f"LoRA form {auto.value} for steps of {len(slots)} tokens" in caplog.text
    backend = select_backend("cpu", KernelConfig(torch_form=LoRAForm.GROUPED))
    meta = prepared(slots, backend=backend)
    assert meta.form is forced and (meta.grouping is not None) == (forced is LoRAForm.GROUPED)
    assert meta.single_slot is None and meta.segments is None


def test_forced_forms_are_checked():
    with pytest.raises(ValueError, match="none and single are fast paths"):
        KernelConfig(torch_form=LoRAForm.SINGLE)
    with pytest.raises(ValueError, match="torch_form must be one of"):
        KernelConfig(torch_form="fused")
    assert KernelConfig(torch_form="laned").torch_form is LoRAForm.LANED
    with pytest.raises(ValueError, match="applies to the torch backend only"):
        select_backend("cpu", KernelConfig(backend=BackendKind.REFERENCE, torch_form=LoRAForm.LANED))


def test_dispatch_table_round_trip(tmp_path):
    shipped = TorchDispatchTable.load()
    path = tmp_path / "table.json"
    path.write_text(shipped.to_json("test"))
    assert TorchDispatchTable.load(path) == TorchDispatchTable(shipped.entries, str(path))
    table = select_backend("cpu", KernelConfig(dispatch_table=str(path)))
    assert isinstance(table, TorchEagerBackend)
    path.write_text(json.dumps({"entries": [{"slots": 1}]}))
    with pytest.raises(ValueError, match="malformed"):
        TorchDispatchTable.load(path)


def test_block_size_table_loads_and_looks_up():
    table = BlockSizeTable.load()
    assert len(table.entries) > 6
    exact = [e for e in table.entries if e.op == "shrink" and e.features == 1024]
    assert table.lookup("shrink", 8, 1024) == min(exact, key=lambda e: e.max_tokens).blocks
    assert isinstance(table.lookup("expand", 10**7, 12345), BlockSizes)
    with pytest.raises(ValueError, match="block_features"):
        BlockSizes(16, 100, 128)
