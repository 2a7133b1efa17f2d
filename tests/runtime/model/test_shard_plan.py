"""The shard plan makes each linear's split (:class:`kernels.LinearShards`) once, and the linear takes its rows'
shapes from it: a fully sharded LoRA is the plan's ``fully_sharded_loras``, never guessed from the rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from adapter_manager import TensorParallel
from adapter_manager.kernels import LinearShards
from adapter_manager.runtime.model.projection import LoRALinear
from adapter_manager.runtime.model.shard_plan import PoolSection, ShardGroup, ShardPlan

HIDDEN, ROWS = 64, 9


def _rows(a_width: int, bt_width: int) -> SimpleNamespace:
    return SimpleNamespace(a=torch.zeros(ROWS, a_width), bt=torch.zeros(ROWS, bt_width), vector=None)


@pytest.mark.parametrize("full", [False, True])
def test_each_form_makes_one_split_per_linear(full):
    none = ShardPlan(TensorParallel(1, full)).linear(row_parallel=True)
    assert (none.form, none.size, none.local, none.fully_sharded, none.row_parallel) == ("none", 1, 1, False, True)
    spmd = ShardPlan(TensorParallel(2, full)).linear()
    assert (spmd.form, spmd.size, spmd.local, spmd.fully_sharded) == ("spmd", 2, 2, full)
    assert spmd.spmd is not None and spmd.process is None
    group = ShardGroup(2, 1)
    processes = ShardPlan(TensorParallel(2, full), group).linear()
    assert (processes.form, processes.size, processes.local, processes.fully_sharded) == ("processes", 2, 1, full)
    assert processes.process is group and processes.spmd is None


def test_a_split_names_one_form_and_a_fully_sharded_one_needs_shards():
    with pytest.raises(ValueError, match="not both"):
        LinearShards(spmd=SimpleNamespace(size=2), process=ShardGroup(2, 0))
    with pytest.raises(ValueError, match="N > 1"):
        LinearShards(fully_sharded=True)


def test_the_plan_reads_a_pool_split_as_it_is():
    plan = ShardPlan(TensorParallel(2, True), ShardGroup(2, 0))
    assert plan.reads(TensorParallel(2, True))
    assert not plan.reads(TensorParallel(2)) and not plan.reads(TensorParallel(4, True))
    assert ShardPlan().reads(TensorParallel(1, True))  # one shard: nothing to split


@pytest.mark.parametrize("row_parallel", [False, True])
def test_a_process_linear_takes_the_rows_its_plan_gives_and_refuses_the_other_split(row_parallel):
    """One process of 2, column-parallel (in: hidden) or row-parallel (out: hidden): fully sharded, its section of A
    or Bt is half of hidden; the base's split keeps it whole. Each plan refuses the other's rows."""
    local = 16  # this process's heads or MLP slice
    in_features, out = (local, HIDDEN) if row_parallel else (HIDDEN, local)
    whole = _rows(in_features, out)
    halved = _rows(in_features, out // 2) if row_parallel else _rows(in_features // 2, out)
    for full, fits, other in ((True, halved, whole), (False, whole, halved)):
        plan = ShardPlan(TensorParallel(2, full), ShardGroup(2, 1))
        linear = LoRALinear(in_features, (out,), plan=plan, row_parallel=row_parallel)
        with pytest.raises(ValueError, match="must have shape"):
            linear.attach(0, other)
        linear.attach(0, fits)
        assert linear.has_lora and linear.shards.fully_sharded == full


def test_a_process_reads_its_own_section_of_the_pools_rows():
    sectioned = SimpleNamespace(a=torch.arange(2 * 3 * 4.0).view(2, 3, 4), bt=torch.zeros(2, 3, 5), vector=None)
    own = ShardPlan(TensorParallel(3), ShardGroup(3, 2)).own_rows(sectioned)
    assert isinstance(own, PoolSection) and torch.equal(own.a, sectioned.a[:, 2]) and own.bt.shape == (2, 5)
    assert ShardPlan(TensorParallel(3)).own_rows(sectioned) is sectioned  # one SPMD program: every section
