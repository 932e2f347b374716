"""The GSRQ cache's options as command-line options: names, defaults, choices and help read from GSRQCacheConfig.

``hf_kvcodecs.gsrq.config`` is imported by ``import hf_kvcodecs`` already, so building the parser imports nothing
more for it (tests/test_cli.py checks what the parser imports).
"""

from __future__ import annotations

import argparse
import typing

from ..gsrq.config import GSRQCacheConfig


def _value_type(name: str):
    """The type argparse converts an option's value with: the field's type without its ``None``."""
    hint = typing.get_type_hints(GSRQCacheConfig)[name]
    kinds = [kind for kind in typing.get_args(hint) if kind is not type(None)] or [hint]
    return kinds[0]


def gsrq_cli_options(*, skip: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The GSRQCacheConfig options a command offers (those meant for the command line, less ``skip``: options the
    command offers in its own way)."""
    return tuple(name for name in GSRQCacheConfig.option_names(cli=True) if name not in skip)


def add_gsrq_cache_arguments(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """``--window-length``, ``--attention``, ...: one option per :func:`gsrq_cli_options` name, in a group of their
    own, with GSRQCacheConfig's default, choices and help."""
    group = parser.add_argument_group("GSRQ cache options", "what cache_config={...} sets when generating in Python")
    defaults = GSRQCacheConfig.defaults()
    for name in gsrq_cli_options(skip=skip):
        metadata = GSRQCacheConfig.metadata(name)
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, type=_value_type(name), default=defaults[name],
                           choices=metadata["choices"], help=metadata["help"])


def gsrq_cache_options(args: argparse.Namespace, *, skip: tuple[str, ...] = ()) -> dict:
    """The options :func:`add_gsrq_cache_arguments` added, as ``cache_config`` keys, those left at ``None`` (which
    stands for another option's value) left out."""
    return {name: getattr(args, name) for name in gsrq_cli_options(skip=skip) if getattr(args, name) is not None}
