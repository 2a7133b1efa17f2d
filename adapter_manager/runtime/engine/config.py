"""The engine's config (sizes, policies, token buckets) and what one step reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from adapter_manager.kernels import KernelConfig

from .scheduler import SchedulerConfig


@dataclass
class EngineConfig:
    """Sizes and policies of one engine."""

    max_batch: int = 16  # sequences in flight, at most (a cap: the KV blocks decide how many fit)
    max_seq_len: int = 2048  # prompt + generated tokens of one sequence, at most
    kv_cache_bytes: int | None = None  # bytes of the KV block pool (every layer's K and V); None: max_batch
    # sequences of max_seq_len tokens (every sequence at its longest), at most half the device's free memory
    kv_block_size: int = 16  # tokens per KV block
    prefix_caching: bool = True  # reuse cached full blocks of a prefix per adapter (and for the base model)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # token budget and fairness bound
    kernels: KernelConfig | None = None  # shrink/expand backend choice (None: by device)
    eos_ids: tuple[int, ...] | None = None  # end-of-sequence ids stopping every request; None: the model config's
    # (generation_config.json, else config.json); () never stops on eos. A request's ignore_eos skips them.
    token_buckets: tuple[int, ...] | None = None  # traced devices: step token counts padded up to one of these
    # (ascending; the last >= the token budget); None: powers of two from 16 up to the budget. Eager devices ignore it.
    deterministic: bool = False  # every request's tokens and logprobs independent of the batch it shares (its
    # size, the other adapters, chunking, preemption, prefix hits): fixed-order matmuls on plain weights and attention
    # per token (the CPU library's ops, else their torch forms; SGLang's deterministic inference, vLLM's
    # VLLM_BATCH_INVARIANT; refused on XLA)
    cuda_graphs: bool = True  # cuda with the triton backend: replay decode steps from CUDA graphs (False: eager, as
    # vLLM's enforce_eager); every other device ignores it

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_seq_len < 2:
            raise ValueError(f"max_batch ({self.max_batch}) must be >= 1 and max_seq_len ({self.max_seq_len}) >= 2")
        if self.kv_block_size < 1 or (self.kv_cache_bytes is not None and self.kv_cache_bytes < 1):
            raise ValueError(
                f"kv_block_size ({self.kv_block_size}) and kv_cache_bytes ({self.kv_cache_bytes}) must be positive"
            )
        if self.token_buckets is not None:
            buckets = self.token_buckets = tuple(self.token_buckets)
            budget = self.scheduler.token_budget
            if not buckets or min(buckets) < 1 or list(buckets) != sorted(set(buckets)) or buckets[-1] < budget:
                raise ValueError(
                    f"token_buckets {buckets} must be positive, strictly ascending, and end at >= the token budget "
                    f"({budget})"
                )

    def kv_blocks(self, block_bytes: int, free_device_bytes: int | None) -> int:
        """The KV pool's blocks, each ``block_bytes`` (a block of every layer's K and V). Raises ValueError when
        ``kv_cache_bytes`` cannot hold one sequence of ``max_seq_len`` tokens (it could never run)."""
        longest = -(-self.max_seq_len // self.kv_block_size)
        if self.kv_cache_bytes is not None:
            blocks = self.kv_cache_bytes // block_bytes
        else:
            blocks = self.max_batch * longest
            if free_device_bytes is not None:
                blocks = max(longest, min(blocks, free_device_bytes // 2 // block_bytes))
        if blocks < longest:
            raise ValueError(
                f"kv_cache_bytes {self.kv_cache_bytes} holds {blocks} blocks of {block_bytes} bytes; one sequence of "
                f"max_seq_len {self.max_seq_len} needs {longest} ({longest * block_bytes} bytes)"
            )
        return blocks

    def buckets(self) -> tuple[int, ...]:
        """The token buckets a traced step pads to: ``token_buckets``, or powers of two from 16 up to the budget."""
        if self.token_buckets is not None:
            return self.token_buckets
        budget, buckets = self.scheduler.token_budget, [16]
        while buckets[-1] < budget:
            buckets.append(buckets[-1] * 2)
        return tuple(buckets)


@dataclass(frozen=True)
class StepStats:
    """What one step did."""

    tokens: int  # tokens in the forward pass
    sequences: int  # sequences in the step
    adapters: int  # distinct adapters in the step
    finished: int  # requests that ended in this step
