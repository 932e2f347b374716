"""`hf-kvcodecs scd make-draft`: a round-to-nearest weight-quantized copy of a model, saved as a plain float model
directory: the draft of a draft -> verifier SCD pair (the draft prefills, the float model decodes).

The weights are quantized by the library's RTN (``quantization.quantize_model`` with a ``KVCodecsConfig``: asymmetric
min-max grids per group of inputs, float16 scale and offset, every ``nn.Linear`` but the LM head), then dequantized
back to float (``model.dequantize()``) and saved with ``save_pretrained`` next to the tokenizer: ``load_model(DIR)``
and ``--producer DIR`` load it like any local model, and its float weights are exactly the RTN grid's values. A sidecar
(:data:`DRAFT_SIDECAR_FILE`) names the base model, the grid and the weight error per layer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ._common import add_command, add_model_arguments, load_model, positive_int

DRAFT_SIDECAR_FILE = "hf_kvcodecs_draft.json"
DRAFT_SIDECAR_VERSION = 1
DRAFT_BITS = (1, 2, 3, 4, 5, 6, 7, 8)  # codecs.weight_quantization.SUPPORTED_BITS (tests/test_scd_pairs.py checks)


def add_parser(scd_commands) -> None:
    make = add_command(scd_commands, "make-draft",
                       "round-to-nearest weight-quantize a model and save it as a float model directory (the draft "
                       "of a draft -> verifier pair)")
    add_model_arguments(make)
    make.add_argument("--bits", type=int, default=3, choices=DRAFT_BITS, help="bits per weight of the RTN grid")
    make.add_argument("--group-size", type=positive_int, default=32,
                      help="inputs per RTN group (one float16 scale and offset each); must divide every layer's inputs")
    make.add_argument("--out", required=True, type=Path,
                      help="directory the draft (config, weights, tokenizer, sidecar) is saved in (created if "
                           "missing; refused if not empty, unless --overwrite)")
    make.add_argument("--overwrite", action="store_true", help="write over what --out already holds")
    make.set_defaults(func=run)


def check_draft_directory(out: Path, *, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; a draft is saved as a directory: pass a directory path.")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; pass another directory, or --overwrite to write the draft over "
                              "what is there.")


def base_model_reference(name: str) -> str:
    """The base model as load_model finds it again: its name, a local path made absolute."""
    return str(Path(name).resolve()) if name != "default" and Path(name).exists() else name


def rtn_draft(model, bits: int, group_size: int, *, progress: bool = True) -> dict:
    """Replace ``model``'s weights (in place) by their RTN grid values; the weight-error report.

    The model is quantized with ``quantize_model`` (packed RTN codes), each layer's error is measured against the float
    weight it replaced, and ``model.dequantize()`` turns it back into a plain float model holding the grid's values.
    """
    import torch
    from tqdm.auto import tqdm

    from ..quantization import KVCodecsConfig, PackedLinear, quantize_model

    originals = {name: module.weight.detach().clone() for name, module in model.named_modules()
                 if type(module) is torch.nn.Linear}
    quantize_model(model, KVCodecsConfig(weight_bits=bits, group_size=group_size))
    packed = [(name, module) for name, module in model.named_modules() if isinstance(module, PackedLinear)]
    if not packed:
        raise ValueError("No nn.Linear layer of this model was quantized; a draft needs a model with linear layers.")
    layers, kinds = {}, {}
    error_total = weight_total = 0.0
    with torch.no_grad():
        for name, module in tqdm(packed, desc=f"RTN W{bits} g{group_size} weight error", disable=not progress):
            original = originals[name].float()
            difference = module.dequantized_weight(torch.float32) - original
            error, norm = float(difference.square().sum()), float(original.square().sum())
            layers[name] = {"relative_error": (error / norm) ** 0.5 if norm else 0.0,
                            "max_abs_error": float(difference.abs().max()), "weights": original.numel()}
            kind = kinds.setdefault(name.rsplit(".", 1)[-1], [0.0, 0.0])
            kind[0] += error
            kind[1] += norm
            error_total += error
            weight_total += norm
    model.dequantize()  # plain nn.Linear layers holding the grid values; the model no longer says it is quantized
    relative = [row["relative_error"] for row in layers.values()]
    return {
        "grid": "asymmetric min-max round-to-nearest per group, float16 scale and offset "
                "(hf_kvcodecs.quantization.quantize_model, KVCodecsConfig)",
        "quantized_layers": len(layers),
        "quantized_weights": sum(row["weights"] for row in layers.values()),
        "kept_in_float": sorted(name for name in originals if name not in layers),
        "bits_per_weight": bits + 2 * 16 / group_size,
        "relative_error": (error_total / weight_total) ** 0.5 if weight_total else 0.0,
        "relative_error_per_layer": {"mean": sum(relative) / len(relative), "max": max(relative)},
        "relative_error_per_kind": {kind: (error / norm) ** 0.5 if norm else 0.0
                                    for kind, (error, norm) in sorted(kinds.items())},
        "layers": layers,
    }


def make_draft(loaded, *, bits: int, group_size: int, out: Path, overwrite: bool = False,
               progress: bool = True) -> dict:
    """Quantize ``loaded`` (a ``models.LoadedModel``, changed in place) into a draft saved in ``out``; the sidecar."""
    import torch

    from ..version import __version__

    check_draft_directory(out, overwrite=overwrite)
    began = time.perf_counter()
    report = rtn_draft(loaded.model, bits, group_size, progress=progress)
    out.mkdir(parents=True, exist_ok=True)
    loaded.model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    sidecar = {
        "format_version": DRAFT_SIDECAR_VERSION,
        "kind": "rtn_draft",
        "base_model": base_model_reference(loaded.name),
        "base_description": loaded.description,
        "description": f"RTN W{bits} g{group_size} draft of {loaded.description}",
        "bits": bits,
        "group_size": group_size,
        "symmetric": False,
        "scale_dtype": "float16",
        "weight_error": report,
        "hf_kvcodecs_version": __version__,
        "torch_threads": torch.get_num_threads(),
        "seconds": time.perf_counter() - began,
    }
    (out / DRAFT_SIDECAR_FILE).write_text(json.dumps(sidecar, indent=2) + "\n")
    return sidecar


def read_draft_sidecar(directory) -> dict | None:
    """The sidecar of a draft directory, or None when ``directory`` is not one."""
    path = Path(directory) / DRAFT_SIDECAR_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def run(args) -> int:
    check_draft_directory(args.out, overwrite=args.overwrite)  # before the model load
    loaded = load_model(args)
    sidecar = make_draft(loaded, bits=args.bits, group_size=args.group_size, out=args.out, overwrite=args.overwrite)
    error = sidecar["weight_error"]
    print(json.dumps({"out": str(args.out), "description": sidecar["description"],
                      "quantized_layers": error["quantized_layers"], "bits_per_weight": error["bits_per_weight"],
                      "relative_error": round(error["relative_error"], 5),
                      "relative_error_per_kind": {kind: round(value, 5)
                                                  for kind, value in error["relative_error_per_kind"].items()},
                      "seconds": round(sidecar["seconds"], 1)}, indent=2))
    return 0
