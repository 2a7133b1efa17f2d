"""One engine replica: an Engine with its own AdapterManager behind the single-machine server's app, with Serve's
model multiplexing mapped onto the replica's slot pool.

Serve's multiplexed loader is the pool's door: loading adapter X registers it (lazily, from the directory's ref)
and operator-pins it into a slot. Each request for X holds X pinned as well until its response ends, so Serve's LRU
unload (which does not wait for in-flight requests) drops only its own hold: X is unpinned (its slot stays filled,
and evictable) once the last request for it is answered. Without the request holds, a request queued for X after
Serve unloaded it could find every slot pinned for other adapters and wait for ever. Serve keeps at most
`max_num_models_per_replica` = the pool's max-rank capacity less `spare_slots` loaded, so a load finds room unless
more adapters than the spare slots still answer after Serve unloaded them; then it waits (`PIN_WAIT_S`) for their
requests to end. An operator's cluster-wide pin (from the directory, at each report) is one more hold, in one of
the `pinned_slots` also kept out of Serve's count. The pool and host tier stay the only cache."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from adapter_manager import (
    AdapterConflictError,
    AdapterNotFoundError,
    SlotsExhaustedError,
    background_executor,
)

from ..server.http_errors import error_body, to_api_error
from ..server.launch import build_serving
from .config import ClusterConfig
from .directory import DirectoryEntry, reconcile_plan
from .forward import ForwardedRequest, ResponseStart, call_app
from .holds import Heat, Holds, Resident
from .replica_metrics import ReplicaGauges

log = logging.getLogger(__name__)

PIN_WAIT_S = 120.0  # how long a load waits for in-flight batches to release room in the pool


class EngineReplica:
    """The deployment's class body; `replica_class` wraps it with Serve's decorators (`models_per_replica` is a
    decorator argument, so the class is made per config)."""

    def __init__(self, config: ClusterConfig, directory: DeploymentHandle) -> None:
        self.config = config
        manager = config.manager
        if config.multiplexed:  # Serve's multiplexer decides what this replica holds; a popularity guess of the
            manager = replace(manager, prefetch_popular=0)  # replica's own would load what Serve sent elsewhere
        self.serving = build_serving(config.folder, manager, config.engine, config.server, config.dtype)
        self.manager = self.serving.manager
        self.serving.engine.start()
        self.directory = directory
        self.loaded: dict[str, Resident] = {}  # Serve's multiplexed models on this replica, by adapter id
        self.synced: dict[str, DirectoryEntry] = {}  # adapter id -> the directory entry it is registered from here
        self.mirror: dict[str, DirectoryEntry] = {}  # every directory entry as of the last report: given back to a
        # restarted directory, so an adapter survives it even if the replica that validated it died before
        self._epoch: str | None = None  # the directory's, at the last report
        self._registering: dict[str, asyncio.Lock] = {}
        self.heat = Heat()
        self.holds = Holds(self.manager, self._pin)
        self._pinner = background_executor(1, "pin")  # pins (slot copies) never queue behind registrations
        self.operator: set[str] = set()  # adapters held here for the operator's cluster-wide pin
        self._operator_tasks: dict[str, asyncio.Task] = {}  # operator pins being taken
        # Serve's loads here and their time in each part (pin_s includes waits for room)
        self.loader = {"loads": 0, "register_s": 0.0, "pin_s": 0.0}
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id if context is not None else f"pid-{os.getpid()}"
        self.gauges = ReplicaGauges()

    async def load(self, adapter_id: str) -> Resident:
        """The multiplexed loader: register from the directory if needed, then hold it pinned in the pool."""
        start = time.perf_counter()
        if not self.manager.is_registered(adapter_id):  # `handle` registers before queueing for Serve's load lock
            await self._register(adapter_id)
        registered = time.perf_counter()
        await self.holds.hold(adapter_id)
        self.loader["loads"] += 1
        self.loader["register_s"] += registered - start
        self.loader["pin_s"] += time.perf_counter() - registered
        return Resident(self.loaded, self.holds, adapter_id)

    async def _warm(self, adapter_id: str) -> None:
        """Everything a load needs but the slot copy, done here, concurrently with other requests: Serve runs a
        replica's loads one at a time under a lock, so the hub round trips of registration and the disk -> host
        preparation (30 ms p50, 170 ms p99 on the bench model, against 2 ms for host -> slot) stay out of it."""
        await self._register(adapter_id)
        if self.manager.slot_of(adapter_id) is None:  # in a slot already: the load is a pin
            registrations = self.serving.app.state.server.registrations
            await asyncio.get_running_loop().run_in_executor(registrations, self.manager.prepare, adapter_id)

    async def _register(self, adapter_id: str) -> None:
        async with self._registering.setdefault(adapter_id, asyncio.Lock()):  # one registration per adapter at once
            await self._sync(adapter_id)

    async def _sync(self, adapter_id: str) -> None:
        entry: DirectoryEntry | None = await self.directory.get.remote(adapter_id)
        if entry is None:
            raise AdapterNotFoundError(adapter_id, "is not registered in the cluster")
        known = self.synced.get(adapter_id)
        if known is not None and known.version == entry.version and self.manager.is_registered(adapter_id):
            return
        loop = asyncio.get_running_loop()
        registrations = self.serving.app.state.server.registrations
        try:
            await loop.run_in_executor(registrations, self.manager.register, entry.ref, adapter_id)
        except AdapterConflictError:  # registered here from another source: the directory's entry wins
            await loop.run_in_executor(registrations, self.manager.unregister, adapter_id)
            await loop.run_in_executor(registrations, self.manager.register, entry.ref, adapter_id)
        self.synced[adapter_id] = entry

    async def _pin(self, adapter_id: str) -> None:
        """Pin into the pool, waiting for room if the units are held by batches of adapters Serve already unloaded:
        the allocator wakes the wait at each release, in waits of at most a second (the pin thread stays free to
        stop with the replica)."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + PIN_WAIT_S
        while True:
            wait_s = min(max(deadline - time.monotonic(), 0.0), 1.0)
            try:
                await loop.run_in_executor(self._pinner, self.manager.pin, adapter_id, wait_s)
                return
            except SlotsExhaustedError:
                if time.monotonic() >= deadline:
                    raise

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """One HTTP request through the server's own app; with a multiplexed model id, its adapter is loaded first."""
        adapter_id = serve.get_multiplexed_model_id()
        if adapter_id:
            self.heat.hit(adapter_id)
            try:
                if adapter_id not in self.loaded:
                    await self._warm(adapter_id)
                await self.multiplexed(adapter_id)
                if not self.manager.is_registered(adapter_id):  # deleted and registered again since Serve loaded it
                    await self._register(adapter_id)
                    await self._pin(adapter_id)
                await self.holds.hold(adapter_id)  # pinned until the response ends, whatever Serve unloads
            except Exception as err:  # noqa: BLE001 - answered like the single server answers it
                api = to_api_error(err, "model")
                body = json.dumps(error_body(api.status, api.message, api.param, api.code)).encode()
                yield ResponseStart(api.status, ((b"content-type", b"application/json"),))
                yield body
                return
            try:
                async for part in call_app(self.serving.app, request):
                    yield part
            finally:
                self.holds.drop(adapter_id)
            return
        if request.adapter_id and not self.manager.is_registered(request.adapter_id):
            try:  # no model id (Serve's default routing): register only; the pool's own LRU decides residency
                await self._register(request.adapter_id)
            except Exception:  # noqa: BLE001 - the app answers an unknown adapter with its own 404
                log.warning("could not register %s", request.adapter_id, exc_info=True)
        async for part in call_app(self.serving.app, request):
            yield part

    async def multiplexed(self, adapter_id: str) -> Resident:  # replaced by the Serve-decorated loader
        raise NotImplementedError

    def snapshot(self) -> dict[str, Any]:
        """This replica's report: capacity, what it holds, how hot each adapter is, and its swap metrics."""
        manager, now, taken_at = self.manager, time.monotonic(), time.time()
        # the pool, Serve's loaded models and the holds at one instant: an unload's drop runs on another thread
        holds, (states, loaded) = self.holds.view(lambda: (manager.slot_states(), sorted(self.loaded)))
        used = sum(s.units for s in states)
        metrics = manager.metrics().to_dict()
        metrics.pop("residency", None)
        heat = {a: round(self.heat.value(a, now), 3) for a in loaded}
        return {
            "replica": self.name,
            "taken_at": taken_at,  # wall clock
            "pid": os.getpid(),
            "capacity": self.config.models_per_replica,
            "loaded": loaded,
            "loader": dict(self.loader),
            "holds": holds,  # Serve's loaded model, each in-flight request and an operator pin
            "pinned": sorted(self.operator),  # held for the operator's cluster-wide pin
            "free": max(self.config.models_per_replica - len(loaded), 0),
            "heats": sorted(heat.values()),  # coldest first: what the next loads here would unload
            "heat": heat,
            "units": manager.num_units,
            "free_units": manager.num_units - used,
            "slots": {
                s.adapter_id: {"slot": s.slot, "rank": s.rank, "pinned": s.manual, "in_flight": s.pins} for s in states
            },
            "registered": len(manager.records()),
            "unadopted": [r.adapter_id for r in manager.records() if r.adapter_id not in self.synced],
            "mirrored": len(self.mirror),
            "in_flight": self.serving.app.state.server.generator.pending,
            "max_batch": self.config.engine.max_batch,
            "metrics": metrics,
        }

    async def record_routing_stats(self) -> dict[str, Any]:
        """Called by Serve every `stats_period_s`: report to the directory, drop deleted adapters, feed the router
        and Prometheus."""
        snapshot = self.snapshot()
        try:
            epoch, versions, removed, pinned = await self.directory.report.remote(self.name, snapshot)
            known = {**self.mirror, **self.synced}
            if epoch != self._epoch and known:  # a new directory (Serve restarted it): give back what we know
                given = [replace(e, pinned=a in self.operator) for a, e in known.items()]
                versions = await self.directory.restore.remote(given)
                pinned = [a for a in self.operator if a in versions]
            self._epoch = epoch
            await self._reconcile(versions, removed)
            await self._follow(versions)
            self._apply_pins(set(pinned))
        except Exception:  # noqa: BLE001 - the directory restarting must not fail the replica's health
            log.warning("replica %s could not report to the adapter directory", self.name, exc_info=True)
        self.gauges.update(snapshot)
        stats = {k: snapshot[k] for k in ("capacity", "free", "heats", "free_units", "in_flight", "max_batch")}
        return {**stats, "in_slot": sorted(snapshot["slots"])}

    async def _follow(self, versions: dict[str, int]) -> None:
        """Bring the mirror to the directory's entries (id -> version): drop what left or changed, fetch what is new."""
        for adapter_id in [a for a, e in self.mirror.items() if versions.get(a) != e.version]:
            del self.mirror[adapter_id]
        missing = [a for a in versions if a not in self.mirror]
        if missing:
            for entry in await self.directory.entries_of.remote(missing):
                if versions.get(entry.adapter_id) == entry.version:  # changed meanwhile: the next report fetches it
                    self.mirror[entry.adapter_id] = entry

    async def _reconcile(self, versions: dict[str, int], removed: list[str]) -> None:
        local = {r.adapter_id: (r.registered_at, r.sha) for r in self.manager.records()}
        adopt, drop = reconcile_plan(local, self.synced, versions, removed, time.time())
        for adapter_id in adopt:  # registered here by the admin route: adopt the directory's entry if it is ours
            entry: DirectoryEntry | None = await self.directory.get.remote(adapter_id)
            if entry is None or entry.version != versions[adapter_id]:
                continue  # changed meanwhile: the next report decides
            if entry.info.get("sha", local[adapter_id][1]) == local[adapter_id][1]:
                self.synced[adapter_id] = entry
            else:  # a stale validation here of what was since registered elsewhere under the same id
                drop.append(adapter_id)
        loop = asyncio.get_running_loop()
        for adapter_id in drop:
            self.synced.pop(adapter_id, None)
            self.heat.forget(adapter_id)
            if adapter_id in self.operator:
                self.operator.discard(adapter_id)
                self.holds.drop(adapter_id)
            try:
                await loop.run_in_executor(None, self.manager.unregister, adapter_id)
            except AdapterNotFoundError:
                pass

    def _apply_pins(self, pinned: set[str]) -> None:
        """Follow the directory's operator pins: take a hold on each new one (in the background: a pin may wait for
        room), drop the hold of each one unpinned."""
        for adapter_id in self.operator - pinned:
            self.operator.discard(adapter_id)
            self.holds.drop(adapter_id)
        for adapter_id in sorted(pinned - self.operator - set(self._operator_tasks)):
            self._operator_tasks[adapter_id] = asyncio.create_task(self._operator_pin(adapter_id))

    async def _operator_pin(self, adapter_id: str) -> None:
        try:
            await self._register(adapter_id)
            await self.holds.hold(adapter_id)
            self.operator.add(adapter_id)  # unpinned meanwhile: the next report drops it
        except Exception:  # noqa: BLE001 - retried at the next report
            log.warning("replica %s could not take the operator pin of %s", self.name, adapter_id, exc_info=True)
        finally:
            self._operator_tasks.pop(adapter_id, None)

    def __del__(self) -> None:
        serving = getattr(self, "serving", None)
        if serving is not None:
            serving.close()
        pinner = getattr(self, "_pinner", None)
        if pinner is not None:
            pinner.shutdown(wait=False, cancel_futures=True)


def replica_class(config: ClusterConfig) -> type:
    """The Serve deployment class for `config`: Serve's multiplexed loader sized to the pool."""

    class AdapterReplica(EngineReplica):
        @serve.multiplexed(max_num_models_per_replica=config.models_per_replica)
        async def multiplexed(self, adapter_id: str) -> Resident:
            return await self.load(adapter_id)

    return AdapterReplica
