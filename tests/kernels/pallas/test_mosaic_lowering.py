"""Every Pallas kernel lowered for TPU (Mosaic) at every shipped block-size entry, over the bench model's, a
Llama-3-8B's and one 8-way tensor-parallel shard of a Llama-3.1-70B's feature sizes, fp32 and bf16, single-adapter
and laned (XLA lane; no TPU needed: jax.export runs the TPU lowering on a CPU). And the check catches a block shape
that interpret mode accepts."""

from __future__ import annotations

import functools

import pytest

pytestmark = pytest.mark.xla
jax = pytest.importorskip("jax")
pytest.importorskip("jax.experimental.pallas.tpu")

import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from adapter_manager.kernels.config import PallasInterpret  # noqa: E402
from adapter_manager.kernels.pallas.block_sizes import BlockSizeTable  # noqa: E402
from adapter_manager.kernels.pallas.kernels import lora_expand, lora_shrink  # noqa: E402
from adapter_manager.kernels.pallas.lowering import MosaicLoweringError, lower_for_tpu  # noqa: E402

# per model: shrink's input features (hidden, intermediate) and expand's output features (q/o, k/v, gate/up); one
# shard of Llama-3.1-70B split 8 ways: shrink reads hidden (q/k/v, gate/up: A whole), o's 8 heads or down's MLP slice
# (A split by input), expand writes q's 8 heads, one KV head, the MLP slice (Bt split by output) or hidden (o, down)
MODELS = {
    "bench": ((1024, 2816), (1024, 256, 2816)),
    "llama3-8b": ((4096, 14336), (4096, 1024, 14336)),
    "llama3-70b-tp8-shard": ((8192, 1024, 3584), (1024, 128, 3584, 8192)),
}
RANK = 16
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
TABLE = BlockSizeTable.load()


def _tokens(entry) -> int:
    """A step's tokens that reach this entry: its max_tokens (capped at a long prefill's 2048)."""
    return min(entry.max_tokens, 2048)


def _cases():
    for entry in TABLE.entries:
        sizes = {model: MODELS[model][0 if entry.op == "shrink" else 1] for model in MODELS}
        for model, features in sizes.items():
            for f in features if entry.features is None else [f for f in features if f == entry.features]:
                yield pytest.param(entry, f, id=f"{entry.op}-T{_tokens(entry)}-{model}-F{f}-e{entry.features}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("active", [1, 8], ids=["single", "laned"])
@pytest.mark.parametrize(("entry", "features"), list(_cases()))
def test_every_entry_lowers_for_tpu(entry, features: int, active: int, dtype: str) -> None:
    sd, jdtype, tokens = jax.ShapeDtypeStruct, DTYPES[dtype], _tokens(entry)
    blocks, off = entry.blocks, PallasInterpret.OFF
    slots = sd((tokens,), jnp.int32)
    if entry.op == "shrink":
        fn = functools.partial(lora_shrink, blocks=blocks, interpret=off)
        args = (sd((tokens, features), jdtype), sd((active, RANK, features), jdtype), slots)
    else:
        fn = functools.partial(lora_expand, blocks=blocks, interpret=off)
        h = sd((tokens, active * RANK), jdtype)
        args = (sd((tokens, features), jdtype), h, sd((active, RANK, features), jdtype), slots)
    assert "tpu_custom_call" in lower_for_tpu(fn, *args, what=entry.describe())


def _doubled(x: jax.Array, block: tuple[int, int], interpret: bool) -> jax.Array:
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    grid = (x.shape[0] // block[0], x.shape[1] // block[1])
    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(kernel, out_shape=out, grid=grid, in_specs=[spec], out_specs=spec, interpret=interpret)(x)


def test_a_block_a_tpu_refuses_is_caught_where_interpret_mode_runs_it() -> None:
    x = jnp.ones((64, 200), jnp.float32)
    assert float(_doubled(x, (16, 100), interpret=True).sum()) == 2 * 64 * 200  # interpret mode: no complaint
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    with pytest.raises(MosaicLoweringError, match="divisible by 8 and 128"):
        lower_for_tpu(functools.partial(_doubled, block=(16, 100), interpret=False), shape, what="bad block")
    good = functools.partial(_doubled, block=(16, 200), interpret=False)  # the whole last axis: a legal block
    assert "tpu_custom_call" in lower_for_tpu(good, shape)
