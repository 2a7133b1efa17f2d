"""Through the HTTP admin API: a refresh of a folder rewritten with other weights of the same size and mtime answers
`updated` and serves the new weights with the prefix cache on, and requests sent after vLLM's unload + load (or an
in-place load) of an adapter that had requests waiting all succeed."""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from adapter_manager import AdapterManagerConfig, RowOptions, write_synthetic_adapter
from adapter_manager.runtime.engine.engine import EngineConfig
from adapter_manager.runtime.server.state import ServerConfig
from tests._rewrite import keeping_size_and_mtime
from tests.runtime.server.conftest import CONFIG, NAME, serving_on

httpx = pytest.importorskip("httpx")

TOKEN = "identity-admin-token"
PROMPT = [5, 17, 3, 9, 60, 2, 41, 7, 8, 13, 22, 31, 4, 11]  # 3 full blocks of 4 and two more tokens


@pytest.fixture(scope="module")
def local(checkpoint_root):
    root = checkpoint_root / "identity"
    spec = CONFIG.to_spec(NAME)
    for i in range(2):
        write_synthetic_adapter(root / f"ad{i}", spec, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=i)
    return root


@pytest.fixture(scope="module")
def server(checkpoint_root, local):
    with serving_on(
        checkpoint_root / "model",
        AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8)),
        EngineConfig(max_batch=1, max_seq_len=96, kv_block_size=4),  # one seat: other requests wait behind it
        ServerConfig(model_name=NAME, port=0, admin_token=TOKEN, max_pending=64, local_roots=(local,)),
    ) as (serving, background):
        yield serving, background


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server[1].url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as client:
        yield client


def _complete(http, model: str, max_tokens: int = 5) -> tuple[list[str], list[float]]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "logprobs": 1, "temperature": 0}
    answer = http.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    logprobs = answer.json()["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"]


def test_a_refresh_of_a_rewritten_folder_serves_the_new_weights_with_the_prefix_cache_on(server, http, local):
    folder = shutil.copytree(local / "ad0", local / "tenant")
    assert http.post("/v1/adapters", json={"ref": str(folder), "id": "tenant"}).status_code == 201
    digest = http.get("/v1/adapters/tenant").json()["digest"]
    old = _complete(http, "tenant")
    again = _complete(http, "tenant")  # now from its cached prefix blocks
    assert again[0] == old[0] and again[1] == pytest.approx(old[1], abs=1e-5)

    weights = folder / "adapter_model.safetensors"
    with keeping_size_and_mtime(weights):
        spec = CONFIG.to_spec(NAME)
        write_synthetic_adapter(folder, spec, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=42)
    refreshed = http.post("/v1/adapters", json={"ref": str(folder), "id": "tenant", "refresh": True})
    assert refreshed.status_code == 200 and refreshed.json()["action"] == "updated"
    assert refreshed.json()["digest"] != digest
    new = _complete(http, "tenant")

    fresh = shutil.copytree(folder, local / "fresh")  # the rewritten weights under a name never served before
    assert http.post("/v1/adapters", json={"ref": str(fresh), "id": "fresh"}).status_code == 201
    oracle = _complete(http, "fresh")
    assert new[0] == oracle[0] and new[1] == pytest.approx(oracle[1], abs=1e-5)
    assert new[1] != pytest.approx(old[1], abs=1e-5)


def test_requests_after_unload_and_load_of_an_adapter_with_waiting_requests_all_succeed(server, http, local):
    path = str(local / "ad1")
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "u", "lora_path": path}).status_code == 200
    busy = threading.Thread(target=_complete, args=(http, NAME, 48))  # holds the one seat a while
    busy.start()
    with ThreadPoolExecutor(8) as pool:
        waiting = [pool.submit(_status, server, "u") for _ in range(4)]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "u"}).status_code == 200
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "u", "lora_path": path}).status_code == 200
        after = [pool.submit(_status, server, "u") for _ in range(24)]
        inplace = {"lora_name": "u", "lora_path": path, "load_inplace": True}
        seen, loaded = [], threading.Event()

        def watch() -> None:  # the in-place load of the same folder never leaves the name unregistered
            while not loaded.is_set():
                seen.append(server[0].manager.is_registered("u"))

        watcher = threading.Thread(target=watch)
        watcher.start()
        assert http.post("/v1/load_lora_adapter", json=inplace).status_code == 200
        loaded.set()
        watcher.join()
        assert seen and all(seen), f"unregistered in {seen.count(False)} of {len(seen)} looks"
        after += [pool.submit(_status, server, "u") for _ in range(24)]
        assert [f.result()[0] for f in after] == [200] * len(after), [f.result() for f in after if f.result()[0] != 200]
        for status, text in (f.result() for f in waiting):  # sent before the unload: served, or told it was gone
            assert status == 200 or (status == 404 and "model_not_found" in text), text
    busy.join()


def _status(server, model: str) -> tuple[int, str]:
    with httpx.Client(base_url=server[1].url, timeout=60) as client:
        answer = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2})
    return answer.status_code, answer.text
