"""`hf-kvcodecs bench kv`: GSRQ (GSKM and l2 k-means codebooks) against the caches transformers ships and a
calibration-free TurboQuant-style cache, side by side, optionally on RULER-style long-context tasks as well."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..codecs.joint import resolve_layouts
from ..codecs.kmeans import BEST_GSKM_LEARNER
from ..codecs.residual import check_bit_rate, lowest_bit_rate
from ..evaluation import TaskSuiteOptions, generate_task_items
from ..gsrq import GSRQCache
from ..gsrq.codebooks import LAYOUTS, RATE_TOLERANCE, heads_per_code
from ..gsrq.store import calibration_defaults, ensure_codebooks
from ..integrations.attention import enable_code_attention
from ..models import LoadedModel, model_fingerprint
from ..text import EVALUATION_DEFAULT, load_corpus, tokenize_corpus
from .fidelity import recorded_attention_inputs, relative_errors
from .harness import (
    FULL_PRECISION,
    TRANSFORMERS_QUANTIZED,
    CacheMethod,
    check_group_sizes,
    evaluate_methods,
    long_context_tasks,
    shipped_baselines,
)
from .memory import cache_footprint, dynamic_cache_bytes
from .report import write_reports

GSRQ_RATES = (1.0, 2.0)  # bits per KV element, scales included
GSRQ_LEARNERS = {BEST_GSKM_LEARNER: "gsrq", "l2": "l2-rvq"}  # learner -> family label in reports

# Full-run and quick-run measurement settings (quick: a smoke test of the whole pipeline in a few minutes).
FULL = dict(context_len=1024, continuation_len=64, n_windows=4, greedy_prompts=2, greedy_tokens=32, passkey_trials=2,
            passkey_lengths=(512, 1024, 2048), speed_contexts=(1024, 4096), speed_tokens=32, speed_repeats=3)
QUICK = dict(context_len=256, continuation_len=16, n_windows=1, greedy_prompts=1, greedy_tokens=8, passkey_trials=1,
             passkey_lengths=(256,), passkey_depths=(0.5,), speed_contexts=(256,), speed_tokens=4, speed_repeats=1)
QUICK_CALIBRATION = dict(num_windows=4, holdout_windows=1, n_iter=4, fit_rows=2048)
# The GSRQ cache settings every benchmark of the codec uses: a 32-token exact window, flushed every 32 tokens, 4 sinks.
# Pinned here rather than read from GSRQCacheConfig's defaults: every published row was measured at these values, and a
# change of the library's defaults must not silently change what the benchmark measures.
BENCH_CACHE_SETTINGS = dict(window_length=32, flush_interval=32, num_sink_tokens=4)


# Plain residual VQ as VQLLM does it, the baseline the GSRQ paper measures against: l2 k-means codebooks shared by a
# layer's heads, fitted unweighted on RMS-normalized head vectors without a decorrelating transform, every head vector
# coded on its own, the nearest codeword stage by stage (greedy), and the normalizing RMS kept as the scale. The
# group size is the run's choice. It differs from VQLLM in the codebook size (256 words, as every row here; VQLLM's
# 1024-2048 words code 32- or 64-dim sub-vectors), contiguous rather than interleaved key channel groups, the stages
# allocated to the groups by error, and no fine-tuning.
PLAIN_RVQ_FAMILY = "plain-rvq"
PLAIN_RVQ_CALIBRATION = {"transform": "none", "key_layout": "per_head", "value_layout": "per_head", "weighted": False}
PLAIN_RVQ_ENCODER = {"gain": "rms", "beam_width": 1}
PLAIN_RVQ_GROUP_DIMS = (calibration_defaults()["group_dim"],)  # `--plain-rvq` without a group size


def plain_rvq_row(group_dim: int, learner: str = "l2") -> tuple[str, str, dict]:
    """``(row label, family label, calibration settings)`` of plain residual VQ over ``group_dim``-dim groups with
    ``learner``'s codebooks (VQLLM's is l2 k-means; the GSRQ paper swaps in GSKM within that pipeline)."""
    if isinstance(group_dim, bool) or not isinstance(group_dim, int) or group_dim < 1:
        raise ValueError(f"plain residual VQ group sizes must be positive integers, got {group_dim!r}.")
    learned, family_learner = ("l2 residual VQ", "") if learner == "l2" else (f"residual VQ, {learner} codebooks",
                                                                               f"{learner}, ")
    return (f"plain {learned} (VQLLM-like, {group_dim}-dim groups)",
            f"{PLAIN_RVQ_FAMILY} ({family_learner}{group_dim}-dim groups)",
            {**PLAIN_RVQ_CALIBRATION, "group_dim": group_dim})


def gsrq_methods(loaded: LoadedModel, *, rates=GSRQ_RATES, learners=tuple(GSRQ_LEARNERS), seeds=(0,), text=None,
                 store=None, window_length: int = BENCH_CACHE_SETTINGS["window_length"],
                 flush_interval: int = BENCH_CACHE_SETTINGS["flush_interval"],
                 num_sink_tokens: int = BENCH_CACHE_SETTINGS["num_sink_tokens"],
                 calibration: dict | None = None, layout: tuple[str, dict] = ("", {}), layout_variants: tuple = (),
                 plain_rvq: tuple[int, ...] = (), progress: bool = True) -> list[CacheMethod]:
    """One calibration per (learner, seed) at the highest rate (lower rates are prefixes), one method per
    (learner, seed, rate). Several calibration seeds show how much of a difference between learners is just the
    luck of one k-means run. ``layout`` (``(description, settings)``, see :func:`codec_layout`) is the codec layout
    of those rows (default: the calibration defaults); ``layout_variants`` (more such pairs) add l2 codebooks of the
    first seed with other codec layouts, measured in the same run. ``plain_rvq`` (group sizes) adds plain
    residual VQ over groups of each size (:func:`plain_rvq_row`, :data:`PLAIN_RVQ_ENCODER`) with each learner's
    codebooks, calibrated with the first seed.

    The model is put on the code-reading attention, as ``generate(cache_implementation="gsrq")`` does, so GSRQ is
    measured on the path users get (the stand-in passes every other cache to the original attention unchanged).
    """
    if not seeds:
        raise ValueError("seeds must name at least one calibration seed.")
    attention_path = "codes" if enable_code_attention(loaded.model) else "dequantize"
    methods = []
    seed_label = (lambda seed: f", seed {seed}") if len(seeds) > 1 else (lambda seed: "")
    # (learner, seed, row label, family label, calibration settings, encoder settings)
    runs = [(learner, seed,
             (f"GSRQ ({learner} codebooks{seed_label(seed)}{layout[0]})" if learner.startswith("gskm")
              else f"same codec, l2 k-means codebooks{seed_label(seed)}{layout[0]}"),
             GSRQ_LEARNERS.get(learner, learner) + (" " + layout_family(layout[1]) if layout[1] else ""),
             layout[1], {}) for learner in learners for seed in seeds]
    runs += [("l2", seeds[0], f"same codec, l2 k-means codebooks{seed_label(seeds[0])}{description}",
              "l2-rvq " + layout_family(settings), settings, {}) for description, settings in layout_variants]
    for learner in learners:
        for group_dim in plain_rvq:
            label, family, settings = plain_rvq_row(group_dim, learner)
            runs.append((learner, seeds[0], label + seed_label(seeds[0]), family, settings, PLAIN_RVQ_ENCODER))
    for learner, seed, label, family, layout, encoder in runs:
        codebooks, directory, reused = ensure_codebooks(
            loaded, store=store, text=text, progress=progress, learner=learner, bits=max(rates), seed=seed,
            **layout, **(calibration or {}),
        )
        for bits in rates:
            cache_settings = dict(codebooks=codebooks, bits=bits, window_length=window_length,
                                  flush_interval=flush_interval, num_sink_tokens=num_sink_tokens, **encoder)
            methods.append(CacheMethod(
                name=f"{label} {bits:g}-bit",
                make_cache=lambda model, s=cache_settings: GSRQCache(model.config, **s),
                family=family,
                nominal_bits=bits,
                extra={
                    "learner": learner, "seed": seed, "bits": bits, "key_layout": codebooks.layout("keys"),
                    "value_layout": codebooks.layout("values"), "window_length": window_length, "flush_interval": flush_interval,
                    "num_sink_tokens": num_sink_tokens, "codebooks": str(directory), "attention": attention_path,
                    "calibration_seconds": round(codebooks.calibration["seconds_total"], 1),
                    "calibration_reused": reused, "calibration_text": codebooks.calibration["text"]["description"],
                    **({"encoder": encoder, "calibration_settings": layout} if encoder else {}),
                    "holdout_relative_mse": codebooks.calibration["holdout_mean"] if bits == max(rates) else None,
                },
            ))
    return methods


def layout_family(layout: dict) -> str:
    """A short family label for codebooks calibrated with non-default layouts."""
    return "(" + ", ".join(f"{name.split('_')[0]}s {str(value).replace('_', '-')}"
                           for name, value in sorted(layout.items())) + ")"


# The simpler layouts the default improves on (values coded jointly over the heads without the keys' prediction; keys
# per head with codebooks shared by the heads; keys and values coded per head vector) and the best-quality layout (keys
# coded conditionally on the heads before them) next to the default, on the same seed, so that each row shows what one
# layout choice buys.
LAYOUT_VARIANTS = ((", values joint over heads", {"value_layout": "joint_heads"}),
                   (", keys per head, shared codebooks, values joint over heads",
                    {"key_layout": "per_head", "value_layout": "joint_heads"}),
                   (", keys and values per head", {"key_layout": "per_head", "value_layout": "per_head"}),
                   (", keys conditional on earlier heads", {"key_layout": "conditional_heads"}))
# How row labels name a layout that differs from the calibration default.
_LAYOUT_WORDS = {"per_head": "per head", "joint_heads": "joint over heads", "per_head_codebooks": "per head, own codebooks",
                 "conditional_heads": "conditional on earlier heads",
                 "given_keys": "given the keys"}


def codec_layout(key_layout: str | None = None, value_layout: str | None = None,
                 group_dim: int | None = None) -> tuple[str, dict]:
    """``(label suffix, calibration settings)`` for rows calibrated with these layouts and ``group_dim``-dim groups
    (``None``: the default)."""
    defaults = dict(zip(("keys", "values"), resolve_layouts()))  # this benchmark codes keys before RoPE
    chosen = dict(zip(("keys", "values"), resolve_layouts("pre_rope", key_layout, value_layout)))
    for kind, value in chosen.items():
        if value not in LAYOUTS[kind]:
            raise ValueError(f"{kind[:-1]}_layout must be one of {LAYOUTS[kind]}, got {value!r}.")
    changed = {kind: value for kind, value in chosen.items() if value != defaults[kind]}
    words = [f"{kind} {_LAYOUT_WORDS[value]}" for kind, value in changed.items()]
    settings = {f"{kind[:-1]}_layout": value for kind, value in changed.items()}
    if group_dim is not None and group_dim != calibration_defaults()["group_dim"]:
        words.append(f"{group_dim}-dim groups")
        settings["group_dim"] = group_dim
    return "".join(", " + word for word in words), settings


def run_kv_benchmark(loaded: LoadedModel, *, out: str | Path, text=None, calibration_text=None, quick: bool = False,
                     seeds=(0,), store=None, progress: bool = True, learners=None, key_layout: str | None = None,
                     value_layout: str | None = None, layout_variants: bool = True, baselines=None,
                     rates=GSRQ_RATES, windows: int | None = None, passkey_trials: int | None = None,
                     speed: bool = True, plain_rvq: tuple[int, ...] = (), group_dim: int | None = None,
                     long_context: TaskSuiteOptions | None = None) -> dict:
    """``bench kv``: every baseline (or ``baselines``, keys of ``harness.BASELINE_IDS``: quanto, HQQ and TurboQuant;
    the full-precision reference always runs), GSRQ per learner (``learners``, default both), seed and rate with the
    codec layout ``key_layout`` / ``value_layout`` (default: the calibration defaults), and, when that layout is the
    default and ``layout_variants`` is true, the l2 codebooks of the first seed with the other layouts of
    :data:`LAYOUT_VARIANTS`.
    ``rates`` are the GSRQ rows' bits per element (calibrated once at the highest; lower rates are its prefixes).
    ``windows`` (perplexity/KL windows) and ``passkey_trials`` (keys per haystack length and depth) override the
    protocol's defaults, for comparisons that need more statistical power; ``speed=False`` skips the speed phase.
    ``plain_rvq`` (group sizes) adds plain residual VQ at the same rates, per learner (see :func:`plain_rvq_row`).
    ``group_dim`` sets the GSRQ rows' group size (default: the calibration default, 8).
    ``long_context`` (default None: none) runs every method that runs through the RULER-style long-context tasks it
    names, against the full-precision reference item by item (:func:`harness.long_context_tasks`); the results go
    under ``long_context``. Each item is one prefill of its context length plus up to its task's answer budget
    (30-120 tokens) of greedy decoding, per method.
    """
    rates, plain_rvq = tuple(rates), tuple(plain_rvq)
    check_group_sizes(loaded.model.config, [*(("--plain-rvq", size) for size in plain_rvq),
                                            *([("--group-dim", group_dim)] if group_dim is not None else [])])
    if not rates or len(set(rates)) < len(rates):
        raise ValueError(f"rates must name each bit rate at most once, got {list(rates)}.")
    for rate in rates:
        check_bit_rate("bits", rate)
    learners = tuple(learners or GSRQ_LEARNERS)
    unknown = sorted(set(learners) - set(GSRQ_LEARNERS))
    if unknown or len(set(learners)) < len(learners):
        raise ValueError(f"learners must name each of {list(GSRQ_LEARNERS)} at most once, got {list(learners)}.")
    protocol = dict(QUICK if quick else FULL)
    for name, value, least in (("windows", windows, 1), ("passkey_trials", passkey_trials, 0)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}.")
        protocol["n_windows" if name == "windows" else name] = value
    if not speed:
        protocol["speed_contexts"] = ()
    if long_context is not None and not isinstance(long_context, TaskSuiteOptions):
        raise TypeError("long_context must be a TaskSuiteOptions (hf_kvcodecs.evaluation.TaskSuiteOptions) or None, "
                        f"got {type(long_context).__name__}.")
    layout = codec_layout(key_layout, value_layout, group_dim)
    # the variants are l2 codebooks next to the default layout's l2 rows
    variants = LAYOUT_VARIANTS if layout_variants and not layout[1] and "l2" in learners and not quick else ()
    check_rates_offered(loaded.model.config, rates, [layout[1], *(settings for _, settings in variants),
                                                     *(plain_rvq_row(dim)[2] for dim in plain_rvq)])
    corpus = load_corpus(text, default=EVALUATION_DEFAULT)
    token_ids = tokenize_corpus(loaded.tokenizer, corpus)
    # Before any calibration or measurement: a context length too short for one of the tasks fails here.
    task_items = None if long_context is None else generate_task_items(loaded.tokenizer, long_context)
    methods = shipped_baselines(loaded.model, only=baselines) + gsrq_methods(
        loaded, rates=rates, seeds=tuple(seeds), learners=learners, text=calibration_text, store=store, progress=progress,
        calibration=QUICK_CALIBRATION if quick else None, layout=layout, layout_variants=variants, plain_rvq=plain_rvq,
    )
    results = evaluate_methods(
        loaded.model, loaded.tokenizer, methods, eval_token_ids=token_ids, eval_description=corpus.description,
        model_description=loaded.description, progress=progress, **protocol,
    )
    if long_context is not None:
        results["long_context"] = long_context_tasks(loaded.model, loaded.tokenizer, methods, long_context,
                                                     items=task_items, entries=results["methods"], progress=progress)
    results["command"] = kv_command(loaded.name, quick=quick, seeds=seeds, learners=learners, layout=layout[1],
                                    layout_variants=layout_variants, baselines=baselines, rates=rates, text=text,
                                    calibration_text=calibration_text, threads=torch.get_num_threads(),
                                    windows=windows, passkey_trials=passkey_trials, speed=speed, plain_rvq=plain_rvq,
                                    long_context=long_context)
    results["files"] = {name: str(path) for name, path in write_reports(results, out).items()}
    return results


def check_rates_offered(config, rates, layouts) -> None:
    """Refuse, before any calibration, a rate below what one residual stage plus the scales cost in one of the
    ``layouts`` (calibration settings, as from :func:`codec_layout`) to be measured, or one between two stages (the
    codebooks serve the lowest rate plus whole stages only)."""
    defaults, fingerprint = calibration_defaults(), model_fingerprint(config)
    codebook_bits, scale_bits = defaults["codebook_bits"], defaults["scale_bits"]
    for layout in layouts:
        resolved = dict(zip(("key", "value"), resolve_layouts(
            layout.get("key_space", defaults["key_space"]), layout.get("key_layout") or defaults["key_layout"],
            layout.get("value_layout") or defaults["value_layout"])))
        for kind, chosen in resolved.items():
            heads = heads_per_code(chosen, fingerprint["num_key_value_heads"])
            lowest = lowest_bit_rate(fingerprint["head_dim"], codebook_bits, scale_bits, heads)
            too_low = [rate for rate in rates if rate < lowest - 1e-9]
            if too_low:
                raise ValueError(
                    f"--bits {too_low[0]:g} is below the lowest rate GSRQ offers for this model's {kind}s coded "
                    f"{_LAYOUT_WORDS[chosen]} ({lowest:.3f} bits per element: one {codebook_bits}-bit codebook index "
                    f"plus the {scale_bits}-bit scale{'s' if heads > 1 else ''} per {heads * fingerprint['head_dim']} "
                    f"elements). Choose rates of at least {lowest:.3f}."
                )
            step = codebook_bits / (heads * fingerprint["head_dim"])
            for rate in rates:
                below = lowest + math.floor((rate - lowest + RATE_TOLERANCE) / step) * step
                if rate - below > RATE_TOLERANCE:
                    raise ValueError(
                        f"--bits {rate:g} falls between two rates GSRQ serves for this model's {kind}s coded "
                        f"{_LAYOUT_WORDS[chosen]} (the lowest, {lowest:.4f}, plus whole stages of {step:.4f} bits per "
                        f"element). Pass {below:.4g} or {below + step:.4g}."
                    )


def measure_memory(loaded: LoadedModel, *, contexts=(1024, 4096), decode_steps: int = 64, text=None, store=None,
                   learners=tuple(GSRQ_LEARNERS), progress: bool = True, calibration_text=None,
                   key_layout: str | None = None, value_layout: str | None = None,
                   group_dim: int | None = None) -> dict:
    """Bits per K/V element held by each cache after prefilling ``context`` tokens of real text and after
    ``decode_steps`` more, counted from the tensors the cache holds (codebook tables shared per model reported apart);
    after the decode steps, the total each cache holds with every per-model table it references (what the model's
    only cache costs), beside what a 16-bit DynamicCache holds for the same tokens; and, at the next decode step,
    the relative squared error of the keys and values attention reads from each cache against the full-precision
    cache's (the first method). ``learners``: the GSRQ rows' codebook learners (each calibrated unless stored), on
    ``calibration_text`` (default: GSRQ's) with the codec layout the other arguments name (default: the default).
    """
    corpus = load_corpus(text, default=EVALUATION_DEFAULT)
    token_ids = tokenize_corpus(loaded.tokenizer, corpus)
    shape = model_fingerprint(loaded.model.config)
    elements_per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"]
    # transformers' caches only: TurboQuant's bits held and quality are measured by bench kv
    methods = [m for m in shipped_baselines(loaded.model) if m.skip_reason is None and "default" not in m.name
               and m.family in (FULL_PRECISION, TRANSFORMERS_QUANTIZED)]
    methods += gsrq_methods(loaded, learners=tuple(learners), text=calibration_text, store=store, progress=progress,
                            layout=codec_layout(key_layout, value_layout, group_dim))
    rows, reference_inputs = [], {}
    # Every method is measured at the same lengths (the least common multiple of their prefill constraints), so
    # that their keys and values can be compared token for token with the reference's.
    multiple = math.lcm(*(max(method.prefill_multiple, 1) for method in methods))
    lengths = [context - context % multiple for context in contexts]
    for method in tqdm(methods, desc="memory", disable=not progress):
        row = {"method": method.name}
        for context in lengths:
            cache = method.make_cache(loaded.model)
            with torch.inference_mode():
                loaded.model(token_ids[None, :context], cache=cache)
                # After a prefill, so that lazily built per-model tables exist and are recognised as shared.
                footprint = cache_footprint(cache, method.make_cache(loaded.model))
                row["shared_mib"] = footprint.table_bytes / 2**20
                row[f"bits_after_prefill@{context}"] = 8 * footprint.state_bytes / (context * elements_per_token)
                for step in range(decode_steps):
                    loaded.model(token_ids[None, context + step : context + step + 1], cache=cache)
            held = context + decode_steps
            # Again: per-model tables built lazily by the first decode step (the code-reading attention's key
            # tables) are reachable from a fresh cache of the method too, so they are shared, not held per token.
            footprint = cache_footprint(cache, method.make_cache(loaded.model))
            row["shared_mib"] = footprint.table_bytes / 2**20
            row[f"bits_after_decode@{context}"] = 8 * footprint.state_bytes / (held * elements_per_token)
            row[f"total_mib@{held}"] = footprint.total_bytes / 2**20
            with torch.inference_mode(), recorded_attention_inputs(loaded.model) as attention_inputs:
                loaded.model(token_ids[None, held : held + 1], cache=cache)
            if not reference_inputs.get(context):
                reference_inputs[context] = attention_inputs  # the first method is the full-precision reference
            errors = relative_errors(attention_inputs, reference_inputs[context])
            row[f"key_error@{context}"], row[f"value_error@{context}"] = errors["keys"], errors["values"]
            del cache, attention_inputs
        rows.append(row)
    sixteen_bit = {str(context + decode_steps): dynamic_cache_bytes(loaded.model.config, context + decode_steps) / 2**20
                   for context in lengths}
    return {"model": loaded.description, "text": corpus.description, "decode_steps": decode_steps, "rows": rows,
            "bf16_dynamic_cache_mib": sixteen_bit}


def memory_markdown(results: dict) -> str:
    keys = [k for k in results["rows"][0] if k.startswith("bits_")]  # insertion order: by context, prefill first
    error_keys = [k for k in results["rows"][0] if k.startswith(("key_error@", "value_error@"))]
    lines = [
        f"Bits per K/V element held (model: {results['model']}; text: {results['text']}; "
        f"after prefill and after {results['decode_steps']} decode steps; 16-bit cache = 16.00)",
        "",
        "| method | " + " | ".join(keys) + " | ratio to 16-bit (last column) | shared MiB |",
        "|---|" + "---|" * (len(keys) + 2),
    ]
    for row in results["rows"]:
        cells = [f"{row[k]:.2f}" for k in keys]
        lines.append(f"| {row['method']} | " + " | ".join(cells) + f" | {16 / row[keys[-1]]:.1f}x | {row['shared_mib']:.1f} |")
    sixteen_bit = results.get("bf16_dynamic_cache_mib")
    if sixteen_bit:
        lengths = list(sixteen_bit)
        lines += [
            "",
            f"Total MiB held after the {results['decode_steps']} decode steps, at each number of tokens held: the "
            "cache with every per-model table it references (codebooks and the tables built from them, e.g. the "
            "code-reading attention's key tables; what the model's only cache costs), against a bf16 DynamicCache "
            "holding the same tokens (tokens x layers x 2 x KV heads x head_dim x 2 bytes):",
            "",
            "| method | " + " | ".join(f"total MiB @{n}" for n in lengths) + f" | ratio to bf16 DynamicCache @{lengths[-1]} |",
            "|---|" + "---|" * (len(lengths) + 1),
            "| bf16 DynamicCache (computed) | " + " | ".join(f"{sixteen_bit[n]:.1f}" for n in lengths) + " | 1.00x |",
        ]
        for row in results["rows"]:
            cells = [f"{row[f'total_mib@{n}']:.1f}" for n in lengths]
            ratio = row[f"total_mib@{lengths[-1]}"] / sixteen_bit[lengths[-1]]
            lines.append(f"| {row['method']} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    if error_keys:
        lines += [
            "",
            "Relative squared error of the keys (after RoPE) and values that attention reads from each cache at the next "
            "decode step, against the full-precision cache's, over every token held (exact windows and sinks count "
            "with their zero error), mean over layers:",
            "",
            "| method | " + " | ".join(error_keys) + " |",
            "|---|" + "---|" * len(error_keys),
        ]
        for row in results["rows"]:
            lines.append(f"| {row['method']} | " + " | ".join(f"{row[k]:.4f}" for k in error_keys) + " |")
    return "\n".join(lines) + "\n"


def kv_command(model_name: str, *, quick: bool, seeds, learners, layout: dict, layout_variants: bool, baselines,
               rates=GSRQ_RATES, text=None, calibration_text=None, threads: int | None = None,
               windows: int | None = None, passkey_trials: int | None = None, speed: bool = True,
               plain_rvq: tuple[int, ...] = (), long_context: TaskSuiteOptions | None = None) -> str:
    """The ``hf-kvcodecs bench kv`` command line that reproduces a run (recorded in its reports); ``text`` and
    ``calibration_text`` as the run got them (None: the defaults; a corpus name or a list of files). Of
    ``long_context``, the command line sets the tasks, lengths and items per cell; its other settings are in the
    results' ``long_context.options``."""
    def words(value):
        return [value] if isinstance(value, str) else list(value)

    tasks, task_defaults = long_context or TaskSuiteOptions(), TaskSuiteOptions()

    options = [
        (["--threads", str(threads)], threads is not None), (["--quick"], quick),
        (["--seeds", *map(str, seeds)], tuple(seeds) != (0,)),
        (["--learners", *learners], tuple(learners) != tuple(GSRQ_LEARNERS)),
        (["--bits", *(f"{rate:g}" for rate in rates)], tuple(rates) != GSRQ_RATES),
        *(([f"--{name.replace('_', '-')}", str(value)], True) for name, value in layout.items()),
        (["--no-layout-variants"], not layout_variants and not layout),
        (["--windows", str(windows)], windows is not None),
        (["--passkey-trials", str(passkey_trials)], passkey_trials is not None),
        (["--no-speed"], not speed),
        (["--plain-rvq", *map(str, plain_rvq)], bool(plain_rvq)),
        (["--tasks", *tasks.tasks], long_context is not None),
        (["--task-lengths", *map(str, tasks.lengths)], long_context is not None and tasks.lengths != task_defaults.lengths),
        (["--task-items", str(tasks.items_per_cell)],
         long_context is not None and tasks.items_per_cell != task_defaults.items_per_cell),
        (["--baselines", *(baselines or ())], baselines is not None),
        (["--text", *words(text or ())], text is not None),
        (["--calibration-text", *words(calibration_text or ())], calibration_text is not None),
        (["--model", model_name], True),
    ]
    return shlex.join(["hf-kvcodecs", "bench", "kv", *(word for option, given in options if given for word in option)])
