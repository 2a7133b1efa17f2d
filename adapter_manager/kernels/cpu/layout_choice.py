"""Which layout a CPU model's base weights are held in, chosen by measurement on the machine at hand.

Each layout this build has for the dtype (fp32: our blocked layout where the library builds, oneDNN's reordered one,
plain; bf16: oneDNN's where it supports bf16, plain; anything else: plain) runs the model's decode chain (one matmul
of ``DECODE_TOKENS`` rows per projection shape, weighted by how many the model has) and its prefill chain
(``PREFILL_TOKENS`` rows) through the matmul the model would call on it, interleaved, medians of ``ROUNDS`` (a
layout ``DROP_BEHIND`` times the best decode chain after two rounds is dropped: its prefill is not timed). The
weights are held once, so one layout serves both phases: the fastest decode chain wins (decode is where serving
spends; prefill's times are kept beside it and logged). The choice is cached in the kernel cache
(``weight_layouts.json`` beside the compiled library), keyed by the CPU (model name and ISA flags), torch, the
library's build, the thread count, the dtype and the shapes; a later start reads it in microseconds. A measurement
is announced as it starts on the ``adapter_manager.progress`` logger (INFO; the command line shows it); what was
chosen and why (the times) is logged once per process per key. ``ADAPTER_MANAGER_WEIGHT_LAYOUT`` = ``blocked`` /
``onednn`` / ``plain`` forces one (where it applies to the dtype); ``auto`` (the default) measures.

Example: the bench model in fp32 on a Zen 3 EPYC (AVX2, no AVX-512) chooses oneDNN's layout (decode chain: blocked
~450 ms, oneDNN ~40 ms, plain ~130 ms); on a Zen 5 EPYC the blocked one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import adapter_manager.kernels.cpu.library as library
from adapter_manager.kernels.cpu.machine import cpu_flags, cpu_model
from adapter_manager.kernels.cpu.weights import LAYOUT_ENV, LinearWeight, forced_layout, linear, pack
from adapter_manager.kernels.protocol import WeightLayout

_log = logging.getLogger(__name__)
_progress = logging.getLogger("adapter_manager.progress")  # long steps, said as they start; the CLI shows them

CACHE_FILE = "weight_layouts.json"
DECODE_TOKENS = 8  # rows of the measured decode matmul (the engine's default batch decodes about this many)
PREFILL_TOKENS = 256  # rows of the measured prefill matmul
ROUNDS = 7  # decode chain rounds
PREFILL_ROUNDS = 3
DROP_BEHIND = 1.5  # after two rounds a layout this many times the best decode chain is dropped (not measured further)
MAX_WEIGHT_BYTES = 64 << 20  # a measured weight keeps at most this many bytes (rows cut; its time scaled back)
Shape = tuple[int, int, int]  # (out_features, in_features, how many of this shape the model holds)

_lock = threading.Lock()
_logged: set[str] = set()


@dataclass(frozen=True)
class LayoutChoice:
    """A chosen layout, how it was chosen (``forced``, ``measured``, ``cached``) and each candidate's chain times
    (ms; empty when forced)."""

    layout: WeightLayout
    source: str
    decode_ms: dict[str, float]
    prefill_ms: dict[str, float]

    def describe(self) -> str:
        def times(chain: dict[str, float]) -> str:
            return ", ".join(f"{name} {ms:.2f} ms" for name, ms in chain.items())

        if self.source == "forced":
            return f"{self.layout.value} (forced by {LAYOUT_ENV})"
        return (
            f"{self.layout.value} ({self.source}; decode chain at {DECODE_TOKENS} tokens: {times(self.decode_ms)}; "
            f"prefill chain at {PREFILL_TOKENS} tokens: {times(self.prefill_ms)})"
        )


def candidates(dtype: torch.dtype) -> list[WeightLayout]:
    """The layouts this build has for ``dtype`` on this CPU, the plain one last."""
    found = []
    if dtype == torch.float32 and library.load():
        found.append(WeightLayout.BLOCKED)
    if torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    ):
        found.append(WeightLayout.ONEDNN)
    return [*found, WeightLayout.PLAIN]


def choose_layout(dtype: torch.dtype, shapes: Sequence[Shape]) -> LayoutChoice:
    """The layout to hold weights of ``shapes`` in ``dtype`` (see the module): forced, cached or measured now."""
    options = candidates(dtype)
    forced = forced_layout()
    if forced is not None:
        layout = forced if forced in options else options[-1 if forced is WeightLayout.PLAIN else 0]
        return LayoutChoice(layout, "forced", {}, {})
    shapes = tuple(sorted((int(o), int(i), int(n)) for o, i, n in shapes))
    key = _key(dtype, shapes)
    with _lock:
        choice = _read_cached(key, options)
        if choice is None:
            names = ", ".join(layout.value for layout in options)
            _progress.info("measuring the CPU weight layouts (%s; once per machine and model shape)...", names)
            start = time.perf_counter()
            choice = _measure(dtype, shapes, options)
            _write_cached(key, choice)
            _log.info("measured the weight layouts in %.1f s", time.perf_counter() - start)
        if key not in _logged:
            _logged.add(key)
            _log.info(
                "weight layout for %s on %s: %s", str(dtype).removeprefix("torch."), cpu_model(), choice.describe()
            )
    return choice


def _key(dtype: torch.dtype, shapes: tuple[Shape, ...]) -> str:
    parts = (
        cpu_model(),
        " ".join(sorted(cpu_flags() or ())),
        torch.__version__,
        library._name(),
        str(torch.get_num_threads()),
        str(dtype),
        repr(shapes),
        str((DECODE_TOKENS, PREFILL_TOKENS)),
    )
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _path() -> Path:
    return library.cache_dir() / CACHE_FILE


def _read_all() -> dict:
    try:
        table = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measured again and rewritten
    return table if isinstance(table, dict) else {}


def _read_cached(key: str, options: list[WeightLayout]) -> LayoutChoice | None:
    entry = _read_all().get(key)
    try:
        layout = WeightLayout(entry["layout"])
        decode, prefill = dict(entry["decode_ms"]), dict(entry["prefill_ms"])
    except (TypeError, KeyError, ValueError):
        return None
    return LayoutChoice(layout, "cached", decode, prefill) if layout in options else None


def _write_cached(key: str, choice: LayoutChoice) -> None:
    """Add ``choice`` to the cache file with one rename (a reader sees the old table or the new one, never half)."""
    table = _read_all()
    table[key] = {"layout": choice.layout.value, "decode_ms": choice.decode_ms, "prefill_ms": choice.prefill_ms}
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".layouts-", delete=False) as out:
            json.dump(table, out, indent=1)
        os.replace(out.name, path)
    except OSError as err:
        _log.warning("cannot cache the weight layout choice in %s: %s", path, err)


def _matmul(layout: WeightLayout, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ weight.T`` the way the model runs it on a weight held in ``layout``."""
    held = pack(weight, layout)
    if held is None:
        held = LinearWeight(WeightLayout.PLAIN, weight, weight.shape[0])
    return lambda x: linear(x, held, fast=True, reorder=True)


