"""The soak benchmark's server: how it is started (loopback hub, its own HF cache, a state directory), the population
registered through the admin API with several calls in flight, and the read-only routes' latency with every entry."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import aiohttp

from scripts.harness.serving import Server, free_port, ours_argv
from scripts.harness.soak_checks import proc_status
from scripts.harness.soak_client import AdminCall, admin, identity

BASE = "base"
"""The base model's name in API calls."""


def server_env(endpoint: str, hf_cache: Path) -> dict[str, str]:
    """The server's environment: the local hub as HF_ENDPOINT, an HF cache of its own, no token, telemetry off."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN", "ADAPTER_MANAGER_ADMIN_TOKEN")
    }
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HUB_CACHE=str(hf_cache),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_IMPLICIT_TOKEN="1",
    )
    return env


def start(name: str, checkpoint: Path, options: Sequence[str], log: Path, env: dict[str, str]) -> tuple[Server, float]:
    """Start a server (loopback, a free port); returns it and the seconds until /health answered."""
    port = free_port()
    began = time.perf_counter()
    server = Server.start(name, ours_argv(checkpoint, {}, port, options), port, log, env=env, timeout_s=7200)
    return server, time.perf_counter() - began


def options(args, *, state_dir: Path | None = None, disk_bytes: int | None = None, prefix: bool = True) -> list[str]:
    out = [
        "--model-name", BASE,
        "--max-rank", "16",
        "--pool-bytes", f"{args.pool_mib}MiB",
        "--host-cache-bytes", f"{args.host_mib}MiB",
        "--max-batch", str(args.max_batch),
        "--max-seq-len", str(args.max_seq_len),
        "--token-budget", "512",
        "--max-pending", str(args.max_pending),
    ]  # fmt: skip
    if state_dir is not None:
        out += ["--state-dir", str(state_dir)]
    if disk_bytes is not None:
        out += ["--disk-cache-bytes", str(disk_bytes)]
    if not prefix:
        out.append("--no-prefix-caching")
    return out


def register_all(
    url: str, ids: Sequence[str], in_flight: int, guard: Callable[[], None]
) -> tuple[dict[str, AdminCall], float]:
    """``POST /v1/adapters {"ref": id, "id": id}`` for every id, `in_flight` at a time, `guard()` called every 2 s
    meanwhile (it raises to stop); (answers by id, seconds)."""

    async def main() -> dict[str, AdminCall]:
        gate = asyncio.Semaphore(in_flight)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=in_flight)) as session:

            async def one(adapter: str) -> AdminCall:
                async with gate:
                    return await admin(session, url, "POST", "/v1/adapters", {"ref": adapter, "id": adapter})

            async def watch() -> None:
                while True:
                    guard()
                    await asyncio.sleep(2.0)

            watcher = asyncio.create_task(watch())
            calls = asyncio.gather(*(one(a) for a in ids))
            done, _ = await asyncio.wait([watcher, calls], return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                calls.cancel()
                await asyncio.gather(calls, return_exceptions=True)
                watcher.result()  # raises the guard's error
            watcher.cancel()
            return dict(zip(ids, calls.result(), strict=True))

    began = time.perf_counter()
    calls = asyncio.run(main())
    return calls, time.perf_counter() - began


class RssLimitError(RuntimeError):
    """The server's RSS passed the run's limit; the server was stopped."""


def rss_guard(server: Server, limit: int) -> Callable[[], None]:
    """A callable that stops `server` and raises RssLimitError once its RSS passes `limit` bytes (the machine is
    shared: a server growing without bound must not take it down)."""

    def guard() -> None:
        rss = proc_status(server.proc.pid)[0]
        if rss > limit:
            server.stop()
            raise RssLimitError(
                f"the server's RSS {rss / 2**30:.1f} GiB passed --rss-limit-gib ({limit / 2**30:.1f}): stopped"
            )

    return guard


def mem_total() -> int:
    """The machine's memory in bytes (/proc/meminfo)."""
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def registered(calls: dict[str, AdminCall]) -> dict[str, tuple[str, str | None]]:
    """Id -> (sha, digest or None) of the registrations answered 201."""
    return {a: (str(c.field("sha")), identity(c.data)) for a, c in calls.items() if c.status == 201}


def route_ms(url: str, path: str, calls: int = 10) -> tuple[float, int]:
    """Median milliseconds of `calls` GETs of `path`, and the entries its ``data`` held."""
    times, entries = [], 0
    for _ in range(calls):
        began = time.perf_counter()
        with urllib.request.urlopen(url + path, timeout=120) as reply:
            body = reply.read()
        times.append(time.perf_counter() - began)
        entries = body.count(b'"id":')
    return 1000 * statistics.median(times), entries
