"""`hf-kvcodecs bench decode`: decode speed and decode-time memory of GSRQ's code-reading attention, side by side
with its dequantize path and the caches transformers ships, on one model in one run.

Speed: the prefill of ``context`` real-text tokens is timed on its own (time to the first token, the cache's
encoding of the prompt included), then ``steps`` single-token decode steps are timed; tokens/s is the steps over their
total time (throughput: the default 132 steps span four whole flush cycles of the GSRQ cache, which encodes 33 window
tokens every 33 steps, and about one of quanto's, which re-quantizes every 128, so their periodic costs are counted,
which a median step time would leave out); the reported value is the median over interleaved repeats (the method order
rotates each repeat so machine-load drift hits every method alike), and ratios are to the fp32 DynamicCache of the
same run.

Memory at the largest context: bytes of the tensors each cache holds (counted from the objects, per-model tables
apart), and the transient memory a decode step needs on top: the peak of the process's resident memory during the
timed steps minus its value just before them (freed heap returned to the OS first, so earlier peaks do not hide new
ones). A cache that dequantizes its history every step shows that copy here.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import functools
import gc
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..codecs.kmeans import DEFAULT_LEARNER
from ..codecs.residual import DEFAULT_BEAM_WIDTH
from ..evaluation import decode_logprobs, divergence_metrics, perplexity_metrics, token_nll
from ..gsrq import GSRQCache
from ..gsrq.store import calibration_defaults, ensure_codebooks
from ..integrations.attention import enable_code_attention
from ..models import LoadedModel, model_fingerprint
from ..rope import model_rope_inv_freq
from ..text import EVALUATION_DEFAULT, load_corpus, tokenize_corpus
from .harness import (
    check_group_sizes,
    full_precision_method,
    run_environment,
    shipped_baselines,
)
from .memory import cache_bytes, shared_storages

DECODE_CONTEXTS = (1024, 4096, 8192)
# Throughput window: four whole flush cycles of the GSRQ cache (its window of 32 exact tokens is encoded down to 32
# once it exceeds 32 + 32, i.e. 33 tokens every 33 steps) and about one of quanto (re-quantizes every 128 tokens).
DECODE_STEPS = 132
# Codec layouts measured next to the default (keys per head with each head's own codebooks, values given the keys), to
# show what each layout trades between quality and speed: values joint over the heads without the keys' prediction
# (with own, then with shared key codebooks), both per head, both joint, and keys coded conditionally on the heads
# before them (the best-quality layout, with values joint and with values given the keys).
LAYOUT_VARIANTS = ((", values joint over heads", {"value_layout": "joint_heads"}),
                   (", keys per head, shared codebooks, values joint over heads",
                    {"key_layout": "per_head", "value_layout": "joint_heads"}),
                   (", keys and values per head", {"key_layout": "per_head", "value_layout": "per_head"}),
                   (", keys and values joint", {"key_layout": "joint_heads", "value_layout": "joint_heads"}),
                   (", keys conditional on earlier heads, values joint over heads",
                    {"key_layout": "conditional_heads", "value_layout": "joint_heads"}),
                   (", keys conditional on earlier heads, values given the keys",
                    {"key_layout": "conditional_heads", "value_layout": "given_keys"}))
GSRQ_BITS = 2.0
REFERENCE = "fp32 DynamicCache"
QUANTO_4BIT = "quanto 4-bit (per-channel keys)"
BF16_SUFFIX = ", bf16 model"  # rows that run the bf16 copy of the model
# per copy of the model, the rows every other row on it is compared with (same weights, same dtype, same run)
SAME_MODEL_REFERENCES = {"fp32": (REFERENCE, QUANTO_4BIT),
                         "bf16": ("bf16 DynamicCache", QUANTO_4BIT + BF16_SUFFIX)}


@dataclass
class DecodeMethod:
    name: str
    family: str
    make_cache: Callable  # model -> Cache
    precision: str = "fp32"  # which copy of the model runs it
    expected_path: str | None = None  # GSRQ attention path the cache must report (checked, so labels cannot lie)
    extra: dict = field(default_factory=dict)
    prefill_multiple: int = 1


def decode_methods(loaded: LoadedModel, *, bits: float = GSRQ_BITS, calibration_text=None, store=None,
                   progress: bool = True, include_post_rope: bool = True, only=None,
                   group_dims: tuple[int, ...] = ()) -> list[DecodeMethod]:
    """Every row of ``bench decode``; with ``only`` (substrings; one ending in ``$`` must end the name), the rows
    whose names contain one of them, plus the fp32 reference the ratios need (codebooks are calibrated only for rows
    that stay). ``group_dims``: the GSRQ rows' group sizes, each a full set of rows (default: the calibration
    default's alone; a size other than the default names itself in the row labels, e.g. ", 32-dim groups")."""
    model = loaded.model
    default_group_dim = calibration_defaults()["group_dim"]
    group_dims = tuple(group_dims) or (default_group_dim,)
    check_group_sizes(model.config, [("--group-dim", dim) for dim in group_dims])

    def wanted(name: str) -> bool:
        return only is None or name == REFERENCE or any(
            name.endswith(part[:-1]) if part.endswith("$") else part in name for part in only)

    methods = [DecodeMethod(REFERENCE, "full precision", full_precision_method(model).make_cache),
               DecodeMethod("bf16 DynamicCache", "full precision", lambda m: full_precision_method(m).make_cache(m),
                            precision="bf16")]
    for baseline in shipped_baselines(model):
        if baseline.skip_reason is None and "per-channel" in baseline.name:
            methods.append(DecodeMethod(baseline.name, "transformers QuantizedCache", baseline.make_cache,
                                        extra=baseline.extra, prefill_multiple=baseline.prefill_multiple))
            if baseline.name == QUANTO_4BIT:  # the best shipped cache on the bf16 copy too: same-model ratios
                methods.append(DecodeMethod(baseline.name + BF16_SUFFIX, "transformers QuantizedCache",
                                            baseline.make_cache, precision="bf16", extra=baseline.extra,
                                            prefill_multiple=baseline.prefill_multiple))
    methods = [method for method in methods if wanted(method.name)]
    # (key space, codec layouts, description): the default, then what the layouts trade between quality and speed
    calibrations = [("pre_rope", {}, "")]
    calibrations += [("pre_rope", layout, description) for description, layout in LAYOUT_VARIANTS]
    if include_post_rope:
        calibrations.append(("post_rope", {}, ""))
    calibrations = [(key_space, layout if dim == default_group_dim else {**layout, "group_dim": dim},
                     description + ("" if dim == default_group_dim else f", {dim}-dim groups"))
                    for dim in group_dims for key_space, layout, description in calibrations]
    for key_space, layout, layout_description in calibrations:
        is_default_layout = not (layout.keys() - {"group_dim"})
        paths = ("dequantize", "codes") if key_space == "pre_rope" and is_default_layout else ("codes",)
        variants = [(path, DEFAULT_BEAM_WIDTH, "fp32") for path in paths]
        if key_space == "pre_rope" and is_default_layout:
            variants.append(("codes", 1, "fp32"))  # what the encoder's beam search costs at prefill and buys in quality
            # the same cache on the bf16 copy of the model: a same-dtype comparison with bf16 DynamicCache
            variants.append(("codes", DEFAULT_BEAM_WIDTH, "bf16"))
        rows = []
        for path, beam_width, precision in variants:
            how = {"dequantize": "dequantize + SDPA",
                   "codes": "code-reading, " + ("keys rebuilt from codes" if key_space == "pre_rope" else "lookup tables")}[path]
            if beam_width != DEFAULT_BEAM_WIDTH:
                how += ", greedy encoder" if beam_width == 1 else f", {beam_width}-beam encoder"
            if precision == "bf16":
                how += BF16_SUFFIX
            name = f"GSRQ {bits:g}-bit, keys {key_space.replace('_', '-')}, {how}{layout_description}"
            if wanted(name):
                rows.append((name, path, beam_width, precision))
        if not rows:
            continue
        codebooks, directory, _ = ensure_codebooks(loaded, store=store, text=calibration_text, progress=progress,
                                                   learner=DEFAULT_LEARNER, bits=bits, key_space=key_space, **layout)
        for name, path, beam_width, precision in rows:
            methods.append(DecodeMethod(
                name, "gsrq",
                lambda m, c=codebooks, p=path, w=beam_width: GSRQCache(m.config, codebooks=c, bits=bits, attention=p,
                                                                       beam_width=w,
                                                                       rope_inv_freq=model_rope_inv_freq(m)),
                precision=precision, expected_path=path,
                extra={"codebooks": str(directory), "key_space": key_space, "attention": path, "beam_width": beam_width,
                       "key_layout": codebooks.layout("keys"), "value_layout": codebooks.layout("values"),
                       "group_dim": layout.get("group_dim", default_group_dim),
                       "holdout_relative_mse": codebooks.calibration["holdout_mean"]},
            ))
    return methods


