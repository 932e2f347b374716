"""`hf-kvcodecs compress`: quantize a model's weights, calibrate its KV codebooks, evaluate, save with a card."""

from __future__ import annotations

from pathlib import Path

from ._common import add_command, add_model_arguments, add_push_arguments
from .defaults import EVALUATION_TEXT, GSRQ_CALIBRATION_TEXT, ZERO_POINT_HELP, ZERO_POINTS


def _weight_bits(value: str):
    return None if value.lower() == "none" else int(value)


def add_parser(commands) -> None:
    compress = add_command(commands, "compress",
                           "quantize weights, calibrate KV codebooks, evaluate against fp, save with a model card")
    add_model_arguments(compress)
    compress.add_argument("--weight-bits", type=_weight_bits, default=4,
                          help="bits per weight of the round-to-nearest quantized linear layers, 1-8, or 'none' to "
                               "keep float weights")
    compress.add_argument("--group-size", type=int, default=64,
                          help="consecutive inputs of a weight row sharing one scale (and, unless --symmetric, one "
                               "offset), a power of two")
    compress.add_argument("--symmetric", action="store_true", help="symmetric grid instead of min-max")
    compress.add_argument("--zero-point", choices=ZERO_POINTS, default=ZERO_POINTS[0], help=ZERO_POINT_HELP)
    compress.add_argument("--mode", default="packed", choices=["packed", "fake"],
                          help="'packed': codes packed into int32 words with their scales; 'fake': float weights with "
                               "fake quantization, for quantization-aware training")
    compress.add_argument("--kv", default="gsrq", choices=["gsrq", "none"],
                          help="KV cache compression: 'gsrq' calibrates codebooks (or takes --codebooks) and saves them as "
                               "the model's default cache; 'none': the model keeps transformers' default cache")
    compress.add_argument("--kv-bits", type=float, default=2.0,
                          help="GSRQ bits per KV element (incl. the scale): the rate the codebooks are calibrated for "
                               "and the saved model's cache runs at")
    compress.add_argument("--codebooks", default=None,
                          help="existing GSRQ codebooks to save with the model instead of calibrating: a directory "
                               "written by `hf-kvcodecs calibrate --out DIR` (or the kv_codebooks/ folder of an "
                               "earlier compress output) or the owner/name of codebooks pushed to the Hub (default: "
                               "none: calibrate, or reuse codebooks calibrated before with the same settings for the "
                               "same (quantized) weights from the codebook store)")
    compress.add_argument("--calibration-text", nargs="+", default=None,
                          help="KV calibration text: files, a built-in corpus, datasets:NAME[:CONFIG]:SPLIT "
                               f"(default: {GSRQ_CALIBRATION_TEXT})")
    compress.add_argument("--calibration-windows", type=int, default=32,
                          help="windows of calibration text the KV codebooks are fitted on")
    compress.add_argument("--calibration-window-tokens", type=int, default=512, help="tokens per calibration window")
    compress.add_argument("--eval-text", nargs="+", default=None,
                          help=f"held-out evaluation text (default: {EVALUATION_TEXT})")
    compress.add_argument("--eval-windows", type=int, default=4,
                          help="windows of --eval-context-tokens + --eval-decoded-tokens tokens, evenly spread over the "
                               "evaluation text, on which the float model and each compressed stage are scored")
    compress.add_argument("--eval-context-tokens", type=int, default=512, help="tokens prefilled per window")
    compress.add_argument("--eval-decoded-tokens", type=int, default=64, help="tokens decoded and scored per window")
    compress.add_argument("--seed", type=int, default=0, help="seed of the KV calibration (see `calibrate --help`)")
    compress.add_argument("--out", type=Path, required=True, help="folder for the compressed model")
    add_push_arguments(compress, "--push-to-hub", "also upload the folder to this Hub repo")
    compress.set_defaults(func=command)


def command(args) -> int:
    import torch

    from ..quantization.compress import CompressSettings, compress

    if args.threads:
        torch.set_num_threads(args.threads)
    settings = CompressSettings(
        model=args.model, weight_bits=args.weight_bits, group_size=args.group_size, symmetric=args.symmetric,
        zero_point=args.zero_point, mode=args.mode, kv=args.kv, kv_bits=args.kv_bits,
        calibration_text=args.calibration_text, calibration_windows=args.calibration_windows,
        calibration_window_tokens=args.calibration_window_tokens,
        evaluation_text=args.eval_text, eval_windows=args.eval_windows, eval_context_tokens=args.eval_context_tokens,
        eval_decoded_tokens=args.eval_decoded_tokens, seed=args.seed, codebooks=args.codebooks,
    )
    report = compress(settings, args.out, push_to_hub=args.push_to_hub, token=args.token, private=args.private)
    print((Path(args.out) / "README.md").read_text())
    print(f"saved to {args.out} in {report['elapsed_seconds']:.0f} s" + (f"; pushed to {args.push_to_hub}" if args.push_to_hub else ""))
    return 0
