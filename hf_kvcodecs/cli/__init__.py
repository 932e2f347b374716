"""Command line: `hf-kvcodecs demo | calibrate | push-codebooks | compress | export | bench kv | bench memory |
bench codec | bench weights | bench split | bench decode | scd make-consumer | scd fit`."""

# Building the parser and printing --help import neither torch nor transformers (`import hf_kvcodecs` imports neither
# either): each command imports what it needs when it runs, and the values the parser shows come from .defaults
# (checked against the library by tests/test_cli.py).

from __future__ import annotations

import argparse
import logging
import sys

from . import _common, bench, calibrate, compress, demo, export, push, scd, squat
from ._common import HelpFormatter

# The model load every command goes through, looked up here at each call (see _common.load_model).
_load = _common.load

__all__ = ["build_parser", "main", "run"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-kvcodecs", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at INFO level, and show the traceback of bad input instead of a one-line error")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in (demo, calibrate, push, compress, export, bench, scd, squat):
        module.add_parser(commands)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ..models import DefaultModelMissingError

    try:
        return args.func(args)
    except DefaultModelMissingError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def run(argv=None) -> int:
    """The ``hf-kvcodecs`` console script: :func:`main`, with bad input (which raises ``ValueError``,
    ``FileNotFoundError`` or ``FileExistsError`` carrying what is wrong and how to fix it) reported in one line rather than a traceback;
    ``--verbose`` keeps the traceback."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    try:
        return main(arguments)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        if {"-v", "--verbose"} & set(arguments):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