def run_decode_benchmark(loaded: LoadedModel, *, contexts=DECODE_CONTEXTS, steps: int = DECODE_STEPS, repeats: int = 2,
                         memory_steps: int = 8, text=None, calibration_text=None, store=None,
                         include_post_rope: bool = True, progress: bool = True, only=None,
                         group_dims: tuple[int, ...] = ()) -> dict:
    started = time.perf_counter()
    token_ids = tokenize_corpus(loaded.tokenizer, corpus := load_corpus(text, default=EVALUATION_DEFAULT))
    longest = max(contexts) + max(steps, memory_steps)
    if token_ids.numel() < longest:
        raise ValueError(f"The evaluation text has {token_ids.numel()} tokens; {longest} are needed for these contexts.")
    methods = decode_methods(loaded, calibration_text=calibration_text, store=store, progress=progress,
                             include_post_rope=include_post_rope, only=only, group_dims=group_dims)
    models = {"fp32": loaded.model}
    enable_code_attention(loaded.model)  # GSRQ caches choose their path; every other cache is unaffected
    if any(m.precision == "bf16" for m in methods):
        models["bf16"] = copy.deepcopy(loaded.model).to(torch.bfloat16)

    quality = _decode_quality(models, methods, token_ids, progress=progress)
    speed = {m.name: {} for m in methods}
    for context in contexts:
        runs = {m.name: [] for m in methods}
        prefills = {m.name: [] for m in methods}
        bar = tqdm(total=repeats * len(methods), desc=f"decode @ {context}", disable=not progress)
        for repeat in range(repeats):
            order = methods[repeat % len(methods):] + methods[:repeat % len(methods)]
            for method in order:
                began = time.perf_counter()
                cache, prompt_length = _prefilled(models[method.precision], method, token_ids, context)
                prefills[method.name].append(time.perf_counter() - began)  # the prompt's forward pass and its encoding
                runs[method.name].append(_timed_steps(models[method.precision], cache, token_ids, prompt_length, steps))
                bar.update()
        bar.close()
        reference = statistics.median(_throughput(run) for run in runs[REFERENCE])
        reference_prefill = statistics.median(prefills[REFERENCE])
        for name, method_runs in runs.items():
            tokens_per_s = statistics.median(_throughput(run) for run in method_runs)
            prefill_s = statistics.median(prefills[name])
            speed[name][str(context)] = {"tokens_per_s": tokens_per_s, "ratio_to_fp32": tokens_per_s / reference,
                                         "runs_tokens_per_s": [_throughput(run) for run in method_runs],
                                         "prefill_s": prefill_s, "prefill_ratio_to_fp32": prefill_s / reference_prefill,
                                         "runs_prefill_s": prefills[name]}

    memory = {}
    shape = model_fingerprint(loaded.model.config)
    elements_per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"]
    context = max(contexts)
    for method in tqdm(methods, desc=f"decode memory @ {context}", disable=not progress):
        model = models[method.precision]
        cache, prompt_length = _prefilled(model, method, token_ids, context)
        transient = _peak_transient_bytes(functools.partial(_timed_steps, model, cache, token_ids, prompt_length, memory_steps))
        # A second, short cache of the same method tells per-model tables (built lazily, so only now) from state.
        twin, _ = _prefilled(model, method, token_ids, 256)
        shared = shared_storages(cache, twin)
        del twin
        held = cache_bytes(cache, excluding=shared)
        memory[method.name] = {
            "context": context, "transient_mib": transient / 2**20, "held_mib": held / 2**20,
            "shared_mib": sum(shared.values()) / 2**20,
            "bits_per_element": 8 * held / ((prompt_length + memory_steps) * elements_per_token),
        }
        del cache
    rows = []
    for method in methods:
        rows.append({"method": method.name, "family": method.family, "precision": method.precision,
                     "attention": method.expected_path, "speed": speed[method.name], "memory": memory[method.name],
                     "quality": quality[method.name],
                     **({"settings": method.extra} if method.extra else {})})
    return {
        "model": loaded.description, "text": corpus.description, "contexts": list(contexts), "steps": steps,
        "repeats": repeats, "memory_steps": memory_steps, "threads": torch.get_num_threads(), "rows": rows,
        "environment": run_environment(), "seconds": round(time.perf_counter() - started, 1),
    }


