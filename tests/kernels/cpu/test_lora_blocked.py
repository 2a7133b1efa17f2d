"""lora_blocked: a linear on our blocked weight layout (kernels.cpu.block_weight) with its LoRA in the same C++
call. It must equal ``x @ W.T`` plus the fp32 loop reference of every group's parts over the adversarial mixes, with
parts on block boundaries and parts straddling blocks and base-only columns, the last block cut at N, every tile width
(decode's 1, 2, 4, 8 tokens, prefill's 12); and refuse bad operands."""

from __future__ import annotations

import pytest
import torch

from adapter_manager.kernels.cpu import BLOCK, block_weight, load, lora_blocked, unavailable_reason, unblock_weight
from tests.kernels._cases import MIXES, bench_qkv_case, linear_case, reference_apply_parts

pytestmark = pytest.mark.skipif(not load(), reason=f"no CPU kernels: {unavailable_reason()}")


def _expected(x, w, pp, bts, slots, start: int) -> torch.Tensor:
    base = x.double() @ w.double().t()
    width = sum(bt.shape[1] for bt in bts)
    base[:, start : start + width] = reference_apply_parts(base[:, start : start + width], x, pp, bts, slots).double()
    return base


@pytest.mark.parametrize("num_tokens", [1, 3, 8, 9, 16, 40])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize(("start", "outs", "tail"), [(0, (64, 32, 96), 0), (5, (7, 24, 20), 6), (32, (33, 64), 13)])
def test_lora_blocked_equals_the_base_matmul_plus_the_loop(mix, num_tokens, start, outs, tail):
    """Parts on block boundaries, parts of no block multiple behind base-only columns, and a mix (a part ending
    mid-block, the last block cut at N); mixed ranks 1..8, stale garbage past every rank."""
    pp, bts, x, slots, meta, gen = linear_case(len(outs), outs, num_tokens, mix, seed=num_tokens)
    n = start + sum(outs) + tail
    w = torch.randn(n, pp.in_features, generator=gen)
    y = lora_blocked(x, block_weight(w), n, [pp.a_parts], bts, [start], meta.runs)
    expected = _expected(x, w, pp, bts, slots, start)
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)
    none = slots < 0
    torch.testing.assert_close(y[none].double(), x[none].double() @ w.double().t(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_tokens", [17, 100, 257])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize(
    ("start", "outs", "tail", "rank", "in_f"),
    [(0, (64, 32, 96), 0, 8, 48), (5, (7, 24, 20), 6, 24, 40), (32, (33, 64), 13, 40, 48), (0, (32,), 0, 16, 64)],
)
def test_prefill_runs_take_their_lora_inside_the_gemm(mix, num_tokens, start, outs, tail, rank, in_f):
    """A prefill step, its tokens grouped by slot as the engine orders them: runs of 16 or more tokens (their LoRA
    inside the GEMM: tiles of 12 cut at run edges, two runs in one tile) beside shorter runs (lora_apply's loops
    after it) and slot -1 runs; mixed ranks up to 40 (one part's A rows fill 1..4 blocks of 32, a last one of <= 16),
    in of no 16 multiple; parts on block boundaries, off them (their edges column by column), the last block cut."""
    pp, bts, x, slots, meta, gen = linear_case(len(outs), outs, num_tokens, mix, num_tokens, in_f, rank, grouped=True)
    n = start + sum(outs) + tail
    w = torch.randn(n, in_f, generator=gen)
    y = lora_blocked(x, block_weight(w), n, [pp.a_parts], bts, [start], meta.runs)
    torch.testing.assert_close(y.double(), _expected(x, w, pp, bts, slots, start), atol=1e-4, rtol=1e-4)
    none = slots < 0
    torch.testing.assert_close(y[none].double(), x[none].double() @ w.double().t(), atol=1e-4, rtol=1e-4)


def test_a_prefill_of_the_bench_models_shapes():
    """q|k|v of the bench model (in 1024, 1024 + 256 + 256 columns, rank 16) over 200 tokens: two adapters' runs of
    90 and 60 tokens with 50 tokens of no adapter between them, and two groups (q | v, k base-only)."""
    runs = [[0, 90, 16, 16], [140, 60, 48, 16]]
    a, bts, w, x, expected = bench_qkv_case(runs, tokens=200)
    wb = block_weight(w)
    y = lora_blocked(x, wb, w.shape[0], [a], bts, [0], torch.tensor(runs))
    torch.testing.assert_close(y.double(), expected, atol=2e-4, rtol=1e-4)
    q_v = lora_blocked(x, wb, w.shape[0], [a[:, 0:1], a[:, 2:3]], [bts[0], bts[2]], [0, 1280], torch.tensor(runs))
    base = x.double() @ w.double().t()
    torch.testing.assert_close(q_v[:, 1024:1280].double(), base[:, 1024:1280], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(q_v[:, :1024].double(), expected[:, :1024], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(q_v[:, 1280:].double(), expected[:, 1280:], atol=2e-4, rtol=1e-4)


def test_a_long_prefill_passes_over_x_in_panels():
    """in 2816 (the down projection's) × 900 tokens: x's packed tiles (12.2 MB) are more than one panel (8 MB: 62
    tiles of 12), so the GEMM passes over each thread's blocks twice; a run crosses the panel edge (token 744), the
    part starts off the block grid and ends mid-block, the last block is cut at N, the last 100 tokens have no
    adapter."""
    gen = torch.Generator().manual_seed(11)
    tokens, k, n, out, rank = 900, 2816, 70, 45, 16
    a = torch.randn(3 * rank, 1, k, generator=gen) * 0.05
    bt = torch.randn(3 * rank, out, generator=gen) * 0.05
    w, x = torch.randn(n, k, generator=gen) * 0.03, torch.randn(tokens, k, generator=gen)
    runs = [[0, 500, 0, rank], [500, 300, rank, rank]]
    expected = x.double() @ w.double().t()
    for start, count, first, r in runs:
        h = x[start : start + count].double() @ a[first : first + r, 0].double().t()
        expected[start : start + count, 5 : 5 + out] += h @ bt[first : first + r].double()
    y = lora_blocked(x, block_weight(w), n, [a], [bt], [5], torch.tensor(runs))
    torch.testing.assert_close(y.double(), expected, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("num_tokens", [1, 2, 4, 7, 8, 12, 16, 17, 30, 100, 200])
@pytest.mark.parametrize(("n", "k"), [(96, 48), (70, 40), (1, 16), (33, 1), (70, 600)])
def test_the_base_matmul_alone(num_tokens, n, k):
    """No runs: every tile width (1, 2, 4, 8 tokens; 12 past 16, a last tile cut short), N of no block multiple, in of
    no vector multiple and of several 16-k packing chunks."""
    gen = torch.Generator().manual_seed(num_tokens * 100 + n)
    x, w = torch.randn(num_tokens, k, generator=gen), torch.randn(n, k, generator=gen)
    wb = block_weight(w)
    assert wb.shape == ((n + BLOCK - 1) // BLOCK, k, BLOCK) and torch.equal(unblock_weight(wb, n), w)
    y = lora_blocked(x, wb, n, [], [], [], None)
    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), atol=1e-4, rtol=1e-4)
    wide = torch.randn(num_tokens, 2 * k, generator=gen)[:, :k]  # x rows of a stride past in
    strided = lora_blocked(wide, wb, n, [], [], [], None)
    torch.testing.assert_close(strided, lora_blocked(wide.contiguous(), wb, n, [], [], [], None))


@pytest.mark.parametrize(
    "runs", [[[0, 8, 0, 16]], [[t, 1, 16 * t, 16] for t in range(8)], [[0, 3, 16, 16], [5, 3, 48, 16]]]
)
def test_the_bench_models_shapes(runs):
    """The decode shapes the kernel was tuned on (in 1024, q|k|v 1024 + 256 + 256, rank 16), 8 tokens: one adapter,
    eight, and two with tokens of no adapter between them."""
    a, bts, w, x, expected = bench_qkv_case(runs)
    y = lora_blocked(x, block_weight(w), w.shape[0], [a], bts, [0], torch.tensor(runs))
    torch.testing.assert_close(y.double(), expected, atol=2e-4, rtol=1e-4)


def test_two_groups_each_on_its_own_columns():
    """q|k|v with k base-only (PEFT targeting q and v): two groups of one part each, the middle columns the base."""
    pp, (q, v), x, slots, meta, gen = linear_case(2, (128, 64), 11, "zipf", seed=5, in_f=40, rank=16)
    w = torch.randn(128 + 32 + 64, pp.in_features, generator=gen)
    y = lora_blocked(x, block_weight(w), 224, [pp.a_parts[:, 0:1], pp.a_parts[:, 1:2]], [q, v], [0, 160], meta.runs)
    base = x.double() @ w.double().t()
    torch.testing.assert_close(y[:, 128:160].double(), base[:, 128:160], atol=1e-4, rtol=1e-4)
    looped = reference_apply_parts(torch.cat([base[:, :128], base[:, 160:]], 1), x, pp, [q, v], slots).double()
    expected = torch.cat([looped[:, :128], base[:, 128:160], looped[:, 128:]], 1)
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)


def test_lora_blocked_refuses_bad_operands():
    x, w = torch.randn(4, 8), block_weight(torch.randn(10, 8))
    a, bts = torch.randn(9, 2, 8), [torch.randn(9, 3), torch.randn(9, 3)]
    runs = torch.tensor([[0, 4, 6, 2]])
    with pytest.raises(RuntimeError, match="reads rows"):
        lora_blocked(x, w, 10, [a], bts, [0], torch.tensor([[0, 4, 8, 2]]))
    with pytest.raises(RuntimeError, match="covers tokens"):
        lora_blocked(x, w, 10, [a], bts, [0], torch.tensor([[2, 3, 0, 2]]))
    with pytest.raises(RuntimeError, match="past the 1 Bt"):
        lora_blocked(x, w, 10, [a], bts[:1], [0], runs)
    with pytest.raises(RuntimeError, match="3 Bt for 2 parts"):
        lora_blocked(x, w, 10, [a], [*bts, bts[0]], [0], runs)
    with pytest.raises(RuntimeError, match=r"columns \[5, 11\) exceed y's 10"):
        lora_blocked(x, w, 10, [a], bts, [5], runs)
    with pytest.raises(RuntimeError, match="must not overlap"):
        lora_blocked(x, w, 10, [a[:, :1], a[:, 1:]], bts, [3, 1], runs)
    with pytest.raises(RuntimeError, match="same rows"):
        lora_blocked(x, w, 10, [a[:, :1], a[:7, 1:]], bts, [0, 3], runs)
    with pytest.raises(RuntimeError, match="1 to 32 columns, not 40"):
        lora_blocked(x, w, 40, [], [], [], None)
    with pytest.raises(RuntimeError, match="fp32 only"):
        lora_blocked(x.double(), w.double(), 10, [], [], [], None)
    with pytest.raises(RuntimeError, match="contiguous"):
        lora_blocked(x, w.transpose(0, 1), 10, [], [], [], None)
