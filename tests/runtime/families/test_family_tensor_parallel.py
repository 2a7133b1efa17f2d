"""Every served family sharded two ways equals the unsharded oracle: q/k/v bias and q/k norms split with their heads,
the sandwich norms and soft-caps whole. CPU: one process per shard (gloo), every family; XLA lane: one SPMD program
over 2 of 4 virtual devices, for the families whose terms a shard splits or caps. The trace
(``tests.runtime.engine._tp_trace``) swaps 3 adapters through 2 slots, hits the prefix cache, preempts, then echoes
prompt logprobs."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.engine._tp_oracle import trace
from tests.runtime.families._oracle import greedy, prompt_logprobs, requests

pytest.importorskip("peft")
TOL = 1e-4
XLA_FAMILIES = ("qwen2", "gemma2", "gemma3")  # bias and q/k norms split with their heads; capped scores per shard


def _check(family, tmp_path, device: str) -> None:
    written = {None: (family.folder, family.model), **family.adapters}
    combos = {(tuple(prompt), name): greedy(family, prompt, name) for prompt, name in requests(family)}
    result = trace(written, combos, tmp_path, tp=2, device=device)
    assert result["compiles_after_warm_up"] == 0
    assert result["swaps"] >= len(family.adapters) and result["preemptions"] > 0, result
    assert len(result["requests"]) > 20
    for prompt, name, tokens in result["requests"]:
        assert tokens == combos[(tuple(prompt), name)][: len(tokens)], (family.name, prompt, name)
    for prompt, name, tokens, logprobs in result["echoes"]:
        assert tokens == combos[(tuple(prompt), name)][:2], (family.name, prompt, name)
        served = torch.tensor([logprob for _, logprob in logprobs])
        expected = torch.tensor(prompt_logprobs(family, prompt, name))
        assert torch.allclose(served, expected, atol=TOL, rtol=0), (family.name, prompt, name)


@pytest.mark.slow
def test_family_sharded_over_two_cpu_processes_equals_the_oracle(family, tmp_path) -> None:
    _check(family, tmp_path, "cpu")


@pytest.mark.xla
def test_family_sharded_by_spmd_over_two_devices_equals_the_oracle(family, tmp_path) -> None:
    pytest.importorskip("torch_xla")
    if family.name not in XLA_FAMILIES:
        pytest.skip(f"the XLA lane shards {XLA_FAMILIES}: the others add no term a shard splits")
    _check(family, tmp_path, "xla")