QUALITY = dict(context=1024, continuation=64, windows=4)


def _decode_quality(models, methods, token_ids, *, context=QUALITY["context"], continuation=QUALITY["continuation"],
                    windows=QUALITY["windows"], progress=True) -> dict[str, dict]:
    """Teacher-forced decoding through each cache (as ``bench kv``): KL and top-1 agreement against the fp32
    DynamicCache, perplexity and its change (± paired standard error). Windows come from the end of the text, away
    from the tokens used for speed."""
    span = context + continuation + 1
    first = token_ids.numel() - windows * span
    spans = [token_ids[first + i * span: first + (i + 1) * span] for i in range(windows)]
    reference_rows, reference_nlls, results = None, None, {}
    for method in tqdm(methods, desc="decode quality", disable=not progress):  # the reference comes first
        model, rows, nlls = models[method.precision], [], []
        with torch.inference_mode():
            for window in spans:
                rows.append(decode_logprobs(model, method.make_cache(model), window, context))
                nlls.append(token_nll(rows[-1], window[context + 1:]))
        metrics = perplexity_metrics(nlls, reference_nlls)
        metrics.update(divergence_metrics(rows, reference_rows))
        if reference_rows is None:
            reference_rows, reference_nlls = rows, nlls
        results[method.name] = {k: v for k, v in metrics.items() if not k.startswith("window_")}
    return results


