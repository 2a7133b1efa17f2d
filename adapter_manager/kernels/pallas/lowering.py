"""The Pallas kernels lowered for a TPU without one: ``jax.export`` for the ``tpu`` platform runs Mosaic's lowering
on any machine and refuses what a TPU would (a block whose last two dimensions are neither multiples of (8, 128) nor
the array's, shapes that disagree), where interpret mode runs both without complaint."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import export

TPU_CUSTOM_CALL = "tpu_custom_call"
"""What a Pallas kernel becomes in a TPU module: a Mosaic custom call."""


class MosaicLoweringError(ValueError):
    """A kernel that does not lower for TPU: what was lowered, and Mosaic's (or JAX's) reason."""


def lower_for_tpu(fn: Callable, *args: jax.ShapeDtypeStruct, what: str = "") -> str:
    """The StableHLO text of ``jax.jit(fn)`` exported for TPU at the argument shapes ``args``; raises
    :class:`MosaicLoweringError` naming ``what`` (default ``fn``'s name) when lowering refuses it or the module holds
    no Mosaic kernel."""
    name = what or getattr(fn, "__name__", repr(fn))
    try:
        module = export.export(jax.jit(fn), platforms=("tpu",))(*args).mlir_module()
    except Exception as err:  # noqa: BLE001 - any refusal of the lowering is the answer, with its reason
        raise MosaicLoweringError(f"{name} does not lower for TPU: {type(err).__name__}: {err}") from err
    if TPU_CUSTOM_CALL not in module:
        raise MosaicLoweringError(f"{name} lowered for TPU without a {TPU_CUSTOM_CALL} (no Pallas kernel in it)")
    return module
