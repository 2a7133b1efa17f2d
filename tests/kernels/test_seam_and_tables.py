"""Validating launchers, the backend seam, the per-step form choice and the data tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adapter_manager import kernels
from adapter_manager.kernels import (
    BackendKind,
    DispatchEntry,
    KernelConfig,
    LoRAForm,
    LoRAKernelMeta,
    TorchDispatchTable,
    expand,
    select_backend,
    shrink,
)
from adapter_manager.kernels.cpu.backend import CpuFusedBackend
from adapter_manager.kernels.pallas.block_sizes import BlockSizes, BlockSizeTable
from adapter_manager.kernels.reference import ReferenceBackend
from adapter_manager.kernels.torch_eager import TorchEagerBackend
from adapter_manager.kernels.xla_laned import XlaLanedBackend
from tests.kernels._cases import ALWAYS_GROUPED


def prepared(slots, backend=None, num_slots=4, rank=2, granule=None):
    backend = backend or TorchEagerBackend(ALWAYS_GROUPED, max_segment_runs=0)
    meta = LoRAKernelMeta.make(backend, num_slots, rank, 16, "cpu", granule=granule)
    meta.prepare(torch.tensor(slots, dtype=torch.int32), dict.fromkeys(range(num_slots), rank))
    return meta


def test_launchers_name_argument_and_shape():
    meta = prepared([0, 1, -1], granule=3)  # N = 4·3 + 1 = 13
    x, a, bt = torch.randn(3, 8), torch.randn(13, 8), torch.randn(13, 5)
    with pytest.raises(ValueError, match=r"x must have shape \[T=3"):
        shrink(torch.randn(2, 8), a, meta)
    with pytest.raises(ValueError, match=r"a_rows must have shape \[N=13, features\] \(N = num_slots·granule \+ 1"):
        shrink(x, torch.randn(4, 2, 8), meta)
    with pytest.raises(ValueError, match=r"a_rows must have shape \[N=13"):
        shrink(x, torch.randn(12, 8), meta)
    with pytest.raises(ValueError, match=r"a_rows features 9 != x features 8 \(x \(3, 8\)\)"):
        shrink(x, torch.randn(13, 9), meta)
    with pytest.raises(ValueError, match="a_rows is torch.bfloat16"):
        shrink(x, a.bfloat16(), meta)
    h = shrink(x, a, meta)
    with pytest.raises(ValueError, match=r"h must have shape \[T=3, 2\]"):
        expand(torch.randn(3, 5), torch.randn(3, 8), bt, meta)
    with pytest.raises(ValueError, match="bt_rows features 5 != y features 6"):
        expand(torch.randn(3, 6), h, bt, meta)
    with pytest.raises(ValueError, match=r"bt_rows must have shape \[N=13"):
        expand(torch.randn(3, 5), h, torch.randn(14, 5), meta)
    laned = prepared([0, 1, -1], backend=XlaLanedBackend(), granule=3)  # k = 2 -> A = 4, h [T, 8]
    with pytest.raises(ValueError, match=r"h must have shape \[T=3, 8\]"):
        expand(torch.randn(3, 5), h, bt, laned)


def test_seam_picks_by_device_and_config():
    assert type(select_backend("cpu")) is CpuFusedBackend  # this machine builds the CPU kernel
    assert type(select_backend("cpu", KernelConfig(backend=BackendKind.TORCH))) is TorchEagerBackend
    assert type(select_backend("cpu", KernelConfig(torch_form=LoRAForm.SEGMENTS))) is TorchEagerBackend
    with pytest.raises(ValueError, match="CPU tensors only"):
        select_backend("cuda", KernelConfig(backend=BackendKind.CPU))
    with pytest.raises(ValueError, match="eager-only"):
        select_backend("xla", KernelConfig(backend=BackendKind.CPU))
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
    with caplog.at_level("DEBUG", logger="adapter_manager.kernels.meta"):
        assert prepared(slots, backend=select_backend("cpu", KernelConfig(backend=BackendKind.TORCH))).form is auto
    assert f"LoRA form {auto.value} for steps of {len(slots)} tokens" in caplog.text
    backend = select_backend("cpu", KernelConfig(torch_form=LoRAForm.GROUPED))
    meta = prepared(slots, backend=backend)
    assert meta.form is forced and (meta.grouping is not None) == (forced is LoRAForm.GROUPED)
    assert meta.single is None and meta.segments is None


def test_the_cpu_backend_fuses_steps_of_few_tokens():
    """FUSED up to fused_max_tokens (its runs table set beside the segments), the torch forms beyond, still with the
    runs table (a blocked layer takes any step in one lora_blocked call); the torch backend sets none."""
    small = prepared([2, 2, -1, 0, 0], backend=select_backend("cpu"))
    assert small.form is LoRAForm.FUSED and small.fused and small.segments is not None
    assert small.runs is not None and small.runs.tolist() == [[0, 2, 4, 2], [3, 2, 0, 2]]  # granule 2
    big = prepared([2, 2, -1, 0, 0], backend=select_backend("cpu", KernelConfig(fused_max_tokens=4)))
    assert big.form is LoRAForm.SEGMENTS and not big.fused
    assert big.runs is not None and big.runs.tolist() == small.runs.tolist()
    torch_forms = prepared([2, 2, -1, 0, 0], backend=select_backend("cpu", KernelConfig(backend=BackendKind.TORCH)))
    assert torch_forms.runs is None
    none = prepared([-1, -1], backend=select_backend("cpu"))
    assert none.form is LoRAForm.NONE and none.runs is None
    forced = prepared([1] * 9, backend=select_backend("cpu", KernelConfig(torch_form="fused", fused_max_tokens=0)))
    assert forced.form is LoRAForm.FUSED


def test_forced_forms_are_checked():
    with pytest.raises(ValueError, match="none and single are fast paths"):
        KernelConfig(torch_form=LoRAForm.SINGLE)
    with pytest.raises(ValueError, match="torch_form must be one of"):
        KernelConfig(torch_form="tiled")
    assert KernelConfig(torch_form="laned").torch_form is LoRAForm.LANED
    with pytest.raises(ValueError, match="applies to the torch and cpu backends only"):
        select_backend("cpu", KernelConfig(backend=BackendKind.REFERENCE, torch_form=LoRAForm.LANED))
    with pytest.raises(ValueError, match="needs the cpu backend"):
        select_backend("cpu", KernelConfig(backend=BackendKind.TORCH, torch_form=LoRAForm.FUSED))


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


def test_every_block_size_entry_fits_the_scoped_vmem_and_one_over_budget_fails_the_load(tmp_path):
    """Each entry's VMEM (blocks double-buffered, accumulator) against v5e's and v6e's scoped VMEM: the shipped table
    fits; a table with an entry over the smallest budget is refused at load, naming the entry and its MiB."""
    from adapter_manager.kernels.pallas.block_sizes import SCOPED_VMEM

    table = BlockSizeTable.load()
    assert max(e.vmem_bytes() for e in table.entries) <= min(SCOPED_VMEM.values())
    big = {"op": "expand", "max_tokens": 4096, "features": 8192, "block_tokens": 512, "block_features": 4096}
    rows = [*json.loads((Path(kernels.__file__).parent / "pallas" / "block_sizes.json").read_text())["entries"]]
    path = tmp_path / "blocks.json"
    path.write_text(json.dumps({"entries": [*rows, {**big, "lane_width": 256}]}))
    with pytest.raises(ValueError, match=r"expand \(features 8192, max_tokens 4096.*MiB of VMEM, over v5e's scoped 16"):
        BlockSizeTable.load(path)


def test_form_follows_the_active_slots_not_the_pool():
    """The dispatch table is keyed by the step's active lanes k·R: 8 active slots choose alike in pools of 8 and 256."""
    table = TorchDispatchTable(
        (DispatchEntry(slots=8, rank=16, laned_max_tokens=64), DispatchEntry(slots=256, rank=16, laned_max_tokens=0))
    )
    slots = [s for _ in range(2) for s in range(8)]  # 16 tokens interleaved over slots 0..7
    for num_slots in (8, 256):
        meta = prepared(slots, backend=TorchEagerBackend(table, max_segment_runs=0), num_slots=num_slots, rank=16)
        assert meta.form is LoRAForm.LANED and meta.lane_onehot.shape == (16, 8, 1)


def test_without_a_compiler_cpu_keeps_the_torch_forms(tmp_path):
    """A machine with no C++ compiler: one warning naming why, the torch backend, and a forced cpu backend refused."""
    script = (
        "import logging, sys; logging.basicConfig(level=logging.WARNING, stream=sys.stdout)\n"
        "from adapter_manager.kernels import BackendKind, KernelConfig, select_backend\n"
        "print(type(select_backend('cpu')).__name__)\n"
        "try:\n    select_backend('cpu', KernelConfig(backend=BackendKind.CPU))\n"
        "except ValueError as err:\n    print('refused:', err)\n"
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "ADAPTER_MANAGER_KERNEL_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert "CPU LoRA kernel unavailable, using the torch forms: RuntimeError: no C++ compiler" in out
    assert "\nTorchEagerBackend\n" in out and "refused: backend 'cpu': its kernel cannot be built here" in out
    assert out.count("unavailable") == 1 and not any(tmp_path.iterdir())
