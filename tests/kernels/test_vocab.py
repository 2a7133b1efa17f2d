"""The vocabulary modules' LoRA (`kernels.vocab`: the embedding's gather + expand, the head's shrink + expand over the
logits rows) against their fp32 loop reference, over adversarial slot mixes, stale rows past every rank, every
backend's form (the eager groups, per token, and the traced lanes run on CPU tensors)."""

from __future__ import annotations

import zlib

import pytest
import torch

from adapter_manager.kernels import embed_lora, head_lora, vocab
from tests.kernels._cases import BACKENDS, MIXES, TOLERANCE, make_rows

NUM_SLOTS, RANK, GRANULE, VOCAB, HIDDEN = 6, 8, 4, 50, 24
FORMS = ("torch_table", "cpu_auto", "reference", "xla_laned_on_cpu")


def reference_embed(h, tokens, pool, slots) -> torch.Tensor:  # noqa: ANN001
    """h[t] + Σ over the token's adapter's rows k of a[k, tokens[t]] · bt[k], in fp32, a token at a time."""
    out = h.float().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            rows = slice(slot * GRANULE, slot * GRANULE + pool.slot_rows[slot])
            out[t] += pool.a_rows[rows, tokens[t]].float() @ pool.bt_rows[rows].float()
    return out


def reference_head(logits, x, pool, slots, index) -> torch.Tensor:  # noqa: ANN001
    """logits[n] + Σ over the row's token's adapter's rows k of (x[n] · a[k]) · bt[k], in fp32, a row at a time."""
    out = logits.float().clone()
    for n, t in enumerate(index.tolist()):
        slot = int(slots[t])
        if slot >= 0:
            rows = slice(slot * GRANULE, slot * GRANULE + pool.slot_rows[slot])
            out[n] += (pool.a_rows[rows].float() @ x[n].float()) @ pool.bt_rows[rows].float()
    return out


class Stacks:
    def __init__(self, a: torch.Tensor, bt: torch.Tensor) -> None:
        self.a, self.bt, self.vector = a, bt, None


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("way", ["gathered", "groups", "per_token"])
def test_embed_lora_equals_its_loop_reference(form, mix, way, monkeypatch) -> None:
    """Eager: every token's rows gathered at once (a small step), one matmul per adapter (``GATHER_MAX`` 0), or a
    token at a time (the deterministic mode); traced: the lanes whatever the way."""
    per_token = way == "per_token"
    if way == "groups":
        monkeypatch.setattr(vocab, "GATHER_MAX", 0)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{form} {mix}".encode()))
    pool = make_rows(NUM_SLOTS, RANK, GRANULE, VOCAB, HIDDEN, gen)  # A [N, V], Bt [N, H]: stale past every rank
    tokens = torch.randint(0, VOCAB, (13,), generator=gen)
    slots = pool.slots(mix, 13, gen)
    meta = pool.meta(BACKENDS[form](), 16)
    meta.prepare(slots, pool.slot_rows)
    h = torch.randn(13, HIDDEN, generator=gen)
    expected = reference_embed(h, tokens, pool, slots)
    got = embed_lora(h.clone(), tokens, Stacks(pool.a_rows, pool.bt_rows), meta, per_token)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("rows", ["all", "last", "shuffled"])
def test_head_lora_equals_its_loop_reference(form, mix, rows) -> None:
    """Logits rows: every token's (decode), a few tokens' (prefill's last tokens), and out of token order."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{form} {mix} {rows}".encode()))
    pool = make_rows(NUM_SLOTS, RANK, GRANULE, HIDDEN, VOCAB, gen)  # A [N, H], Bt [N, V]
    slots = pool.slots(mix, 13, gen)
    meta = pool.meta(BACKENDS[form](), 16)
    meta.prepare(slots, pool.slot_rows)
    index = {"all": None, "last": torch.tensor([3, 7, 12]), "shuffled": torch.tensor([9, 0, 4, 4, 11])}[rows]
    picked = torch.arange(13) if index is None else index
    x = torch.randn(picked.numel(), HIDDEN, generator=gen)
    logits = torch.randn(picked.numel(), VOCAB, generator=gen)
    expected = reference_head(logits, x, pool, slots, picked)
    got = head_lora(logits.clone(), x, Stacks(pool.a_rows, pool.bt_rows), meta, index)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
    grouped = head_lora(logits.clone(), x, Stacks(pool.a_rows, pool.bt_rows), meta, index, per_token=True)
    torch.testing.assert_close(grouped, expected, **TOLERANCE[torch.float32])


def test_a_kernel_reading_a_stale_row_fails_the_reference() -> None:
    """The reference can fail: reading every granule's full rows (past each adapter's rank) is far off."""
    gen = torch.Generator().manual_seed(5)
    pool = make_rows(NUM_SLOTS, RANK, GRANULE, VOCAB, HIDDEN, gen)
    short = next(slot for slot, r in pool.slot_rows.items() if r < GRANULE)
    slots = torch.full((4,), short, dtype=torch.int32)
    tokens, h = torch.randint(0, VOCAB, (4,), generator=gen), torch.zeros(4, HIDDEN)
    full = {slot: GRANULE for slot in pool.slot_rows}
    wrong = reference_embed(h, tokens, type(pool)(pool.a_rows, pool.bt_rows, full, pool.slot_ids, NUM_SLOTS, RANK,
                                                  GRANULE), slots)  # fmt: skip
    assert (wrong - reference_embed(h, tokens, pool, slots)).abs().max() > 1.0


@pytest.mark.parametrize("form", ["torch_table", "cpu_auto"])
@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "groups"])
def test_slots_without_rows_in_the_module_are_skipped(form, gathered, monkeypatch) -> None:
    """The pool's ``held`` names the slots whose adapter has rows in the module; the eager groups read no others
    (their rows are zero there: skipping them changes nothing but the work)."""
    if not gathered:
        monkeypatch.setattr(vocab, "GATHER_MAX", 0)
    gen = torch.Generator().manual_seed(11)
    pool = make_rows(NUM_SLOTS, RANK, GRANULE, VOCAB, HIDDEN, gen)
    slots = pool.slots("uniform", 13, gen)
    meta = pool.meta(BACKENDS[form](), 16)
    meta.prepare(slots, pool.slot_rows)
    tokens, h = torch.randint(0, VOCAB, (13,), generator=gen), torch.randn(13, HIDDEN, generator=gen)
    held = set(sorted(pool.slot_rows)[::2])
    stacks = Stacks(pool.a_rows, pool.bt_rows)
    stacks.held = held
    kept = torch.tensor([s if s in held else -1 for s in slots.tolist()], dtype=torch.int32)
    got = embed_lora(h.clone(), tokens, stacks, meta)
    torch.testing.assert_close(got, reference_embed(h, tokens, pool, kept), **TOLERANCE[torch.float32])
    assert set(slots.tolist()) - held - {-1}  # some token's slot was skipped
