"""The soak's admin churn: one admin operation every few seconds while the load runs, each judged by its answer, and
each change followed by a probe request (the adapter's fixed prompt, sent once the call returned) that the replay
checks against the new version. A refresh is probed before too, so its prefix is cached under the old content.

Operations: register a new adapter, refresh one to new bytes (a new revision published at main, then
``POST /v1/adapters {"refresh": true}``), unregister, register again, pin, unpin, vLLM's ``load_lora_adapter`` with
``load_inplace`` (to new bytes), register a broken adapter and refresh to broken bytes (both must get a typed 4xx and
change nothing: the adapter unknown, or still at its version)."""

from __future__ import annotations

import asyncio
import itertools
import random
from dataclasses import dataclass, field

import aiohttp

from scripts.harness.soak_client import Answer, admin, clock, generate, identity
from scripts.harness.soak_population import Population
from scripts.harness.soak_registrations import Registrations, Version
from scripts.harness.soak_trace import probe_prompt

WEIGHTS = {
    "register_new": 1.0,
    "refresh": 2.0,
    "unregister": 1.0,
    "reregister": 1.5,
    "pin": 1.0,
    "unpin": 1.0,
    "load_inplace": 1.0,
    "bad_adapter": 1.0,
    "bad_refresh": 0.5,
}
BROKEN = ("weights", "config", "target", "json")
MAX_PINNED = 3
PROBE_TOKENS = 8


@dataclass
class OpResult:
    op: str
    adapter: str
    status: int | None
    ok: bool
    note: str = ""
    seconds: float = 0.0


