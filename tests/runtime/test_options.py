"""The serve options: each one field (`runtime.options.ServeOptions`, or a lifecycle object it holds whole), the
command line made from the fields, and the options read back from it."""

from __future__ import annotations

import argparse
from functools import reduce
from pathlib import Path

from adapter_manager.runtime.cli import _parser
from adapter_manager.runtime.cli_args import dest, field_default, format_bytes, option_fields, parse_bytes
from adapter_manager.runtime.client import TOKEN_ENV
from adapter_manager.runtime.options import ServeOptions


def test_each_serve_option_is_one_field_declared_once_with_its_default_and_read_back(monkeypatch):
    """A serve option is one field (of `ServeOptions`, or of the `RowOptions` / `TensorParallel` it holds whole): its
    flag is declared once, in `serve` and (but the serve-only ones) `cluster serve`, with the field's default and no
    other serve flag beside it; a value given on the command line comes back in that field and no other."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    cluster_own = {"--replicas", "--address", "--num-cpus", "--replica-cpus", "--port", "--metrics-port", "--state-dir"}
    cluster_own |= {"--pinned-slots", "--no-multiplex"}
    for names, replica, own in (
        (["serve"], False, {"--adapter", "--workdir"}),
        (["cluster", "serve"], True, cluster_own),
    ):
        parser = _command(_parser(), names)
        fields = list(option_fields(ServeOptions, replica=replica))
        flags = [flag for action in parser._actions for flag in action.option_strings]
        declared = [field.metadata["flag"] for _, field in fields]
        assert set(flags) - set(declared) == {"-h", "--help", "--random", "--model-name", *own}, names
        assert len(declared) == len(set(declared)) and all(flags.count(flag) == 1 for flag in declared), names
        defaults = parser.parse_args(["m"])
        for path, field in fields:
            default, to_field = field_default(field), field.metadata.get("to_field", lambda value: value)
            assert to_field(getattr(defaults, dest(field))) == default, field.metadata["flag"]
            value = _other_value(field.metadata, default)
            got = ServeOptions.from_args(parser.parse_args(["m", *_argv(field.metadata, value)]), "m", replica=replica)
            assert reduce(getattr, path, got) == value, path
            assert all(reduce(getattr, other, got) == field_default(f) for other, f in fields if other != path), path
    monkeypatch.setenv(TOKEN_ENV, "secret")  # the admin token's default: the environment's as the parser is made
    assert ServeOptions.from_args(_parser().parse_args(["serve", "m"]), "m").admin_token == "secret"


def _command(parser, names: list[str]):
    """The sub-command parser ``names`` names (``["cluster", "serve"]``)."""
    for name in names:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def _other_value(meta, default):
    """A value of an option field other than its default."""
    if isinstance(default, bool):
        return not default
    if "choices" in meta:
        return next(choice for choice in meta["choices"] if choice != default)
    if meta.get("action") == "append":
        return (Path("/a"), Path("/b"))
    if meta.get("type") is parse_bytes:
        return 3 << 30 if default is None else 2 * default
    if meta.get("type") is Path:
        return Path("/state")
    if isinstance(default, int):
        return default + 3
    assert default is None or isinstance(default, str), f"{meta['flag']}: a new kind of option, give it a value here"
    return "other"


def _argv(meta, value) -> list[str]:
    """The command line that sets an option field to ``value``."""
    if isinstance(value, bool):
        return [meta["flag"]]
    text = format_bytes if meta.get("type") is parse_bytes else str
    return [arg for item in (value if isinstance(value, tuple) else (value,)) for arg in (meta["flag"], text(item))]
