"""`hf-kvcodecs export`: write a model quantized by hf_kvcodecs (a `compress` output, a SQuaT student) as a
compressed-tensors checkpoint that plain transformers and vLLM load without hf_kvcodecs."""

from __future__ import annotations

import json
from pathlib import Path

from ._common import add_command, load_model, positive_int

FORMATS = ("compressed-tensors",)


def add_parser(commands) -> None:
    export = add_command(commands, "export",
                         "write an hf_kvcodecs-quantized model as a compressed-tensors checkpoint (transformers, vLLM)")
    export.add_argument("--model", required=True,
                        help="a checkpoint quantized by hf_kvcodecs: a folder written by `hf-kvcodecs compress` (with "
                             "--weight-bits), the model/ folder of `hf-kvcodecs squat`, or a Hub id of one")
    export.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    export.add_argument("--format", choices=FORMATS, default=FORMATS[0],
                        help="checkpoint format: compressed-tensors pack-quantized, group strategy, int32 packing")
    export.add_argument("--widen-symmetric", action="store_true",
                        help="export a symmetric (mid-rise or stretched) b-bit grid exactly as a (b+1)-bit symmetric one; "
                             "without it such a model is refused, since no b-bit compressed-tensors grid holds it")
    export.add_argument("--drop-activation-quantization", action="store_true",
                        help="export the weights of a model with learned activation steps (W*A* SQuaT students) and "
                             "leave the activation quantization out; without it such a model is refused")
    export.add_argument("--no-logits-check", action="store_true",
                        help="skip comparing the logits of the model and of the exported weights on a short input (it "
                             "holds the exported layers dequantized next to the model for that forward pass)")
    export.add_argument("--out", type=Path, required=True, help="folder for the checkpoint (new or empty)")
    export.set_defaults(func=command)


def command(args) -> int:
    from ..quantization.compressed_tensors_export import check_compressed_tensors, export_compressed_tensors

    try:  # before loading the model
        check_compressed_tensors()
    except ImportError as error:
        raise ValueError(str(error)) from error
    if args.out.exists() and any(args.out.iterdir()):
        raise FileExistsError(f"--out {args.out} is not empty; give a new folder for the exported checkpoint.")
    loaded = load_model(args)
    report = export_compressed_tensors(loaded.model, loaded.tokenizer, args.out, widen_symmetric=args.widen_symmetric,
                                       drop_activation_quantization=args.drop_activation_quantization,
                                       check_logits=not args.no_logits_check)
    summary = {
        "out": str(args.out),
        "model": loaded.description,
        "scheme": report["scheme"],
        "exact": report["exact"],
        "exact_groups": f"{report['exact_groups']} of {report['groups']}",
        "refit_groups": report["refit_groups"],
        "weight_difference": report["weight_difference"],
        "logits_difference": report.get("logits_difference"),
        "dropped": report["dropped"],
        "load": f"AutoModelForCausalLM.from_pretrained({str(args.out)!r})  # needs compressed-tensors"
                f"{report['loads_with_compressed_tensors']}; vllm serve {args.out}",
    }
    print(json.dumps(summary, indent=2))
    return 0
