"""HF-format Llama checkpoints: write random-weight ones, and load safetensors ones into a model on the meta device.

Layout read and written: ``config.json`` plus ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name: shard}}``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from safetensors.torch import save_file

from adapter_manager import TensorParallel
from adapter_manager.kernels import packs_by_default, platform_for
from adapter_manager.spmd import mesh

from .config import LlamaConfig, eos_ids
from .cpu_features import warn_if_slow_bf16
from .hf_map import hf_target, hf_tensor_shapes, load_hf
from .llama import Llama
from .projection import LoRALinear, quantize_linears
from .shard_plan import ShardGroup, shard_plan

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HUB_PATTERNS = (
    CONFIG_FILE,
    "*.safetensors",
    INDEX_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    GENERATION_CONFIG_FILE,
)
"""What a hub download fetches: never pickle weights."""
_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt")
_LOCAL_PREFIXES = ("/", "./", "../", "~", "file://")
SERVED_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a model is served in, by torch name."""
DTYPE_CHOICES = ("auto", *SERVED_DTYPES)
"""What a requested serving dtype may be: a served dtype's name, or "auto": the checkpoint's (:func:`resolve_dtype`)."""
QUANTIZE_CHOICES = ("none", "int8")
"""How a model's base weights may be held: as loaded, or weight-only int8 (:func:`load_model`'s ``quantize``)."""
_DTYPE_KEYS = ("dtype", "torch_dtype")  # config.json: the key transformers >= 4.56 writes, and the older one


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded: missing files, pickle-only weights, unknown/missing/misshapen tensors."""


@dataclass(frozen=True)
class CheckpointSource:
    """Where a base model checkpoint comes from and how hub downloads are made."""

    ref: str
    """A local directory (starts with /, ./, ../, ~ or file://, or is an existing directory) or a hub id
    ``org/name``, optionally ``org/name@revision``."""
    cache_dir: Path | None = None
    """HF cache; None = HF_HUB_CACHE."""
    endpoint: str | None = None
    """Hub URL; None = HF_ENDPOINT."""
    token: str | bool | None = None
    """Hub token; None = HF_TOKEN or the saved login; False = anonymous."""
    offline: bool = False
    """Only the local cache (HF_HUB_OFFLINE=1 has the same effect)."""

    def __post_init__(self) -> None:
        if not isinstance(self.ref, str) or not self.ref.strip():
            raise ValueError(f"ref must be a non-empty local path or hub id, got {self.ref!r}")

    @property
    def is_local(self) -> bool:
        return self.ref.startswith(_LOCAL_PREFIXES) or Path(self.ref).is_dir()

    def resolve(self) -> Path:
        """The local folder holding the checkpoint (downloading config, safetensors and tokenizer files if a hub id)."""
        if self.is_local:
            folder = Path(self.ref.removeprefix("file://")).expanduser().resolve()
            if not folder.is_dir():
                raise CheckpointError(f"{folder}: no such checkpoint directory")
            return folder
        repo_id, _, revision = self.ref.partition("@")
        path = snapshot_download(
            repo_id,
            revision=revision or None,
            allow_patterns=list(HUB_PATTERNS),
            cache_dir=self.cache_dir,
            endpoint=self.endpoint,
            token=self.token,
            local_files_only=self.offline,
        )
        return Path(path)


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: the single file, or every shard the index names (in index order)."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = list(dict.fromkeys(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards {missing} that are not in {folder}")
        return [folder / s for s in shards]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    pickled = [name for name in _PICKLE_FILES if (folder / name).exists()]
    if pickled:
        raise CheckpointError(
            f"{folder} has only pickle weights {pickled}; refusing to unpickle, convert to safetensors"
        )
    raise CheckpointError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def resolve_dtype(
    source: str | Path | Mapping[str, object] | None, requested: str | torch.dtype = "auto"
) -> torch.dtype:
    """The serving dtype: ``requested`` (a torch dtype, or a name in :data:`DTYPE_CHOICES`), where "auto" is the one
    the checkpoint's config.json names (``dtype``, or ``torch_dtype`` as transformers before 4.56 wrote it) when it
    is float32, bfloat16 or float16, and float32 where it names none or another (float64, null). ``source``: the
    checkpoint folder, its config.json, or the parsed config; only "auto" reads it (None is then refused). What
    "auto" chose and why is logged at INFO.

    Example: a folder whose config.json says ``"torch_dtype": "bfloat16"`` -> ``torch.bfloat16``."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {requested!r}")
    if requested != "auto":
        return getattr(torch, requested)
    if source is None:
        raise ValueError("dtype 'auto' is the checkpoint's: name its folder to resolve it")
    config = source if isinstance(source, Mapping) else _read_config(Path(source))
    key = next((k for k in _DTYPE_KEYS if k in config), None)
    declared = config.get(key) if key else None
    name = declared.removeprefix("torch.") if isinstance(declared, str) else None
    if name in SERVED_DTYPES:
        dtype, why = getattr(torch, name), f"config.json {key} is {declared!r}"
    elif key is None:
        dtype, why = torch.float32, "config.json names no dtype"
    else:
        dtype, why = torch.float32, f"config.json {key} {declared!r} is none of {', '.join(SERVED_DTYPES)}"
    log.info("dtype auto: serving in %s (%s)", str(dtype).removeprefix("torch."), why)
    return dtype


