"""Megatron tensor parallelism's plan: which features of each projection one of N shards holds (the model's and the
adapter pool's sections alike; how the shards run, one SPMD program or one process each, is
``runtime.model.shard_plan``'s).

Column-parallel projections (q/k/v, gate/up) split their output features: a shard holds its q heads, its KV heads
(replicated where KV < N, as vLLM does), its slice of the MLP width; their LoRA keeps A whole and splits B by the same
output features. Row-parallel ones (o, down) split their input features the same way and keep their output (and B)
whole: each shard's partial output, LoRA included, joins the others in the layer's one all-reduce. ``size`` 1 holds
every feature: the plan of an unsharded model.

With ``fully_sharded_loras`` (vLLM's name) the LoRA splits what the default keeps whole, so a device holds exactly
1/N of every adapter's rows: column-parallel A by input features (hidden / N each) and row-parallel Bt by output
features (hidden / N each). The price is one all-reduce of the shrink output (each token's ``[r]`` per part) per
linear, since each shard's ``x_s A_sᵀ`` is then a partial sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base_model import BaseModelSpec

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # A whole, B split by output features
ROW_PARALLEL = ("o_proj", "down_proj")  # A split by input features, B whole


@dataclass(frozen=True)
class TensorParallel:
    """N-way tensor parallelism (Megatron's split of every projection). Each field's ``metadata`` is its serve flag
    (`runtime.cli_args`)."""

    size: int = field(
        default=1,
        metadata={
            "flag": "--tensor-parallel-size",
            "help": "shard the model and the adapter pool{each} over N devices (Megatron; XLA: one SPMD program) "
            "(%(default)s)",
        },
    )  # N devices (shards); 1: unsharded
    fully_sharded_loras: bool = field(
        default=False,
        metadata={
            "flag": "--fully-sharded-loras",
            "help": "with --tensor-parallel-size N: split every adapter's A and B N ways too (1/N of the pool per "
            "device, one all-reduce of the shrink output per linear; default: no LoRA collective; docs/engine.md)",
        },
    )  # the LoRA's A of q/k/v, gate/up and Bt of o, down split too (1/N of each row)

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {self.size!r}")

    def check(self, spec: BaseModelSpec) -> None:
        """ValueError unless ``spec`` splits ``size`` ways: heads and the MLP width evenly, KV heads evenly or each
        replicated on a whole number of shards."""
        n, kv = self.size, spec.num_kv_heads
        if spec.num_heads % n or spec.intermediate_size % n or (kv % n and n % kv):
            raise ValueError(
                f"tensor_parallel_size {n} does not split the model {spec.name!r}: num_heads {spec.num_heads} and "
                f"intermediate_size {spec.intermediate_size} must be multiples of it, and num_kv_heads {kv} a "
                "multiple or a divisor of it"
            )
        if self.fully_sharded_loras and spec.hidden_size % n:
            raise ValueError(
                f"fully_sharded_loras splits the hidden size {spec.hidden_size} {n} ways: it must be a multiple of it"
            )

    def kv_heads(self, spec: BaseModelSpec) -> int:
        """KV heads one shard holds: ``num_kv_heads / N``, or 1 (replicated) where KV < N."""
        return max(1, spec.num_kv_heads // self.size)

    def kv_head_of(self, spec: BaseModelSpec, shard: int, local: int) -> int:
        """The global KV head that ``shard``'s ``local``-th KV head is."""
        if spec.num_kv_heads >= self.size:
            return shard * self.kv_heads(spec) + local
        return shard * spec.num_kv_heads // self.size

    def out_index(self, spec: BaseModelSpec, proj: str, shard: int) -> torch.Tensor:
        """The full projection's output features ``shard`` holds (int64, ascending within a head). Row-parallel
        projections: all of them."""
        self._check_shard(shard)
        dim, n = spec.head_dim, self.size
        if proj == "q_proj":
            heads = spec.num_heads // n
            return torch.arange(shard * heads * dim, (shard + 1) * heads * dim)
        if proj in ("k_proj", "v_proj"):
            heads = [self.kv_head_of(spec, shard, j) for j in range(self.kv_heads(spec))]
            return torch.cat([torch.arange(h * dim, (h + 1) * dim) for h in heads])
        if proj in ("gate_proj", "up_proj"):
            width = spec.intermediate_size // n
            return torch.arange(shard * width, (shard + 1) * width)
        if proj in ROW_PARALLEL:
            return torch.arange(spec.hidden_size)
        raise ValueError(f"unknown projection {proj!r}")

    def in_index(self, spec: BaseModelSpec, proj: str, shard: int) -> torch.Tensor:
        """The full projection's input features ``shard`` holds. Column-parallel projections: all of them."""
        self._check_shard(shard)
        if proj in COLUMN_PARALLEL:
            return torch.arange(spec.hidden_size)
        if proj == "o_proj":
            return self.out_index(spec, "q_proj", shard)  # the shard's heads' attention output
        if proj == "down_proj":
            return self.out_index(spec, "up_proj", shard)
        raise ValueError(f"unknown projection {proj!r}")

    def local_shape(self, spec: BaseModelSpec, proj: str) -> tuple[int, int]:
        """(in_features, out_features) of one shard's piece of ``proj``."""
        return len(self.in_index(spec, proj, 0)), len(self.out_index(spec, proj, 0))

    def lora_in_index(self, spec: BaseModelSpec, proj: str, shard: int) -> torch.Tensor:
        """The input features of ``proj``'s LoRA A that ``shard`` holds: the base's (:meth:`in_index`), or with
        ``fully_sharded_loras`` a column-parallel module's hidden / N slice."""
        if self.fully_sharded_loras and proj in COLUMN_PARALLEL:
            return self._hidden_slice(spec, shard)
        return self.in_index(spec, proj, shard)

    def lora_out_index(self, spec: BaseModelSpec, proj: str, shard: int) -> torch.Tensor:
        """The output features of ``proj``'s LoRA Bt that ``shard`` holds: the base's (:meth:`out_index`), or with
        ``fully_sharded_loras`` a row-parallel module's hidden / N slice."""
        if self.fully_sharded_loras and proj in ROW_PARALLEL:
            return self._hidden_slice(spec, shard)
        return self.out_index(spec, proj, shard)

    def lora_local_shape(self, spec: BaseModelSpec, proj: str) -> tuple[int, int]:
        """(A's width, Bt's width) of one shard's piece of ``proj``'s LoRA."""
        return len(self.lora_in_index(spec, proj, 0)), len(self.lora_out_index(spec, proj, 0))

    def _hidden_slice(self, spec: BaseModelSpec, shard: int) -> torch.Tensor:
        self._check_shard(shard)
        width = spec.hidden_size // self.size
        return torch.arange(shard * width, (shard + 1) * width)

    def _check_shard(self, shard: int) -> None:
        if not 0 <= shard < self.size:
            raise ValueError(f"shard {shard} is outside 0..{self.size - 1}")
