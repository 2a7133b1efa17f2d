"""The Pallas kernels directly in JAX, interpreted on CPU, against the fp32 loop reference (XLA lane).

The kernels take the compact table [A, R, F] and compact ids; here a dense table plays it (G = R, full ranks).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.xla
jax = pytest.importorskip("jax")
pytest.importorskip("jax.experimental.pallas.tpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from adapter_manager.kernels.config import PallasInterpret  # noqa: E402
from adapter_manager.kernels.pallas.block_sizes import BlockSizes, BlockSizeTable  # noqa: E402
from adapter_manager.kernels.pallas.kernels import lora_expand, lora_shrink, weight_fetches  # noqa: E402
from tests.kernels._cases import (  # noqa: E402
    TOLERANCE,
    collapse_laned,
    dense_pool,
    make_stacks,
    reference_forward,
    slot_mix,
)

SMALL = BlockSizes(block_tokens=16, block_features=128, lane_width=128)


def run(x, y, a, bt, slots, blocks_shrink, blocks_expand, interpret, dtype):
    jdtype = jnp.float32 if dtype == torch.float32 else jnp.bfloat16
    to_jax = lambda t: jnp.asarray(t.float().numpy()).astype(jdtype)
    jslots = jnp.asarray(slots.numpy())
    h = lora_shrink(to_jax(x), to_jax(a), jslots, blocks=blocks_shrink, interpret=interpret)
    y_new = lora_expand(to_jax(y), h, to_jax(bt), jslots, blocks=blocks_expand, interpret=interpret)
    to_torch = lambda arr: torch.from_numpy(np.array(arr.astype(jnp.float32)))
    return to_torch(h), to_torch(y_new)


def check(
    num_tokens,
    num_slots,
    rank,
    in_f,
    out_f,
    mix,
    *,
    dtype=torch.float32,
    blocks=(SMALL, SMALL),
    interpret=PallasInterpret.TPU,
    used_rank=None,
    seed=0,
):
    gen = torch.Generator().manual_seed(seed)
    a, bt = make_stacks(num_slots, rank, in_f, out_f, gen, used_rank)
    x = torch.randn(num_tokens, in_f, generator=gen).to(dtype)
    y = torch.randn(num_tokens, out_f, generator=gen).to(dtype)
    a, bt = a.to(dtype), bt.to(dtype)
    slots = slot_mix(mix, num_tokens, num_slots, gen)
    h_ref, y_ref = reference_forward(x, y, dense_pool(a, bt), slots)
    h, y_new = run(x, y, a, bt, slots, blocks[0], blocks[1], interpret, dtype)
    assert h.shape == (num_tokens, num_slots * rank)
    torch.testing.assert_close(collapse_laned(h, rank), h_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(y_new, y_ref, **TOLERANCE[dtype])
    none = slots < 0
    assert torch.equal(y_new[none], y.float()[none]), "slot -1 rows must be unchanged bit for bit"
    assert torch.equal(h[none], torch.zeros_like(h[none]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", ["none", "single", "single_with_none", "distinct", "zipf", "skewed", "empty_slots"])
def test_tpu_interpret_mixes(mix, dtype):
    """Several 16-rank slots share one 128-lane block; T = 37 is no multiple of the 16-token block."""
    check(37, 10, 16, 136, 200, mix, dtype=dtype)


@pytest.mark.parametrize(
    ("num_tokens", "num_slots", "rank", "used_rank"),
    [(1, 3, 8, None), (20, 4, 12, None), (20, 3, 200, None), (33, 6, 16, 5), (17, 1, 64, None)],
    ids=["T1", "rank12_padded_to_16", "rank200_two_lane_blocks", "zero_padded_ranks", "one_slot"],
)
def test_tpu_interpret_shapes(num_tokens, num_slots, rank, used_rank):
    check(num_tokens, num_slots, rank, 64, 96, "uniform", used_rank=used_rank)


def test_hlo_interpret_matches():
    check(37, 10, 16, 136, 200, "uniform", interpret=PallasInterpret.HLO)


@pytest.mark.parametrize("index", range(len(BlockSizeTable.load().entries)))
def test_every_block_size_entry(index):
    """Each shipped entry runs on a shape one past its blocks, so every tiled axis has a ragged last block."""
    entry = BlockSizeTable.load().entries[index]
    blocks = entry.blocks
    features = blocks.block_features + 1
    other = SMALL
    pair = (blocks, other) if entry.op == "shrink" else (other, blocks)
    in_f, out_f = (features, 96) if entry.op == "shrink" else (96, features)
    num_slots = blocks.lane_width // 16 + 1
    check(
        blocks.block_tokens + 1,
        num_slots,
        16,
        in_f,
        out_f,
        "uniform",
        blocks=pair,
        interpret=PallasInterpret.HLO,
        seed=index,
    )


ON_TPU = jax.devices()[0].platform == "tpu"


@pytest.mark.skipif(not ON_TPU, reason="needs a TPU: the kernels compiled by Mosaic (scripts/tpu_figures runs this)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", ["none", "single", "distinct", "zipf", "empty_slots"])
def test_compiled_on_a_tpu_the_kernels_equal_the_loop(mix, dtype):
    """The same checks with interpret off: on a TPU the kernels Mosaic compiled, at the shipped table's entries for the
    bench model's projections (a decode step and a prefill chunk)."""
    table = BlockSizeTable.load()
    for tokens in (8, 512):
        blocks = (table.lookup("shrink", tokens, 1024), table.lookup("expand", tokens, 2816))
        check(tokens, 8, 16, 1024, 2816, mix, dtype=dtype, blocks=blocks, interpret=PallasInterpret.OFF)


