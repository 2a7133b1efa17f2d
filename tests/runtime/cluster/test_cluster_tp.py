"""The cluster with tensor parallelism: a local Ray on loopback, one engine replica of the tiny model sharded 2 ways
on CPU (the replica is rank 0 and starts the other shard's process), adapters from the local hub, the `openai` client
against Serve's ingress. Every greedy answer must equal the unsharded single-machine server's, and stopping the
cluster must leave no shard process behind."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")
pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from adapter_manager import (  # noqa: E402
    AdapterManagerConfig,
    HubConfig,
    LocalHub,
    RowOptions,
    TensorParallel,
    write_synthetic_adapter,
)
from adapter_manager.runtime.cluster import ClusterConfig, RayOptions, start_cluster, stop_cluster  # noqa: E402
from adapter_manager.runtime.engine.engine import EngineConfig  # noqa: E402
from adapter_manager.runtime.model.checkpoint import write_random_checkpoint  # noqa: E402
from adapter_manager.runtime.model.config import LlamaConfig  # noqa: E402
from adapter_manager.runtime.server.app import BackgroundServer  # noqa: E402
from adapter_manager.runtime.server.launch import build_serving  # noqa: E402
from adapter_manager.runtime.server.state import ServerConfig  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

NAME = "tiny-base"
ADAPTERS = [f"org/tp-lora-{i}" for i in range(4)]
PROMPTS = [(f"Hello {i}", ADAPTERS[i % len(ADAPTERS)] if i % 5 else NAME) for i in range(12)]  # every fifth: base


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return [
        client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0.0).choices[0].text
        for prompt, model in PROMPTS
    ]


def _spawned() -> set[int]:
    """Processes started by multiprocessing's spawn (the shard workers are), by pid."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"spawn_main" in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def test_a_tensor_parallel_replica_answers_as_the_unsharded_server_and_leaves_no_shard(tmp_path):
    config = LlamaConfig.tiny()
    write_random_checkpoint(config, tmp_path / "model")
    for i, adapter in enumerate(ADAPTERS):
        write_synthetic_adapter(tmp_path / "hub" / adapter, config.to_spec(NAME), r=8, lora_alpha=16, seed=i)
    engine, server = EngineConfig(max_batch=4, max_seq_len=64), ServerConfig(model_name=NAME, port=0)
    with LocalHub(tmp_path / "hub") as hub:
        hub_config = HubConfig(endpoint=hub.endpoint, cache_dir=tmp_path / "hf-cache", retries=0)
        single = build_serving(tmp_path / "model",
                               AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8), hub=hub_config),
                               engine, server)  # fmt: skip
        for adapter in ADAPTERS:
            single.manager.register(adapter)
        with BackgroundServer(single.app) as background:
            expected = _answers(background.url)
        single.close()
        before = _spawned()
        sharded = AdapterManagerConfig(
            max_slots=2, rows=RowOptions(max_rank=8, tensor_parallel=TensorParallel(2)), hub=hub_config
        )
        cluster = ClusterConfig(tmp_path / "model", sharded, engine, server, replicas=1, replica_cpus=0.5)
        url = start_cluster(cluster, RayOptions(num_cpus=2, port=_port(), metrics_export_port=_port()))
        try:
            with httpx.Client(base_url=url, timeout=60) as http:
                for adapter in ADAPTERS:
                    answer = http.post("/v1/adapters", json={"ref": adapter})
                    assert answer.status_code == 201, answer.text
            shards = _spawned() - before
            assert shards, "the replica started no shard process"
            assert _answers(url) == expected
        finally:
            stop_cluster(cluster)
    deadline = time.monotonic() + 60
    while _spawned() & shards and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _spawned() & shards, "a shard process outlived the cluster"
