"""Continuous batching over the model with adapter-aware scheduling; importable without any web stack."""

from .engine import Engine, EngineConfig, StepStats
from .request import Request, RequestFailedError, RequestHandle
from .sampling import SamplingParams, SamplingParamsError, TokenLogprobs
from .scheduler import ScheduledChunk, SchedulerConfig, StepPlan, plan_step

__all__ = [
    "Engine",
    "EngineConfig",
    "Request",
    "RequestFailedError",
    "RequestHandle",
    "SamplingParams",
    "SamplingParamsError",
    "ScheduledChunk",
    "SchedulerConfig",
    "StepPlan",
    "StepStats",
    "TokenLogprobs",
    "plan_step",
]
