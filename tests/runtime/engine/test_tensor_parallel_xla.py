"""Tensor parallelism as one SPMD program on the torch_xla CPU device with 4 virtual devices (XLA lane).

Each TP size runs the engine trace of ``_tp_trace`` in its own process (SPMD is switched on before the first XLA
tensor; the lane's other tests run without it): warm-up, then mixed adapters with swaps (5 adapters through 2 slots),
prefix hits and preemptions, then echo requests. TP = 2 (KV heads split) and TP = 4 (KV heads replicated, as 4 > 2
KV heads) must equal TP = 1, i.e. PEFT: every greedy generation HF's tokens, every prompt logprob within 1e-4 of
log_softmax of PEFT's logits, and nothing compiled after warm-up. The same with ``fully_sharded_loras`` (every A and
Bt split too: the shrink outputs summed over the shards), and with the Pallas kernels run per shard.
"""

from __future__ import annotations

import pytest

from tests.runtime.engine._tp_oracle import check_against_peft, trace

pytestmark = pytest.mark.xla
pytest.importorskip("torch_xla")
pytest.importorskip("peft")


@pytest.mark.parametrize(("tp", "full"), [(2, False), (4, False), (2, True), (4, True)])
def test_tensor_parallel_engine_equals_peft_and_compiles_nothing_after_warm_up(written, expected, tmp_path, tp, full):
    check_against_peft(trace(written, expected, tmp_path, tp, "xla", full), written, expected)


@pytest.mark.parametrize(("tp", "full"), [(4, False), (2, True)])
def test_the_pallas_kernels_run_per_shard_and_equal_peft(written, expected, tmp_path, tp, full):
    """The Pallas backend (interpreted as HLO here; Mosaic on a TPU) under tensor parallelism: GSPMD cannot partition
    its kernels, so each device calls them at its shard's shapes between manual-sharding marks."""
    result = trace(written, expected, tmp_path, tp, "xla", full, pallas=True)
    check_against_peft(result, written, expected)
    assert result["pallas_shrinks"] > 0
