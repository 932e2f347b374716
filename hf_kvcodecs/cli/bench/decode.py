"""`hf-kvcodecs bench decode`: decode tokens/s and decode-time memory of the code-reading GSRQ cache and the rest."""

from __future__ import annotations

import shlex
from pathlib import Path

from .._common import add_command, add_model_arguments, load_model, positive_int, write_results
from ..defaults import CALIBRATION, DECODE_CONTEXTS, DECODE_STEPS, EVALUATION_TEXT

REPEATS = 2


def add_parser(bench) -> None:
    decode = add_command(bench, "decode", "decode tokens/s and decode-time memory: code-reading GSRQ vs the rest")
    add_model_arguments(decode)
    decode.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                        help="folder for decode.json, decode.md and decode.png")
    decode.add_argument("--contexts", type=int, nargs="+", default=list(DECODE_CONTEXTS),
                        help=f"context lengths in tokens of {EVALUATION_TEXT} text, each prefilled (and timed) "
                             "before the timed decode steps; memory is measured at the largest")
    decode.add_argument("--steps", type=int, default=DECODE_STEPS,
                        help="timed decode steps per run; tokens/s = steps / their total time (default %(default)s: "
                             "four whole flush cycles of GSRQ, every 33 steps, and about one of quanto, every 128)")
    decode.add_argument("--repeats", type=int, default=REPEATS, help="interleaved repeats (the median is reported)")
    decode.add_argument("--no-post-rope", action="store_true",
                        help="skip the GSRQ variant with keys coded after RoPE (it needs its own calibration)")
    decode.add_argument("--text", nargs="+", default=None, help=f"evaluation text (default: {EVALUATION_TEXT})")
    decode.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="measure only the rows whose names contain one of these (the fp32 reference always "
                             "runs), e.g. --only 'quanto 4' 'values given the keys'; a TEXT ending in $ must end the "
                             "name ('rebuilt from codes$': the default code-reading row, not its layout variants) "
                             "(default: every row)")
    decode.add_argument("--group-dim", type=positive_int, nargs="+", default=None, metavar="N",
                        help=f"the GSRQ rows' group size(s), each a full set of rows side by side (default: "
                             f"{CALIBRATION['group_dim']}, the calibration default); another size is named in the row "
                             "labels, e.g. --group-dim 8 32 --only 'rebuilt from codes'")
    decode.set_defaults(func=command)


def command_line(args) -> str:
    """The ``bench decode`` command line that reproduces a run (options at their defaults left out)."""
    words = ["hf-kvcodecs", "bench", "decode", "--model", args.model]
    options = [(["--threads", str(args.threads)], args.threads is not None),
               (["--contexts", *map(str, args.contexts)], list(args.contexts) != list(DECODE_CONTEXTS)),
               (["--steps", str(args.steps)], args.steps != DECODE_STEPS),
               (["--repeats", str(args.repeats)], args.repeats != REPEATS),
               (["--no-post-rope"], args.no_post_rope), (["--text", *(args.text or ())], bool(args.text)),
               (["--only", *(args.only or ())], bool(args.only)),
               (["--group-dim", *map(str, args.group_dim or ())], bool(args.group_dim))]
    return shlex.join(words + [word for option, given in options if given for word in option])


def command(args) -> int:
    from ...bench.decode import decode_markdown, plot_decode_speed, run_decode_benchmark

    loaded = load_model(args)
    results = run_decode_benchmark(loaded, contexts=tuple(args.contexts), steps=args.steps, repeats=args.repeats,
                                   text=args.text, include_post_rope=not args.no_post_rope, only=args.only,
                                   group_dims=tuple(args.group_dim or ()))
    results["command"] = command_line(args)
    write_results(Path(args.out), "decode", results, decode_markdown(results))
    plot_decode_speed(results, Path(args.out) / "decode.png")
    return 0
