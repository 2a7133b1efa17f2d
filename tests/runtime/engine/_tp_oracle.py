"""Runs the tensor-parallel engine trace (``_tp_trace``) in its own process and checks it against PEFT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.runtime._oracle import ADAPTERS, FP32_TOL, oracle_logits

ROOT = Path(__file__).resolve().parents[3]


def trace(written, expected, tmp_path: Path, tp: int, device: str, full: bool = False, pallas: bool = False) -> dict:
    combos = sorted(expected, key=str)
    paths = {name or "base": str(folder) for name, (folder, _) in written.items()}
    spec = tmp_path / f"paths-{tp}.json"
    spec.write_text(json.dumps({"paths": paths, "combos": [[list(p), a] for p, a in combos]}))
    out = tmp_path / f"trace-{tp}.json"
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    command = [sys.executable, "-m", "tests.runtime.engine._tp_trace", str(spec), str(out), "--tp", str(tp)]
    command += ["--device", device] + (["--fully-sharded-loras"] if full else []) + (["--pallas"] if pallas else [])
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def check_against_peft(result: dict, written, expected) -> None:
    """Every greedy generation HF's tokens, every prompt logprob within 1e-4 of log_softmax of PEFT's logits, and the
    trace did what it is for: swaps, prefix hits, preemptions, nothing compiled after warm-up."""
    assert result["compiles_after_warm_up"] == 0, result["compiles_after_warm_up"]
    assert result["prefix_hit_tokens"] > 0 and result["preemptions"] > 0, result
    assert result["swaps"] >= len(ADAPTERS)
    assert len(result["requests"]) > 20
    for prompt, name, tokens in result["requests"]:
        assert tokens == expected[(tuple(prompt), name)][: len(tokens)], (prompt, name)
    for prompt, name, tokens, logprobs in result["echoes"]:
        assert tokens == expected[(tuple(prompt), name)][:2], (prompt, name)
        reference = torch.log_softmax(oracle_logits(written, name, prompt), -1)
        for i, (token, logprob) in enumerate(logprobs, start=1):
            assert token == prompt[i]
            assert abs(logprob - reference[i - 1, token].item()) < FP32_TOL, (prompt, name, i)
