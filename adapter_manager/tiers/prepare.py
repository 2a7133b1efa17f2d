"""Host-side preparation: a validated PEFT safetensors file -> per-module `A [r, in]`, `Bt [r, out]`, scale folded.

A prepared adapter of rank r (its highest module rank) is one ``[r, width]`` block in the pool's row layout
(`row_layout.RowLayout`): pinned when serving on CUDA, its byte size proportional to its own rank, moved into the
slot pool by one contiguous copy. Modules it does not target, and rows past a module's own rank, are zero. A variant
with a per-output vector (DoRA, LoRA bias: `vectors`) also has one vector row in the layout's vector order, copied
into its slot's vector row with the block. Trainable tokens are rows of the vocabulary columns made from the served
weights (`vocab`): without them the adapter is checked whole but not servable, like DoRA's.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..base_model import BaseModelSpec, ModuleKey
from ..errors import CorruptWeightsError, NonFiniteWeightsError, TensorKeyError, TensorShapeError
from ..sources.peft_format import ModuleLora, Variant, parse_tensor_key
from ..sources.peft_fused import UnfusedHandle
from .row_layout import RowLayout
from .vectors import BaseWeight, bias_vector, dora_vector
from .vocab import check_base_copy, token_rows

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class ModuleWeights:
    """One module's prepared LoRA weights: strided views of the adapter's block; rows past `rank` are zero."""

    a: torch.Tensor  # Shape: [r, in] (r: the adapter's rank); over N shards [r, N, in_s]
    bt: torch.Tensor  # Shape: [r, out] = (scaling * B).T, zero past the module's rank; over N shards [r, N, out_s]
    rank: int  # the module's own rank <= r
    vector: torch.Tensor | None = None  # Shape: [out] (over N shards [N, out_s]): a view of the vector row, if any


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter ready to be copied into a slot range: one row block in the serving dtype."""

    adapter_id: str
    sha: str  # revision the weights came from
    modules: Mapping[ModuleKey, ModuleWeights]  # targeted modules only; the others are zero
    storage: torch.Tensor  # Shape: [r, width], over N shards [r, N, W_s] (`RowLayout.block`): what `a`, `bt` view
    digest: str = ""  # the content digest of the files it was prepared from (`sources.digests`)
    variant: Variant = Variant.LORA  # what it adds beyond A and B
    vector: torch.Tensor | None = None  # Shape: [vector_width], the vector row (DoRA's g - 1, LoRA's s · b); else None
    awaiting_base: bool = False  # trainable tokens' rows not made: the base model's weights were not attached

    @property
    def rows(self) -> int:
        """r: rows of the block, the adapter's highest module rank."""
        return self.storage.shape[0]

    @property
    def complete(self) -> bool:
        """Whether it can be served: a variant with a vector has it, trainable tokens their rows (DoRA's scale and the
        tokens' rows need the base model's weights)."""
        return (self.variant.vector is None or self.vector is not None) and not self.awaiting_base

    @property
    def nbytes(self) -> int:
        """Bytes of its block and its vector row: what a host -> slot move copies."""
        vector = 0 if self.vector is None else self.vector.numel() * self.vector.element_size()
        return self.storage.numel() * self.storage.element_size() + vector

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype


def prepare_adapter(
    adapter_id: str,
    sha: str,
    weights_path: Path,
    modules: Mapping[ModuleKey, ModuleLora],
    spec: BaseModelSpec,
    dtype: torch.dtype,
    pin_memory: bool = False,
    layout: RowLayout | None = None,
    digest: str = "",
    variant: Variant = Variant.LORA,
    base_weight: BaseWeight | None = None,
) -> PreparedAdapter:
    """Validate `adapter_model.safetensors` against the resolved modules and build the prepared adapter.

    Every key must be the lora_A/lora_B of a targeted module (and its variant's vector: `.lora_B.bias`,
    `.lora_magnitude_vector`), every targeted module must have each, shapes must be `A [r, in]`, `B [out, r]`,
    vectors `[out]`, values finite. DoRA's scale needs ``base_weight`` (`vectors.BaseWeight`): without it the adapter
    is checked whole but comes back without its vector row (``complete`` False: not servable). Nothing is kept if any
    check fails.
    """
    with _opened(adapter_id, weights_path, spec) as handle:
        tensors = _match_keys(adapter_id, list(handle.keys()), modules, spec, variant)
        _check_shapes(adapter_id, handle, tensors, modules, spec)
        layout = layout or RowLayout.of(spec)  # over N tensor-parallel shards: RowLayout.of(spec, tp)
        prepared = _build(adapter_id, sha, handle, tensors, modules, spec, layout, dtype, pin_memory, base_weight)
        if variant is not Variant.LORA:
            prepared = _with_vector(prepared, handle, tensors, modules, spec, layout, variant, base_weight)
    return replace(prepared, digest=digest)


