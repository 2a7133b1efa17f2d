"""The triton backend's kernels in Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors) against the fp32 loop
reference: BGMV (decode) and SGMV (prefill) over the adversarial mixes, P = 1..3 parts, mixed ranks 8..64 with stale
garbage past every rank, fp32 / bf16 / fp16; and the seam's rules for picking it. The same kernels compiled for a GPU
run in tests/kernels/test_cuda.py."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from adapter_manager.kernels import (
    BackendKind,
    KernelConfig,
    LoRAForm,
    apply_parts,
    expand,
    select_backend,
    shrink,
    shrink_parts,
)
from adapter_manager.kernels.triton.backend import token_table
from adapter_manager.kernels.triton.block_sizes import OPS, TritonBlockEntry, TritonBlockTable
from tests.kernels._cases import (
    MIXES,
    OUTS,
    PAD_LEFT,
    PAD_RIGHT,
    STALE,
    TOLERANCE,
    PartsPool,
    RowPool,
    bt_parts,
    check_apply_parts,
    make_rows,
    parts_pool,
    reference_apply_parts,
    reference_forward,
)

pytestmark = pytest.mark.usefixtures("triton_interpret")

KINDS = {
    "bgmv": KernelConfig(backend=BackendKind.TRITON),
    "sgmv": KernelConfig(backend=BackendKind.TRITON, bgmv_max_tokens=0),
}
"""The two kernel pairs: every step of these tests has <= 64 tokens (BGMV) unless bgmv_max_tokens=0 (SGMV)."""
TOLERANCES = {**TOLERANCE, torch.float16: {"atol": 5e-3, "rtol": 5e-3}}


def backend(kind: str):
    return select_backend("cpu", KINDS[kind])


def mixed_rank_pool(parts: int, in_f: int = 32, seed: int = 0) -> PartsPool:
    """Ranks 8, 64, 16, 32, 8, 64 at slots 0, 2, 11, 14, 19, 21 of 30 (granule 8, R = 64): gaps between adapters,
    adapters spanning 1..8 granules, stale garbage (x100) in every row past a rank and around the parts' columns."""
    gen = torch.Generator().manual_seed(seed + 500)
    granule, rank, num_slots = 8, 64, 30
    slot_rows = {0: 8, 2: 64, 11: 16, 14: 32, 19: 8, 21: 64}
    num_rows = num_slots * granule + 1
    buffer = torch.randn(num_rows, PAD_LEFT + parts * in_f + PAD_RIGHT, generator=gen) * STALE
    for part in range(parts):
        columns = slice(PAD_LEFT + part * in_f, PAD_LEFT + (part + 1) * in_f)
        for slot, r in slot_rows.items():
            buffer[slot * granule : slot * granule + r, columns] = torch.randn(r, in_f, generator=gen) / in_f**0.5
        buffer[-1, columns] = 0
    slot_ids = torch.tensor(sorted(slot_rows))
    pool = RowPool(buffer[:, PAD_LEFT : PAD_LEFT + in_f], buffer[:, :1], slot_rows, slot_ids, num_slots, rank, granule)
    return PartsPool(buffer, pool, parts, in_f)


@pytest.mark.parametrize(("parts", "dtype"), [(1, torch.float32), (3, torch.float32), (2, torch.bfloat16)])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_apply_parts_equals_the_loop_over_mixes(kind, mix, parts, dtype):
    """One shrink and one expand launch per call; y a column view of a wider tensor; slot -1 rows bit for bit."""
    check_apply_parts(backend(kind), parts_pool(parts, 6, 8, 8), num_tokens=19, mix=mix, dtype=dtype)


