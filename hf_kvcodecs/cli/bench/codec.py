"""`hf-kvcodecs bench codec`: ablation of codebook learners and codec layouts, in relative MSE."""

from __future__ import annotations

from pathlib import Path

from .._common import add_command, add_model_arguments, load_model, write_results


def add_parser(bench) -> None:
    codec = add_command(bench, "codec", "ablation of codebook learners and codec layouts (relative MSE)")
    add_model_arguments(codec)
    codec.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                       help="folder for codec_ablation.json and codec_ablation.md")
    codec.add_argument("--layers", type=int, nargs="+", default=[0, 11, 23, 29], help="layers to fit and measure")
    codec.add_argument("--seeds", type=int, nargs="+", default=[0],
                       help="seeds of the codebook fits (k-means seeding and the fitted subset of the samples), each "
                            "a full refit on the same samples: their spread is the learners' own variability")
    codec.set_defaults(func=command)


def command(args) -> int:
    from ...bench.codec_ablation import ablation_markdown, run_codec_ablation

    loaded = load_model(args)
    results = run_codec_ablation(loaded.model, loaded.tokenizer, layers=tuple(args.layers), seeds=tuple(args.seeds))
    results["model"]["description"] = loaded.description
    write_results(Path(args.out), "codec_ablation", results, ablation_markdown(results))
    return 0
