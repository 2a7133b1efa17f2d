"""The engine workload: the bench model serving 8 rank-16 adapters from one manager, its adapter mixes, the engine
over it, and the real engine's decode step timed against the forward inside it (``engine_step_ms``)::

    from scripts.harness import engine_workload

    with engine_workload(dtype=torch.float32, device="cpu") as work:  # checkpoint, a0 .. a7, model, manager
        engine = work.engine(max_batch=8, max_seq_len=1024)
        handles = [engine.submit(p, a, params) for p, a in zip(prompts, work.mix("lora_8", 8), strict=True)]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions
from adapter_manager.kernels import KernelConfig
from adapter_manager.runtime.engine.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.engine.scheduler import SchedulerConfig
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.config import LlamaConfig
from adapter_manager.runtime.model.llama import Llama
from scripts.harness.checkpoint import VOCAB_KINDS, write_adapters, write_checkpoint, write_family_checkpoint

RANK = 16
"""Rank of the engine workload's adapters."""
ADAPTERS = 8
"""Adapters of the engine workload: a0 .. a7, one slot each."""
CONFIGS = ("base", "lora_none", "lora_1", "lora_8")
"""The engine workload's configurations (see :meth:`EngineWorkload.mix`)."""


def build_engine(
    model: Llama,
    manager: AdapterManager,
    max_batch: int,
    max_seq_len: int,
    token_budget: int | None = None,
    kernels: KernelConfig | None = None,
    deterministic: bool = False,
) -> Engine:
    """The eager engine over ``model`` and ``manager``; ``token_budget`` None: the scheduler's default; ``kernels``
    None: the backend the device gets by default; ``deterministic``: EngineConfig's mode (it unpacks the model)."""
    scheduler = SchedulerConfig() if token_budget is None else SchedulerConfig(token_budget=token_budget)
    config = EngineConfig(
        max_batch=max_batch, max_seq_len=max_seq_len, scheduler=scheduler, kernels=kernels, deterministic=deterministic
    )
    return Engine(model, manager, config)


