"""A package's names loaded on first use (PEP 562), so importing the package costs nothing until one is used:

    __all__, __getattr__, __dir__ = lazy_names(__name__, {"manager": ("AdapterManager",), ...})

`exports` maps each submodule (relative to the package) to the names it gives the package. A name is imported from
its submodule on first access and then kept in the package's namespace, so later lookups are plain attributes.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    package: str, exports: Mapping[str, tuple[str, ...]]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """The package's ``__all__``, module ``__getattr__`` and ``__dir__`` for ``exports``."""
    where = {name: module for module, names in exports.items() for name in names}
    namespace = sys.modules[package].__dict__

    def load(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value  # the next lookup is a plain attribute
        return value

    def listing() -> list[str]:
        return sorted({*namespace, *where})

    return sorted(where), load, listing
