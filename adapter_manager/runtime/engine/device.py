"""What the engine asks of the device it runs on: its free memory (the KV pool's default bound) and, on XLA, the
step's one sync."""

from __future__ import annotations

import os

import torch


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory of the device the caches live on (CPU: available RAM); None where it cannot be asked (XLA)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def xla_sync() -> None:
    """Cut the lazy graph of every live tensor on the XLA device and run it (a traced step's one sync)."""
    import torch_xla

    torch_xla.sync()
