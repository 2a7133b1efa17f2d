"""AdapterRouter's choices on Ray's own replica records (no cluster started): locality, where a cold adapter goes,
and when a hot one spreads (the failures of ray#35911 and ray#65691)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")

from ray.serve._private.common import (  # noqa: E402
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest  # noqa: E402

from adapter_manager.runtime.cluster import AdapterRouter  # noqa: E402

DEPLOYMENT = DeploymentID("EngineReplica", "test")


@dataclass(frozen=True)
class _Replica:
    """What the router reads of Serve's `RunningReplica` (the real one needs a live replica actor)."""

    replica_id: ReplicaID
    multiplexed_model_ids: set[str]
    routing_stats: dict


def _replica(
    name: str, loaded: list[str], in_slot: list[str] | None = None, heats: tuple = (0.0, 0.0), max_batch: int = 4
) -> _Replica:
    stats = {"capacity": 2, "heats": sorted(heats), "in_slot": in_slot or loaded, "max_batch": max_batch}
    return _Replica(ReplicaID(name, DEPLOYMENT), set(loaded), stats)


def _choose(router: AdapterRouter, replicas: list, model: str) -> list[list[str]]:
    async def choose():
        metadata = RequestMetadata("r", "i", multiplexed_model_id=model)
        return await router.choose_replicas(replicas, PendingRequest(args=[], kwargs={}, metadata=metadata))

    return [[r.replica_id.unique_id for r in rank] for rank in asyncio.run(choose())]


@pytest.fixture
def router() -> AdapterRouter:
    router = AdapterRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
    router.initialize_state(spill_queue=3)
    return router


def test_holders_first_and_a_hot_adapter_spills_only_when_its_holder_is_saturated(router):
    a, b = _replica("a", ["hot", "x"]), _replica("b", ["y"])
    assert _choose(router, [a, b], "hot") == [["a"], ["b"]]
    router.replica_queue_len_cache.update(a.replica_id, 5)
    router.replica_queue_len_cache.update(b.replica_id, 1)
    assert _choose(router, [a, b], "hot") == [["a", "b"], []]  # 5 >= batch 4 and 5 >= 1 + 3: b may take it too
    wide = _replica("a", ["hot", "x"], max_batch=8)  # the same queue fits in one of a's batches: no spread
    assert _choose(router, [wide, b], "hot") == [["a"], ["b"]]
    router.replica_queue_len_cache.update(b.replica_id, 6)
    assert _choose(router, [a, b], "hot") == [["a"], ["b"]]  # b is as busy: no spread


def test_a_cold_adapter_goes_to_free_capacity_then_to_the_coldest_victim(router):
    full_hot = _replica("a", ["h1", "h2"], heats=(9.0, 12.0))
    free = _replica("b", ["y"])
    assert _choose(router, [full_hot, free], "cold")[0] == ["b"]
    full_cold = _replica("c", ["c1", "c2"], heats=(0.5, 20.0))
    assert _choose(router, [full_hot, full_cold], "cold2")[0] == ["c"]  # never evict a's hot adapter
    assert _choose(router, [full_hot, full_cold], "cold2")[0] == ["c"]  # just placed: c counts as its holder


def test_a_replica_whose_pool_still_holds_the_adapter_comes_first(router):
    kept = _replica("a", ["h1", "h2"], in_slot=["h1", "h2", "old"], heats=(9.0, 9.0))
    free = _replica("b", [])
    assert _choose(router, [free, kept], "old")[0] == ["a"]


def test_a_burst_of_cold_adapters_spreads_over_the_coldest_ends(router):
    """Between reports each cold adapter sent to a full replica counts as unloading its next coldest adapter: the
    second cold one goes where the next victim is colder, not again to the replica with the coldest first one."""
    a = _replica("a", ["a1", "a2"], heats=(0.5, 20.0))
    b = _replica("b", ["b1", "b2"], heats=(1.0, 2.0))
    assert _choose(router, [a, b], "cold1")[0] == ["a"]  # a's coldest (0.5) is the coldest victim
    assert _choose(router, [a, b], "cold2")[0] == ["b"]  # a's next one is 20.0, b's coldest 1.0
    assert _choose(router, [a, b], "cold3")[0] == ["b"]  # b's next one is 2.0 < 20.0
