"""`hf-kvcodecs bench weights`: size and perplexity of weight quantization methods, measured side by side in one run.

Every method starts from the same floating-point checkpoint (the default model saved once as safetensors) and is
scored on the same fixed windows of held-out real text by one forward pass per window (weights act on every token,
so no KV cache is involved). Methods that transformers can serialize are saved, and both the size and the
perplexity are measured on the model loaded back from those files; optimum-quanto's transformers integration
cannot be saved, so its size is the bytes of the tensors its quantized layers hold in memory, and the table says so.
A method that cannot run here is kept in the table with the reason.
"""

from __future__ import annotations

import datetime
import gc
import logging
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

REFERENCE = "fp32"
METHOD_NAMES = (REFERENCE, "rtn-w8", "rtn-w4", "rtn-w3", "rtn-w2", "rtn-w4-g32", "rtn-w3-g32", "rtn-w2-g32", "bnb-nf4",
                "bnb-int8", "quanto-int4", "quanto-int2")
MISSING = "–"


@dataclass
class WeightMethod:
    key: str  # e.g. "rtn-w4"
    label: str  # human-readable, with its settings
    family: str
    quantization_config: Callable[[], object] | None  # None: the floating-point reference
    serializable: bool = True
    settings: dict = field(default_factory=dict)


def weight_methods(group_size: int = 64) -> list[WeightMethod]:
    """The methods of the benchmark, each with the settings it runs with (printed in the table).

    RTN runs at ``group_size`` and, for 4 to 2 bits, also at 32: the default model comes from a Q4_1 GGUF file (4-bit
    asymmetric blocks of 32 weights), so 32-weight groups can land on the grid its weights already sit on.
    """
    import torch

    def kvcodecs(bits, group):
        from ..quantization import KVCodecsConfig

        return lambda: KVCodecsConfig(weight_bits=bits, group_size=group)

    def bnb(**kwargs):
        from transformers import BitsAndBytesConfig

        return lambda: BitsAndBytesConfig(**kwargs)

    def quanto(weights):
        from transformers import QuantoConfig

        return lambda: QuantoConfig(weights=weights)

    methods = [WeightMethod(REFERENCE, "fp32 (reference)", "floating point", None)]
    rtn = [(bits, group_size, f"rtn-w{bits}") for bits in (8, 4, 3, 2)]
    rtn += [(bits, 32, f"rtn-w{bits}-g32") for bits in (4, 3, 2) if group_size != 32]
    for bits, group, key in rtn:
        methods.append(WeightMethod(
            key, f"hf_kvcodecs RTN W{bits} g{group}", "hf_kvcodecs", kvcodecs(bits, group),
            settings={"bits": bits, "group_size": group, "grid": "asymmetric min-max", "scales": "fp16 scale + fp16 offset"},
        ))
    methods.append(WeightMethod(
        "bnb-nf4", "bitsandbytes NF4", "bitsandbytes",
        bnb(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
        settings={"bits": 4, "blocksize": 64, "absmax": "fp32 per block of 64", "compute_dtype": "float32"},
    ))
    methods.append(WeightMethod(
        "bnb-int8", "bitsandbytes LLM.int8", "bitsandbytes", bnb(load_in_8bit=True),
        settings={"bits": 8, "scales": "per output row", "llm_int8_threshold": 6.0},
    ))
    for weights in ("int4", "int2"):
        methods.append(WeightMethod(
            f"quanto-{weights}", f"optimum-quanto {weights}", "optimum-quanto", quanto(weights), serializable=False,
            settings={"weights": weights},
        ))
    return methods


def run_weights_benchmark(*, model: str = "default", threads: int | None = None, windows: int = 8,
                          window_tokens: int = 512, group_size: int = 64, text=None, methods=None,
                          loaded=None, progress: bool = True) -> dict:
    """Measure every method; returns the results dict written to ``weights.json``."""
    import torch
    from tqdm.auto import tqdm

    from ..evaluation.paired import fixed_windows, forward_nll, paired_comparison
    from ..models import load_model
    from ..text import EVALUATION_DEFAULT, load_corpus, tokenize_corpus

    started = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    loaded = loaded if loaded is not None else load_model(model)
    corpus = load_corpus(text, default=EVALUATION_DEFAULT)
    token_ids = tokenize_corpus(loaded.tokenizer, corpus)
    evaluation_windows = fixed_windows(token_ids, windows, window_tokens)
    chosen = [m for m in weight_methods(group_size) if methods is None or m.key in methods or m.key == REFERENCE]
    target_layers = _quantization_targets(loaded.model)

    workdir = Path(tempfile.mkdtemp(prefix="hf_kvcodecs_bench_weights_"))
    entries, reference = [], None
    try:
        float_dir = workdir / REFERENCE
        loaded.model.save_pretrained(float_dir)
        for method in tqdm(chosen, desc="weight methods", disable=not progress):
            entry = {"key": method.key, "name": method.label, "family": method.family, "settings": method.settings}
            entries.append(entry)
            method_started = time.perf_counter()
            try:
                quantized = _build(method, loaded.model, float_dir, workdir, entry)
                converted = _converted_layers(quantized, target_layers)
                entry["quantized_layers"] = len(converted)
                if method.key != REFERENCE and not converted:
                    raise RuntimeError("no layer was quantized")
                entry["size"] = _size(method, quantized, workdir, float_dir, converted, target_layers)
                entry["settings"].update(_measured_settings(quantized, converted))
                step = time.perf_counter()
                scores = _score(quantized, evaluation_windows, method, progress, forward_nll)
                entry["seconds_evaluating"] = round(time.perf_counter() - step, 1)
                if method.key == REFERENCE:
                    reference = scores
                entry.update(paired_comparison(scores, reference))
            except Exception as error:  # a method that cannot run here is reported, not dropped
                logger.warning("%s failed: %s", method.label, error)
                entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
                if method.key == REFERENCE:
                    raise
            finally:
                entry["seconds"] = round(time.perf_counter() - method_started, 1)
                quantized = None
                gc.collect()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    fingerprint = loaded.model.config
    return {
        "model": {"name": loaded.name, "description": loaded.description,
                  "parameters": sum(p.numel() for p in loaded.model.parameters()),
                  "num_hidden_layers": fingerprint.num_hidden_layers},
        "evaluation_text": {**corpus.to_dict(), "tokens": int(token_ids.numel())},
        "settings": {"windows": windows, "window_tokens": window_tokens, "scored_tokens": windows * (window_tokens - 1),
                     "group_size": group_size, "torch_threads": torch.get_num_threads(),
                     "quantization_targets": len(target_layers),
                     "target_weights": sum(w for w in target_layers.values())},
        "environment": _environment(),
        "methods": entries,
        "elapsed_seconds": round(time.perf_counter() - started, 1),
    }


def _quantization_targets(model) -> dict[str, int]:
    """``nn.Linear`` layers every method is expected to quantize (all but the output embedding), with their
    number of weights."""
    from torch import nn

    output = model.get_output_embeddings()
    return {name: module.weight.numel() for name, module in model.named_modules()
            if type(module) is nn.Linear and module is not output}


def _converted_layers(model, targets: dict[str, int]) -> list[str]:
    from torch import nn

    return [name for name in targets if type(model.get_submodule(name)) is not nn.Linear]


def _build(method: WeightMethod, float_model, float_dir: Path, workdir: Path, entry: dict):
    from transformers import AutoModelForCausalLM

    if method.quantization_config is None:
        return float_model
    step = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=method.quantization_config(),
                                                 dtype=float_model.dtype, device_map="cpu")
    entry["seconds_quantizing"] = round(time.perf_counter() - step, 1)
    if not method.serializable:
        return model.eval()
    saved = workdir / method.key
    model.save_pretrained(saved)
    del model
    gc.collect()
    # Score what was saved: the checkpoint as a user loads it.
    return AutoModelForCausalLM.from_pretrained(saved, dtype=float_model.dtype, device_map="cpu").eval()


