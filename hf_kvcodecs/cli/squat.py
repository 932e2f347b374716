"""`hf-kvcodecs squat`: train a low-bit student of a model with SQuaT (or one of its ablations) on real text, report
it against the float teacher and round-to-nearest on a held-out text, and save (or push) the packed student."""

from __future__ import annotations

import json
from pathlib import Path

from ._common import add_command, add_model_arguments, load_model, positive_int
from .defaults import CALIBRATION_TEXT, EVALUATION_TEXT, ZERO_POINT_HELP, ZERO_POINTS

# Mirrors of training.run.ARMS and SQuaTRunSettings (the parser imports no torch-based module); tests/test_cli.py
# checks them against the library.
SQUAT_ARMS = ("cross-entropy", "logit-kd", "raw-teacher-feature", "squat")
SQUAT_RUN = {"steps": 100, "sequence_tokens": 512, "batch_size": 4, "learning_rate": 1e-4,
             "quantizer_learning_rate": 1e-5, "group_size": 64, "eval_windows": 8, "eval_tokens": 1024, "seed": 0,
             "activation_granularity": "channel", "activation_modules": None, "activation_step_learning_rate": None,
             "zero_point": "float"}
ACTIVATION_GRANULARITIES = ("tensor", "channel")
# Mirror of quantization.modules.WEIGHT_INITS; "stretched" is ParetoQ's symmetric grid, the others are min-max grids.
WEIGHT_INITS = ("minmax", "stretched", "mse")
WEIGHT_INIT_HELP = ("how the weight grid starts: min-max round-to-nearest; ParetoQ's stretched elastic grid (symmetric, "
                    "no zero level); or min-max clipped per group to its least squared error")


def weight_grid(weight_init: str) -> dict:
    """The run settings of a weight initialisation: the stretched grid is symmetric, the others are not."""
    return {"weight_init": weight_init, "symmetric": weight_init == "stretched"}


def add_parser(commands) -> None:
    squat = add_command(commands, "squat", "train a low-bit student with SQuaT on real text, evaluate it, save it")
    add_model_arguments(squat)
    squat.add_argument("--weight-bits", type=int, default=4, help="bits per weight of the linear layers (1-8)")
    squat.add_argument("--act-bits", type=int, default=16,
                       help="bits of the linear layers' inputs (2-8; 16 keeps them in floating point)")
    squat.add_argument("--act-modules", nargs="+", default=SQUAT_RUN["activation_modules"], metavar="PATTERN",
                       help="quantize only these layers' inputs: names, suffixes ('mlp.gate_proj'), shell globs or "
                            "regular expressions matched against module names, e.g. 'model.layers.23.mlp.gate_proj' "
                            "'model.layers.23.mlp.up_proj' (default: every quantized layer; a pattern matching none "
                            "is an error listing the names)")
    squat.add_argument("--act-granularity", choices=ACTIVATION_GRANULARITIES, default=SQUAT_RUN["activation_granularity"],
                       help="one static activation step per layer (tensor) or per input channel (channel)")
    squat.add_argument("--group-size", type=positive_int, default=SQUAT_RUN["group_size"], help="weights per scale")
    squat.add_argument("--weight-init", choices=WEIGHT_INITS, default="minmax", help=WEIGHT_INIT_HELP)
    squat.add_argument("--stretched", dest="weight_init", action="store_const", const="stretched",
                       help="same as --weight-init stretched")
    squat.add_argument("--zero-point", choices=ZERO_POINTS, default=SQUAT_RUN["zero_point"],
                       help=ZERO_POINT_HELP + "; learned through a straight-through rounding")
    squat.add_argument("--arm", choices=SQUAT_ARMS, default="squat",
                       help="objective: SQuaT, or an ablation (raw-teacher-feature, logit-kd, cross-entropy)")
    squat.add_argument("--steps", type=positive_int, default=SQUAT_RUN["steps"], help="optimizer steps")
    squat.add_argument("--seq-len", type=positive_int, default=SQUAT_RUN["sequence_tokens"], help="tokens per window")
    squat.add_argument("--batch-size", type=positive_int, default=SQUAT_RUN["batch_size"], help="windows per step")
    squat.add_argument("--lr", type=float, default=SQUAT_RUN["learning_rate"], help="peak learning rate of weights")
    squat.add_argument("--quantizer-lr", type=float, default=SQUAT_RUN["quantizer_learning_rate"],
                       help="learning rate of weight scales/offsets and activation steps")
    squat.add_argument("--act-step-lr", type=float, default=SQUAT_RUN["activation_step_learning_rate"],
                       help="learning rate of the activation steps alone, in an optimizer group of their own "
                            "(default: --quantizer-lr; 0 freezes them at their data-based start)")
    squat.add_argument("--text", nargs="+", default=None,
                       help=f"training text: files, a built-in corpus or datasets:NAME[:CONFIG]:SPLIT (default: "
                            f"{CALIBRATION_TEXT})")
    squat.add_argument("--eval-text", nargs="+", default=None, help=f"evaluation text (default: {EVALUATION_TEXT})")
    squat.add_argument("--eval-windows", type=positive_int, default=SQUAT_RUN["eval_windows"],
                       help="held-out evaluation windows")
    squat.add_argument("--eval-tokens", type=positive_int, default=SQUAT_RUN["eval_tokens"], help="tokens per window")
    squat.add_argument("--seed", type=int, default=SQUAT_RUN["seed"], help="data order and window choice")
    squat.add_argument("--out", required=True, type=Path,
                       help="folder for report.json/.md, loss.png and the packed student (model/)")
    squat.add_argument("--push-to-hub", default=None, metavar="REPO", help="also upload the packed student (default: no upload)")
    squat.set_defaults(func=run)


def run(args) -> int:
    from ..text import load_corpus, tokenize_corpus
    from ..training.run import SQuaTRunSettings, run_squat

    if args.act_modules and args.act_bits == 16:
        raise ValueError("--act-modules chooses the layers whose inputs --act-bits quantizes; give --act-bits 2 to 8.")
    settings = SQuaTRunSettings(
        weight_bits=args.weight_bits, activation_bits=None if args.act_bits == 16 else args.act_bits,
        activation_granularity=args.act_granularity, activation_modules=args.act_modules,
        activation_step_learning_rate=args.act_step_lr, group_size=args.group_size, **weight_grid(args.weight_init),
        zero_point=args.zero_point,
        arm=args.arm, steps=args.steps, sequence_tokens=args.seq_len, batch_size=args.batch_size,
        learning_rate=args.lr, quantizer_learning_rate=args.quantizer_lr, eval_windows=args.eval_windows,
        eval_tokens=args.eval_tokens, seed=args.seed)
    train = load_corpus(args.text, default=CALIBRATION_TEXT)
    evaluation = load_corpus(args.eval_text, default=EVALUATION_TEXT)
    if train.sha256 == evaluation.sha256:
        raise ValueError("The training and evaluation texts are the same; evaluate on a held-out text.")
    loaded = load_model(args)
    report = run_squat(loaded, tokenize_corpus(loaded.tokenizer, train), tokenize_corpus(loaded.tokenizer, evaluation),
                       settings, args.out, train_description=train.description,
                       eval_description=evaluation.description, push_to_hub=args.push_to_hub)
    print((args.out / "report.md").read_text())
    print(json.dumps({"out": str(args.out), "seconds": round(report["seconds"], 1)}, indent=2))
    return 0
