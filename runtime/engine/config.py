"""The engine's config (sizes, policies, token buckets) and what one step reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from kernels import KernelConfig

from .scheduler import SchedulerConfig


@dataclass
class EngineConfig:
    """Sizes and policies of one engine."""

    max_batch: int = 16  # sequences in flight: rows of the KV cache
    max_seq_len: int = 2048  # prompt + generated tokens of one sequence, at most
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # token budget and fairness bound
    kernels: KernelConfig | None = None  # shrink/expand backend choice (None: by device)
    eos_ids: tuple[int, ...] | None = None  # end-of-sequence ids stopping every request; None: the model config's
    # (generation_config.json, else config.json); () never stops on eos. A request's ignore_eos skips them.
    token_buckets: tuple[int, ...] | None = None  # traced devices: step token counts padded up to one of these
    # (ascending; the last >= the token budget); None: powers of two from 16 up to the budget. Eager devices ignore it.
    cuda_graphs: bool = True  # cuda with the triton backend: replay decode steps from CUDA graphs (False: eager, as
    # vLLM's enforce_eager); every other device ignores it

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_seq_len < 2:
            raise ValueError(f"max_batch ({self.max_batch}) must be >= 1 and max_seq_len ({self.max_seq_len}) >= 2")
        if self.token_buckets is not None:
            buckets = self.token_buckets = tuple(self.token_buckets)
            budget = self.scheduler.token_budget
            if not buckets or min(buckets) < 1 or list(buckets) != sorted(set(buckets)) or buckets[-1] < budget:
                raise ValueError(
                    f"token_buckets {buckets} must be positive, strictly ascending, and end at >= the token budget "
                    f"({budget})"
                )

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
