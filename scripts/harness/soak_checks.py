"""The soak's checks: how every request was answered, the answers against a replay on an idle server, the server's
state once the load stopped (KV blocks, registrations) and its process (RSS, threads) over time.

Each check is a :class:`Check`: a name, PASS or FAIL, and the counts behind it."""

from __future__ import annotations

import asyncio
import math
import random
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from scripts.harness.soak_client import FAILURES, Answer, admin, generate, identity
from scripts.harness.soak_population import Population, revision_ref
from scripts.harness.soak_registrations import Judgement, Registrations, Version


@dataclass
class Check:
    name: str
    passed: bool
    detail: str

    def line(self) -> str:
        return f"  {'PASS' if self.passed else 'FAIL'}  {self.name}: {self.detail}"


def proc_status(pid: int) -> tuple[int, int]:
    """(VmRSS bytes, threads) of process `pid`, from /proc/<pid>/status."""
    text = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1)) * 1024
    return rss, int(re.search(r"^Threads:\s+(\d+)", text, re.M).group(1))


def prometheus(url: str) -> dict[str, float]:
    """The server's /metrics as {name{labels}: value} (comments dropped)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def drained(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """Wait until no generation is in flight and no KV block is used; returns the KV gauges seen last."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = prometheus(url)
        kv = {
            "used": m.get('adapter_manager_kv_blocks{state="used"}', math.nan),
            "free": m.get('adapter_manager_kv_blocks{state="free"}', math.nan),
            "cached": m.get('adapter_manager_kv_blocks{state="cached"}', math.nan),
            "total": m.get("adapter_manager_kv_blocks_total", math.nan),
            "in_flight": m.get("adapter_manager_generation_in_flight", math.nan),
        }
        if (kv["used"] == 0 and kv["in_flight"] == 0) or time.monotonic() > deadline:
            return kv


def kv_check(kv: dict[str, float]) -> Check:
    passed = kv["used"] == 0 and kv["free"] == kv["total"] and kv["in_flight"] == 0
    detail = (
        f"{kv['used']:.0f} used, {kv['free']:.0f} free of {kv['total']:.0f} ({kv['cached']:.0f} cached), "
        f"{kv['in_flight']:.0f} requests in flight"
    )
    return Check("KV blocks all free once the load stopped", passed, detail)


def tally(answers: Sequence[Answer], model: Registrations, base: str) -> tuple[dict, list[Check]]:
    """Counts of every outcome, 4xx by status, and the answers the registrations say were wrong: a 404 while every
    version it may have met was registered (a stale 'not registered'), a result while none was."""
    outcomes = Counter(a.outcome for a in answers)
    statuses = Counter(str(a.status) for a in answers if a.outcome in ("4xx", "503", "5xx", "untyped"))
    codes = Counter(f"{a.outcome} {a.code}" for a in answers if a.outcome not in ("ok", "cancelled"))
    stale, served = [], []
    for a in answers:
        versions = model.judge(a, base).versions
        if a.status == 404 and all(v is not None for v in versions):
            stale.append(a)
        if a.outcome in ("ok", "cancelled") and all(v is None for v in versions):
            served.append(a)
    failed = sum(outcomes[f] for f in FAILURES)
    counts = {
        "outcomes": dict(outcomes),
        "statuses": dict(statuses),
        "codes": dict(codes),
        "stale_404": len(stale),
        "unregistered_served": len(served),
    }
    shown = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1]))
    checks = [
        Check(
            "every request answered (a result, a typed 4xx or 503)",
            failed == 0,
            f"{len(answers)} requests: {shown}; codes {dict(sorted(codes.items()))}; "
            + ", ".join(f"{f} {outcomes[f]}" for f in FAILURES),
        ),
        Check(
            "no 'not registered' for a registered adapter (re-register included)",
            not stale,
            f"{len(stale)} stale 404s" + "".join(f"; {a.kind} {a.model} code {a.code}" for a in stale[:3]),
        ),
        Check("no result from an unregistered adapter", not served, f"{len(served)} answers"),
    ]
    return counts, checks


Output = tuple[str, list[float]]
"""An answer's text and its tokens' logprobs."""


