"""ClusterConfig: Serve's model count per replica is the pool's slots less the spare and the pinned ones."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")

from adapter_manager import (
    AdapterManagerConfig,  # noqa: E402
    RowOptions,
)
from adapter_manager.runtime.cluster import ClusterConfig  # noqa: E402


def test_models_per_replica_leave_out_spare_and_pinned_slots(tmp_path):
    manager = AdapterManagerConfig(max_slots=8, rows=RowOptions(max_rank=8))
    assert ClusterConfig(tmp_path, manager).models_per_replica == 7
    assert ClusterConfig(tmp_path, manager, spare_slots=2, pinned_slots=3).models_per_replica == 3
    for bad in ({"pinned_slots": 7}, {"pinned_slots": -1}, {"spare_slots": 8}, {"spare_slots": 4, "pinned_slots": 4}):
        with pytest.raises(ValueError, match="leave Serve at least one"):
            ClusterConfig(tmp_path, manager, **bad)


def test_cluster_serve_refuses_pinned_slots_that_leave_serve_nothing_before_starting_ray(capsys):
    from adapter_manager.runtime.cli import USAGE_ERROR, main

    assert main(["cluster", "serve", "--random", "tiny", "--max-slots", "2", "--pinned-slots", "1"]) == USAGE_ERROR
    assert "pinned_slots (1)" in capsys.readouterr().err
