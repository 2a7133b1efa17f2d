"""The command line's arguments that are more than a flag: byte sizes written as text, and options made from the
fields of an options dataclass (`runtime.options.ServeOptions` and the lifecycle objects it holds whole). No web
stack.

A dataclass field is a command-line option where its ``metadata`` names a ``flag``; the rest of its metadata is what
:meth:`argparse.ArgumentParser.add_argument` takes (``help``, ``type``, ``action``, ``dest``, ``metavar``,
``choices``), and:

- the default is the field's, written nowhere else (a byte size as the text it parses from, e.g. ``2GiB``); the help
  may show it with ``%(default)s``, and take ``{name}`` words the command fills (``{each}``: " per replica");
- a bool field is a switch: ``store_true``, or ``store_false`` where its default is True (a ``--no-...`` flag); an int
  field with no ``type`` takes ``type=int``;
- ``serve_only``: only `serve` declares it (`cluster serve`'s replicas keep its default);
- ``env``: an environment variable whose value, where set, is the default;
- ``to_field``: what turns the parsed value into the field's (a repeated flag's list into a tuple).

A field holding a dataclass, with no flag of its own (``RowOptions``, ``TensorParallel``), is walked: its fields'
flags are options too, and :func:`options_from` builds it back whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Iterator
from typing import Any

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30}
_OURS = ("flag", "serve_only", "env", "to_field")  # metadata keys that are not add_argument's


def parse_bytes(text: str) -> int:
    """'2GiB', '512MB', '1e6' -> bytes."""
    match = _SIZE.fullmatch(text.strip())
    unit = (match.group(2) or "").upper().removesuffix("B") if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MB, 1048576)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """Bytes as the text :func:`parse_bytes` reads back: 2147483648 -> '2GiB', 1000 -> '1000'."""
    for unit in ("GI", "MI", "KI"):
        size = int(_UNITS[unit])
        if n >= size and n % size == 0:
            return f"{n // size}{unit[0]}iB"
    return str(n)


def option_fields(cls: type, *, replica: bool = False) -> Iterator[tuple[tuple[str, ...], dataclasses.Field]]:
    """(path, field) of every field of ``cls`` that is a command-line option, nested dataclasses' included, in
    declaration order (path: the field names from ``cls`` down, e.g. ``("rows", "tensor_parallel", "size")``); with
    ``replica`` not the ``serve_only`` ones."""
    for field in dataclasses.fields(cls):
        if "flag" in field.metadata:
            if not (replica and field.metadata.get("serve_only")):
                yield (field.name,), field
        elif (nested := _nested(field)) is not None:
            for path, inner in option_fields(nested, replica=replica):
                yield (field.name, *path), inner


def add_options(parser: argparse.ArgumentParser, cls: type, *, replica: bool = False, **words: str) -> None:
    """Declare every option field of ``cls`` (:func:`option_fields`) on ``parser``; ``words`` fill the helps'
    ``{name}`` placeholders."""
    for _, field in option_fields(cls, replica=replica):
        meta = field.metadata
        kwargs: dict[str, Any] = {key: value for key, value in meta.items() if key not in _OURS}
        default = field_default(field)
        if "env" in meta:
            default = os.environ.get(meta["env"], default)
        if isinstance(default, bool):
            kwargs.setdefault("action", "store_false" if default else "store_true")
        elif isinstance(default, int) and "type" not in kwargs:
            kwargs["type"] = int
        if kwargs.get("type") is parse_bytes and isinstance(default, int):
            default = format_bytes(default)  # argparse parses a text default with `type`: shown as written
        kwargs["help"] = kwargs["help"].format(**words)
        parser.add_argument(meta["flag"], default=default, **kwargs)


def options_from(cls: type, args: argparse.Namespace, *, replica: bool = False, **given: Any) -> Any:
    """``cls`` built from the options :func:`add_options` declared, read back by field (nested dataclasses built
    whole); ``given`` are fields that are not options, fields not declared (``replica``) keep their defaults."""
    values = dict(given)
    for field in dataclasses.fields(cls):
        meta = field.metadata
        if "flag" in meta:
            if not (replica and meta.get("serve_only")):
                value = getattr(args, dest(field))
                values[field.name] = meta["to_field"](value) if "to_field" in meta else value
        elif (nested := _nested(field)) is not None:
            values[field.name] = options_from(nested, args, replica=replica)
    return cls(**values)


def dest(field: dataclasses.Field) -> str:
    """The namespace attribute an option field is parsed into: its ``dest``, or argparse's name for its flag."""
    return field.metadata.get("dest") or field.metadata["flag"].lstrip("-").replace("-", "_")


def field_default(field: dataclasses.Field) -> Any:
    """A field's default value (a new one from its factory)."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _nested(field: dataclasses.Field) -> type | None:
    """The dataclass a field without a flag holds whole (its default factory), if it holds one."""
    factory = field.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None
