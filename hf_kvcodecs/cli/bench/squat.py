"""`hf-kvcodecs bench squat`: SQuaT against its ablations, cross-entropy QAT and RTN at several bit settings, with the
same data, steps and seed for every arm (JSON + Markdown; one loss curve per run; the logged mechanism per distilled
layer)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .._common import add_command, load_model, positive_int
from ..defaults import CALIBRATION_TEXT, EVALUATION_TEXT
from ..squat import ACTIVATION_GRANULARITIES, SQUAT_ARMS, SQUAT_RUN, WEIGHT_INIT_HELP, WEIGHT_INITS, weight_grid

# Mirror of training.run.BENCH_ARMS (the parser imports no torch-based module): `squat`'s arms and feature-only.
BENCH_SQUAT_ARMS = (*SQUAT_ARMS, "feature-only")


def add_parser(bench) -> None:
    squat = add_command(bench, "squat", "SQuaT vs raw-teacher-feature KD, logit KD, cross-entropy QAT and RTN")
    squat.add_argument("--model", default="default", help="'default', a Hub id or a local path")
    squat.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    squat.add_argument("--settings", nargs="+", default=["W4A16", "W2A16", "W4A4", "W2A4"],
                       help="WxAy: weight bits and activation bits at the blocks' linear inputs (16: floating point). "
                            "W4 with --group-size 32 and the minmax grid (asymmetric) is the default model's own Q4_1 "
                            "grid: its weights are then lossless")
    squat.add_argument("--arms", nargs="+", choices=BENCH_SQUAT_ARMS, default=list(SQUAT_ARMS),
                       help="objectives (feature-only: SQuaT's feature term with no logit term)")
    squat.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                       help="seeds of SQuaT and the raw-teacher-feature ablation")
    squat.add_argument("--reference-seeds", type=int, nargs="+", default=None,
                       help="seeds of the other arms, logit-kd, cross-entropy and feature-only; SQuaT is compared "
                            "with every arm over the seeds both ran (default: the first of --seeds)")
    squat.add_argument("--steps", type=positive_int, default=SQUAT_RUN["steps"], help="optimizer steps per run")
    squat.add_argument("--seq-len", type=positive_int, default=SQUAT_RUN["sequence_tokens"],
                       help="tokens per training window")
    squat.add_argument("--batch-size", type=positive_int, default=SQUAT_RUN["batch_size"], help="windows per step")
    squat.add_argument("--act-modules", nargs="+", default=SQUAT_RUN["activation_modules"], metavar="PATTERN",
                       help="quantize only these layers' inputs (names, suffixes such as 'mlp.gate_proj', shell globs "
                            "or regular expressions), e.g. 'model.layers.29.mlp.gate_proj' 'model.layers.29.mlp.up_proj' "
                            "(default: every quantized layer; needs activation bits below 16 in every setting)")
    squat.add_argument("--act-granularity", choices=ACTIVATION_GRANULARITIES, default=SQUAT_RUN["activation_granularity"],
                       help="one static activation step per layer (tensor) or per input channel (channel)")
    squat.add_argument("--group-size", type=positive_int, default=SQUAT_RUN["group_size"], help="weights per scale")
    squat.add_argument("--weight-init", choices=WEIGHT_INITS, default="minmax", help=WEIGHT_INIT_HELP)
    squat.add_argument("--lr", type=float, default=SQUAT_RUN["learning_rate"], help="peak learning rate of weights")
    squat.add_argument("--quantizer-lr", type=float, default=SQUAT_RUN["quantizer_learning_rate"],
                       help="learning rate of weight scales/offsets and activation steps")
    squat.add_argument("--act-step-lr", type=float, default=SQUAT_RUN["activation_step_learning_rate"],
                       help="learning rate of the activation steps alone, in an optimizer group of their own "
                            "(default: --quantizer-lr; 0 freezes them at their data-based start)")
    squat.add_argument("--distillation-layers", type=int, nargs="+", default=None, metavar="LAYER",
                       help="decoder layers whose feature (the input of mlp.gate_proj) is distilled, negative from "
                            "the end; their terms are averaged and each is logged (default: the last)")
    squat.add_argument("--eval-windows", type=positive_int, default=SQUAT_RUN["eval_windows"],
                       help="held-out evaluation windows")
    squat.add_argument("--eval-tokens", type=positive_int, default=SQUAT_RUN["eval_tokens"], help="tokens per window")
    squat.add_argument("--out", type=Path, default=Path("benchmarks/results/squat"),
                       help="folder for squat.json/.md and one folder per run (an existing squat.json is continued)")
    squat.set_defaults(func=command)


def command(args) -> int:
    from ...bench.squat import run_squat_bench
    from ...text import load_corpus, tokenize_corpus
    from ...training.run import SQuaTRunSettings

    if args.act_modules and any(setting.endswith("A16") for setting in args.settings):
        raise ValueError("--act-modules chooses the layers whose inputs the settings' activation bits quantize; "
                         "every setting needs activation bits 2 to 8 (e.g. W4A2).")
    train = load_corpus(None, default=CALIBRATION_TEXT)
    evaluation = load_corpus(None, default=EVALUATION_TEXT)
    loaded = load_model(argparse.Namespace(model=args.model, threads=args.threads))
    base = SQuaTRunSettings(steps=args.steps, sequence_tokens=args.seq_len, batch_size=args.batch_size,
                            group_size=args.group_size, **weight_grid(args.weight_init),
                            activation_granularity=args.act_granularity, activation_modules=args.act_modules,
                            activation_step_learning_rate=args.act_step_lr,
                            distillation_layers=args.distillation_layers, learning_rate=args.lr,
                            quantizer_learning_rate=args.quantizer_lr, eval_windows=args.eval_windows,
                            eval_tokens=args.eval_tokens)
    run_squat_bench(loaded, tokenize_corpus(loaded.tokenizer, train), tokenize_corpus(loaded.tokenizer, evaluation),
                    settings=args.settings, arms=args.arms, seeds=args.seeds, reference_seeds=args.reference_seeds,
                    base=base, out=args.out,
                    train_description=train.description, eval_description=evaluation.description)
    print((args.out / "squat.md").read_text())
    return 0
