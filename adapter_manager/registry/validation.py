"""What an adapter must be to be accepted: a valid PEFT config for the served base model, from an allowed place.

The weights themselves are checked where they are read (`tiers.prepare`): shapes and dtypes at registration and
restore, every value finite at preparation.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..base_model import BaseModelSpec, ModuleKey
from ..errors import BaseModelMismatchError, InvalidAdapterRefError, UnsupportedAdapterError
from ..sources.hub import AdapterFiles, AdapterRef
from ..sources.peft_format import LoraAdapterConfig, ModuleLora
from .records import RegistryConfig

log = logging.getLogger(__name__)


def read_config(
    adapter_id: str, source: AdapterFiles | str, spec: BaseModelSpec, config: RegistryConfig, quiet: bool = False
) -> tuple[LoraAdapterConfig, tuple[str, ...], dict[ModuleKey, ModuleLora]]:
    """The adapter's validated config (from its files, or ``source`` as the config file's stored text), its
    base-model warnings (logged unless ``quiet``) and the modules it targets."""
    if isinstance(source, str):
        adapter_config = LoraAdapterConfig.from_dict(json.loads(source), adapter_id)
    else:
        adapter_config = LoraAdapterConfig.from_file(source.config_path, adapter_id)
    variant, rows = adapter_config.variant, config.rows
    if variant.vector is not None and not rows.lora_vectors:
        raise UnsupportedAdapterError(
            adapter_id, f"a {variant.value} adapter needs the pool's vector rows, which this server has off "
            "(lora_vectors=False, --no-lora-vectors)"
        )  # fmt: skip
    if variant.vector is not None and rows.tensor_parallel.size > 1:
        raise UnsupportedAdapterError(
            adapter_id, f"a {variant.value} adapter with tensor_parallel_size {rows.tensor_parallel.size} is not "
            "built (its vector joins after the row-parallel all-reduce)"
        )  # fmt: skip
    warnings = check_base_model(adapter_id, adapter_config.base_model_name_or_path, spec, config, quiet)
    modules = adapter_config.resolve(spec, adapter_id, rows.max_rank)
    vocab = [key.proj for key in modules if key.is_vocab]
    if vocab and not rows.lora_vocab:
        what = " and ".join(f"{name} {'trainable tokens' if modules[ModuleKey.vocab(name)].tokens else 'LoRA'}"
                            for name in vocab)  # fmt: skip
        raise UnsupportedAdapterError(
            adapter_id, f"{what} need the pool's vocabulary columns, which this server has off "
            "(lora_vocab=False; serve with --lora-vocab)"
        )  # fmt: skip
    return adapter_config, warnings, modules


def check_base_model(
    adapter_id: str, base: str | None, spec: BaseModelSpec, config: RegistryConfig, quiet: bool = False
) -> tuple[str, ...]:
    """The warning for an adapter trained on another base model than `spec` (none if the same or unknown), logged
    unless `quiet`; with `base_model_mismatch="refuse"`, `BaseModelMismatchError` instead."""
    served = spec.identities
    if not base or not served or any(_same_model(base, name) for name in served):
        return ()
    compared = ", ".join(repr(name) for name in served)
    message = f"trained on base model {base!r}, serving {spec.name or served[0]!r} (compared with {compared})"
    if config.base_model_mismatch == "refuse":
        raise BaseModelMismatchError(adapter_id, message)
    if not quiet:
        log.warning("adapter %r: %s", adapter_id, message)
    return (message,)


def check_local_root(ref: AdapterRef, raw: str, roots: tuple[Path, ...] | None) -> None:
    """Refuse a local ref outside every allowed root (`InvalidAdapterRefError` naming `raw`); no roots: any."""
    if ref.path is None or roots is None:
        return
    if not any(ref.path.is_relative_to(Path(root).resolve()) for root in roots):
        raise InvalidAdapterRefError(raw, f"local path {ref.path} is outside the allowed roots {list(roots)}")


def _same_model(a: str, b: str) -> bool:
    """Same base model: equal names, or equal last path component (a hub id vs a local copy of it)."""
    a, b = a.rstrip("/"), b.rstrip("/")
    return a == b or a.rsplit("/", 1)[-1].lower() == b.rsplit("/", 1)[-1].lower()
