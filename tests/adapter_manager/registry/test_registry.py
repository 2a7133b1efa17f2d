"""The registry on local directories: the malformed corpus, idempotency, updates, eviction and re-preparation."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch

from adapter_manager import (
    AdapterConflictError,
    AdapterNotFoundError,
    AdapterRegistry,
    BaseModelSpec,
    InvalidAdapterRefError,
    Move,
    RegistryConfig,
    RowOptions,
    TensorKeyError,
    write_synthetic_adapter,
)
from adapter_manager.sources.peft_format import CONFIG_NAME
from tests.adapter_manager._malformed import CASES
from tests.conftest import TINY, TINY_NAME


@pytest.fixture
def good(tmp_path, tiny_spec):
    return write_synthetic_adapter(tmp_path / "good", tiny_spec, r=4, target_modules=["q_proj", "v_proj"], seed=1)


def registry_for(spec, **overrides) -> AdapterRegistry:
    overrides.setdefault("rows", RowOptions(max_rank=8))
    return AdapterRegistry(spec, RegistryConfig(**overrides))


def test_corpus_is_large_enough():
    assert len(CASES) >= 25
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_malformed_local_adapter_is_refused_and_leaves_nothing(case, good, tiny_spec):
    case.mutate(good)
    before = sorted((p.name, p.stat().st_size) for p in good.iterdir())
    registry = registry_for(tiny_spec, **case.registry)
    with pytest.raises(case.error) as info:
        registry.register(f"{good}", adapter_id="bad")
    assert type(info.value) is case.error
    assert info.value.adapter == "bad" and "bad" in str(info.value)
    assert len(registry) == 0 and registry.list() == []
    assert registry.host.used_bytes == 0 and registry.host.keys() == set()
    assert sorted((p.name, p.stat().st_size) for p in good.iterdir()) == before


def test_valid_adapter_registers_with_timings(good, tiny_spec):
    registry = registry_for(tiny_spec)
    result = registry.register(str(good))
    assert result.action == "registered" and result.record.adapter_id == "good"
    assert result.record.rank == 4 and len(result.record.modules) == 2 * tiny_spec.num_layers
    assert result.record.sha.startswith("local-") and result.downloaded_bytes == 0
    assert result.prepare_s > 0
    snapshot = registry.metrics.snapshot()
    assert snapshot.moves[Move.DISK_TO_HOST].count == 1
    assert snapshot.moves[Move.DISK_TO_HOST].total_bytes == result.record.nbytes
    assert Move.HUB_TO_DISK not in snapshot.moves
    assert registry.host.used_bytes == result.record.nbytes


def test_register_is_idempotent_and_conflicts_are_refused(good, tmp_path, tiny_spec):
    registry = registry_for(tiny_spec)
    first = registry.register(str(good), adapter_id="a")
    again = registry.register(str(good), adapter_id="a")
    assert again.action == "unchanged" and again.record == first.record and again.prepare_s == 0
    other = write_synthetic_adapter(tmp_path / "other", tiny_spec, r=2, seed=2)
    with pytest.raises(AdapterConflictError):
        registry.register(str(other), adapter_id="a")
    assert registry.get("a") == first.record


def test_refresh_picks_up_changed_files_and_a_failed_update_keeps_the_old(good, tiny_spec):
    registry = registry_for(tiny_spec)
    first = registry.register(str(good), adapter_id="a")
    old_a = registry.prepared("a").modules[next(iter(first.record.modules))].a.clone()
    write_synthetic_adapter(good, tiny_spec, r=8, target_modules=["q_proj", "v_proj"], seed=5)
    updated = registry.register(str(good), adapter_id="a", refresh=True)
    assert updated.action == "updated" and updated.previous_sha == first.record.sha
    assert updated.record.rank == 8 and registry.host.keys() == {("a", updated.record.digest)}
    assert not torch.equal(registry.prepared("a").modules[next(iter(first.record.modules))].a[:4], old_a[:4])
    raw = json.loads((good / CONFIG_NAME).read_text())
    (good / CONFIG_NAME).write_text(json.dumps({**raw, "use_dora": True}))  # a DoRA config, no magnitudes
    with pytest.raises(TensorKeyError, match="missing lora_magnitude_vector"):
        registry.register(str(good), adapter_id="a", refresh=True)
    assert registry.get("a") == updated.record
    assert registry.prepared("a").sha == updated.record.sha


def test_unregister(good, tiny_spec):
    registry = registry_for(tiny_spec)
    registry.register(str(good), adapter_id="a")
    record = registry.unregister("a")
    assert record.adapter_id == "a" and "a" not in registry and registry.host.used_bytes == 0
    with pytest.raises(AdapterNotFoundError):
        registry.unregister("a")
    with pytest.raises(AdapterNotFoundError):
        registry.prepared("a")


def test_evicted_adapter_is_prepared_again_from_disk(tmp_path, tiny_spec):
    folders = [write_synthetic_adapter(tmp_path / f"a{i}", tiny_spec, r=8, seed=i) for i in range(4)]
    one = tiny_spec.max_adapter_bytes(8, 4)
    registry = registry_for(tiny_spec, host_cache_bytes=2 * one)
    for i, folder in enumerate(folders):
        registry.register(str(folder), adapter_id=f"a{i}")
        assert registry.host.used_bytes <= 2 * one
    assert len(registry) == 4 and {k[0] for k in registry.host.keys()} == {"a2", "a3"}
    assert registry.metrics.snapshot().evictions["host"] == 2
    prepared = registry.prepared("a0")
    assert prepared.adapter_id == "a0" and {k[0] for k in registry.host.keys()} == {"a3", "a0"}
    assert registry.metrics.snapshot().moves[Move.DISK_TO_HOST].count == 5


def test_host_cache_smaller_than_one_adapter_is_a_config_error(tiny_spec):
    with pytest.raises(ValueError, match="smaller than one adapter"):
        registry_for(tiny_spec, host_cache_bytes=1000)


@pytest.mark.parametrize(
    "ref", ["", "org/../x", "org/na me", "org/name@../../etc", "org/name@", "a/b/c", "org/name@-x", "org--x/y"]
)
def test_bad_refs_are_refused(ref, tiny_spec):
    registry = registry_for(tiny_spec)
    with pytest.raises(InvalidAdapterRefError):
        registry.register(ref)
    assert len(registry) == 0


def test_local_path_outside_allowed_roots_is_refused(good, tmp_path, tiny_spec):
    inside = tmp_path / "root"
    shutil.copytree(good, inside / "x")
    registry = registry_for(tiny_spec, allowed_local_roots=(inside,))
    registry.register(str(inside / "x"))
    with pytest.raises(InvalidAdapterRefError, match="outside the allowed roots"):
        registry.register(f"{inside}/x/../../good")
    with pytest.raises(InvalidAdapterRefError):
        registry.register(str(good), adapter_id="../etc")


def test_base_model_mismatch_warns_by_default(good, tiny_spec):
    raw = json.loads((good / CONFIG_NAME).read_text())
    (good / CONFIG_NAME).write_text(json.dumps({**raw, "base_model_name_or_path": "other/model"}))
    result = registry_for(tiny_spec).register(str(good))
    assert result.record.warnings and "other/model" in result.record.warnings[0]


def test_concurrent_registers_of_one_adapter_prepare_it_once(good, tiny_spec):
    registry = registry_for(tiny_spec)
    results, barrier = [], threading.Barrier(6)

    def work():
        barrier.wait()
        results.append(registry.register(str(good), adapter_id="a"))

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.action for r in results) == ["registered"] + ["unchanged"] * 5
    assert registry.metrics.snapshot().moves[Move.DISK_TO_HOST].count == 1


def test_changed_local_files_are_not_served_under_the_old_sha(good, tiny_spec):
    registry = registry_for(tiny_spec, host_cache_bytes=tiny_spec.max_adapter_bytes(8, 4))
    record = registry.register(str(good), adapter_id="a").record
    registry.host.discard(("a", record.digest))
    write_synthetic_adapter(good, tiny_spec, r=8, seed=7)
    with pytest.raises(AdapterConflictError, match="refresh=True"):
        registry.prepared("a")
    assert registry.register(str(good), adapter_id="a", refresh=True).action == "updated"
    assert registry.prepared("a").modules[next(iter(registry.get("a").modules))].rank == 8


def test_adapter_of_a_deeper_model_names_the_layer_it_has_and_the_base_lacks(write_peft_adapter):
    folder, _ = write_peft_adapter()  # PEFT on the 3-layer tiny Llama
    shallow = BaseModelSpec.from_hf_config({**TINY, "num_hidden_layers": 2}, name=TINY_NAME)
    registry = registry_for(shallow)
    with pytest.raises(TensorKeyError) as info:
        registry.register(str(folder), adapter_id="deep")
    message = str(info.value)
    assert "'base_model.model.model.layers.2.self_attn." in message and ".lora_" in message
    assert "layer 2" in message and "the base model has 2 layers" in message and "does not target" not in message
    assert len(registry) == 0


def test_bias_lora_only_without_bias_tensors_serves_as_plain_lora(write_peft_adapter, tiny_spec):
    plain, _ = write_peft_adapter(seed=3)
    lora_only, _ = write_peft_adapter(seed=3, bias="lora_only")  # Llama's projections have no bias: nothing saved
    assert json.loads((lora_only / CONFIG_NAME).read_text())["bias"] == "lora_only"
    registry = registry_for(tiny_spec)
    registry.register(str(plain), adapter_id="plain")
    registry.register(str(lora_only), adapter_id="lora_only")
    assert torch.equal(registry.prepared("lora_only").storage, registry.prepared("plain").storage)