def _size(method: WeightMethod, model, workdir: Path, float_dir: Path, converted: list[str], targets: dict[str, int]) -> dict:
    from .memory import tensor_storages

    target_weights = sum(targets[name] for name in converted) or sum(targets.values())
    if not method.serializable:
        layer_bytes = sum(sum(tensor_storages(model.get_submodule(name)).values()) for name in converted)
        storages = {}
        for tensor in list(model.parameters()) + list(model.buffers()):
            storages.update(tensor_storages(tensor))
        return {"kind": "in memory (not serializable)", "bytes": sum(storages.values()),
                "quantized_layer_bytes": layer_bytes, "bits_per_quantized_weight": 8 * layer_bytes / target_weights}
    directory = float_dir if method.quantization_config is None else workdir / method.key
    tensors = _saved_tensor_bytes(directory)
    layer_names = converted or list(targets)
    layer_bytes = sum(size for key, size in tensors.items() if any(key.startswith(name + ".") for name in layer_names))
    files = [path for path in directory.rglob("*") if path.is_file()]
    return {"kind": "on disk", "bytes": sum(p.stat().st_size for p in files),
            "weights_file_bytes": sum(p.stat().st_size for p in files if p.suffix == ".safetensors"),
            "quantized_layer_bytes": layer_bytes, "bits_per_quantized_weight": 8 * layer_bytes / target_weights}


def _saved_tensor_bytes(directory: Path) -> dict[str, int]:
    from safetensors import safe_open

    sizes = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                tensor = handle.get_slice(key)
                numel = 1
                for dim in tensor.get_shape():
                    numel *= dim
                sizes[key] = numel * _dtype_bytes(tensor.get_dtype())
    return sizes


