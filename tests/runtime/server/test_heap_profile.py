"""The heap profile of a serving process (`heap_profile`): off unless the environment names a folder; on, one call
answers RSS by kind, malloc's arenas, tracemalloc's totals, torch's CPU storages, and dumps a loadable snapshot."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from adapter_manager.runtime.server.heap_profile import ENV, FRAMES_ENV, HeapProfiler, heap_router, malloc_stats
from adapter_manager.runtime.server.http_errors import APIError, install_handlers


def test_off_unless_the_environment_names_a_folder(tmp_path: Path) -> None:
    assert HeapProfiler.from_env({}) is None
    assert HeapProfiler.from_env({ENV: ""}) is None
    profiler = HeapProfiler.from_env({ENV: str(tmp_path), FRAMES_ENV: "3"})
    assert profiler == HeapProfiler(tmp_path, 3)
    with pytest.raises(ValueError, match="number of frames"):
        HeapProfiler.from_env({ENV: str(tmp_path), FRAMES_ENV: "many"})
    with pytest.raises(ValueError, match=r"\[1, 100\]"):
        HeapProfiler(tmp_path, 0)


@pytest.fixture
def profiler(tmp_path: Path):
    was_tracing = tracemalloc.is_tracing()
    profiler = HeapProfiler(tmp_path / "heap")
    profiler.start()
    yield profiler
    if not was_tracing:
        tracemalloc.stop()


def test_a_snapshot_tells_python_torch_and_the_c_heap_apart(profiler: HeapProfiler) -> None:
    kept = torch.ones(1 << 18)  # 1 MiB of storage
    shot = profiler.snapshot("one", trim=True)
    assert shot["proc"]["rss"] >= shot["proc"]["anon"] > 0
    assert shot["torch"][str(kept.device)]["bytes"] >= kept.untyped_storage().nbytes()
    assert shot["tracemalloc"]["tracing"] and shot["tracemalloc"]["traced_bytes"] > 0
    assert "builtins.dict" in shot["objects"]  # live objects by type, the most numerous
    assert shot["trimmed"]["rss_after"] > 0
    loaded = tracemalloc.Snapshot.load(shot["tracemalloc"]["snapshot"])
    assert Path(shot["tracemalloc"]["snapshot"]) == profiler.folder / "one.tracemalloc" and loaded.traces
    if malloc_stats()["available"]:  # glibc
        arenas = shot["malloc"]["arenas"]
        assert arenas["count"] >= 1 and arenas["system"] >= arenas["free"] >= 0
        assert shot["malloc"]["uordblks"] > 0


def test_the_route_validates_its_label_and_needs_the_admin_token(profiler: HeapProfiler) -> None:
    def check_admin(authorization: str | None) -> None:
        if authorization != "Bearer secret-token":
            raise APIError(401, "admin token required", None, "unauthorized")

    app = FastAPI()
    install_handlers(app)
    app.include_router(heap_router(profiler, check_admin))
    client = TestClient(app)
    assert client.post("/debug/heap", params={"label": "warm"}).status_code == 401
    headers = {"Authorization": "Bearer secret-token"}
    reply = client.post("/debug/heap", params={"label": "../etc", "traces": "false"}, headers=headers)
    assert reply.status_code == 400 and "label" in reply.json()["error"]["message"]
    reply = client.post("/debug/heap", params={"label": "warm", "traces": "false"}, headers=headers)
    assert reply.status_code == 200 and reply.json()["label"] == "warm"
    assert not (profiler.folder / "warm.tracemalloc").exists()  # traces=false: figures only