def check_weights(
    adapter_id: str,
    weights_path: Path,
    modules: Mapping[ModuleKey, ModuleLora],
    spec: BaseModelSpec,
    variant: Variant = Variant.LORA,
) -> None:
    """Every check of `prepare_adapter` that needs only the file's header: a whole safetensors file (its length
    covers every tensor), the keys, every shape and dtype. Reads no tensor, so it cannot find non-finite values."""
    with _opened(adapter_id, weights_path, spec) as handle:
        tensors = _match_keys(adapter_id, list(handle.keys()), modules, spec, variant)
        _check_shapes(adapter_id, handle, tensors, modules, spec)


@contextmanager
def _opened(adapter_id: str, weights_path: Path, spec: BaseModelSpec) -> Iterator[Any]:
    """The safetensors handle of `weights_path`, a fused module's tensors read as its parts' (`UnfusedHandle`:
    Phi-3's qkv_proj); a missing or malformed file raises `CorruptWeightsError`."""
    try:
        with safe_open(weights_path, framework="pt") as handle:
            yield UnfusedHandle(handle, spec)
    except FileNotFoundError:
        raise CorruptWeightsError(adapter_id, f"{weights_path.name} is missing") from None
    except SafetensorError as err:
        raise CorruptWeightsError(adapter_id, f"{weights_path.name} is not a valid safetensors file: {err}") from None


_KIND_NAMES = {
    "A": "lora_A", "B": "lora_B", "bias": "lora_B.bias", "magnitude": "lora_magnitude_vector",
    "base": "base_layer.weight", "tokens": "token_adapter.trainable_tokens_delta",
}  # fmt: skip


