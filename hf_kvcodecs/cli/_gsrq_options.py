"""The GSRQ cache's options as command-line options: names, types, defaults, choices and help of GSRQCacheConfig.

They are read from the copy in ``.defaults`` (checked against GSRQCacheConfig by tests/test_cli.py): GSRQCacheConfig's
module imports torch, which building the parser must not.
"""

from __future__ import annotations

import argparse

from .defaults import GSRQ_CACHE_OPTIONS


def gsrq_cli_options(*, skip: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The GSRQCacheConfig options a command offers (those meant for the command line, less ``skip``: options the
    command offers in its own way)."""
    return tuple(name for name in GSRQ_CACHE_OPTIONS if name not in skip)


def add_gsrq_cache_arguments(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """``--window-length``, ``--attention``, ...: one option per :func:`gsrq_cli_options` name, in a group of their
    own, with GSRQCacheConfig's type, default, choices and help."""
    group = parser.add_argument_group("GSRQ cache options", "what cache_config={...} sets when generating in Python")
    for name in gsrq_cli_options(skip=skip):
        option = GSRQ_CACHE_OPTIONS[name]
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, type=option["type"], default=option["default"],
                           choices=option["choices"], help=option["help"])


def gsrq_cache_options(args: argparse.Namespace, *, skip: tuple[str, ...] = ()) -> dict:
    """The options :func:`add_gsrq_cache_arguments` added, as ``cache_config`` keys, those left at ``None`` (which
    stands for another option's value) left out."""
    return {name: getattr(args, name) for name in gsrq_cli_options(skip=skip) if getattr(args, name) is not None}
