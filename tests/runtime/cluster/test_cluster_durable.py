"""With a state dir, the cluster's registrations survive a restart of the whole cluster (Ray included): the new
directory loads them and replicas register them again lazily, so the same requests get the same answers; an
operator pin is held again by the new replicas."""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")
httpx = pytest.importorskip("httpx")

from adapter_manager import AdapterManagerConfig, HubConfig, LocalHub, RowOptions, write_synthetic_adapter  # noqa: E402
from adapter_manager.runtime.cluster import ClusterConfig, RayOptions, start_cluster, stop_cluster  # noqa: E402
from adapter_manager.runtime.engine.engine import EngineConfig  # noqa: E402
from adapter_manager.runtime.model.checkpoint import write_random_checkpoint  # noqa: E402
from adapter_manager.runtime.model.config import LlamaConfig  # noqa: E402
from adapter_manager.runtime.server.state import ServerConfig  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(url: str, adapters: list[str]) -> dict[str, str]:
    with httpx.Client(base_url=url, timeout=60) as http:
        models = {m["id"] for m in http.get("/v1/models").json()["data"]}
        assert set(adapters) <= models
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        return {
            a: http.post("/v1/completions", json={**body, "model": a}).json()["choices"][0]["text"] for a in adapters
        }


def test_registrations_survive_a_cluster_restart(tmp_path):
    config = LlamaConfig.tiny()
    write_random_checkpoint(config, tmp_path / "model")
    adapters = ["org/durable-a", "org/durable-b"]
    for i, adapter in enumerate(adapters):
        write_synthetic_adapter(tmp_path / "hub" / adapter, config.to_spec("base"), r=4, lora_alpha=8, seed=i)
    with LocalHub(tmp_path / "hub") as hub:
        cluster = ClusterConfig(
            tmp_path / "model",
            AdapterManagerConfig(
                max_slots=3,
                rows=RowOptions(max_rank=8),
                hub=HubConfig(endpoint=hub.endpoint, cache_dir=tmp_path / "hf"),
            ),
            EngineConfig(max_batch=4, max_seq_len=64),
            ServerConfig(model_name="base", port=0),
            replicas=1,
            replica_cpus=0.5,
            state_dir=tmp_path / "state",
            pinned_slots=1,
        )
        url = start_cluster(cluster, RayOptions(num_cpus=2, port=_free_port()))
        try:
            with httpx.Client(base_url=url, timeout=60) as http:
                for adapter in adapters:
                    assert http.post("/v1/adapters", json={"ref": adapter}).status_code == 201
                assert http.post(f"/v1/adapters/{adapters[1]}/pin").status_code == 200
            before = _answers(url, adapters)
        finally:
            stop_cluster(cluster)  # Serve and Ray too: nothing of the first cluster is left
        url = start_cluster(cluster, RayOptions(num_cpus=2, port=_free_port()))
        try:
            assert _answers(url, adapters) == before
            with httpx.Client(base_url=url, timeout=60) as http:
                assert http.get(f"/v1/adapters/{adapters[1]}").json()["pinned"] is True
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:  # the new replica takes the pin at its next report
                    reports = http.get("/v1/cluster/replicas").json()["data"]
                    if reports and all(r["pinned"] == [adapters[1]] for r in reports):
                        break
                    time.sleep(0.25)
                assert reports and all(r["pinned"] == [adapters[1]] for r in reports), reports
                assert all(r["slots"][adapters[1]]["pinned"] for r in reports)
        finally:
            stop_cluster(cluster)
