"""The full hub path: local hub on loopback + real huggingface_hub downloads + register; faults and offline mode."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from adapter_manager import (
    AdapterAccessError,
    AdapterNotFoundError,
    AdapterRegistry,
    AdapterRevisionNotFoundError,
    HubConfig,
    HubUnavailableError,
    Move,
    PickleRefusedError,
    RegistryConfig,
    RowOptions,
    write_synthetic_adapter,
)
from adapter_manager.sources.local_hub import HubFault, LocalHub
from adapter_manager.sources.peft_format import CONFIG_NAME, WEIGHTS_NAME
from tests.adapter_manager._malformed import CASES


@pytest.fixture
def hub_root(tmp_path, tiny_spec) -> Path:
    root = tmp_path / "hub"
    write_synthetic_adapter(root / "org" / "good", tiny_spec, r=4, target_modules=["q_proj", "v_proj"], seed=1)
    write_synthetic_adapter(root / "org" / "good" / ".revisions" / "v1", tiny_spec, r=2, seed=2)
    return root


@pytest.fixture
def hub(hub_root, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    with LocalHub(hub_root) as running:
        yield running


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """Retry back-off sleeps (ours and huggingface_hub's), recorded instead of slept."""
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    return slept


def make_registry(spec, hub: LocalHub, cache: Path, **overrides) -> AdapterRegistry:
    hub_config = HubConfig(endpoint=hub.endpoint, cache_dir=cache, retries=2, backoff_s=0.01, timeout_s=2)
    return AdapterRegistry(spec, RegistryConfig(hub=hub_config, **{"rows": RowOptions(max_rank=8), **overrides}))


def cache_leftovers(cache: Path) -> list[str]:
    """What a failed download must not leave: weights in the cache, or partial downloads."""
    return [str(p) for p in cache.rglob("*") if p.name == WEIGHTS_NAME or p.name.endswith(".incomplete")]


HEAD_GET = ("HEAD", "GET")


def downloads(hub: LocalHub) -> int:
    return sum(1 for r in hub.requests if r.method == "GET" and "/resolve/" in r.path)


def test_register_by_hub_id_records_sha_and_timings(hub, tmp_path, tiny_spec):
    registry = make_registry(tiny_spec, hub, tmp_path / "cache")
    result = registry.register("org/good")
    record = result.record
    assert result.action == "registered" and record.adapter_id == "org/good" and record.rank == 4
    assert len(record.sha) == 40 and record.files.weights_path.parent.name == record.sha
    assert record.files.weights_path.is_relative_to(tmp_path / "cache")
    assert result.downloaded_bytes == (hub.root / "org/good" / WEIGHTS_NAME).stat().st_size + len(
        (hub.root / "org/good/adapter_config.json").read_bytes()
    )
    moves = registry.metrics.snapshot().moves
    assert moves[Move.HUB_TO_DISK].count == 1 and moves[Move.HUB_TO_DISK].total_bytes == result.downloaded_bytes
    assert moves[Move.DISK_TO_HOST].count == 1
    assert downloads(hub) == 2


def test_revision_pinning_update_and_idempotency(hub, tmp_path, tiny_spec):
    registry = make_registry(tiny_spec, hub, tmp_path / "cache")
    v1 = registry.register("org/good@v1")
    assert v1.record.rank == 2 and v1.record.adapter_id == "org/good"
    n = len(hub.requests)
    assert registry.register("org/good@v1").action == "unchanged" and len(hub.requests) == n
    main = registry.register("org/good")
    assert main.action == "updated" and main.previous_sha == v1.record.sha and main.record.rank == 4
    by_sha = registry.register(f"org/good@{v1.record.sha}")
    assert by_sha.action == "updated" and by_sha.record.sha == v1.record.sha and by_sha.record.rank == 2
    assert registry.host.keys() == {("org/good", v1.record.digest)}


def test_refresh_follows_a_moved_branch(hub, hub_root, tmp_path, tiny_spec):
    registry = make_registry(tiny_spec, hub, tmp_path / "cache")
    first = registry.register("org/good")
    write_synthetic_adapter(hub_root / "org" / "good", tiny_spec, r=8, target_modules=["q_proj", "v_proj"], seed=9)
    assert registry.register("org/good").action == "unchanged"
    moved = registry.register("org/good", refresh=True)
    assert moved.action == "updated" and moved.previous_sha == first.record.sha and moved.record.rank == 8


def test_evicted_adapter_is_prepared_again_without_a_download(hub, tmp_path, tiny_spec):
    write_synthetic_adapter(hub.root / "org" / "other", tiny_spec, r=8, seed=3)
    one = tiny_spec.max_adapter_bytes(8, 4)
    registry = make_registry(tiny_spec, hub, tmp_path / "cache", host_cache_bytes=one)
    registry.register("org/good")
    registry.register("org/other")
    assert {k[0] for k in registry.host.keys()} == {"org/other"}
    before = len(hub.requests)
    assert registry.prepared("org/good").adapter_id == "org/good"
    assert len(hub.requests) == before


def test_prepare_fetches_again_pinned_to_the_sha_when_files_left_the_cache(hub, tmp_path, tiny_spec):
    registry = make_registry(tiny_spec, hub, tmp_path / "cache", host_cache_bytes=tiny_spec.max_adapter_bytes(8, 4))
    record = registry.register("org/good").record
    registry.host.discard(("org/good", record.digest))
    shutil.rmtree(tmp_path / "cache")
    hub.clear_requests()
    assert registry.prepared("org/good").sha == record.sha
    assert any(record.sha in r.path for r in hub.requests) and downloads(hub) == 2


def test_offline_from_warm_cache_in_a_fresh_process(hub, tmp_path, tiny_spec):
    cache = tmp_path / "cache"
    make_registry(tiny_spec, hub, cache).register("org/good@v1")
    hub.clear_requests()
    script = f"""
import json
from adapter_manager import AdapterRegistry, BaseModelSpec, RegistryConfig, HubUnavailableError, RowOptions
spec = BaseModelSpec.from_hf_config({
        json.dumps(
            dict(
                hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2
            )
        )
    }, name="test-org/tiny-llama")
registry = AdapterRegistry(spec, RegistryConfig(rows=RowOptions(max_rank=8)))
record = registry.register("org/good@v1").record
try:
    registry.register("org/good@main", adapter_id="main")
    cold = "registered"
except HubUnavailableError as err:
    cold = type(err).__name__
print(json.dumps({{"sha": record.sha, "rank": record.rank, "path": str(record.files.weights_path), "cold": cold}}))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": hub.endpoint}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["rank"] == 2 and out["path"].startswith(str(cache)) and out["cold"] == "HubUnavailableError"
    assert hub.requests == []


def test_offline_config_refuses_a_cold_cache(hub, tmp_path, tiny_spec):
    registry = make_registry(tiny_spec, hub, tmp_path / "cache")
    registry.config.hub.offline = True
    with pytest.raises(HubUnavailableError, match="offline"):
        registry.register("org/good")
    assert hub.requests == [] and len(registry) == 0


@pytest.mark.parametrize("case", CASES[:: max(1, len(CASES) // 14)], ids=lambda c: c.name)
def test_malformed_adapter_on_the_hub_is_refused(case, hub, hub_root, tmp_path, tiny_spec, sleeps):
    folder = hub_root / "bad" / "adapter"
    shutil.copytree(hub_root / "org" / "good", folder, ignore=shutil.ignore_patterns(".revisions"))
    case.mutate(folder)
    registry = make_registry(tiny_spec, hub, tmp_path / "cache", **case.registry)
    with pytest.raises(case.error) as info:
        registry.register("bad/adapter")
    assert type(info.value) is case.error
    assert len(registry) == 0 and registry.host.used_bytes == 0
    assert not list((tmp_path / "cache").rglob("*.incomplete"))


def test_pickle_only_repo_is_refused_without_downloading_the_pickle(hub, hub_root, tmp_path, tiny_spec):
    folder = hub_root / "bad" / "pickle"
    shutil.copytree(hub_root / "org" / "good", folder, ignore=shutil.ignore_patterns(".revisions"))
    (folder / WEIGHTS_NAME).rename(folder / "adapter_model.bin")
    registry = make_registry(tiny_spec, hub, tmp_path / "cache")
    with pytest.raises(PickleRefusedError, match="adapter_model.bin"):
        registry.register("bad/pickle")
    assert not any(r.path.endswith(".bin") and r.method == "GET" for r in hub.requests)


FAULTS = [
    ("repo_404", HubFault("/api/models/*", status=404, error_code="RepoNotFound"), AdapterNotFoundError),
    ("repo_401", HubFault("/api/models/*", status=401), AdapterAccessError),
    ("file_403", HubFault("*/resolve/*", status=403), AdapterAccessError),
    ("api_500_forever", HubFault("/api/models/*", status=500), HubUnavailableError),
    ("file_503_forever", HubFault("*/resolve/*", status=503), HubUnavailableError),
    ("truncated_forever", HubFault(f"*/{WEIGHTS_NAME}", truncate_at=100), HubUnavailableError),
]


@pytest.mark.parametrize("name,fault,error", FAULTS, ids=[f[0] for f in FAULTS])
def test_hub_faults_give_typed_errors_and_leave_nothing(name, fault, error, hub, tmp_path, tiny_spec, sleeps):
    hub.add_fault(fault)
    cache = tmp_path / "cache"
    registry = make_registry(tiny_spec, hub, cache)
    with pytest.raises(error) as info:
        registry.register("org/good")
    assert type(info.value) is error and info.value.adapter == "org/good"
    assert len(registry) == 0 and registry.host.used_bytes == 0
    assert cache_leftovers(cache) == []
    hub.clear_faults()
    assert registry.register("org/good").action == "registered"


def test_unknown_repo_and_revision(hub, tmp_path, tiny_spec):
    registry = make_registry(tiny_spec, hub, tmp_path / "cache")
    with pytest.raises(AdapterNotFoundError) as info:
        registry.register("org/missing")
    assert type(info.value) is AdapterNotFoundError
    with pytest.raises(AdapterRevisionNotFoundError):
        registry.register("org/good@v9")


TRANSIENT = [
    ("api_503_twice", HubFault("/api/models/*", status=503, times=2)),
    ("file_500_once", HubFault("*/resolve/*", status=500, times=1)),
    ("truncated_once", HubFault(f"*/{WEIGHTS_NAME}", truncate_at=100, times=1)),
    ("head_past_timeout_once", HubFault("*/resolve/*", method="HEAD", delay_s=1.0, times=1)),
]


@pytest.mark.parametrize("name,fault", TRANSIENT, ids=[t[0] for t in TRANSIENT])
def test_transient_faults_are_retried_to_success(name, fault, hub, tmp_path, tiny_spec, sleeps):
    hub.add_fault(fault)
    registry = make_registry(tiny_spec, hub, tmp_path / "cache")
    registry.config.hub.timeout_s = 0.2
    assert registry.register("org/good").action == "registered"
    assert hub.faults == []


def test_the_revision_lookup_times_out_and_is_retried(hub, tmp_path, tiny_spec, sleeps):
    """The sha lookup is asked with the resolver's timeout (huggingface_hub's resolve_revision has none): a hub that
    holds every lookup for a minute gets each try timed out and retried, then a typed error, instead of the caller
    waiting it out; once the hub answers again, the same registry registers."""
    stall = hub.add_fault(HubFault("/api/models/*", delay_s=60.0))
    registry = make_registry(tiny_spec, hub, tmp_path / "cache")
    registry.config.hub.timeout_s = 0.2
    with pytest.raises(HubUnavailableError, match="after 3 attempts"):
        registry.register("org/good")
    assert stall in hub.faults
    hub.clear_faults()
    assert registry.register("org/good").action == "registered"


def requests_of(hub: LocalHub) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in hub.requests]


def test_a_registration_asks_only_for_the_sha_and_the_two_files(hub, tmp_path, tiny_spec):
    """Counts, never times: one revision lookup, then a HEAD and a GET of each file pinned to its sha; nothing more
    for files already cached, no lookup for a ref pinned to a sha."""
    sha = make_registry(tiny_spec, hub, tmp_path / "cache").register("org/good").record.sha
    files = [(method, f"/org/good/resolve/{sha}/{name}") for name in (CONFIG_NAME, WEIGHTS_NAME) for method in HEAD_GET]
    assert len(hub.requests) == 5 and requests_of(hub) == [("GET", "/api/models/org/good"), *files]
    hub.clear_requests()
    assert make_registry(tiny_spec, hub, tmp_path / "cache").register("org/good").record.sha == sha
    assert len(hub.requests) == 1 and requests_of(hub) == [("GET", "/api/models/org/good")]
    hub.clear_requests()
    assert make_registry(tiny_spec, hub, tmp_path / "cold").register(f"org/good@{sha}").record.sha == sha
    assert len(hub.requests) == 4 and requests_of(hub) == files


def test_a_registration_sends_nothing_to_any_host_but_the_configured_endpoint(hub, tmp_path, tiny_spec):
    """huggingface_hub fetches ``{HF_ENDPOINT}/api/agent-harnesses`` (huggingface.co by default) for its user agent
    unless telemetry is off: a resolver with its own endpoint must not, so HF_ENDPOINT here is a second local hub
    that must see no request. A fresh process, so huggingface_hub reads its constants and caches nothing before."""
    (tmp_path / "elsewhere").mkdir()
    with LocalHub(tmp_path / "elsewhere") as elsewhere:
        script = (
            "from adapter_manager import *\n"
            f"spec = {tiny_spec!r}\n"
            f"hub = HubConfig(endpoint={hub.endpoint!r}, cache_dir={str(tmp_path / 'cache')!r})\n"
            "AdapterRegistry(spec, RegistryConfig(hub=hub, rows=RowOptions(max_rank=8))).register('org/good')\n"
        )
        env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
        env |= {"HF_ENDPOINT": elsewhere.endpoint, "HF_HOME": str(tmp_path / "home"), "PYTHONPATH": os.getcwd()}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert downloads(hub) == 2 and elsewhere.requests == []
