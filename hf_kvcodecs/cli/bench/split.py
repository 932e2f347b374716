"""`hf-kvcodecs bench split`: GSRQ quality when keys and values get different shares of the bits."""

from __future__ import annotations

from pathlib import Path

from .._common import add_command, add_model_arguments, calibration_text, load_model, write_results
from ..defaults import CODEBOOK_STORE, EVALUATION_TEXT, GSRQ_CALIBRATION_TEXT, SPLIT_LAYOUTS, SPLIT_OFFSETS


def add_parser(bench) -> None:
    split = add_command(bench, "split", "GSRQ quality when keys and values get different shares of the bits")
    add_model_arguments(split)
    split.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                       help="folder for bit_split.json, bit_split.md and bit_split.png")
    split.add_argument("--average-bits", type=float, nargs="+", default=[2.0],
                       help="average bits per K/V element of every split")
    split.add_argument("--offsets", type=float, nargs="+", default=list(SPLIT_OFFSETS),
                       help="bits moved from values to keys: keys get average + offset, values average - offset")
    split.add_argument("--layouts", nargs="+", default=list(SPLIT_LAYOUTS), choices=SPLIT_LAYOUTS,
                       help="codec layouts to calibrate and measure: 'default', or 'conditional-keys' (keys coded "
                            "conditional on the heads decoded before them)")
    split.add_argument("--text", nargs="+", default=None, help=f"evaluation text (default: {EVALUATION_TEXT})")
    split.add_argument("--calibration-text", nargs="+", default=None,
                       help=f"calibration text (default: {GSRQ_CALIBRATION_TEXT})")
    split.add_argument("--codebook-store", type=Path, default=None,
                       help=f"where calibrated codebooks are kept and reused (default: {CODEBOOK_STORE})")
    split.set_defaults(func=command)


def command(args) -> int:
    from ...bench.bit_split import plot_split, run_bit_split_benchmark, split_markdown

    loaded = load_model(args)
    results = run_bit_split_benchmark(loaded, average_bits=tuple(args.average_bits), offsets=tuple(args.offsets),
                                      layouts=tuple(args.layouts), text=args.text,
                                      calibration_text=calibration_text(args), store=args.codebook_store)
    write_results(Path(args.out), "bit_split", results, split_markdown(results))
    plot_split(results, Path(args.out) / "bit_split.png")
    return 0