@pytest.mark.parametrize(("parts", "dtype"), [(1, torch.float32), (3, torch.bfloat16)])
@pytest.mark.parametrize("mix", ["distinct", "zipf", "empty_slots"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_mixed_ranks_8_to_64_with_stale_rows(kind, mix, parts, dtype):
    """Rank blocks past a token's rank return at once; a kernel that read past a rank would add the x100 garbage."""
    check_apply_parts(backend(kind), mixed_rank_pool(parts), num_tokens=21, mix=mix, dtype=dtype, seed=5)


POOLS = {"granule_below_rank": (20, 8, 3), "ranks_1_to_64": (12, 64, 8)}


@pytest.mark.parametrize(
    ("dtype", "accumulate"),
    [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True), (torch.float16, True)],
    ids=["fp32", "fp32-write", "bf16", "fp16"],
)
@pytest.mark.parametrize("mix", ["single_with_none", "distinct", "zipf"])
@pytest.mark.parametrize("pool_name", list(POOLS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_shrink_and_expand_ops_equal_the_reference(kind, pool_name, mix, dtype, accumulate):
    gen = torch.Generator().manual_seed(3)
    pool = make_rows(*POOLS[pool_name], 40, 56, gen).to(dtype)
    x, y = torch.randn(19, 40, generator=gen).to(dtype), torch.randn(19, 56, generator=gen).to(dtype)
    slots = pool.slots(mix, 19, gen)
    h_ref, y_ref = reference_forward(x, y if accumulate else torch.zeros_like(y), pool, slots)
    meta = pool.meta(backend(kind), 32)
    meta.prepare(slots, pool.slot_rows)
    h = shrink(x, pool.a_rows, meta)
    assert h.dtype == dtype and h.shape == (19, pool.rank)
    y_new = expand(y.clone(), h, pool.bt_rows, meta, accumulate=accumulate)
    torch.testing.assert_close(h.float(), h_ref, **TOLERANCES[dtype])
    torch.testing.assert_close(y_new.float(), y_ref, **TOLERANCES[dtype])
    none = slots < 0
    assert torch.equal(h[none], torch.zeros_like(h[none])), "slot -1 tokens shrink to exactly zero"
    expected_none = y[none] if accumulate else torch.zeros_like(y[none])
    assert torch.equal(y_new[none], expected_none), "slot -1 rows of y: untouched (accumulate) or zero"


@pytest.mark.parametrize("kind", list(KINDS))
def test_shrink_parts_equals_each_part(kind):
    pp = parts_pool(3, 20, 8, 3, seed=1)
    gen = torch.Generator().manual_seed(1)
    x, slots = torch.randn(23, 48, generator=gen), pp.pool.slots("uniform", 23, gen)
    meta = pp.pool.meta(backend(kind), 32)
    meta.prepare(slots, pp.pool.slot_rows)
    h = shrink_parts(x, pp.a_parts, meta)
    assert h.shape == (3, 23, pp.pool.rank)
    for part in range(3):
        ref = pp.pool.meta(select_backend("cpu", KernelConfig(backend=BackendKind.REFERENCE)), 32)
        ref.prepare(slots, pp.pool.slot_rows)
        torch.testing.assert_close(h[part], shrink(x, pp.part(part), ref), **TOLERANCE[torch.float32])


def _single_entry_table(entry: TritonBlockEntry) -> TritonBlockTable:
    """The shipped table with ``entry``'s blocks as its op's only (any rank, any features) entry."""
    shipped = TritonBlockTable.load()
    others = [e for e in shipped.entries if e.op != entry.op and e.rank is None and e.features is None]
    return TritonBlockTable((*others, dataclasses.replace(entry, rank=None, features=None, max_tokens=1 << 20)))


@pytest.mark.parametrize("index", range(len(TritonBlockTable.load().entries)))
def test_every_shipped_block_size_entry_runs(index, tmp_path):
    """Each entry of kernels/triton/block_sizes.json on a mixed-rank pool (its split_k and rank blocks included)."""
    entry = TritonBlockTable.load().entries[index]
    table = tmp_path / "blocks.json"
    table.write_text(_single_entry_table(entry).to_json("one entry"))
    config = dataclasses.replace(KINDS[entry.op[:4]], triton_block_size_table=str(table))
    check_apply_parts(select_backend("cpu", config), mixed_rank_pool(2, in_f=40), num_tokens=17, mix="uniform")


def test_the_table_needs_every_op_and_valid_blocks():
    shipped = TritonBlockTable.load()
    assert {e.op for e in shipped.entries} == set(OPS)
    with pytest.raises(ValueError, match="needs a 'sgmv_expand' entry"):
        TritonBlockTable(tuple(e for e in shipped.entries if e.op != "sgmv_expand"))
    with pytest.raises(ValueError, match="block_tokens >= 16"):
        dataclasses.replace(shipped.entries[-1], op="sgmv_shrink", blocks=shipped.entries[0].blocks)
    assert shipped.lookup("bgmv_shrink", 8, 64, 4096).block_rank == 64  # the rank-64 entry, any features
    assert shipped.lookup("bgmv_shrink", 8, 16, 4096).split_k > 1  # decode: split the input features


def test_steps_up_to_bgmv_max_tokens_take_bgmv_and_longer_ones_sgmv():
    pp = parts_pool(1, 6, 8, 8)
    meta = pp.pool.meta(select_backend("cpu", KernelConfig(backend=BackendKind.TRITON, bgmv_max_tokens=4)), 8)
    slots = torch.tensor([3, 3, -1, 0], dtype=torch.int32)
    meta.prepare(slots, pp.pool.slot_rows)
    assert meta.fused and meta.form is LoRAForm.FUSED
    tables = meta.backend.step_tables(meta)
    first, rank = 3 * 8, pp.pool.slot_rows[3]
    assert tables.runs is None and tables.tokens.tolist() == [
        [first, first, 0, 0],
        [rank, rank, 0, pp.pool.slot_rows[0]],
    ]
    assert meta.backend.step_tables(meta) is tables, "built once per step"
    meta.prepare(torch.cat([slots, slots[:1]]), pp.pool.slot_rows)
    tables = meta.backend.step_tables(meta)
    assert tables.tokens is None and tables.longest_run == 2 and tables.runs.shape == (3, 4)
    meta.prepare(torch.full((3,), -1, dtype=torch.int32), pp.pool.slot_rows)
    assert meta.no_adapter and not meta.fused


@pytest.mark.parametrize("kind", list(KINDS))
def test_parts_in_separate_tensors_take_one_expand_launch_each(kind):
    """Bt parts that are not views of one tensor: the expand runs part by part, same result."""
    pp = parts_pool(3, 6, 8, 8, seed=4)
    gen = torch.Generator().manual_seed(4)
    x, slots = torch.randn(13, 48, generator=gen), pp.pool.slots("zipf", 13, gen)
    meta = pp.pool.meta(backend(kind), 16)
    meta.prepare(slots, pp.pool.slot_rows)
    shared = bt_parts(pp, OUTS, 4)
    separate = [bt.clone() for bt in shared]
    assert len({bt.untyped_storage().data_ptr() for bt in separate}) == 3
    y = torch.randn(13, sum(OUTS), generator=gen)
    expected = reference_apply_parts(y, x, pp, shared, slots)
    torch.testing.assert_close(
        apply_parts(y.clone(), x, pp.a_parts, separate, meta), expected, **TOLERANCE[torch.float32]
    )
    torch.testing.assert_close(
        apply_parts(y.clone(), x, pp.a_parts, shared, meta), expected, **TOLERANCE[torch.float32]
    )


@pytest.mark.parametrize("mix", ["distinct", "zipf", "empty_slots", "none"])
def test_the_token_table_names_each_tokens_rows(mix):
    pool = make_rows(20, 8, 3, 4, 4, torch.Generator().manual_seed(6))
    slots = pool.slots(mix, 41, torch.Generator().manual_seed(7))
    meta = pool.meta(backend("bgmv"), 64)
    meta.prepare(slots, pool.slot_rows)
    expected = [[s * 3 if s >= 0 else 0 for s in slots.tolist()], [pool.slot_rows.get(s, 0) for s in slots.tolist()]]
    if meta.no_adapter:
        assert meta.runs is None
    else:
        assert token_table(meta).tolist() == expected


def test_operands_the_kernels_do_not_take_fall_back_to_the_torch_forms():
    """A parts view with inner stride 2 (not a pool view): the same step through the torch segments path."""
    pp = parts_pool(2, 6, 8, 8)
    wide = PartsPool(pp.buffer.repeat_interleave(2, dim=1), pp.pool, 2, 48)
    gen = torch.Generator().manual_seed(2)
    x, slots = torch.randn(9, 48, generator=gen), pp.pool.slots("uniform", 9, gen)
    meta = pp.pool.meta(backend("bgmv"), 16)
    meta.prepare(slots, pp.pool.slot_rows)
    a_parts = wide.buffer[:, 2 * PAD_LEFT :: 2][:, : 2 * 48].unflatten(1, (2, 48))  # [N, 2, 48], inner stride 2
    assert a_parts.stride(2) == 2 and torch.equal(a_parts, pp.a_parts)
    torch.testing.assert_close(shrink_parts(x, a_parts, meta), shrink_parts(x, pp.a_parts, meta))


def test_the_seam_picks_triton_on_cuda_and_never_on_cpu(monkeypatch):
    """Forced onto a CPU device only in interpret mode, and only in the mode triton was imported in."""
    from adapter_manager.kernels.triton.backend import TritonBackend
    from adapter_manager.kernels.triton.kernels import InterpretModeError

    assert isinstance(select_backend("cuda"), TritonBackend), "AUTO on cuda: the Triton kernels"
    assert not isinstance(select_backend("cpu"), TritonBackend), "AUTO on cpu: the cpu backend, even interpreting"
    assert select_backend("cpu", KernelConfig(backend=BackendKind.TRITON)).kernels.interpret
    with pytest.raises(ValueError, match="eager-only"):
        select_backend("xla", KernelConfig(backend=BackendKind.TRITON))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("cpu", KernelConfig(backend=BackendKind.TRITON))
    with pytest.raises(InterpretModeError, match="unset now but was set when triton was first imported"):
        select_backend("cuda", KernelConfig(backend=BackendKind.TRITON))  # tl.sum is interpreted: no compiled kernel
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    with pytest.warns(UserWarning, match="triton cannot be imported"):
        fallback = select_backend("cuda")
    assert not isinstance(fallback, TritonBackend)
    with pytest.raises(ValueError, match="backend 'triton': triton cannot be imported"):
        select_backend("cuda", KernelConfig(backend=BackendKind.TRITON))


def test_first_contact_keeps_working_kernels_and_falls_back_from_broken_ones(triton_interpret, monkeypatch):
    """On CUDA the seam tries the Triton kernels on one small fused step first: kernels that run right are kept;
    a kernel the device refuses (here: a launch that raises, as a failed compile does) or one that computes wrong
    numbers leaves the torch forms, with one warning naming why."""
    import warnings

    from adapter_manager.kernels.backend import first_contact
    from adapter_manager.kernels.torch_eager import TorchEagerBackend
    from adapter_manager.kernels.triton.backend import TritonBackend

    config = KernelConfig(backend=BackendKind.TRITON)
    triton = select_backend("cpu", config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert first_contact(triton, "cpu", config) is triton

    def refused(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise RuntimeError("PassManager::run failed (sm_90a)")

    monkeypatch.setattr(TritonBackend, "shrink_all", refused)
    with pytest.warns(RuntimeWarning, match="torch LoRA forms, not the TritonBackend kernels.*PassManager"):
        fallback = first_contact(triton, "cpu", config)
    assert type(fallback) is TorchEagerBackend
    monkeypatch.undo()
    expand_all = TritonBackend.expand_all
    monkeypatch.setattr(
        TritonBackend, "expand_all", lambda self, y, h, bts, meta: expand_all(self, y, h * 2, bts, meta)
    )
    with pytest.warns(RuntimeWarning, match="differs from the fp32 loop reference"):
        assert type(first_contact(triton, "cpu", config)) is TorchEagerBackend