def _prefilled(model, method: DecodeMethod, token_ids, context: int):
    context -= context % max(method.prefill_multiple, 1)
    cache = method.make_cache(model)
    if method.expected_path is not None and cache.attention_path != method.expected_path:
        raise RuntimeError(f"{method.name}: the cache chose the {cache.attention_path} path.")
    with torch.inference_mode():
        model(token_ids[None, :context], cache=cache, logits_to_keep=1)
    return cache, context


def _throughput(step_seconds: list[float]) -> float:
    """Decoded tokens per second of one run: every step counted, the ones that also encode or re-quantize too."""
    return len(step_seconds) / sum(step_seconds)


def _timed_steps(model, cache, token_ids, start: int, steps: int) -> list[float]:
    seconds = []
    with torch.inference_mode():
        for position in range(start, start + steps):
            began = time.perf_counter()
            model(token_ids[None, position:position + 1], cache=cache)
            seconds.append(time.perf_counter() - began)
    return seconds


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _release_free_heap() -> None:
    gc.collect()
    libc_path = ctypes.util.find_library("c")
    if libc_path:
        trim = getattr(ctypes.CDLL(libc_path), "malloc_trim", None)
        if trim is not None:
            trim(0)


def _peak_transient_bytes(run: Callable) -> int:
    """Peak resident memory while ``run()`` executes, minus the resident memory just before (sampled every 0.2 ms)."""
    _release_free_heap()
    baseline = peak = _resident_bytes()
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _resident_bytes())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run()
    finally:
        done.set()
        sampler.join()
    return max(peak, _resident_bytes()) - baseline


