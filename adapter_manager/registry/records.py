"""What the registry holds: an adapter's record, the result of one `register` call, and the registry's config."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from ..base_model import ModuleKey
from ..errors import InvalidAdapterRefError
from ..sources.hub import AdapterFiles, AdapterRef, HubConfig
from ..sources.peft_format import ModuleLora, Variant
from ..tiers.row_layout import RowOptions

_ADAPTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:/-]{0,199}")
_GIB = 1 << 30


def check_adapter_id(adapter_id: str) -> str:
    """Return `adapter_id` if the registry can hold it (letters, digits and ._@:/-, no '..'), else raise
    `InvalidAdapterRefError`; servers call it before any lookup."""
    if not isinstance(adapter_id, str) or not _ADAPTER_ID.fullmatch(adapter_id) or ".." in adapter_id:
        raise InvalidAdapterRefError(str(adapter_id), "adapter ids use letters, digits and ._@:/- and no '..'")
    return adapter_id


@dataclass
class RegistryConfig:
    """How adapters are accepted and prepared."""

    dtype: torch.dtype = torch.float32  # serving dtype of prepared weights
    host_cache_bytes: int = 2 * _GIB  # byte bound of the host tier
    base_model_mismatch: Literal["warn", "refuse"] = "warn"  # adapter trained on another base model
    pin_memory: bool = False  # prepare into pinned host memory (set when serving on CUDA)
    allowed_local_roots: tuple[Path, ...] | None = None  # if set, local refs must lie under one of these
    hub: HubConfig = field(default_factory=HubConfig)  # how hub refs are downloaded
    state_dir: Path | None = None  # if set, registrations are kept durably here and restored by `restore()`
    disk_cache_bytes: int | None = None  # if set, bound on the bytes of this registry's repos in the HF cache
    rows: RowOptions = field(default_factory=RowOptions)  # R accepted; the sections prepared blocks hold, one per
    # shard; variants with a vector (DoRA, lora_bias) and vocabulary modules accepted only with their columns

    def __post_init__(self) -> None:
        if self.disk_cache_bytes is not None and self.disk_cache_bytes <= 0:
            raise ValueError(f"disk_cache_bytes must be positive, got {self.disk_cache_bytes}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point dtype, got {self.dtype}")
        if self.base_model_mismatch not in ("warn", "refuse"):
            raise ValueError(f"base_model_mismatch must be 'warn' or 'refuse', got {self.base_model_mismatch!r}")
        if self.host_cache_bytes <= 0:
            raise ValueError(f"host_cache_bytes must be positive, got {self.host_cache_bytes}")
        if not isinstance(self.rows, RowOptions):
            raise TypeError(f"rows must be a RowOptions (max_rank, tensor_parallel, ...), got {self.rows!r}")


@dataclass(frozen=True)
class AdapterRecord:
    """A registered adapter: where it came from, which revision, and what it adapts."""

    adapter_id: str
    ref: AdapterRef  # as registered (the revision asked for)
    files: AdapterFiles  # where its files are on local disk, and the resolved sha
    modules: Mapping[ModuleKey, ModuleLora]  # targeted modules with their rank, alpha and scaling
    nbytes: int  # size of its prepared weights
    base_model: str | None  # base_model_name_or_path from its config
    registered_at: float  # time.time()
    warnings: tuple[str, ...] = ()  # accepted-with-warning findings (e.g. base model mismatch)
    disk_bytes: int = 0  # size of its two files (what a download of them again reserves in a bounded disk tier)
    generation: int = 0  # this registration of its id: new at each register, update to new content and restore
    variant: Variant = Variant.LORA  # what it adds beyond A and B (DoRA's scale, LoRA's bias)

    @property
    def sha(self) -> str:
        """The revision its files are: the hub commit, or "local-" + the digest's first 40 hex."""
        return self.files.sha

    @property
    def digest(self) -> str:
        """What the adapter is: the digest of its files' content (`sources.digests`). The prefix cache's namespace,
        the host tier's key and the refresh decision use it: the same bytes at another commit are the same adapter."""
        return self.files.digest

    @property
    def rank(self) -> int:
        """Highest rank over its modules."""
        return max(m.rank for m in self.modules.values())

    @property
    def vocab(self) -> dict[str, str]:
        """What it does to each vocabulary module it adapts: {"embed_tokens" | "lm_head": "lora" | "tokens"}."""
        return {key.proj: "tokens" if lora.tokens else "lora" for key, lora in self.modules.items() if key.is_vocab}


@dataclass(frozen=True)
class RegisterResult:
    """What one `register` call did, with the time each tier move took."""

    record: AdapterRecord
    action: Literal["registered", "unchanged", "updated"]
    previous_sha: str | None  # the sha replaced by an update
    download_s: float  # hub -> disk (0 for a local dir or an unchanged ref)
    prepare_s: float  # disk -> host: read, validate, fold scale, pad
    downloaded_bytes: int
