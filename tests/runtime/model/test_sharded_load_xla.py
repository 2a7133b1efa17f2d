"""The sharded SPMD load on the torch_xla CPU device with 4 virtual devices (XLA lane): each parameter is read on the
host and each device receives only its shard, so the host sends every split weight's bytes once per replica of the
mesh (4 / N), not once per device, and a model bigger than one device loads. The values are the checkpoint's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.xla
pytest.importorskip("torch_xla")
pytest.importorskip("transformers")

from tests.conftest import make_tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
DEVICES = 4


@pytest.mark.parametrize("tp", [2, 4])
def test_each_device_receives_only_its_shard(tmp_path, tp):
    make_tiny_llama().save_pretrained(tmp_path / "base")
    out = tmp_path / "load.json"
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(DEVICES))
    command = [sys.executable, "-m", "tests.runtime.model._sharded_load", str(tmp_path / "base"), str(out)]
    done = subprocess.run([*command, "--tp", str(tp)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    tensors = load_file(tmp_path / "base" / "model.safetensors")
    params = result["params"]  # a parameter's bytes: with KV heads replicated (4 > 2) q/k/v hold more than the file
    split = sum(p["nbytes"] for name, p in params.items() if "norm" not in name)
    whole = sum(p["nbytes"] for name, p in params.items() if "norm" in name)
    replicas = DEVICES // tp
    assert result["sent_bytes"] <= split * replicas + whole * DEVICES + 4096, result["sent_bytes"]
    assert result["sent_bytes"] < split * DEVICES  # the old load: every weight whole on every device
    assert "devices=[" in params["tok_embeddings.weight"]["spec"]  # split over the mesh
    assert "devices=[" in params["layers.0.attention.wo.weight"]["spec"]
    assert params["norm.weight"]["spec"] in ("", "{replicated}")
    checks = {
        "tok_embeddings.weight": tensors["model.embed_tokens.weight"],
        "layers.1.feed_forward.w2.weight": tensors["model.layers.1.mlp.down_proj.weight"],
        "norm.weight": tensors["model.norm.weight"],
    }
    if tp == 2:  # the same rows in another order over the shards (KV heads not replicated): the same sum
        checks["layers.2.attention.wqkv.weight"] = torch.cat(
            [tensors[f"model.layers.2.self_attn.{p}_proj.weight"] for p in "qkv"]
        )
    for name, tensor in checks.items():
        assert params[name]["sum"] == pytest.approx(float(tensor.double().sum()), rel=1e-6, abs=1e-6), name
