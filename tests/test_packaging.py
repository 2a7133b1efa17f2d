"""The distribution installs one import name, ``adapter_manager``, so it installs beside the stack our users already
have: transformers ≥ 5.25 requires Hugging Face's ``kernels`` distribution, whose import name is ``kernels``."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built by pip as a user's ``pip install .`` would (setuptools in an isolated build env)."""
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    (path,) = out.glob("adapter_manager-*.whl")
    return path


def test_wheel_installs_one_top_level_name(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"adapter_manager"}
    top_level = next((n for n in names if n.endswith(".dist-info/top_level.txt")), None)
    if top_level is not None:
        assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["adapter_manager"]
    # package data travels with the kernels: the C++ sources and the shipped tables
    assert "adapter_manager/kernels/cpu/csrc/lora_blocked.cpp" in names
    assert "adapter_manager/kernels/triton/block_sizes.json" in names
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "adapter-manager = adapter_manager.runtime.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_installed_wheel_imports_beside_hugging_face_kernels(wheel: Path, tmp_path: Path) -> None:
    """The wheel unpacked into its own site folder, outside this checkout, imported in one process with transformers
    and Hugging Face's ``kernels``: each import name resolves to its own distribution."""
    hf_kernels = pytest.importorskip("kernels", reason="no Hugging Face kernels (transformers brings it)")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    code = (
        "import kernels, transformers\n"
        "from kernels import CUDAProperties, get_kernel\n"
        "import adapter_manager, adapter_manager.kernels as ours, adapter_manager.runtime.engine\n"
        "from adapter_manager import AdapterManager\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "print(kernels.__file__)\n"
        "print(ours.__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    hf_file, ours_file = (Path(line) for line in out.stdout.split())
    assert hf_file == Path(hf_kernels.__file__) and hf_file.parent.parent.name == "site-packages"  # Hugging Face's
    assert site in ours_file.parents  # ours, from the wheel
    assert not (site / "kernels").exists() and not (site / "runtime").exists()
