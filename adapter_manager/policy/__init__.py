"""What moves adapters and what they may evict: TinyLFU admission, the prefetcher, the background workers."""

from .admission import FrequencySketch, SketchConfig
from .prefetch import PrefetchConfig, Prefetcher
from .workers import background_executor

__all__ = ["FrequencySketch", "PrefetchConfig", "Prefetcher", "SketchConfig", "background_executor"]
