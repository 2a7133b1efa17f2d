"""The Pallas kernels directly in JAX, interpreted on CPU, against the fp32 loop reference (XLA lane)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.xla
jax = pytest.importorskip("jax")
pytest.importorskip("jax.experimental.pallas.tpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels.block_sizes import BlockSizes, BlockSizeTable  # noqa: E402
from kernels.config import PallasInterpret  # noqa: E402
from kernels.pallas_kernels import lora_expand, lora_shrink  # noqa: E402
from tests.kernels._cases import TOLERANCE, collapse_laned, make_stacks, reference_forward, slot_mix  # noqa: E402

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
    h_ref, y_ref = reference_forward(x, y, a, bt, slots)
    h, y_new = run(x, y, a, bt, slots, blocks[0], blocks[1], interpret, dtype)
    assert h.shape == (num_tokens, num_slots * rank)
    torch.testing.assert_close(collapse_laned(h, num_slots, rank), h_ref, **TOLERANCE[dtype])
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
