"""The engine serving embedding / lm_head LoRA and trainable tokens beside plain LoRA and the base model, more
adapters than slots, untied and tied, against `PeftModel` generate with each adapter alone."""

from __future__ import annotations

import prometheus_client
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions, UnsupportedAdapterError
from adapter_manager.prometheus import AdapterManagerCollector
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.model import load_model
from tests.runtime._oracle import hf_greedy
from tests.runtime._vocab import TIED_ROWS, UNTIED_ROWS

NEW_TOKENS = 6
BASES = {False: (None, UNTIED_ROWS), True: ("tied", TIED_ROWS)}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_vocab_adapters_through_two_slots_match_peft(written_vocab, make_engine, tied):
    """Every adapter of the base through two slots, each request twice; the trainable tokens' rows are made on first
    use from the engine's model (registered before it existed); the metrics and the records name what each does."""
    base, rows = BASES[tied]
    names = tuple(sorted({name for _, name in rows if name is not None}))
    model = load_model(written_vocab[base][0], dtype=torch.float32)
    engine, manager = make_engine(adapters=names, source={**written_vocab, None: written_vocab[base]}, model=model,
                                  rows=RowOptions(max_rank=8, lora_vocab=True))  # fmt: skip
    assert manager.lora_vocab and set(model.vocab_lora) == {"embed_tokens", "lm_head"}
    requests = rows * 2
    handles = [engine.submit(p, a, SamplingParams(max_tokens=NEW_TOKENS)) for p, a in requests]
    engine.run_until_idle(max_steps=500)
    for handle, (prompt, name) in zip(handles, requests, strict=True):
        hf = written_vocab[name][1] if name is not None else written_vocab[base][1]
        assert handle.result(timeout=0) == hf_greedy(hf, prompt, NEW_TOKENS), (prompt, name)
    snapshot = manager.metrics()
    assert snapshot.moves["host_to_slot"].count >= len(names) and snapshot.evictions["slot"] > 0
    registry = prometheus_client.CollectorRegistry()
    registry.register(AdapterManagerCollector(manager))
    families = {f.name: f for f in text_string_to_metric_families(prometheus_client.generate_latest(registry).decode())}
    gauge = families["adapter_manager_adapters_by_vocab_module"].samples
    counted = {(s.labels["module"], s.labels["kind"]): s.value for s in gauge}
    expected = {(m, k): 0 for m in ("embed_tokens", "lm_head") for k in ("lora", "tokens")}
    for name in names:
        for module, kind in manager.record(name).vocab.items():
            expected[module, kind] += 1
    assert counted == expected and sum(counted.values()) >= 3
    if tied:
        assert manager.record("tied_tokens").vocab == {"embed_tokens": "tokens", "lm_head": "tokens"}
        assert manager.record("tied_apart").vocab == {"embed_tokens": "tokens", "lm_head": "tokens"}
    else:
        assert manager.record("embed_head").vocab == {"embed_tokens": "lora", "lm_head": "lora"}
        assert manager.record("tokens").vocab == {"embed_tokens": "tokens"}
    manager.close()


def test_a_pool_without_vocab_columns_refuses_by_name(written_vocab, tiny_spec):
    manager = AdapterManager(tiny_spec, AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8)))
    for name, what in (("tokens", "embed_tokens trainable tokens"), ("embed_head", "embed_tokens LoRA and lm_head")):
        with pytest.raises(UnsupportedAdapterError, match=f"'{name}'.*{what}.*--lora-vocab"):
            manager.register(str(written_vocab[name][0]), adapter_id=name)
    manager.register(str(written_vocab["plain"][0]), adapter_id="plain")
    assert not manager.lora_vocab and [r.adapter_id for r in manager.records()] == ["plain"]
    manager.close()


def test_trainable_tokens_without_a_model_fail_their_first_use_by_name(written_vocab, tiny_spec):
    manager = AdapterManager(tiny_spec, AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8, lora_vocab=True)))
    manager.register(str(written_vocab["tokens"][0]), adapter_id="tokens")
    with pytest.raises(UnsupportedAdapterError, match="'tokens'.*trainable tokens.*attach_base_weights"):
        manager.acquire(["tokens"])
    manager.register(str(written_vocab["embed_head"][0]), adapter_id="embed_head")  # LoRA: no base weights needed
    manager.release(manager.acquire(["embed_head"]))
    manager.close()


def test_a_saved_table_that_is_not_the_models_is_refused(written_vocab, make_engine, tmp_path):
    """PEFT loads the frozen table saved beside an embedding LoRA over the model's: one that differs (another model,
    a resized vocabulary) is refused by name at its first use, and the engine serves the others."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "other-table"
    shutil.copytree(written_vocab["embed_head"][0], folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.base_layer.weight"] += 1.0
    save_file(tensors, folder / "adapter_model.safetensors")
    engine, manager = make_engine(
        adapters=("plain",), source=written_vocab, rows=RowOptions(max_rank=8, lora_vocab=True)
    )
    with pytest.raises(UnsupportedAdapterError, match="'other'.*embed_tokens.base_layer.weight.*not the served"):
        manager.register(str(folder), adapter_id="other")
    assert [r.adapter_id for r in manager.records()] == ["plain"]
    handle = engine.submit([1, 2, 3], "plain", SamplingParams(max_tokens=2))
    engine.run_until_idle(max_steps=50)
    assert len(handle.result(timeout=0)) == 2
    manager.close()
