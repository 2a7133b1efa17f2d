"""The request router: Serve's multiplexed locality, plus where a cold adapter goes and when a hot one spreads.

Serve's default (power of two choices) sends a request to a replica holding its model id; with no holder it picks
among the replicas with the fewest models, i.e. any replica once all are full, so a cold adapter can evict another
replica's hot one (ray#35911), and a holder is kept as long as its queue has room, so a hot adapter stays on one
replica while others idle (ray#65691). This router ranks candidates instead:

  holders of the adapter            unless every holder is saturated (more requests than its engine batches at
                                    once, so new ones wait there) and runs `spill_queue` more than the best other
                                    replica;
  holders + the best other replica  then: the hot adapter may load on a second one (a spread costs a load, so
                                    it happens only when waiting is the alternative);
  no holder (cold)                  a replica whose pool still has it in a slot (Serve unloaded it, the pool kept
                                    it: loading it again is a pin, not a copy), else the replica with free
                                    capacity, else the one whose coldest adapter (about the one Serve's LRU would
                                    unload) is the coldest; then the shortest queue.

Capacity and heat come from each replica's `record_routing_stats`; between reports the router counts the cold
adapters it has just sent, so a burst of cold adapters spreads instead of piling onto one replica. Requests
without a model id (the base model) go to the shortest queue. Serve picks the shortest queue within a rank and
moves to the next rank only when a replica refuses (its `max_ongoing_requests` is reached)."""

from __future__ import annotations

import math
import time

from ray.serve.request_router import MultiplexMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

_PLACEMENT_MEMORY_S = 2.0  # cold placements remembered until replicas' own reports include them


class AdapterRouter(MultiplexMixin, RequestRouter):
    def initialize_state(self, spill_queue: int = 4) -> None:
        self.spill_queue = spill_queue
        self._placed: dict[ReplicaID, dict[str, float]] = {}  # replica -> cold adapters sent there recently

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        model = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not model:
            return [candidate_replicas]
        now = time.time()
        holders = [r for r in candidate_replicas if model in r.multiplexed_model_ids or self._was_placed(r, model, now)]
        others = sorted(
            (r for r in candidate_replicas if r not in holders),
            key=lambda r: (model not in (r.routing_stats or {}).get("in_slot", ()), *self._cost(r, now)),
        )
        if not holders:
            if others:
                self._placed.setdefault(others[0].replica_id, {})[model] = now
            return [others[:1], others[1:]]
        if others and all(self._saturated(r) for r in holders):
            if min(self._queue(r) for r in holders) >= self._queue(others[0]) + self.spill_queue:
                return [holders + others[:1], others[1:]]
        return [holders, others]

    def _saturated(self, replica: RunningReplica) -> bool:
        """More requests than its engine runs in one batch: new ones would wait there."""
        return self._queue(replica) >= (replica.routing_stats or {}).get("max_batch", 0)

    def _cost(self, replica: RunningReplica, now: float) -> tuple[int, int, int, int]:
        """(no free capacity, heat of the adapter a new load would unload, cold adapters just sent there, queue
        length): lower is a better home. Cold adapters sent since the replica's last report count as loaded: the
        k-th of them past its capacity unloads its k-th coldest adapter. Heat is compared in whole requests, so
        among victims about as cold (adapters asked for about once) the loads spread over the replicas."""
        stats = replica.routing_stats or {}
        placed = self._placed.get(replica.replica_id, {})
        for model in [m for m, at in placed.items() if now - at > _PLACEMENT_MEMORY_S]:
            del placed[model]
        loaded = set(replica.multiplexed_model_ids) | set(placed)
        capacity = stats.get("capacity")
        if capacity is None or len(loaded) < capacity:
            return (0, 0, len(placed), self._queue(replica))
        heats = stats.get("heats") or [0.0]  # its loaded adapters' heat, coldest first
        victim = heats[min(len(loaded) - capacity, len(heats) - 1)]
        return (1, math.floor(victim), len(placed), self._queue(replica))

    def _was_placed(self, replica: RunningReplica, model: str, now: float) -> bool:
        at = self._placed.get(replica.replica_id, {}).get(model)
        return at is not None and now - at <= _PLACEMENT_MEMORY_S

    def _queue(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0