def _measure(dtype: torch.dtype, shapes: tuple[Shape, ...], options: list[WeightLayout]) -> LayoutChoice:
    gen = torch.Generator().manual_seed(0)
    chains: dict[WeightLayout, list[tuple[Callable, int, float]]] = {layout: [] for layout in options}
    inputs = {}
    for out, inp, count in shapes:
        rows = max(1, min(out, MAX_WEIGHT_BYTES // (inp * torch.finfo(dtype).bits // 8)))
        weight = (torch.randn(rows, inp, generator=gen) * 0.02).to(dtype)
        for layout in options:
            chains[layout].append((_matmul(layout, weight), inp, count * out / rows))
        for tokens in (DECODE_TOKENS, PREFILL_TOKENS):
            inputs.setdefault((tokens, inp), torch.randn(tokens, inp, generator=gen).to(dtype))

    def chain_ms(layout: WeightLayout, tokens: int) -> float:
        total = 0.0
        for matmul, inp, scale in chains[layout]:
            x = inputs[(tokens, inp)]
            start = time.perf_counter()
            matmul(x)
            total += scale * (time.perf_counter() - start)
        return 1e3 * total

    decode: dict[str, list[float]] = {layout.value: [] for layout in options}
    live = list(options)
    with torch.no_grad():
        for layout in options:  # warm-up: first-call allocations, oneDNN's primitive caches
            chain_ms(layout, DECODE_TOKENS)
        for r in range(ROUNDS):
            for layout in live[r % len(live) :] + live[: r % len(live)]:
                decode[layout.value].append(chain_ms(layout, DECODE_TOKENS))
            if r == 1:  # a layout far behind after two rounds cannot win: stop spending time on it
                best = min(statistics.median(decode[layout.value]) for layout in live)
                live = [layout for layout in live if statistics.median(decode[layout.value]) <= DROP_BEHIND * best]
        prefill: dict[str, list[float]] = {layout.value: [] for layout in live}
        for r in range(PREFILL_ROUNDS + 1):  # the first round warms up
            for layout in live:
                ms = chain_ms(layout, PREFILL_TOKENS)
                if r:
                    prefill[layout.value].append(ms)
    decode_ms = {name: statistics.median(v) for name, v in decode.items()}
    best = min(live, key=lambda layout: decode_ms[layout.value])
    return LayoutChoice(best, "measured", decode_ms, {name: statistics.median(v) for name, v in prefill.items()})
