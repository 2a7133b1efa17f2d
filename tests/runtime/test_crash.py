"""Durable registrations through a crash: the CLI server (a subprocess) takes a burst of concurrent registrations and
unregistrations from real HTTP clients against the local hub, is SIGKILLed in the middle, and restarts on the same
--state-dir with the hub gone. What the clients saw answered is what comes back; serving works at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from adapter_manager import LocalHub, RowOptions, write_synthetic_adapter
from adapter_manager.runtime.model.config import LlamaConfig

httpx = pytest.importorskip("httpx")

THREADS, IDS_PER_THREAD, KILL_AFTER = 8, 3, 24  # answers the clients receive before the kill


def _serve(tmp_path: Path, endpoint: str) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ADAPTER_MANAGER_", "HF_"))}
    env.update(PYTHONUNBUFFERED="1", HF_ENDPOINT=endpoint, HF_HUB_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="0")
    command = [
        sys.executable, "-m", "adapter_manager.runtime.cli", "serve", "--random", "tiny", "--port", "0",
        "--max-rank", "8", "--host-cache-bytes", "16MiB", "--workdir", str(tmp_path),
        "--state-dir", str(tmp_path / "state"), "--disk-cache-bytes", "64MiB",
    ]  # fmt: skip
    log = tmp_path / f"server-{time.monotonic_ns()}.log"  # a file: a full stderr pipe would block the server
    with log.open("w") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    lines = []
    while not lines or " at http://" not in lines[-1]:
        lines.append(proc.stdout.readline())
        if not lines[-1] and proc.poll() is not None:
            raise AssertionError(f"the server exited: {lines} {log.read_text()}")
    return proc, lines[-1].split(" at ", 1)[1].split()[0]


@dataclass
class Client:
    """One client thread's ids (no other thread touches them) and what it saw, in order."""

    ids: list[str]
    answered: list[tuple[str, str, str | None]] = field(default_factory=list)  # (op, id, sha)
    unanswered: list[tuple[str, str]] = field(default_factory=list)  # sent when the server died

    def run(self, url: str, answers: list[int], kill: threading.Event) -> None:
        registered: set[str] = set()
        with httpx.Client(base_url=url, timeout=60) as http:
            for step in range(200):  # register, register, unregister, ... over this client's ids, until the kill
                if (step % 3 == 2 and registered) or len(registered) == len(self.ids):
                    op, adapter_id = "unregister", min(registered)
                else:
                    op = "register"
                    adapter_id = next(a for a in self.ids[step % len(self.ids) :] + self.ids if a not in registered)
                try:
                    if op == "register":
                        answer = http.post("/v1/adapters", json={"ref": f"org/{adapter_id}", "id": adapter_id})
                    else:
                        answer = http.delete(f"/v1/adapters/{adapter_id}")
                except httpx.TransportError:
                    self.unanswered.append((op, adapter_id))
                    return
                assert answer.status_code in (200, 201), answer.text
                (registered.add if op == "register" else registered.discard)(adapter_id)
                self.answered.append((op, adapter_id, answer.json().get("sha")))
                answers.append(1)
                if len(answers) >= KILL_AFTER:
                    kill.set()