def _slots(values):
    return torch.tensor(values, dtype=torch.int32)


FETCH_CASES = {
    "one_slot": [0] * 64,
    "one_slot_late": [-1] * 40 + [3] * 24,  # the leading token blocks have no work
    "two_blocks": [0, 9] * 8 + [-1] * 48,  # token block 0 meets lane blocks 0 and 1, the rest none
    "none": [-1] * 64,
}


@pytest.mark.parametrize("case", list(FETCH_CASES))
def test_weight_dma_follows_the_active_blocks(case):
    """Weight-block DMAs equal (pairs with work) × (feature blocks swept per pair), whatever the table's width A:
    blocks without work re-point at the block fetched last. T = 64 (4 token blocks), 256 features (2 blocks),
    R = 16 in 128-lane blocks (8 compact slots per lane block)."""
    slots = _slots(FETCH_CASES[case])
    jslots = jnp.asarray(slots.numpy())
    counts = {}
    for width in (16, 64):
        for op in ("shrink", "expand"):
            counts[width, op] = weight_fetches(op, jslots, width, 16, 256, SMALL)
    for op in ("shrink", "expand"):
        narrow, wide = counts[16, op], counts[64, op]
        assert wide.grid_steps == 4 * narrow.grid_steps  # 8 lane blocks instead of 2
        assert (wide.work_pairs, wide.weight_fetches) == (narrow.work_pairs, narrow.weight_fetches)
        assert narrow.weight_fetches == max(narrow.work_pairs * 2, 1)
    expected_work = {"one_slot": 4, "one_slot_late": 2, "two_blocks": 2, "none": 0}[case]
    assert counts[64, "shrink"].work_pairs == expected_work


@pytest.mark.parametrize("case", list(FETCH_CASES))
@pytest.mark.parametrize("interpret", [PallasInterpret.TPU, PallasInterpret.HLO], ids=["tpu", "hlo"])
def test_redirected_blocks_stay_correct(case, interpret):
    """The same cases through the kernels: pairs without work read a redirected block and must not use it."""
    gen = torch.Generator().manual_seed(7)
    a, bt = make_stacks(16, 16, 256, 256, gen)
    x, y = torch.randn(64, 256, generator=gen), torch.randn(64, 256, generator=gen)
    slots = _slots(FETCH_CASES[case])
    h_ref, y_ref = reference_forward(x, y, dense_pool(a, bt), slots)
    h, y_new = run(x, y, a, bt, slots, SMALL, SMALL, interpret, torch.float32)
    torch.testing.assert_close(collapse_laned(h, 16), h_ref, **TOLERANCE[torch.float32])
    torch.testing.assert_close(y_new, y_ref, **TOLERANCE[torch.float32])