def _kinds(module: ModuleKey, lora: ModuleLora, variant: Variant) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the kinds of tensor a targeted module must have, those it may have)."""
    if lora.tokens is not None:
        return (("tokens",), ()) if lora.tokens.source == module.proj else ((), ())
    if module.is_vocab:
        return ("A", "B"), ("base",)  # PEFT saves the frozen table it wrapped beside the LoRA
    return (("A", "B") if variant.vector is None else ("A", "B", variant.vector)), ()


def _match_keys(
    adapter_id: str, keys: list[str], modules: Mapping[ModuleKey, ModuleLora], spec: BaseModelSpec, variant: Variant
) -> dict[ModuleKey, dict[str, str]]:
    """Each targeted module's tensor keys by kind ("A", "B", the variant's vector, a vocabulary module's "base" and
    "tokens")."""
    found: dict[ModuleKey, dict[str, str]] = {}
    for key in keys:
        module, kind = parse_tensor_key(key, adapter_id)
        if module.layer >= spec.num_layers:
            raise TensorKeyError(
                adapter_id, f"tensor {key!r} is for layer {module.layer}, but the base model has {spec.num_layers} "
                f"layers (0..{spec.num_layers - 1}): the adapter was trained on a deeper model"
            )  # fmt: skip
        if module not in modules:
            raise TensorKeyError(adapter_id, f"tensor {key!r} is for a module adapter_config.json does not target")
        required, optional = _kinds(module, modules[module], variant)
        if kind not in required + optional:
            raise TensorKeyError(
                adapter_id, f"tensor {key!r} is a {_KIND_NAMES[kind]}, which a {variant.value} adapter does not have "
                f"(adapter_config.json: use_dora / lora_bias)"
            )  # fmt: skip
        found.setdefault(module, {})[kind] = key
    for module, lora in modules.items():
        missing = [_KIND_NAMES[kind] for kind in _kinds(module, lora, variant)[0] if kind not in found.get(module, {})]
        if missing:
            raise TensorKeyError(adapter_id, f"missing {'/'.join(missing)} for targeted module {module.module_name!r}")
    return found


def _check_shapes(adapter_id, handle, tensors, modules, spec: BaseModelSpec) -> None:
    for module, lora in modules.items():
        fan_in, fan_out = spec.projection_shape(module.proj)
        expected = {"A": [lora.rank, fan_in], "B": [fan_out, lora.rank], "bias": [fan_out], "magnitude": [fan_out]}
        expected |= {"base": [spec.vocab_size, spec.hidden_size], "tokens": [lora.rank, spec.hidden_size]}
        for ab, key in tensors.get(module, {}).items():
            tensor_slice = handle.get_slice(key)
            shape = list(tensor_slice.get_shape())
            if shape != expected[ab]:
                raise TensorShapeError(adapter_id, f"tensor {key!r} has shape {shape}, expected {expected[ab]}")
            dtype = tensor_slice.get_dtype()
            if dtype not in ("F32", "F16", "BF16", "F64"):
                raise TensorShapeError(adapter_id, f"tensor {key!r} has dtype {dtype}, expected a float type")


def _build(
    adapter_id, sha, handle, tensors, modules, spec, layout: RowLayout, dtype, pin_memory, base_weight
) -> PreparedAdapter:
    rank = max(lora.rank for lora in modules.values())
    storage = layout.block(_block(rank, layout.width, dtype, pin_memory))  # [r, width]; over N shards [r, N, W_s]
    prepared: dict[ModuleKey, ModuleWeights] = {}
    tp, awaiting = layout.tensor_parallel, False
    for module in sorted(modules):
        lora = modules[module]
        a_view, bt_view = layout.a_view(storage, module), layout.bt_view(storage, module)  # [r, in], [r, out]
        prepared[module] = ModuleWeights(a=a_view, bt=bt_view, rank=lora.rank)
        if lora.tokens is not None:  # trainable tokens: a one-hot LoRA made from the served weights (`vocab`)
            name = tensors[ModuleKey.vocab(lora.tokens.source)]["tokens"]
            if base_weight is None:
                awaiting = True
                if not bool(handle.get_tensor(name).isfinite().all()):
                    raise NonFiniteWeightsError(adapter_id, f"tensor {name!r} holds NaN or infinity")
            else:
                rows = handle.get_tensor(name)
                token_rows(module, lora.tokens.ids, rows, base_weight, a_view, bt_view, adapter_id, name)
            continue
        if "base" in tensors[module] and base_weight is not None:
            check_base_copy(module, handle.get_tensor(tensors[module]["base"]), base_weight, adapter_id,
                            tensors[module]["base"])  # fmt: skip
        a = handle.get_tensor(tensors[module]["A"])  # [r_m, in]
        bt = (handle.get_tensor(tensors[module]["B"]).to(torch.float32) * lora.scaling).t()  # [r_m, out]
        if layout.sections == 1:
            a_view[: lora.rank].copy_(a)
            bt_view[: lora.rank].copy_(bt)
        else:  # [r, N, in_s], [r, N, out_s]: each section its shard's features
            for shard in range(layout.sections):
                a_view[: lora.rank, shard].copy_(a[:, tp.lora_in_index(spec, module.proj, shard)])
                bt_view[: lora.rank, shard].copy_(bt[:, tp.lora_out_index(spec, module.proj, shard)])
    # A finite sum proves every element finite (NaN and inf propagate); a non-finite one is checked element-wise,
    # since finite values can also sum past the dtype's range.
    if not bool(storage.sum().isfinite()):
        for module, weights in prepared.items():
            for ab, view in (("A", weights.a), ("B", weights.bt)):
                if not bool(torch.isfinite(view).all()):
                    raise NonFiniteWeightsError(
                        adapter_id,
                        f"tensor {tensors.get(module, {}).get(ab, module.module_name)!r} holds NaN or "
                        f"infinity (in {dtype} after scaling)",
                    )
    return PreparedAdapter(adapter_id=adapter_id, sha=sha, modules=prepared, storage=storage, awaiting_base=awaiting)


def _with_vector(prepared, handle, tensors, modules, spec, layout: RowLayout, variant, base_weight) -> PreparedAdapter:
    """The adapter with its vector row: each targeted module's `vectors.bias_vector` or `vectors.dora_vector`, zero
    for the others (the epilogue's identity), in the block's dtype."""
    storage, tp = prepared.storage, layout.tensor_parallel
    vector = _block(1, layout.vector_width, storage.dtype, storage.is_pinned())  # [1, vector_width]
    weights = dict(prepared.modules)
    for module in sorted(m for m in modules if not m.is_vocab):  # the vocabulary modules have no vector
        lora, key = modules[module], tensors[module][variant.vector]
        values = handle.get_tensor(key)  # [out]
        if variant is Variant.LORA_BIAS:
            values = bias_vector(values, lora.scaling)
        elif base_weight is None:  # checked, not servable: `PreparedAdapter.complete` is False
            if not bool(values.isfinite().all()):
                raise NonFiniteWeightsError(prepared.adapter_id, f"tensor {key!r} holds NaN or infinity")
            continue
        else:
            a, bt = handle.get_tensor(tensors[module]["A"]), handle.get_tensor(tensors[module]["B"]).t() * lora.scaling
            values = dora_vector(values, a, bt, base_weight(module))
        if not bool(values.isfinite().all()):
            what = "bias" if variant is Variant.LORA_BIAS else "magnitude (or the row norms of W + s·B·A are zero)"
            raise NonFiniteWeightsError(prepared.adapter_id, f"tensor {key!r}: the {what} gives NaN or infinity")
        view = layout.vector_view(vector, module)[0]  # [out]; over N shards [N, out_s]
        if layout.sections == 1:
            view.copy_(values)
        else:
            for shard in range(layout.sections):
                view[shard].copy_(values[tp.out_index(spec, module.proj, shard)])
        weights[module] = replace(weights[module], vector=view)
    if not bool(vector.isfinite().all()):
        raise NonFiniteWeightsError(prepared.adapter_id, f"its {variant.value} vectors overflow {storage.dtype}")
    complete = variant is not Variant.DORA or base_weight is not None
    return replace(prepared, modules=weights, variant=variant, vector=vector[0] if complete else None)


def _block(rows: int, width: int, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    """A zeroed ``[rows, width]`` block in a mapping of its own (pinned memory when serving on CUDA). A host tier
    churning through blocks of a few MB would otherwise leave the C heap fragmented: glibc serves them from its arenas
    once it has freed one such mapping, and keeps what they free (measured: RSS +0.7-4 MB per registration with the
    host tier full, all of it returned by malloc_trim); a mapping goes back to the OS when its tensor is freed."""
    if pin_memory:
        return torch.zeros(rows, width, dtype=dtype, pin_memory=True)
    nbytes = rows * width * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes].view(dtype).view(rows, width)