@dataclass
class Churn:
    """``hot``: population adapters the churn may change (popular, so the load's own requests see the changes)."""

    url: str
    population: Population
    model: Registrations
    hot: list[str]
    vocab: int
    every_s: float
    hang_s: float
    seed: int = 0
    results: list[OpResult] = field(default_factory=list)
    probes: list[Answer] = field(default_factory=list)
    _unregistered: list[str] = field(default_factory=list)
    _new: list[str] = field(default_factory=list)
    probe_retries: int = 0  # probes sent again after a 503
    _count: itertools.count = field(default_factory=itertools.count)
    _busy: set[str] = field(default_factory=set)  # adapters a running operation holds
    _held: dict[asyncio.Task, str] = field(default_factory=dict)
    _rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self._rng.seed(self.seed)

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        """Start one operation every ``every_s`` (each in its own task: a probe waits its turn in the server's queue,
        which under overload takes seconds) on an adapter no running operation holds; wait for all at the end."""
        rng = self._rng
        start = clock()
        running: set[asyncio.Task] = set()
        while not stop.is_set():
            ops = [op for op in WEIGHTS if self._feasible(op)]
            op = rng.choices(ops, [WEIGHTS[o] for o in ops])[0]
            task = asyncio.create_task(self._operate(op, session, start))
            running.add(task)
            task.add_done_callback(running.discard)
            try:
                await asyncio.wait_for(stop.wait(), self.every_s)
            except TimeoutError:
                pass
        await asyncio.gather(*running)

    async def _operate(self, op: str, session: aiohttp.ClientSession, start: float) -> None:
        began = clock()
        try:
            result = await getattr(self, op)(session, start)
        except (aiohttp.ClientError, ConnectionError) as err:
            result = OpResult(op, "", None, False, f"connection error {type(err).__name__}")
        finally:
            self._busy.discard(self._held.pop(asyncio.current_task(), None))
        result.seconds = clock() - began
        self.results.append(result)

    def _take(self, candidates: list[str]) -> str:
        """One of `candidates`, held by the calling operation until it ends."""
        adapter = self._rng.choice(candidates)
        self._busy.add(adapter)
        self._held[asyncio.current_task()] = adapter
        return adapter

    def _changeable(self, hot_only: bool = False) -> list[str]:
        pool = self.hot if hot_only else self.hot + self._new
        return [a for a in pool if a in self.model.current and a not in self.model.pinned and a not in self._busy]

    def _feasible(self, op: str) -> bool:
        if op == "reregister":
            return bool(self._unregistered)
        if op == "unpin":
            return bool(self.model.pinned - self._busy)
        if op == "pin":
            return len(self.model.pinned) < MAX_PINNED and bool(self._changeable())
        if op in ("refresh", "load_inplace", "bad_refresh"):
            return bool(self._changeable(hot_only=True))
        if op == "unregister":
            return bool(self._changeable())
        return True

    async def probe(self, session: aiohttp.ClientSession, adapter: str, start: float) -> Answer:
        """The adapter's probe, sent again a second after each 503 (the server is overloaded by design)."""
        for _ in range(max(1, int(self.hang_s))):
            answer = Answer("probe", adapter, probe_prompt(adapter, self.vocab), PROBE_TOKENS, at=clock() - start)
            await generate(session, self.url, answer, self.hang_s, start)
            if answer.outcome != "503":
                break
            self.probe_retries += 1
            await asyncio.sleep(1.0)
        self.probes.append(answer)
        return answer

    async def _info(self, session: aiohttp.ClientSession, adapter: str) -> dict | None:
        call = await admin(session, self.url, "GET", f"/v1/adapters/{adapter}")
        return call.data if call.status == 200 and isinstance(call.data, dict) else None

    async def _publish(self, repo: str) -> Version:
        rev = self.model.next_rev(repo)
        seed = 1_000_000 + self.seed * 100_000 + next(self._count)  # new bytes: no two revisions alike
        sha = await asyncio.to_thread(self.population.publish, repo, rev, seed)
        return Version(repo, rev, sha)

    # -- the operations: each returns its judgement ------------------------------------------------------------

    async def register_new(self, session, start) -> OpResult:
        name = f"n{self.seed}x{next(self._count)}"
        seed = 2_000_000 + self.seed * 100_000 + next(self._count)
        repo = await asyncio.to_thread(self.population.new_adapter, name, seed)
        t0 = clock()
        call = await admin(session, self.url, "POST", "/v1/adapters", {"ref": repo, "id": repo})
        ok = call.status == 201
        if ok:
            sha = str(call.field("sha"))
            self.model.change(repo, "register_new", t0, clock(), Version(repo, 0, sha), identity(call.data))
            self._new.append(repo)
            await self.probe(session, repo, start)
        return OpResult("register_new", repo, call.status, ok)

    async def refresh(self, session, start) -> OpResult:
        adapter = self._take(self._changeable(hot_only=True))
        await self.probe(session, adapter, start)  # the prompt's blocks cached under the old content
        version = await self._publish(self.model.current[adapter].repo)
        t0 = clock()
        call = await admin(
            session, self.url, "POST", "/v1/adapters", {"ref": version.repo, "id": adapter, "refresh": True}
        )
        t1 = clock()
        ok = call.status == 200 and call.field("action") == "updated" and call.field("sha") == version.sha
        if call.status == 200:
            took = version if call.field("sha") == version.sha else self.model.current[adapter]
            self.model.change(adapter, "refresh", t0, t1, took, identity(call.data))
        await self.probe(session, adapter, start)
        return OpResult("refresh", adapter, call.status, ok, "" if ok else f"answer {str(call.data)[:160]}")

    async def unregister(self, session, start) -> OpResult:
        adapter = self._take(self._changeable())
        t0 = clock()
        call = await admin(session, self.url, "DELETE", f"/v1/adapters/{adapter}")
        if call.status == 200:
            self.model.change(adapter, "unregister", t0, clock(), None)
            self._unregistered.append(adapter)
            await self.probe(session, adapter, start)  # must be 404
        return OpResult("unregister", adapter, call.status, call.status == 200)

    async def reregister(self, session, start) -> OpResult:
        adapter = self._unregistered.pop(self._rng.randrange(len(self._unregistered)))
        repo = adapter  # ids are their repos' names
        rev = self.model.revs.get(repo, 0)
        sha = await asyncio.to_thread(self.population.sha, repo)
        t0 = clock()
        call = await admin(session, self.url, "POST", "/v1/adapters", {"ref": repo, "id": adapter})
        ok = call.status == 201 and call.field("sha") == sha
        if call.status in (200, 201):
            self.model.change(adapter, "reregister", t0, clock(), Version(repo, rev, sha), identity(call.data))
            await self.probe(session, adapter, start)  # right after: a stale 'not registered' would fail it
        else:
            self._unregistered.append(adapter)
        return OpResult("reregister", adapter, call.status, ok)

    async def pin(self, session, start) -> OpResult:
        adapter = self._take(self._changeable())
        call = await admin(session, self.url, "POST", f"/v1/adapters/{adapter}/pin")
        if call.status == 200:
            self.model.pinned.add(adapter)
        ok = call.status == 200 or (call.status == 409 and call.typed_4xx)  # 409: no room, typed
        return OpResult("pin", adapter, call.status, ok)

    async def unpin(self, session, start) -> OpResult:
        adapter = self._take(sorted(self.model.pinned - self._busy))
        call = await admin(session, self.url, "POST", f"/v1/adapters/{adapter}/unpin")
        if call.status == 200:
            self.model.pinned.discard(adapter)
        return OpResult("unpin", adapter, call.status, call.status == 200)

    async def load_inplace(self, session, start) -> OpResult:
        adapter = self._take(self._changeable(hot_only=True))
        await self.probe(session, adapter, start)  # as before a refresh
        old = self.model.current[adapter]
        version = await self._publish(old.repo)
        t0 = clock()
        body = {"lora_name": adapter, "lora_path": version.repo, "load_inplace": True}
        call = await admin(session, self.url, "POST", "/v1/load_lora_adapter", body)
        t1 = clock()
        info = await self._info(session, adapter)
        took = None
        if info is not None:
            took = {version.sha: version, old.sha: old}.get(info["sha"], Version(old.repo, -1, info["sha"]))
        self.model.change(adapter, "load_inplace", t0, t1, took, identity(info or {}))
        ok = call.status == 200 and took == version
        if took is not None:
            await self.probe(session, adapter, start)
        return OpResult("load_inplace", adapter, call.status, ok, "" if ok else f"now {info and info['sha']}")

    async def bad_adapter(self, session, start) -> OpResult:
        """A new repo with broken files: a typed 4xx, and the id stays unknown."""
        n = next(self._count)
        kind = BROKEN[n % len(BROKEN)]
        repo = await asyncio.to_thread(self.population.broken_adapter, f"bad{self.seed}x{n}-{kind}", kind, n)
        call = await admin(session, self.url, "POST", "/v1/adapters", {"ref": repo, "id": repo})
        unknown = (await admin(session, self.url, "GET", f"/v1/adapters/{repo}")).status == 404
        code = call.data["error"].get("code") if call.typed_4xx else str(call.data)[:160]
        return OpResult(
            "bad_adapter", repo, call.status, call.typed_4xx and unknown, f"{kind}: {code}, unknown {unknown}"
        )

    async def bad_refresh(self, session, start) -> OpResult:
        adapter = self._take(self._changeable(hot_only=True))
        version = self.model.current[adapter]
        kind = BROKEN[next(self._count) % len(BROKEN)]
        await asyncio.to_thread(self.population.break_main, version.repo, kind)
        try:
            body = {"ref": version.repo, "id": adapter, "refresh": True}
            call = await admin(session, self.url, "POST", "/v1/adapters", body)
            info = await self._info(session, adapter)
        finally:
            await asyncio.to_thread(self.population.restore_main, version.repo, self.model.revs.get(version.repo, 0))
        kept = info is not None and info["sha"] == version.sha
        if not kept and info is not None:  # the server took the broken bytes: the model follows, the op fails
            self.model.change(adapter, "bad_refresh", clock(), clock(), Version(version.repo, -1, info["sha"]))
        await self.probe(session, adapter, start)
        return OpResult("bad_refresh", adapter, call.status, call.typed_4xx and kept, f"{kind}: kept {kept}")
