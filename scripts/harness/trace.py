"""The many-adapter serving workload: a population of mixed ranks, the arrival trace every configuration replays
over it, and the replay itself (the engine stepping in its own thread, as in a server, while this one submits on
schedule)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

from adapter_manager.runtime.engine.engine import Engine
from adapter_manager.runtime.engine.sampling import SamplingParams

RANKS, SHARES = (8, 16, 32, 64), (0.4, 0.3, 0.2, 0.1)
"""The population's adapter ranks and the share of adapters of each."""
_POLL_S = 0.005  # how often replay looks for finished requests (their e2e latency is this exact)


def population_ranks(n: int, seed: int) -> list[int]:
    """The ranks of ``n`` adapters drawn with SHARES (seeded)."""
    rng = np.random.default_rng(seed + 1)
    return [RANKS[i] for i in rng.choice(len(RANKS), n, p=SHARES)]


@dataclass(frozen=True)
class Trace:
    """The arrival trace every configuration replays: arrival times (s), prompts, output lengths, adapter draws."""

    arrivals: list[float]
    prompts: list[list[int]]
    outputs: list[int]
    draws: list[float]  # uniform in [0, 1): the adapter, by Zipf inverse CDF over N

    @classmethod
    def make(cls, n: int, seed: int, vocab: int, prompt_range: tuple[int, int], output_range: tuple[int, int]):
        rng = np.random.default_rng(seed)
        gaps = rng.exponential(1.0, n)  # unit-rate Poisson; scaled by the measured rate
        prompts = [rng.integers(0, vocab, int(rng.integers(*prompt_range))).tolist() for _ in range(n)]
        outputs = rng.integers(*output_range, n).tolist()
        return cls(np.cumsum(gaps).tolist(), prompts, outputs, rng.random(n).tolist())

    def head(self, n: int) -> Trace:
        return Trace(self.arrivals[:n], self.prompts[:n], self.outputs[:n], self.draws[:n])

    def scaled(self, rate: float) -> Trace:
        return Trace([t / rate for t in self.arrivals], self.prompts, self.outputs, self.draws)

    def adapters(self, n_adapters: int, alpha: float) -> list[int]:
        weights = 1.0 / np.arange(1, n_adapters + 1) ** alpha
        cdf = np.cumsum(weights) / weights.sum()
        return np.minimum(np.searchsorted(cdf, self.draws, side="right"), n_adapters - 1).tolist()


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def replay(engine: Engine, trace: Trace, adapters: list[str | None], closed: bool = False) -> dict:
    """Submit each request at its arrival time (all at once if `closed`) from this thread while the engine steps in
    its own, as in a server. Latencies count from the scheduled arrival; completions are seen within `_POLL_S`."""
    n = len(trace.prompts)
    arrivals = [0.0] * n if closed else trace.arrivals
    handles, first, done = {}, {}, {}
    next_i, start = 0, time.perf_counter()
    progress = max(1, n // 10)
    engine.start()
    try:
        while next_i < n or handles:
            now = time.perf_counter() - start
            while next_i < n and arrivals[next_i] <= now:
                params = SamplingParams(max_tokens=trace.outputs[next_i], ignore_eos=True)
                handles[next_i] = engine.submit(trace.prompts[next_i], adapters[next_i], params)
                next_i += 1
            now = time.perf_counter() - start
            for i, handle in list(handles.items()):
                if handle.done:
                    done[i] = now - arrivals[i]
                    handle.result(timeout=0)
                    first[i] = handle.first_token_at - start - arrivals[i]  # max_tokens >= 1: a token was produced
                    del handles[i]
                    if len(done) % progress == 0:
                        print(f"    {len(done)}/{n} requests done ({now:.0f}s)", file=sys.stderr, flush=True)
            wake = arrivals[next_i] - (time.perf_counter() - start) if next_i < n else _POLL_S
            time.sleep(max(0.0, min(wake, _POLL_S)))
    finally:
        engine.stop()
    wall = time.perf_counter() - start
    makespan = wall - (0.0 if closed else arrivals[0])
    tokens = sum(trace.outputs)
    ttft, e2e = list(first.values()), list(done.values())
    return {
        "requests": n,
        "wall_s": round(wall, 2),
        "throughput_req_s": n / makespan,
        "throughput_tok_s": tokens / makespan,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
    }