@dataclass
class Replayed:
    """An answer and the idle server's answers to the same request: per candidate version (None: not replayable)
    and, after a refresh, from the content it replaced. Equal: the same text, logprobs within ``tol``."""

    answer: Answer
    judgement: Judgement
    texts: dict[Version, Output | None]
    previous: Output | None = None
    tol: float = 1e-3

    def close(self, output: Output | None) -> bool:
        if output is None or output[0] != self.answer.text or len(output[1]) != len(self.answer.logprobs):
            return False
        return self.gap(output) <= self.tol

    def first_difference(self, output: Output | None) -> int | None:
        """The first token whose logprob differs beyond ``tol`` (None: none, or not replayed)."""
        if output is None:
            return None
        pairs = zip(output[1], self.answer.logprobs, strict=False)
        return next((i for i, (a, b) in enumerate(pairs) if abs(a - b) > self.tol), None)

    def describe(self) -> dict:
        """What a mismatch report needs: the answer, its candidate versions' replays, where each first differs."""
        a = self.answer
        return {
            "kind": a.kind,
            "model": a.model,
            "sent": a.sent,
            "done": a.done,
            "text": a.text,
            "logprobs": a.logprobs,
            "replays": [
                {"rev": v.rev, "sha": v.sha, "output": t, "first_difference": self.first_difference(t)}
                for v, t in self.texts.items()
            ],
        }

    def gap(self, output: Output) -> float:
        return max((abs(a - b) for a, b in zip(output[1], self.answer.logprobs, strict=True)), default=0.0)

    @property
    def replayable(self) -> bool:
        return any(t is not None for t in self.texts.values())

    @property
    def matched(self) -> bool:
        return any(self.close(t) for t in self.texts.values())

    @property
    def telling(self) -> bool:
        """The replaced content answers otherwise: a stale answer would have been caught."""
        return self.previous is not None and not self.close(self.previous)


def sample(answers: Sequence[Answer], model: Registrations, base: str, size: int, seed: int) -> list[tuple]:
    """Every completed probe, every completed answer sent after a refresh of its adapter returned and every one that
    overlapped a change of its adapter, then a random sample of the others, up to `size` in all (the former are
    never left out)."""
    judged = [(a, model.judge(a, base)) for a in answers if a.outcome == "ok"]
    must = [(a, j) for a, j in judged if a.kind == "probe" or j.after_refresh or j.overlapped]
    rest = [(a, j) for a, j in judged if not (a.kind == "probe" or j.after_refresh or j.overlapped)]
    random.Random(seed).shuffle(rest)
    return must + rest[: max(0, size - len(must))]


def replay(
    url: str, base: str, population: Population, chosen: list[tuple], hang_s: float, tol: float
) -> list[Replayed]:
    """Register every version the chosen answers may come from on the idle server at `url` (as ``rp/<n>``: the hub
    keeps every published revision), then send each request once per candidate version, four at a time."""

    async def main() -> list[Replayed]:
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            ids: dict[Version, str | None] = {}
            for _, judgement in chosen:
                for v in (*judgement.versions, judgement.previous):
                    if v is not None and v not in ids:
                        ids[v] = await _register(session, url, population, v, len(ids), base)
            cache: dict[tuple, asyncio.Task] = {}
            gate = asyncio.Semaphore(4)

            async def one(model_id: str, a: Answer) -> Output | None:
                async with gate:
                    again = Answer("plain", model_id, a.prompt, a.max_tokens)
                    await generate(session, url, again, hang_s, time.perf_counter())
                    return (again.text, again.logprobs) if again.outcome == "ok" else None

            def task(v: Version, a: Answer) -> asyncio.Task:
                key = (ids[v], tuple(a.prompt), a.max_tokens)
                if key not in cache:
                    cache[key] = asyncio.create_task(one(ids[v], a))
                return cache[key]

            out = []
            for a, j in chosen:
                texts = {v: task(v, a) for v in j.versions if v is not None and ids[v] is not None}
                previous = task(j.previous, a) if j.previous is not None and ids[j.previous] is not None else None
                out.append((a, j, texts, previous))
            return [
                Replayed(a, j, {v: await t for v, t in texts.items()}, previous and await previous, tol)
                for a, j, texts, previous in out
            ]

    return asyncio.run(main())


async def _register(session, url: str, population: Population, v: Version, n: int, base: str) -> str | None:
    """Version `v` on the replay server as ``rp/<n>`` (None where it cannot be: not that sha, or never published)."""
    if v.repo == base:
        return base
    if v.rev < 0:
        return None
    published = (population.hub / v.repo / ".revisions" / f"v{v.rev}").is_dir()
    ref = revision_ref(v.repo, v.rev) if published else v.repo
    call = await admin(session, url, "POST", "/v1/adapters", {"ref": ref, "id": f"rp/{n}"})
    return f"rp/{n}" if call.status == 201 and call.field("sha") == v.sha else None