def decode_markdown(results: dict) -> str:
    contexts = results["contexts"]
    longest = max(contexts)
    lines = [
        "# Decode speed and memory",
        "",
        f"- Model: {results['model']}",
        f"- Text: {results['text']}",
        f"- Speed: {results['steps']} decode steps after the prefill; tokens/s = steps / their total time (periodic work included: GSRQ encodes 33 window tokens every 33 steps, quanto re-quantizes every 128); median "
        f"of {results['repeats']} interleaved repeats; × = ratio to `{REFERENCE}` in the same run; "
        f"{results['threads']} torch threads",
        f"- Memory at {longest} tokens: `held` = tensors the cache holds (per-model tables in `shared`); `transient` = "
        f"peak resident memory during {results['memory_steps']} decode steps minus resident memory before them",
        f"- {results['environment']['date']}; torch {results['environment']['versions']['torch']}, transformers "
        f"{results['environment']['versions']['transformers']}; {results['seconds']:.0f} s in all",
        f"- Quality: teacher-forced decoding through each cache, {QUALITY['windows']} windows × ({QUALITY['context']} "
        f"prefilled + {QUALITY['continuation']} decoded tokens) from the end of the text; KL and top-1 against "
        f"`{REFERENCE}`; Δppl ± standard error of paired per-window differences",
        *([f"- Command: `{results['command']}`"] if results.get("command") else []),
        "",
        "| method | KL | top-1 | Δppl % ± se | " + " | ".join(f"tok/s @{c} (×)" for c in contexts)
        + f" | bits/elt held @{longest} | held MiB | transient MiB | shared MiB |",
        "|---|" + "---|" * (len(contexts) + 7),
    ]
    for row in results["rows"]:
        cells = [f"{row['speed'][str(c)]['tokens_per_s']:.1f} ({row['speed'][str(c)]['ratio_to_fp32']:.2f}×)"
                 for c in contexts]
        memory, quality = row["memory"], row["quality"]
        error = quality["delta_ppl_pct_se"]
        lines.append(f"| {row['method']} | {quality['kl_mean']:.3f} | {quality['top1_agreement']:.3f} | "
                     f"{quality['delta_ppl_pct']:+.1f} ± {error if error is None else round(error, 1)} | " + " | ".join(cells) + f" | {memory['bits_per_element']:.2f} | "
                     f"{memory['held_mib']:.1f} | {memory['transient_mib']:.1f} | {memory['shared_mib']:.1f} |")
    ratios = same_model_ratios(results)
    if any(ratio is not None for row in ratios for ratio in row["ratios"].values()):
        cells = lambda values: " | ".join("–" if v is None else f"{v:.2f}×" for v in values)  # noqa: E731
        lines += [
            "",
            "Same model, same run: each row's decode speed as a multiple of the DynamicCache and of quanto 4-bit "
            "(per-channel keys) that ran on the same copy of the model (fp32 rows against the fp32 ones, bf16 rows "
            "against the bf16 ones), i.e. what changing the cache and nothing else changes; – where that row was not "
            "run.",
            "",
            "| method | model | " + " | ".join(f"× DynamicCache @{c}" for c in contexts) + " | "
            + " | ".join(f"× quanto 4-bit @{c}" for c in contexts) + " |",
            "|---|---|" + "---|" * (2 * len(contexts)),
        ]
        for row in ratios:
            lines.append(f"| {row['method']} | {row['precision']} | "
                         + cells(row["ratios"][("dynamic", c)] for c in contexts) + " | "
                         + cells(row["ratios"][("quanto", c)] for c in contexts) + " |")
    if all("prefill_s" in row["speed"][str(c)] for row in results["rows"] for c in contexts):
        lines += [
            "",
            f"Prefill (time to the first token): seconds for the prompt's forward pass, including the cache's "
            f"encoding of it; median of {results['repeats']} runs; × = ratio to `{REFERENCE}`.",
            "",
            "| method | " + " | ".join(f"prefill s @{c} (×)" for c in contexts) + " |",
            "|---|" + "---|" * len(contexts),
        ]
        for row in results["rows"]:
            lines.append(f"| {row['method']} | " + " | ".join(
                f"{row['speed'][str(c)]['prefill_s']:.2f} ({row['speed'][str(c)]['prefill_ratio_to_fp32']:.2f}×)"
                for c in contexts) + " |")
    return "\n".join(lines) + "\n"


def same_model_ratios(results: dict) -> list[dict]:
    """Per row, its tokens/s over those of the DynamicCache and of quanto 4-bit that ran on the same copy of the
    model (``SAME_MODEL_REFERENCES``); None where that reference is not among the rows."""
    speeds = {row["method"]: row["speed"] for row in results["rows"]}
    out = []
    for row in results["rows"]:
        precision = row.get("precision", "fp32")
        references = dict(zip(("dynamic", "quanto"), SAME_MODEL_REFERENCES.get(precision, (None, None))))
        ratios = {}
        for kind, reference in references.items():
            for context in results["contexts"]:
                base = speeds.get(reference, {}).get(str(context))
                ratios[(kind, context)] = (row["speed"][str(context)]["tokens_per_s"] / base["tokens_per_s"]
                                           if base else None)
        out.append({"method": row["method"], "precision": precision, "ratios": ratios})
    return out


def plot_decode_speed(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for row in results["rows"]:
        contexts = results["contexts"]
        axis.plot(contexts, [row["speed"][str(c)]["tokens_per_s"] for c in contexts], marker="o", label=row["method"])
    axis.set_xscale("log", base=2)
    axis.set_xticks(results["contexts"], [str(c) for c in results["contexts"]])
    axis.set_xlabel("context (tokens)")
    axis.set_ylabel("decode tokens/s (throughput, median of runs)")
    axis.set_title(f"Decode speed on CPU, {results['threads']} threads")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