def decode_step_parser(doc: str, out: str, repeats: int) -> argparse.ArgumentParser:
    """The options every in-process decode-step benchmark shares: ``--rounds`` of ``--repeats`` interleaved steps of
    ``--seqs`` sequences at context ``--context``, results to ``--out`` (default ``out``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--context", type=int, default=144)
    parser.add_argument("--out", type=Path, default=Path(out))
    return parser


@dataclass
class EngineWorkload:
    """The bench model serving ADAPTERS synthetic rank-RANK adapters from one manager; from :func:`engine_workload`,
    usable inside its ``with`` block (the checkpoint's folder is removed and the manager closed on exit)."""

    config: LlamaConfig  # the bench model: hidden 1024, 8 layers, intermediate 2816
    checkpoint: Path  # its random checkpoint (seed 0), in the workload's temp folder
    dtype: torch.dtype  # of the checkpoint, the model's weights and the slots
    device: str  # where the model and the slots live: cpu or cuda[:i]
    model: Llama  # loaded from ``checkpoint``
    load_s: float  # seconds ``load_model`` took for ``model``
    manager: AdapterManager  # ADAPTERS slots of max rank RANK, no prefetch workers, a0 .. a7 registered
    adapter_ids: list[str]  # a0 .. a7, as registered on ``manager``

    def load_model(self, pack_weights: bool | None = None, quantize: str | None = None) -> Llama:
        """One more copy of the model from ``checkpoint`` (``pack_weights`` and ``quantize`` as in
        :func:`load_model`)."""
        return load_model(
            self.checkpoint, dtype=self.dtype, device=self.device, pack_weights=pack_weights, quantize=quantize
        )

    def engine(self, max_batch: int, max_seq_len: int, token_budget: int | None = None) -> Engine:
        """An engine over ``model`` and ``manager`` (see :func:`build_engine`)."""
        return build_engine(self.model, self.manager, max_batch, max_seq_len, token_budget)

    def mix(self, name: str, requests: int) -> list[str | None]:
        """The adapter of each of ``requests`` requests under configuration ``name`` (one of CONFIGS): base and
        lora_none no adapter, lora_1 all on a0, lora_8 spread evenly over a0 .. a7."""
        if name in ("base", "lora_none"):
            return [None] * requests
        if name == "lora_1":
            return [self.adapter_ids[0]] * requests
        if name == "lora_8":
            return [self.adapter_ids[i % ADAPTERS] for i in range(requests)]
        raise ValueError(f"unknown configuration {name!r}; expected one of {CONFIGS}")


@contextmanager
def engine_workload(
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    pack_weights: bool | None = None,
    variants: dict[str, str] | None = None,
    family: str = "llama",
) -> Iterator[EngineWorkload]:
    """Write the bench checkpoint and the ADAPTERS synthetic adapters into a temp folder, load the model
    (``pack_weights`` as in :func:`load_model`), register the adapters on a manager; on exit close the manager and
    remove the folder. ``variants``: more sets of ADAPTERS adapters, id prefix -> LoRA variant (e.g. ``{"d":
    "dora"}`` registers d0 .. d7 as DoRA adapters), each with slots of its own. ``family``: the bench shapes as
    another family's checkpoint (:data:`harness.checkpoint.FAMILY_CLASSES`, written by transformers)."""
    config = LlamaConfig.bench()
    variants = variants or {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if family == "llama":
            checkpoint = write_checkpoint(root / "model", config, dtype=dtype)
        else:
            checkpoint = write_family_checkpoint(root / "model", config, family, dtype)
        spec = config.to_spec("bench")
        ids = [f"a{i}" for i in range(ADAPTERS)]
        folders = write_adapters(root, spec, ids, [RANK] * ADAPTERS)
        for prefix, variant in variants.items():
            more = [f"{prefix}{i}" for i in range(ADAPTERS)]
            folders += write_adapters(root, spec, more, [RANK] * ADAPTERS, variant=variant)
            ids += more
        start = time.perf_counter()
        model = load_model(checkpoint, dtype=dtype, device=device, pack_weights=pack_weights)
        load_s = time.perf_counter() - start
        config = model.config
        vocab = any(kind in VOCAB_KINDS for kind in variants.values())
        manager_config = AdapterManagerConfig(
            max_slots=len(ids),
            rows=RowOptions(max_rank=RANK, lora_vocab=vocab),
            dtype=dtype,
            device=device,
            prefetch_workers=0,
        )
        manager = AdapterManager(spec, manager_config)
        try:
            for adapter_id, folder in zip(ids, folders, strict=True):
                manager.register(str(folder), adapter_id=adapter_id)
            yield EngineWorkload(config, checkpoint, dtype, device, model, load_s, manager, ids)
        finally:
            manager.close()


def engine_step_ms(
    work: EngineWorkload,
    adapters: list[str | None],
    context: int,
    steps: int,
    model: Llama | None = None,
    deterministic: bool = False,
) -> dict[str, float]:
    """The real engine's decode step (scheduling, lease, forward, sampling) over ``steps`` decode steps: the median
    step (ms), the median forward inside those same steps (metadata + model, ms) and the median of each step's
    overhead over its own forward, so that the overhead is not a difference of two noisy phases. ``model`` None:
    the workload's; ``deterministic``: the engine's mode."""
    max_seq_len = context + steps + 8
    engine = build_engine(model or work.model, work.manager, len(adapters), max_seq_len, deterministic=deterministic)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    for adapter in adapters:
        engine.submit(torch.randint(0, work.config.vocab_size, (context,), generator=gen).tolist(), adapter, params)
    while any(r.in_prefill for r in engine._running) or engine._waiting:  # noqa: SLF001 - bench: reach decode
        engine.step()
    runner = engine._runner  # noqa: SLF001 - bench: the forward's share of each step
    run_model, forward = runner.run, []

    def timed(batch, slot_rows, slot_vectors=None):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        logits = run_model(batch, slot_rows, slot_vectors)
        forward.append(time.perf_counter() - start)
        return logits

    runner.run = timed
    times, forwards = [], []
    for _ in range(steps):
        forward.clear()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        forwards.append(sum(forward))
    runner.run = run_model
    while engine.has_work:
        engine.step()
    return {
        "step_ms": 1e3 * statistics.median(times),
        "forward_ms": 1e3 * statistics.median(forwards),
        "overhead": statistics.median(t / f - 1 for t, f in zip(times, forwards, strict=True)),
    }
