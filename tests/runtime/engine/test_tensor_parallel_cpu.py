"""Tensor parallelism on CPU, one process per shard (gloo on loopback): the engine trace of ``_tp_trace`` runs in a
process of its own as rank 0, which starts the other shards; each loads only its part of every weight and holds its
section of the adapter pool, rank 0 sends each step and the rows loaded since the last one.

TP = 2 (KV heads split) and 4 (KV heads replicated: the tiny Llama has 2) with mixed adapters, swaps (5 adapters
through 2 slots), prefix hits and preemptions, then echo requests, must equal TP = 1, i.e. PEFT: every greedy
generation HF's tokens, every prompt logprob within 1e-4 of PEFT's; and the collectives are Megatron's: per forward 2
all-reduces a layer, the embedding's, and the logits' all-gather."""

from __future__ import annotations

import pytest

from tests.runtime.engine._tp_oracle import check_against_peft, trace

pytest.importorskip("peft")


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_processes_equal_peft(written, expected, tmp_path, tp):
    result = trace(written, expected, tmp_path, tp, "cpu")
    check_against_peft(result, written, expected)
    layers = 3  # the tiny Llama's
    forwards = result["collectives"] / (2 * layers + 2)
    assert forwards == int(forwards) and forwards > 50, result["collectives"]