def test_registrations_survive_sigkill_in_a_burst(tmp_path):
    spec = LlamaConfig.tiny().to_spec("random-tiny")
    ids = [f"a{i:02d}" for i in range(THREADS * IDS_PER_THREAD)]
    for i, adapter_id in enumerate(ids):
        write_synthetic_adapter(tmp_path / "hub" / "org" / adapter_id, spec, r=2 + i % 3, seed=i)
    clients = [Client(ids[t::THREADS]) for t in range(THREADS)]
    with LocalHub(tmp_path / "hub") as hub:
        proc, url = _serve(tmp_path, hub.endpoint)
        try:
            answers: list[int] = []
            kill = threading.Event()
            threads = [threading.Thread(target=c.run, args=(url, answers, kill)) for c in clients]
            for thread in threads:
                thread.start()
            assert kill.wait(timeout=120), "the burst never reached the kill point"
            proc.send_signal(signal.SIGKILL)
            for thread in threads:
                thread.join(timeout=60)
        finally:
            proc.kill()
            proc.wait(timeout=30)

    started = time.monotonic()
    proc, url = _serve(tmp_path, hub.endpoint)  # the hub is down: restoring must not need it
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            listed = {a["id"]: a for a in http.get("/v1/adapters").json()["data"]}
            present = next(iter(listed), None)
            if present is not None:  # serving works at once, on a restored adapter
                body = {"model": present, "prompt": "hi", "max_tokens": 2}
                assert http.post("/v1/completions", json=body).status_code == 200
        ready_s = time.monotonic() - started
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0

    assert all(a["status"] != "unrestorable" for a in listed.values()), listed  # no half-registered entry
    assert set(listed) <= set(ids)
    answered_registers = answered_unregisters = 0
    for client in clients:
        pending = {adapter_id for _, adapter_id in client.unanswered}
        last: dict[str, tuple[str, str | None]] = {}
        for op, adapter_id, sha in client.answered:
            last[adapter_id] = (op, sha)
            answered_registers += op == "register"
            answered_unregisters += op == "unregister"
        for adapter_id, (op, sha) in last.items():
            if adapter_id in pending:
                continue  # its next call was in flight at the kill: either outcome is right
            if op == "register":
                assert adapter_id in listed and listed[adapter_id]["sha"] == sha, (adapter_id, listed.get(adapter_id))
            else:
                assert adapter_id not in listed, adapter_id
        for adapter_id in set(listed) & set(client.ids):  # present: last answer was a register, or one in flight
            assert adapter_id in pending or last[adapter_id][0] == "register", adapter_id
    assert answered_registers > 0 and answered_unregisters > 0  # the burst had both before the kill
    print(f"restart to first completion: {ready_s:.1f}s, {len(listed)} adapters restored")


def test_an_adapter_that_cannot_be_restored_is_listed_counted_and_removable(tmp_path):
    from adapter_manager import AdapterManagerConfig
    from adapter_manager.runtime.engine.engine import EngineConfig
    from adapter_manager.runtime.model.checkpoint import write_random_checkpoint
    from adapter_manager.runtime.server.app import BackgroundServer
    from adapter_manager.runtime.server.launch import build_serving
    from adapter_manager.runtime.server.state import ServerConfig

    config = LlamaConfig.tiny()
    write_random_checkpoint(config, tmp_path / "model")
    spec = config.to_spec("tiny")
    kept, lost = (write_synthetic_adapter(tmp_path / "local" / n, spec, r=2, seed=i) for i, n in enumerate("kl"))

    def serve() -> tuple:
        serving = build_serving(
            tmp_path / "model",
            AdapterManagerConfig(
                max_slots=2, rows=RowOptions(max_rank=8), host_cache_bytes=1 << 24, state_dir=tmp_path / "state"
            ),
            EngineConfig(max_batch=4, max_seq_len=64),
            ServerConfig(model_name="tiny", port=0, local_roots=(tmp_path / "local",)),
        )
        return serving, BackgroundServer(serving.app).start()

    serving, background = serve()
    with httpx.Client(base_url=background.url, timeout=60) as http:
        for folder in (kept, lost):
            assert http.post("/v1/adapters", json={"ref": str(folder), "id": folder.name}).status_code == 201
        assert http.post("/v1/adapters/k/pin").status_code == 200
    background.stop()
    serving.close()
    for file in lost.iterdir():
        file.unlink()

    serving, background = serve()
    try:
        with httpx.Client(base_url=background.url, timeout=60) as http:
            listed = {a["id"]: a for a in http.get("/v1/adapters").json()["data"]}
            assert listed["k"]["status"] == "ready" and listed["k"]["pinned"]  # restored, pin re-applied
            assert (
                listed["l"]["status"] == "unrestorable" and "has no adapter_model.safetensors" in listed["l"]["error"]
            )
            assert http.get("/v1/adapters/l").json()["status"] == "unrestorable"
            metrics = http.get("/metrics").text
            assert "adapter_manager_adapters_unrestorable 1.0" in metrics
            assert "adapter_manager_restore_failures_total 1.0" in metrics
            assert "adapter_manager_restored_adapters_total 1.0" in metrics
            assert http.get("/v1/metrics/swaps").json()["restore"] == {"restored": 1, "failed": 1}
            body = {"model": "k", "prompt": "hi", "max_tokens": 2}
            assert http.post("/v1/completions", json=body).status_code == 200
            assert http.post("/v1/completions", json={**body, "model": "l"}).status_code == 404
            assert http.delete("/v1/adapters/l").status_code == 200
            assert [a["id"] for a in http.get("/v1/adapters").json()["data"]] == ["k"]
    finally:
        background.stop()
        serving.close()