def replay_checks(replayed: Sequence[Replayed]) -> tuple[dict, list[Check]]:
    plain = [r for r in replayed if not r.judgement.overlapped and r.answer.kind != "probe"]
    overlapped = [r for r in replayed if r.judgement.overlapped]
    after = [r for r in replayed if r.judgement.after_refresh or r.answer.kind == "probe"]
    told = [r for r in after if r.telling]
    gaps = [r.gap(t) for r in replayed for t in r.texts.values() if r.close(t)]
    unreplayable = [r for r in replayed if not r.replayable]
    wrong = [r for r in replayed if r.replayable and not r.matched]

    def mismatches(rows: Sequence[Replayed]) -> str:
        rows = [r for r in rows if r.replayable]
        bad = [r for r in rows if not r.matched]
        shown = "".join(
            f"; {r.answer.kind} {r.answer.model} ({r.answer.tokens} tokens): first differs from version(s) "
            f"{ {v.rev: r.first_difference(t) for v, t in r.texts.items()} } at token"
            for r in bad[:3]
        )
        return f"{len(rows) - len(bad)}/{len(rows)} equal{shown}"

    counts = {
        "replayed": len(replayed),
        "plain": len(plain),
        "overlapping_a_change": len(overlapped),
        "after_a_refresh_or_probe": len(after),
        "after_a_refresh_unlike_the_old_content": len(told),
        "unreplayable": len(unreplayable),
        "mismatched": len(wrong),
        "max_logprob_gap_of_equal": max(gaps, default=0.0),
        "mismatches": [r.describe() for r in wrong],
    }
    checks = [
        Check(
            "greedy answers equal an idle replay (no prefix cache; text, logprobs within tolerance)",
            not wrong,
            f"{mismatches(replayed)} ({len(unreplayable)} not replayable); largest logprob gap of the equal ones "
            f"{max(gaps, default=0.0):.1e}",
        ),
        Check(
            "  of them overlapping a change of their adapter (either version accepted)",
            all(r.matched for r in overlapped if r.replayable),
            mismatches(overlapped),
        ),
        Check(
            "no wrong-version answer after a refresh (probes + requests sent after it returned)",
            all(r.matched for r in after if r.replayable),
            f"{mismatches(after)}; {len(told)} of them after a refresh whose old content answers otherwise",
        ),
    ]
    return counts, checks


def registrations_check(listing: dict, model: Registrations) -> Check:
    """GET /v1/adapters against the model: the same ids, each at its sha (and digest, where reported), pins."""
    served = {a["id"]: a for a in listing["data"]}
    missing = sorted(set(model.current) - set(served))
    extra = sorted(set(served) - set(model.current))
    moved = [a for a, v in model.current.items() if a in served and served[a]["sha"] != v.sha]
    digests = [
        a
        for a, d in model.digests.items()
        if a in served and identity(served[a]) is not None and identity(served[a]) != d
    ]
    pins = sorted(a for a in served if bool(served[a].get("pinned")) != (a in model.pinned))
    broken = sorted(a for a, info in served.items() if info.get("status") == "unrestorable")
    passed = not (missing or extra or moved or digests or pins or broken)
    detail = (
        f"{len(served)} served, {len(model.current)} expected; missing {missing[:3]} extra {extra[:3]} "
        f"other sha {moved[:3]} other digest {digests[:3]} pin differs {pins[:3]} unrestorable {broken[:3]}"
        f" ({len(model.digests)} digests compared)"
    )
    return Check("registrations exactly as the admin calls left them", passed, detail)


def flat_check(name: str, series: Sequence[tuple[float, int, int]], warm_s: float, index: int, unit: float) -> dict:
    """A (t, rss, threads) series' first / after-warm-up / last / max of column `index`, and last vs after warm-up."""
    values = [row[index] for row in series]
    warm = next((row[index] for row in series if row[0] >= warm_s), values[-1])
    growth = values[-1] / warm - 1 if warm else math.nan
    return {
        "name": name,
        "first": values[0] / unit,
        "after_warm_up": warm / unit,
        "last": values[-1] / unit,
        "max": max(values) / unit,
        "growth": growth,
        "passed": abs(growth) <= 0.05,
    }


async def admin_json(url: str, method: str, path: str, body: dict | None = None):
    async with aiohttp.ClientSession() as session:
        return await admin(session, url, method, path, body)