def _read_config(path: Path) -> Mapping[str, object]:
    """The parsed config.json of a checkpoint folder (or the file itself)."""
    path = path / CONFIG_FILE if path.is_dir() else path
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read the checkpoint's {CONFIG_FILE} at {path}: {err}") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return config


def load_model(
    folder: str | Path,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    pack_weights: bool | None = None,
    quantize: str | None = None,
    tensor_parallel: TensorParallel | int = 1,
    shard_group: ShardGroup | None = None,
) -> Llama:
    """Build the model on the meta device, allocate it once on ``device`` and copy each tensor in from its file.

    ``dtype`` is a torch dtype or a name :func:`resolve_dtype` takes ("auto", the default: the checkpoint's own,
    float32 where it names none). bf16 on a CPU that lacks avx512_bf16 and AMX works, and warns once that float32
    is faster there.

    ``pack_weights`` (None: on unless ``ADAPTER_MANAGER_PACK_WEIGHTS=0``) then reorders the projections' weights
    into the layout measured fastest on this machine (our blocked one, oneDNN's, or plain) where it applies (CPU;
    :meth:`Llama.pack_weights`), replacing the plain ones.

    ``tensor_parallel``: Megatron tensor parallelism over N shards (:class:`sharding.TensorParallel`: N, and whether
    the LoRA is fully sharded, as the adapter pool's; an int: N, the LoRA split as its base). N > 1 on XLA: one SPMD
    program over N devices, each weight split over the mesh; on CPU one process per shard: ``shard_group`` names this
    process's shard, which loads only its part of each tensor (:mod:`.shard_plan`: the form, chosen here once).

    ``quantize="int8"`` (one of :data:`QUANTIZE_CHOICES`; None or "none": not) first replaces every projection
    weight (q/k/v/o/gate/up/down, and an untied lm_head) by weight-only int8 with one scale per output row
    (:func:`kernels.quantize_weight`, any device); embeddings (a tied lm_head with them) and norms stay in ``dtype``,
    and so do the adapters' rows: their LoRA adds onto the int8 matmul's output.

    Every parameter is written exactly once (fused q/k/v and gate/up row slices included); tensors are read one at a
    time from the memory-mapped files, so at no point does a second copy of the weights exist. The end-of-sequence
    ids come from ``generation_config.json`` when it names them (as transformers' ``generate`` reads them), else
    from ``config.json``.
    """
    folder = Path(folder)
    quantize = check_quantize(quantize)
    if not (folder / CONFIG_FILE).is_file():
        raise CheckpointError(f"{folder} has no {CONFIG_FILE}")
    config = LlamaConfig.from_hf(folder / CONFIG_FILE)
    dtype = resolve_dtype(folder, dtype)
    platform = platform_for(device)
    if platform.computes_on_host:
        warn_if_slow_bf16(dtype)
    generation = folder / GENERATION_CONFIG_FILE
    if generation.is_file():
        try:
            generation_eos = json.loads(generation.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as err:
            raise CheckpointError(f"{generation} is not a JSON object: {err}") from err
        if generation_eos is not None:
            config = replace(config, eos_token_ids=eos_ids(generation_eos))
    if isinstance(tensor_parallel, int):
        tensor_parallel = TensorParallel(tensor_parallel)
    plan = shard_plan(tensor_parallel, device, shard_group)  # the form, chosen once
    if plan.form == "spmd":
        if quantize not in (None, "none"):
            raise ValueError(f"quantize={quantize!r} with tensor_parallel_size {plan.size} on XLA is not built")
        mesh(plan.size)  # SPMD mode on before the first tensor reaches the device
    with torch.device("meta"):
        model = Llama(config, plan)
    model = model.to(dtype=dtype)
    expected = hf_tensor_shapes(config)
    with ExitStack() as files, torch.no_grad():
        index: dict[str, Any] = {}  # every tensor's name -> its file's handle, shapes checked
        for path in weight_files(folder):
            handle = files.enter_context(safe_open(path, framework="pt", device="cpu"))
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.output is None):
                    continue
                if name not in expected:
                    family = config.model_type
                    raise CheckpointError(f"{path.name}: unexpected tensor {name!r} for this {family} config")
                shape = tuple(handle.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(
                        f"{path.name}: tensor {name!r} has shape {list(shape)}, expected {list(expected[name])}"
                    )
                index[name] = handle
        if platform.loads_on_host:  # one parameter at a time on the host, then placed whole: each
            # device receives only its shard of it (SPMD), and no parameter is left a view of slice writes (the
            # first step would materialise it, and compile a graph no later step reuses)
            destinations = {id(param): name for name, param in model.named_parameters()}
            groups: dict[str, list[str]] = {}
            for name in index:
                groups.setdefault(destinations[id(hf_target(model, name)[0])], []).append(name)
            for destination, names in groups.items():
                host = torch.empty(model.get_parameter(destination).shape, dtype=dtype)
                for name in names:
                    load_hf(model, name, index[name].get_tensor(name), into=host)
                placed = plan.place(destination, host, torch.device(device))
                module, attribute = destination.rsplit(".", 1)
                setattr(model.get_submodule(module), attribute, torch.nn.Parameter(placed, requires_grad=False))
        else:
            model = model.to_empty(device=device)
            for name, handle in index.items():
                load_hf(model, name, handle.get_tensor(name))
    missing = sorted(set(expected) - set(index))
    if missing:
        raise CheckpointError(
            f"{folder}: tensors missing from the checkpoint: {missing[:8]}{'...' if len(missing) > 8 else ''}"
        )
    model = model.eval().requires_grad_(False)
    if quantize not in (None, "none"):
        quantize_linears([m for m in model.modules() if isinstance(m, LoRALinear)])
    if pack_weights if pack_weights is not None else packs_by_default():
        model.pack_weights()
    return model


def check_quantize(quantize: str | None) -> str | None:
    """``quantize`` as :func:`load_model` takes it (None for "none"), or a ValueError naming the choices."""
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    return None if quantize == "none" else quantize


def load_checkpoint(
    source: CheckpointSource | str,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    quantize: str | None = None,
) -> tuple[Llama, Path]:
    """Resolve ``source`` (local dir or hub id) and load it in ``dtype`` (as :func:`load_model` takes it: "auto" is
    the checkpoint's; ``quantize`` too); returns the model and the local folder."""
    source = CheckpointSource(source) if isinstance(source, str) else source
    folder = source.resolve()
    return load_model(folder, dtype, device, quantize=quantize), folder


def write_random_checkpoint(
    config: LlamaConfig,
    folder: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
    std: float = 0.02,
) -> Path:
    """Write an HF-format checkpoint with random weights (deterministic in ``seed``), readable by transformers.

    Linear and embedding weights are N(0, std²); norm weights 1 + N(0, 0.1²) so a test notices a missing norm
    weight. With ``max_shard_bytes`` the tensors are packed into shards of at most that size (a tensor larger than
    the limit gets a shard of its own) plus ``model.safetensors.index.json``. Returns the folder.
    """
    if std <= 0 or (max_shard_bytes is not None and max_shard_bytes <= 0):
        raise ValueError(f"std ({std}) and max_shard_bytes ({max_shard_bytes}) must be positive")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, shape in hf_tensor_shapes(config).items():
        noise = torch.randn(shape, generator=generator)
        tensor = (1 + 0.1 * noise if name.endswith("norm.weight") else std * noise).to(dtype)
        if max_shard_bytes is not None and shards[-1] and shard_bytes + tensor.nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += tensor.nbytes
    hf_config = {**config.to_hf(), "torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(shards[0], folder / SINGLE_FILE, metadata=metadata)
        return folder
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / file, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
        total += sum(t.nbytes for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return folder
