"""`hf-kvcodecs bench weights`: size on disk and perplexity of weight quantization methods."""

from __future__ import annotations

from pathlib import Path

from .._common import add_command, add_model_arguments, write_results
from ..defaults import EVALUATION_TEXT, WEIGHT_METHODS


def add_parser(bench) -> None:
    weights = add_command(bench, "weights", "size on disk and perplexity: fp, RTN W8-W2, bitsandbytes, quanto")
    add_model_arguments(weights)
    weights.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                         help="folder for weights.json, weights.md and weights.png")
    weights.add_argument("--text", nargs="+", default=None, help=f"evaluation text (default: {EVALUATION_TEXT})")
    weights.add_argument("--windows", type=int, default=8, help="fixed windows of evaluation text")
    weights.add_argument("--window-tokens", type=int, default=512, help="tokens per evaluation window")
    weights.add_argument("--group-size", type=int, default=64, help="group size of the RTN rows")
    weights.add_argument("--methods", nargs="+", default=None, choices=WEIGHT_METHODS,
                         help="subset of methods (default: all)")
    weights.set_defaults(func=command)


def command(args) -> int:
    from ...bench.weights import plot_weights, run_weights_benchmark, weights_markdown

    results = run_weights_benchmark(model=args.model, threads=args.threads, windows=args.windows,
                                    window_tokens=args.window_tokens, group_size=args.group_size, text=args.text or None,
                                    methods=args.methods)
    write_results(Path(args.out), "weights", results, weights_markdown(results))
    plot_weights(results, Path(args.out) / "weights.png")
    print("written:", ", ".join(str(Path(args.out) / f"weights.{suffix}") for suffix in ("json", "md", "png")))
    return 0