def _dtype_bytes(name: str) -> float:
    return {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
            "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}.get(name, 4)


def _measured_settings(model, converted: list[str]) -> dict:
    """Settings read off the quantized layers themselves (e.g. quanto picks its group size per layer)."""
    groups = sorted({getattr(model.get_submodule(name), "weight_group_size", None) for name in converted} - {None})
    classes = sorted({type(model.get_submodule(name)).__name__ for name in converted})
    measured = {"layer_classes": classes} if classes else {}
    if groups:
        measured["group_sizes"] = groups
    return measured


def _score(model, windows, method: WeightMethod, progress: bool, forward_nll):
    from ..quantization import dequantized_weight_cache

    with dequantized_weight_cache(model):  # same numbers, dequantized once per layer instead of once per window
        return forward_nll(model, windows, progress=progress, description=method.label)


def _environment() -> dict:
    import importlib.metadata

    versions = {}
    for package in ("torch", "transformers", "bitsandbytes", "optimum-quanto", "safetensors", "hf-kvcodecs"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "platform": platform.platform(), "versions": versions}


# ---- report ---------------------------------------------------------------------------------------------------
def weights_markdown(results: dict) -> str:
    from .report import format_number

    settings, model = results["settings"], results["model"]
    versions = ", ".join(f"{name} {version}" for name, version in results["environment"]["versions"].items() if version)
    lines = [
        "# Weight quantization benchmark",
        "",
        f"- Model: {model['description']} ({model['parameters'] / 1e6:.1f}M parameters); every method quantizes the "
        f"same {settings['quantization_targets']} `nn.Linear` layers ({settings['target_weights'] / 1e6:.1f}M weights); "
        "the tied embedding / LM head stays in floating point everywhere",
        f"- Perplexity: {settings['windows']} fixed windows of {settings['window_tokens']} tokens of "
        f"{results['evaluation_text']['description']} ({settings['scored_tokens']} scored tokens), one forward pass per "
        "window; Δppl ± standard error of the paired per-window differences against fp32 from the same run",
        "- Size: bytes of the saved checkpoint folder (config, generation config, safetensors), measured on disk, and "
        "the bits per weight of the quantized layers (their saved tensors: codes, scales, offsets, quantization state). "
        "optimum-quanto cannot be saved through transformers: its sizes are the bytes of the tensors held in memory",
        "- Serializable methods are scored after saving and loading back",
    ]
    if results["model"]["name"] == "default":
        lines.append(
            "- Caveat: the default model's weights come from a Q4_1 GGUF file (4-bit, asymmetric, blocks of 32 weights), "
            "so RTN with 32-weight groups at 4 bits can land on the grid they already sit on; its result says nothing "
            "about RTN on a model that was never quantized"
        )
    lines += [
        f"- {results['environment']['date']}; {versions}; Python {results['environment']['python']}; "
        f"{settings['torch_threads']} torch threads; {results['elapsed_seconds']:.0f} s in all",
        "",
        "| method | settings | size (MiB) | measured as | bits/weight (quantized layers) | ppl | Δppl % ± se | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in results["methods"]:
        settings_text = _settings_text(entry.get("settings", {})).replace("|", "/")
        if "error" in entry:
            lines.append(f"| {entry['name']} | {settings_text} | {MISSING} | could not run: {entry['error'].replace('|', '/')} "
                         f"| {MISSING} | {MISSING} | {MISSING} | {entry.get('seconds', 0):.0f} |")
            continue
        size = entry["size"]
        delta = MISSING if entry["key"] == REFERENCE else (
            f"{entry['delta_ppl_pct']:+.2f}" + (f" ± {entry['delta_ppl_pct_se']:.2f}" if entry.get("delta_ppl_pct_se") is not None else ""))
        lines.append(
            f"| {entry['name']} | {settings_text} | {size['bytes'] / 2**20:.1f} | {size['kind']} | "
            f"{format_number(size.get('bits_per_quantized_weight'), '.2f')} | {format_number(entry.get('perplexity'), '.3f')} | "
            f"{delta} | {entry['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _settings_text(settings: dict) -> str:
    return ", ".join(f"{key}={value}" if not isinstance(value, list) else f"{key}={'/'.join(map(str, value))}"
                     for key, value in settings.items() if key != "layer_classes")  # classes: in the JSON


def plot_weights(results: dict, path: Path) -> None:
    """Perplexity against size, one labelled point per method that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5.5))
    colors = plt.get_cmap("tab20").colors
    for index, entry in enumerate(e for e in results["methods"] if "perplexity" in e):
        marker = "o" if entry["size"]["kind"] == "on disk" else "s"
        axis.scatter(entry["size"]["bytes"] / 2**20, entry["perplexity"], color=colors[index % len(colors)],
                     marker=marker, label=f"{entry['name']} ({entry['size']['kind']})")
    axis.set_xlabel("size (MiB): square = tensors in memory, circle = checkpoint on disk")
    axis.set_ylabel("perplexity (log scale)")
    axis.set_yscale("log")
    axis.grid(True, alpha=0.3)
    axis.set_title(f"{results['model']['description']}\n{results['settings']['scored_tokens']} tokens of "
                   f"{results['evaluation_text']['description'].split(':')[0]}", fontsize=8)
    axis.legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
