"""`hf-kvcodecs scd make-consumer`: fine-tune a consumer of a model, with a LoRA adapter or every weight (a real
fine-tuned variant for SCD to transfer caches to), report how far it moved, and save it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ._common import add_command, add_model_arguments, load_model, positive_int
from .defaults import CALIBRATION_TEXT, EVALUATION_TEXT

# Mirrors of library values (the parser imports no torch-based module): text.PYTHON_SOURCE and the defaults of
# scd.consumer.ConsumerFitSettings; tests/test_scd_consumer.py checks them against the library.
CONSUMER_TEXT = "python-stdlib-source"
CONSUMER_FIT = {"method": "lora", "steps": 150, "sequence_tokens": 256, "batch_size": 4, "learning_rate": 2e-4, "lora_rank": 16,
                "lora_alpha": 32, "seed": 0, "eval_windows": 32}
# The texts the perplexity shift is measured on besides the fine-tuning text's held-out end: SCD's calibration text and
# the evaluation text.
CONSUMER_EVAL_TEXTS = (CALIBRATION_TEXT, EVALUATION_TEXT)


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not number > 0.0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return number


def add_parser(scd_commands) -> None:
    make = add_command(scd_commands, "make-consumer",
                       "fine-tune a consumer of a model on real text (a LoRA adapter, or every weight), report its "
                       "perplexity shift, save it")
    add_model_arguments(make)
    make.add_argument("--text", nargs="+", default=None,
                      help="fine-tuning text: files, a built-in corpus name, or datasets:NAME[:CONFIG]:SPLIT "
                           f"(default: {CONSUMER_TEXT}); its last tenth is held out for the perplexity")
    make.add_argument("--method", choices=("lora", "full"), default=CONSUMER_FIT["method"],
                      help="lora: an adapter on every projection, saved as a few MB naming the base model; full: every "
                           "weight trained, saved as a whole model directory (a fine-tune that moves the model further)")
    make.add_argument("--steps", type=positive_int, default=CONSUMER_FIT["steps"], help="optimizer steps")
    make.add_argument("--seq-len", type=positive_int, default=CONSUMER_FIT["sequence_tokens"],
                      help="tokens per training window")
    make.add_argument("--batch-size", type=positive_int, default=CONSUMER_FIT["batch_size"],
                      help="training windows per step")
    make.add_argument("--lr", type=_positive_float, default=CONSUMER_FIT["learning_rate"],
                      help="peak AdamW learning rate (linear warmup, then linear decay to zero)")
    make.add_argument("--rank", type=positive_int, default=CONSUMER_FIT["lora_rank"],
                      help="LoRA rank (alpha is twice the rank, as at the default)")
    make.add_argument("--eval-windows", type=positive_int, default=CONSUMER_FIT["eval_windows"],
                      help=f"held-out windows per text (fine-tuning text, {', '.join(CONSUMER_EVAL_TEXTS)}) the "
                           "perplexity shift is measured on")
    make.add_argument("--seed", type=int, default=CONSUMER_FIT["seed"],
                      help="seeds the adapter's initialisation and the choice of training windows")
    make.add_argument("--out", required=True, type=Path,
                      help="directory the adapter, its sidecar and report.json / report.md are saved in (created if "
                           "missing; refused if not empty, unless --overwrite)")
    make.add_argument("--overwrite", action="store_true", help="write over what --out already holds")
    make.set_defaults(func=run)


def run(args) -> int:
    from ..scd.consumer import ConsumerFitSettings, check_consumer_directory, make_consumer, report_markdown
    from ..text import load_corpus

    settings = ConsumerFitSettings(method=args.method, steps=args.steps, sequence_tokens=args.seq_len, batch_size=args.batch_size,
                                   learning_rate=args.lr, lora_rank=args.rank, lora_alpha=2 * args.rank,
                                   seed=args.seed, eval_windows=args.eval_windows)
    check_consumer_directory(args.out, overwrite=args.overwrite)  # before minutes of loading and fine-tuning
    train = load_corpus(args.text, default=CONSUMER_TEXT)  # a missing file fails before the model load
    eval_corpora = {name: load_corpus(name, default=name) for name in CONSUMER_EVAL_TEXTS}
    loaded = load_model(args)
    report = make_consumer(loaded, train, settings=settings, out=args.out, eval_corpora=eval_corpora,
                           overwrite=args.overwrite, train_name=CONSUMER_TEXT if args.text is None else "--text")
    print(report_markdown(report))
    print(json.dumps({"out": report["adapter"], "seconds": round(report["seconds_total"], 1)}, indent=2))
    return 0
