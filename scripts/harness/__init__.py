"""The benchmarks' one harness, imported as ``from scripts.harness import ...`` (run from the repository root):

- ``timers``: medians of interleaved repeats (``median_ms``, ``samples_ms``, ``medians_ms``, ``interleaved_ms``);
- ``profile``: a step's operator calls and self time by category;
- ``checkpoint``: the bench checkpoint and synthetic PEFT adapters on disk;
- ``workload``: the engine workload (the bench model serving 8 rank-16 adapters), its mixes and the engine over it;
- ``steps``: one model's decode / prefill steps as closures; ``references``: the roofline references beside them;
- ``trace``: the many-adapter population and its arrival trace, replayed on a stepping engine;
- ``floors``: the prefill and decode floors (shared/DESIGN.md, Floors), one definition each;
- ``results``: the JSON writer and the machine description;
- ``company``: a request served alone against in company (the same-tokens rate);
- ``soak_*``: the soak benchmark's pieces (population, trace, client, churn, expected registrations, checks, report),
  imported by ``bench_soak`` alone.

``peer``: the vLLM peer's environment and its scripts' runner; ``vllm_peer.py`` (``bench_peer``'s side) and
``vllm_same.py`` (``bench_determinism``'s) run as files in the peer venv, never imported.
"""

from scripts.harness.checkpoint import write_adapters, write_checkpoint
from scripts.harness.floors import adapter_bytes, decode_floor, prefill_floor, projection_shapes
from scripts.harness.profile import op_calls, profile_step
from scripts.harness.references import References
from scripts.harness.results import cpu_features, cpu_model, write_json
from scripts.harness.steps import StepSetup, base_linears
from scripts.harness.timers import interleaved_ms, median_ms, medians_ms, samples_ms
from scripts.harness.trace import RANKS, SHARES, Trace, percentile, population_ranks, replay
from scripts.harness.workload import (
    ADAPTERS,
    CONFIGS,
    RANK,
    EngineWorkload,
    build_engine,
    decode_step_parser,
    engine_step_ms,
    engine_workload,
)

__all__ = [
    "ADAPTERS",
    "CONFIGS",
    "RANK",
    "RANKS",
    "SHARES",
    "EngineWorkload",
    "References",
    "StepSetup",
    "Trace",
    "adapter_bytes",
    "base_linears",
    "build_engine",
    "cpu_features",
    "cpu_model",
    "decode_floor",
    "decode_step_parser",
    "engine_step_ms",
    "engine_workload",
    "interleaved_ms",
    "median_ms",
    "medians_ms",
    "op_calls",
    "percentile",
    "population_ranks",
    "prefill_floor",
    "profile_step",
    "projection_shapes",
    "replay",
    "samples_ms",
    "write_adapters",
    "write_checkpoint",
    "write_json",
]
