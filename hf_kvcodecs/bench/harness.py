"""Compare KV-cache factories side by side in one process, following ``shared/docs/benchmark-protocol.md``.

Every method is a factory for fresh cache objects. All of them see the same windows of real text, the same pass-key
haystacks and the same speed inputs, and every quality number is paired against a full-precision ``DynamicCache``
that runs first in the same process:

1. teacher-forced decoding: prefill ``context_len`` tokens, then feed the continuation one token per forward call, so
   every scored prediction attends to what the cache stored (quantized caches return exact states on the prefill
   call, so prefill logits would measure nothing); perplexity, KL(fp || method), top-1 agreement;
2. greedy ``generate`` agreement with the full-precision tokens;
3. pass-key retrieval, the question fed in decode mode;
4. bytes held by the cache's tensors, as bits per KV element;
5. decode tokens/s with prefill untimed, repeats interleaved across methods.

:func:`long_context_tasks` runs the RULER-style long-context suite (:mod:`hf_kvcodecs.evaluation.tasks`) for the same
methods, on the same items for each, paired item by item against the same reference.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import logging
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import Cache, DynamicCache, PreTrainedModel, QuantizedCache

from ..codecs.turboquant import TurboQuantRotations, held_bits_per_element, rotation_bytes
from ..evaluation import (
    TaskSuiteOptions,
    compare_task_results,
    decode_logprobs,
    decode_step,
    divergence_metrics,
    generate_task_items,
    perplexity_metrics,
    prefill,
    run_task_suite,
    strided_windows,
    token_nll,
)
from ..evaluation.passkey import PASSKEY_QUESTION, PasskeyCase, passkey_cases, passkey_scores, token_ids
from ..integrations.loading import loaded_from
from ..integrations.turboquant_cache import TurboQuantCache
from ..models import model_fingerprint
from .memory import cache_bytes, shared_storages

logger = logging.getLogger(__name__)

FULL_PRECISION = "full precision"
TRANSFORMERS_QUANTIZED = "transformers QuantizedCache"


# Tokens prefilled (then decoded twice) to warm each method up: quanto compiles a C++ extension on first use.
_WARM_UP_TOKENS = 64
_WARM_UP_DECODE_STEPS = 2


@dataclass
class CacheMethod:
    name: str  # e.g. "fp32 DynamicCache", "quanto 4-bit (per-channel keys)"
    make_cache: Callable[[PreTrainedModel], Cache]  # returns a FRESH cache object each call
    family: str  # "full precision" | "transformers QuantizedCache" | "turboquant" | "gsrq" | "l2-rvq" ...
    nominal_bits: float | None = None  # bits per KV element the method claims; plotted when nothing was measured
    extra: dict = field(default_factory=dict)  # echoed into the report (settings, calibration time, ...)
    # Every prefill length must be a multiple of this, because some backends crash on other lengths (quanto's
    # per-channel groups need kv_heads * tokens to be a multiple of 64). The harness trims all lengths to the least
    # common multiple over the methods it runs, and records what it trimmed.
    prefill_multiple: int = 1
    # Set when the method cannot run on this machine (e.g. its backend is not installed); it is reported, not run.
    skip_reason: str | None = None


_SHORT_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def check_group_sizes(config, sizes: Sequence[tuple[str, int]]) -> None:
    """Raise a clear error unless each ``(option, size)`` names a codec group size this model can use: a positive
    integer that divides its head_dim, each size given once per option."""
    head_dim = model_fingerprint(config)["head_dim"]
    for option in {option for option, _ in sizes}:
        given = [size for name, size in sizes if name == option]
        if len(set(given)) < len(given):
            raise ValueError(f"{option}: each group size must be given once, got {given}.")
    for option, size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or head_dim % size:
            raise ValueError(f"{option} {size}: a group size must be a positive integer that divides the model's "
                             f"head_dim ({head_dim}), e.g. 8.")


def full_precision_method(model: PreTrainedModel) -> CacheMethod:
    """The reference: transformers' ``DynamicCache`` at the model's own precision."""
    dtype = model.dtype
    return CacheMethod(
        name=f"{_SHORT_DTYPE_NAMES.get(dtype, str(dtype).removeprefix('torch.'))} DynamicCache",
        make_cache=lambda model: DynamicCache(config=model.config),
        family=FULL_PRECISION,
        nominal_bits=float(torch.finfo(dtype).bits),
    )


TURBOQUANT = "turboquant"  # family of the calibration-free rotation + Lloyd-Max rows
TURBOQUANT_RATES = (2.0, 2.5, 3.0, 3.5, 4.0)
# Rates also measured with the first and last layers at full precision: the low ones, where coding errs the most.
TURBOQUANT_PROTECTED_RATES = (2.0, 3.0)
TURBOQUANT_PROTECTED_LAYERS = 1  # at each end of the model
# The exact window of bench kv's GSRQ rows (32 recent tokens), so that their bits held compare like for like.
TURBOQUANT_RESIDUAL_LENGTH = 32


def _turboquant_name(bits: float, protected_layers: int = 0) -> str:
    protection = {0: "", 1: ", first and last layer exact"}.get(
        protected_layers, f", first and last {protected_layers} layers exact")
    return f"turboquant {bits:g}-bit (rotation + Lloyd-Max{protection})"


# Short names for the shipped baselines (the CLI's ``--baselines``), in the order they are measured.
BASELINE_IDS = {
    "quanto-4": "quanto 4-bit (per-channel keys)",
    "quanto-2": "quanto 2-bit (per-channel keys)",
    "quanto-2-per-token": "quanto 2-bit (default per-token keys)",
    "hqq-4": "hqq 4-bit (axis 1)",
    "hqq-2": "hqq 2-bit (axis 1)",
    **{f"turboquant-{bits:g}": _turboquant_name(bits) for bits in TURBOQUANT_RATES},
    **{f"turboquant-{bits:g}-protected": _turboquant_name(bits, TURBOQUANT_PROTECTED_LAYERS)
       for bits in TURBOQUANT_PROTECTED_RATES},
}


def shipped_baselines(model: PreTrainedModel, *, residual_length: int = 128,
                      only: Sequence[str] | None = None) -> list[CacheMethod]:
    """The full-precision ``DynamicCache``, transformers' ``QuantizedCache`` at its best settings, not only defaults,
    and the calibration-free TurboQuant-style cache.

    quanto 4- and 2-bit with per-channel keys (``axis_key=-1``, KIVI-style) and per-token values, and quanto 2-bit with
    the default per-token keys so that its collapse is visible. HQQ (``axis=1`` for keys and values, its better
    setting) is listed with a skip reason when the ``hqq`` package does not import. TurboQuant at each of
    :data:`TURBOQUANT_RATES`, and with the first and last layers at full precision at :data:`TURBOQUANT_PROTECTED_RATES`
    (see :func:`turboquant_method`). ``residual_length`` is the quanto and HQQ caches' flush length; TurboQuant keeps
    its :data:`TURBOQUANT_RESIDUAL_LENGTH` most recent tokens exact.

    ``only`` (keys of :data:`BASELINE_IDS`) keeps those quantized caches; the full-precision reference is always
    first, since every quality number and speed ratio is measured against it.
    """
    unknown = sorted(set(only or ()) - set(BASELINE_IDS))
    if unknown:
        raise ValueError(f"Unknown baseline(s) {unknown}; choose from {list(BASELINE_IDS)}.")
    shape = model_fingerprint(model.config)
    kv_heads, head_dim = shape["num_key_value_heads"], shape["head_dim"]
    group_size = 64
    methods = [full_precision_method(model)]

    quanto_settings = [(4, -1, "per-channel keys"), (2, -1, "per-channel keys"), (2, 0, "default per-token keys")]
    for nbits, axis_key, label in quanto_settings:
        multiple = math.lcm(
            _quanto_token_multiple(kv_heads, head_dim, axis_key, group_size),
            _quanto_token_multiple(kv_heads, head_dim, 0, group_size),
        )
        methods.append(
            _quantized_cache_method(
                f"quanto {nbits}-bit ({label})", "quanto", nbits, axis_key, 0, group_size, residual_length, multiple
            )
        )

    hqq_problem = _import_problem("hqq")
    for nbits in (4, 2):
        multiple = _hqq_token_multiple(kv_heads, head_dim, nbits, group_size)
        method = _quantized_cache_method(
            f"hqq {nbits}-bit (axis 1)", "hqq", nbits, 1, 1, group_size, residual_length, multiple
        )
        method.skip_reason = hqq_problem
        methods.append(method)
    methods += [turboquant_method(model, bits) for bits in TURBOQUANT_RATES]
    methods += [turboquant_method(model, bits, protected_layers=TURBOQUANT_PROTECTED_LAYERS)
                for bits in TURBOQUANT_PROTECTED_RATES]
    if only is not None:
        kept = {BASELINE_IDS[key] for key in only}
        methods = [methods[0]] + [method for method in methods[1:] if method.name in kept]
    return methods


def _quantized_cache_method(name, backend, nbits, axis_key, axis_value, group_size, residual_length, multiple):
    # The residual window is flushed (re-quantized together with the history) when it reaches residual_length
    # tokens, so quantized lengths are prefill + k * residual_length: both must be multiples for the backend.
    if residual_length % multiple:
        raise ValueError(
            f"{name}: residual_length={residual_length} must be a multiple of {multiple} on this model "
            "(the backend cannot quantize other lengths)."
        )
    settings = dict(
        backend=backend,
        nbits=nbits,
        axis_key=axis_key,
        axis_value=axis_value,
        q_group_size=group_size,
        residual_length=residual_length,
    )
    return CacheMethod(
        name=name,
        make_cache=lambda model: QuantizedCache(config=model.config, **settings),
        family=TRANSFORMERS_QUANTIZED,
        nominal_bits=float(nbits),
        extra=dict(settings),
        prefill_multiple=multiple,
    )


def turboquant_method(model: PreTrainedModel, bits: float, *, protected_layers: int = 0,
                      residual_length: int = TURBOQUANT_RESIDUAL_LENGTH, seed: int = 0) -> CacheMethod:
    """:class:`TurboQuantCache` at ``bits``. Every cache of the method shares one set of rotations, as a deployment
    would (one table per model), so they are reported as shared MiB; bits per element count the codes, the 16-bit
    norms and the full-precision window and protected layers."""
    shape = model_fingerprint(model.config)
    heads, head_dim, layers = shape["num_key_value_heads"], shape["head_dim"], shape["num_hidden_layers"]
    rotations = TurboQuantRotations(heads, head_dim, seed)
    settings = dict(bits=bits, residual_length=residual_length, protected_layers=protected_layers)
    coded_layers = max(layers - 2 * protected_layers, 0)
    return CacheMethod(
        name=_turboquant_name(bits, protected_layers),
        make_cache=lambda model: TurboQuantCache(model.config, rotations=rotations, **settings),
        family=TURBOQUANT,
        nominal_bits=float(bits),
        extra={**settings, "seed": seed, "calibration": "none",
               "coded_bits_per_element": held_bits_per_element(bits, head_dim),
               "rotation_bytes": rotation_bytes(coded_layers, heads, head_dim),
               "rotations": "one table per model, shared by every cache: in shared MiB, not in bits per element"},
    )


def _quanto_token_multiple(kv_heads: int, head_dim: int, axis: int, group_size: int) -> int:
    """Token counts quanto can quantize (batch 1): it views [batch, heads, tokens, head_dim] as 2-D and cuts groups of
    ``group_size`` along the rows (batch * heads * tokens) for axis -1, or along the flattened elements for axis 0."""
    per_token = kv_heads if axis == -1 else kv_heads * head_dim
    return group_size // math.gcd(per_token, group_size)


def _hqq_token_multiple(kv_heads: int, head_dim: int, nbits: int, group_size: int) -> int:
    """Token counts HQQ can quantize with axis 1 (batch 1): groups of ``group_size`` elements, and the group rows are
    bit-packed ``8 // nbits`` at a time (the limit measured in shared/docs/benchmark-protocol.md for head_dim 64)."""
    elements = group_size * (8 // nbits)
    return elements // math.gcd(kv_heads * head_dim, elements)


def _import_problem(module: str) -> str | None:
    try:
        __import__(module)
    except Exception as error:  # any failure to import means the backend cannot run here
        return f"the {module} package does not import ({type(error).__name__}: {error})"
    return None


def evaluate_methods(
    model: PreTrainedModel,
    tokenizer,
    methods: Sequence[CacheMethod],
    *,
    eval_token_ids: torch.Tensor,
    eval_description: str,
    context_len: int = 1024,
    continuation_len: int = 64,
    n_windows: int = 4,
    greedy_prompts: int = 2,
    greedy_tokens: int = 32,
    passkey_trials: int = 2,
    passkey_lengths: Sequence[int] = (512, 1024, 2048),
    passkey_depths: Sequence[float] = (0.1, 0.5, 0.9),
    passkey_answer_tokens: int = 8,
    speed_contexts: Sequence[int] = (1024, 4096),
    speed_tokens: int = 32,
    speed_repeats: int = 3,
    progress: bool = True,
    seed: int = 0,
    model_description: str | None = None,
) -> dict:
    """Run every metric for every method and return a JSON-serialisable results dict (see ``report.write_reports``).

    The first ``"full precision"`` method in ``methods`` is the reference; if there is none, a ``DynamicCache`` is
    added. It runs first, and a failure in it raises. A failure in another method is recorded in its entry (``error``)
    and the run goes on. ``passkey_trials`` is the number of keys per (length, depth) cell; 0 skips the pass-key test,
    as ``greedy_prompts=0`` and ``speed_contexts=()`` skip theirs.
    """
    started = time.perf_counter()
    methods = _reference_first(model, methods)
    names = [method.name for method in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"Method names must be unique (results are keyed by name): {names}")
    reference = methods[0]
    runnable = [method for method in methods if method.skip_reason is None]
    eval_token_ids = torch.as_tensor(eval_token_ids, dtype=torch.long).flatten()
    shape = model_fingerprint(model.config)
    elements_per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"]

    adjustments: list[str] = []
    alignment = math.lcm(*(method.prefill_multiple for method in runnable))
    constrained = ", ".join(method.name for method in runnable if method.prefill_multiple > 1)

    def trim(length: int, what: str) -> int:
        return _trim_to_multiple(length, alignment, what, constrained, adjustments)

    context_len = trim(context_len, "context_len")
    passkey_lengths = [trim(length, "pass-key length") for length in passkey_lengths] if passkey_trials > 0 else []
    speed_contexts = [trim(context, "speed context") for context in speed_contexts]
    speed_contexts = _fitting(speed_contexts, len(eval_token_ids) - speed_tokens, "speed context", adjustments)
    passkey_lengths = _fitting(passkey_lengths, len(eval_token_ids), "pass-key length", adjustments)

    windows, window_starts = strided_windows(eval_token_ids, n_windows, context_len + continuation_len + 1)
    generator = torch.Generator().manual_seed(seed)
    plan = _QualityPlan(
        windows=windows,
        context_len=context_len,
        elements_per_token=elements_per_token,
        greedy_prompts=[window[:context_len] for window in windows[:greedy_prompts]],
        greedy_tokens=greedy_tokens,
        passkey_cases=passkey_cases(
            tokenizer, eval_token_ids, passkey_lengths, passkey_depths, passkey_trials, generator
        ),
        passkey_answer_tokens=passkey_answer_tokens,
        progress=progress,
    )

    entries = {method.name: _entry(method) for method in methods}
    warm_up_ids = eval_token_ids[: math.ceil(_WARM_UP_TOKENS / alignment) * alignment]
    with torch.inference_mode():
        warm_caches = {}
        for method in tqdm(runnable, desc="warm-up", disable=not progress):
            warm_caches[method.name] = _guarded(
                entries[method.name], "warm-up", method is reference, functools.partial(_warm_up, model, method, warm_up_ids)
            )

        reference_outputs: dict = {}
        for method in runnable:
            if "error" not in entries[method.name]:  # else its warm-up failed
                _measure_quality(
                    model, tokenizer, method, method is reference, entries[method.name], reference_outputs,
                    warm_caches.pop(method.name), plan,
                )
        warm_caches.clear()
        decode_check = _decode_matches_full_forward(model, windows[0], context_len, reference_outputs["logprobs"][0])

        timed = [method for method in runnable if "error" not in entries[method.name]]
        for context in speed_contexts:
            for name, speed in _decode_speed(
                model, timed, reference, eval_token_ids, context, speed_tokens, speed_repeats, progress
            ).items():
                entries[name].setdefault("speed", {})[str(context)] = speed

    return {
        "model": {
            "description": model_description or loaded_from(model.config) or shape["model_type"],
            "dtype": str(model.dtype).removeprefix("torch."),
            **shape,
        },
        "evaluation_text": {"description": eval_description, "tokens": len(eval_token_ids)},
        "settings": {
            "context_len": context_len,
            "continuation_len": continuation_len,
            "n_windows": len(windows),
            "window_starts": window_starts,
            "greedy_prompts": len(plan.greedy_prompts),
            "greedy_tokens": greedy_tokens,
            "passkey_lengths": passkey_lengths,
            "passkey_depths": list(passkey_depths),
            "passkey_trials_per_cell": passkey_trials,
            "passkey_answer_tokens": passkey_answer_tokens,
            "speed_contexts": speed_contexts,
            "speed_tokens": speed_tokens,
            "speed_repeats": speed_repeats,
            "prefill_alignment": alignment,
            "seed": seed,
            "torch_threads": torch.get_num_threads(),
        },
        "adjustments": adjustments,
        "reference": reference.name,
        "checks": {"fp_decode_vs_full_forward_max_abs_logprob_diff": decode_check},
        "environment": run_environment(),
        "methods": [entries[method.name] for method in methods],
        "elapsed_seconds": round(time.perf_counter() - started, 1),
    }


@dataclass(frozen=True)
class _QualityPlan:
    """The inputs every method is measured on, identical across methods so that all comparisons are paired."""

    windows: list[torch.Tensor]  # context_len + continuation + 1 tokens each
    context_len: int
    elements_per_token: int  # layers * 2 (K and V) * kv_heads * head_dim
    greedy_prompts: list[torch.Tensor]
    greedy_tokens: int
    passkey_cases: list[PasskeyCase]
    passkey_answer_tokens: int
    progress: bool


def _measure_quality(model, tokenizer, method, is_reference, entry, reference_outputs, warm_cache, plan) -> None:
    """Perplexity / KL / memory, greedy agreement and pass key for one method, written into its entry.

    The reference stores its log-probabilities and greedy tokens in ``reference_outputs`` for the others.
    """
    started = time.perf_counter()
    teacher_forced = _guarded(
        entry, "perplexity", is_reference,
        lambda: _teacher_forced(model, method, plan, reference_outputs.get("logprobs"), warm_cache),
    )
    if teacher_forced is not None:
        entry["perplexity"], entry["memory"], logprobs = teacher_forced
        if is_reference:
            reference_outputs["logprobs"] = logprobs
    if plan.greedy_prompts and "error" not in entry:
        greedy = _guarded(
            entry, "greedy", is_reference,
            lambda: _greedy_tokens(model, tokenizer, method, plan.greedy_prompts, plan.greedy_tokens, plan.progress),
        )
        if greedy is not None:
            if is_reference:
                reference_outputs["greedy"] = greedy
            entry["greedy"] = _greedy_agreement(greedy, reference_outputs["greedy"])
    if plan.passkey_cases and "error" not in entry:
        answers = _guarded(
            entry, "pass key", is_reference,
            lambda: _passkey_answers(
                model, tokenizer, method, plan.passkey_cases, plan.passkey_answer_tokens, plan.progress
            ),
        )
        if answers is not None:
            entry["passkey"] = passkey_scores(plan.passkey_cases, answers)
    entry["quality_seconds"] = round(time.perf_counter() - started, 1)


def _reference_first(model, methods: Sequence[CacheMethod]) -> list[CacheMethod]:
    references = [method for method in methods if method.family == FULL_PRECISION and method.skip_reason is None]
    reference = references[0] if references else full_precision_method(model)
    return [reference] + [method for method in methods if method is not reference]


def _entry(method: CacheMethod) -> dict:
    entry = {
        "name": method.name,
        "family": method.family,
        "nominal_bits": method.nominal_bits,
        "prefill_multiple": method.prefill_multiple,
        "extra": method.extra,
    }
    if method.skip_reason is not None:
        entry["skipped"] = method.skip_reason
    return entry


def _guarded(entry: dict, phase: str, is_reference: bool, run: Callable):
    """Run one phase of one method; a non-reference failure is recorded in its entry instead of ending the benchmark."""
    try:
        return run()
    except Exception as error:
        if is_reference:
            raise
        entry["error"] = f"{phase}: {type(error).__name__}: {error}"
        logger.exception("%s failed during %s; its remaining phases are skipped", entry["name"], phase)
        return None


def _trim_to_multiple(length: int, multiple: int, what: str, constrained_by: str, adjustments: list[str]) -> int:
    trimmed = length - length % multiple
    if trimmed <= 0:
        raise ValueError(
            f"{what} {length} is shorter than the prefill multiple {multiple} required by {constrained_by}."
        )
    if trimmed != length:
        adjustments.append(
            f"{what} {length} trimmed to {trimmed}, a multiple of {multiple}, required by {constrained_by}"
        )
    return trimmed


def _fitting(lengths: list[int], available: int, what: str, adjustments: list[str]) -> list[int]:
    too_long = [n for n in lengths if n > available]
    if too_long:
        adjustments.append(f"{what} {too_long} dropped: the evaluation text has only {available} usable tokens")
    return [n for n in lengths if n <= available]


def _warm_up(model, method: CacheMethod, token_ids: torch.Tensor) -> Cache:
    """Exercise prefill and decode once; the cache is kept as the second cache of the shared-table check."""
    cache = method.make_cache(model)
    prefill(model, cache, token_ids)
    for token_id in token_ids[:_WARM_UP_DECODE_STEPS]:
        decode_step(model, cache, token_id)
    return cache


def _teacher_forced(model, method, plan, reference_logprobs, warm_cache):
    """Prefill each window's context, then teacher-force its continuation one token per forward call.

    Returns (metrics, memory, per-window log-probability rows); the rows are kept only for the reference, which the
    others are compared against. Memory is measured on the first window, after prefill and after the continuation.
    """
    context_len = plan.context_len
    nlls, all_logprobs, memory = [], [], {}

    def measure_after_prefill(cache):
        shared = shared_storages(cache, warm_cache)
        memory["shared_bytes"] = sum(shared.values())
        memory["after_prefill"] = _memory_point(cache, context_len, shared, plan.elements_per_token)

    windows = tqdm(plan.windows, desc=f"{method.name}: perplexity", disable=not plan.progress)
    for window_index, window in enumerate(windows):
        cache = method.make_cache(model)
        logprobs = decode_logprobs(model, cache, window, context_len,
                                   after_prefill=measure_after_prefill if window_index == 0 else None)
        if window_index == 0:
            # Again after decoding: per-model tables built lazily by the first decode step (e.g. code-reading
            # attention's folded key tables) are reachable from the warm-up cache too, so they count as shared.
            shared = shared_storages(cache, warm_cache)
            memory["shared_bytes"] = sum(shared.values())
            memory["after_decode"] = _memory_point(cache, len(window) - 1, shared, plan.elements_per_token)
        del cache
        nlls.append(token_nll(logprobs, window[context_len + 1 :]))
        all_logprobs.append(logprobs)
    reference_nlls = None if reference_logprobs is None else [
        token_nll(rows, window[context_len + 1 :]) for rows, window in zip(reference_logprobs, plan.windows)]
    metrics = perplexity_metrics(nlls, reference_nlls)
    # window_kl: per window, for comparisons paired by window between two methods (report.paired_comparisons)
    metrics.update(divergence_metrics(all_logprobs, reference_logprobs))
    return metrics, memory, all_logprobs if reference_logprobs is None else []


def _memory_point(cache, tokens: int, shared: dict, elements_per_token: int) -> dict:
    held = cache_bytes(cache, excluding=shared)
    return {
        "tokens": tokens,
        "bytes": held,
        "bytes_per_token": held / tokens,
        "bits_per_element": 8.0 * held / (tokens * elements_per_token),
    }


def _decode_matches_full_forward(model, window, context_len, decode_logprobs) -> float:
    """Largest |log p| difference on the scored tokens between the reference decode loop and one no-cache forward."""
    scored = len(window) - 1 - context_len
    logits = model(window[None, :-1], use_cache=False, logits_to_keep=scored).logits[0].float()
    targets = window[context_len + 1 :, None]
    full_forward = torch.log_softmax(logits, dim=-1).gather(1, targets)
    return (full_forward - decode_logprobs.gather(1, targets)).abs().max().item()


def _greedy_tokens(model, tokenizer, method, prompts, n_tokens, progress) -> list[list[int]]:
    generated = []
    for prompt in tqdm(prompts, desc=f"{method.name}: greedy", disable=not progress):
        output = model.generate(
            prompt[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            cache=method.make_cache(model),
            do_sample=False,
            max_new_tokens=n_tokens,
            # An early end-of-sequence would make the lengths differ between methods; every method gets n_tokens.
            min_new_tokens=n_tokens,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
        generated.append(output[0, len(prompt) :].tolist())
    return generated


def _greedy_agreement(generated: list[list[int]], reference: list[list[int]]) -> dict:
    prefixes, agreements = [], []
    for tokens, reference_tokens in zip(generated, reference):
        matches = [a == b for a, b in zip(tokens, reference_tokens)]
        prefixes.append(matches.index(False) if False in matches else len(matches))
        agreements.append(sum(matches) / len(matches))
    n_tokens = len(reference[0])
    return {
        "tokens_per_prompt": n_tokens,
        "prefix_match_tokens": statistics.fmean(prefixes),
        "prefix_match_fraction": statistics.fmean(prefixes) / n_tokens,
        "position_agreement": statistics.fmean(agreements),
        "per_prompt": [{"prefix_match": p, "position_agreement": a} for p, a in zip(prefixes, agreements)],
    }


def _passkey_answers(model, tokenizer, method, cases, answer_tokens, progress) -> list[str]:
    """Prefill the haystack, feed the question one token per forward call, then greedy-decode the answer."""
    question = token_ids(tokenizer, PASSKEY_QUESTION)
    answers = []
    for case in tqdm(cases, desc=f"{method.name}: pass key", disable=not progress):
        cache = method.make_cache(model)
        prefill(model, cache, case.prompt_ids)
        for token_id in question:
            logits = decode_step(model, cache, token_id)
        answer = []
        for step in range(answer_tokens):
            answer.append(int(logits.argmax()))
            if step + 1 < answer_tokens:
                logits = decode_step(model, cache, answer[-1])
        answers.append(tokenizer.decode(answer, skip_special_tokens=True))
    return answers


class _AlignedPrefill:
    """``model`` as the long-context runner calls it, with each prompt prefilled in a multiple of ``multiple`` tokens
    and the rest of it fed one token per call, as the pass key feeds its question: quanto and HQQ cannot quantize
    other prefill lengths (:attr:`CacheMethod.prefill_multiple`), and the prompts fit their context length exactly.
    Every method of a run gets the same split, so that their answers stay paired item by item."""

    def __init__(self, model, multiple: int):
        self._model, self._multiple = model, multiple

    def __getattr__(self, name):  # device, config, generation_config: the model's
        return getattr(self._model, name)

    def __call__(self, input_ids, cache=None, **kwargs):
        length = input_ids.shape[-1]
        aligned = length - length % self._multiple
        if cache is None or length == 1 or aligned in (0, length):
            return self._model(input_ids, cache=cache, **kwargs)
        self._model(input_ids[:, :aligned], cache=cache, use_cache=True, logits_to_keep=1)
        for position in range(aligned, length - 1):
            self._model(input_ids[:, position : position + 1], cache=cache, use_cache=True, logits_to_keep=1)
        return self._model(input_ids[:, length - 1 :], cache=cache, **kwargs)


def long_context_tasks(model: PreTrainedModel, tokenizer, methods: Sequence[CacheMethod], options: TaskSuiteOptions,
                       *, items: list | None = None, entries: Sequence[dict] = (), progress: bool = True) -> dict:
    """The RULER-style long-context suite of ``options`` for every method that runs, on the same ``items`` (default:
    generated from ``options``) for each: every item gets a fresh cache from the method's factory, as every pass-key
    haystack does, after one warm-up of the method. Answers are compared item by item with the first full-precision
    method's (added when there is none, as :func:`evaluate_methods` does), the reference.

    Methods with a ``skip_reason``, or whose entry in ``entries`` (from :func:`evaluate_methods`) holds an error, are
    not run; a failure of another method is recorded and the suite goes on, a failure of the reference raises. Each
    prompt is prefilled in a multiple of the methods' prefill multiples, the rest of it in decode mode
    (:class:`_AlignedPrefill`).

    Returns a JSON-able dict: ``options``, ``reference``, ``prefill_alignment``, ``methods`` (per method, the result of
    :func:`hf_kvcodecs.evaluation.tasks.run_task_suite`), ``vs_reference`` (per other method, the item-paired
    differences of :func:`hf_kvcodecs.evaluation.compare_task_results`, plus ``lengths``: per length, the mean over
    tasks of the cells' differences), ``not_run`` (method -> why) and ``elapsed_seconds``.
    """
    started = time.perf_counter()
    methods = _reference_first(model, methods)
    reference = methods[0]
    failed = {entry["name"]: entry["error"] for entry in entries if "error" in entry}
    not_run = {method.name: f"skipped: {method.skip_reason}" if method.skip_reason is not None
               else f"failed before the tasks: {failed[method.name]}"
               for method in methods if method.skip_reason is not None or method.name in failed}
    runnable = [method for method in methods if method.name not in not_run]
    items = generate_task_items(tokenizer, options) if items is None else items
    alignment = math.lcm(*(method.prefill_multiple for method in runnable))
    runner = model if alignment == 1 else _AlignedPrefill(model, alignment)
    warm_up_ids = items[0].input_ids[: math.ceil(_WARM_UP_TOKENS / alignment) * alignment]

    def run(method: CacheMethod) -> dict:
        with torch.no_grad():  # as the task runner: quanto's tensor subclasses cannot run under inference_mode
            _warm_up(model, method, warm_up_ids)
        return run_task_suite(runner, tokenizer, functools.partial(method.make_cache, model), options, progress,
                              items=items, description=f"long-context tasks: {method.name}")

    results = {}
    for method in runnable:
        entry = {"name": method.name}
        result = _guarded(entry, "long-context tasks", method is reference, functools.partial(run, method))
        if result is None:
            not_run[method.name] = f"failed: {entry['error']}"
        else:
            results[method.name] = result
    vs_reference = {}
    for name, result in results.items():
        if name != reference.name:
            compared = compare_task_results(result, results[reference.name])
            vs_reference[name] = {**compared, "lengths": _differences_by_length(compared["cells"])}
    return {"options": options.to_dict(), "reference": reference.name, "prefill_alignment": alignment,
            "methods": results, "vs_reference": vs_reference, "not_run": not_run,
            "elapsed_seconds": round(time.perf_counter() - started, 1)}


def _differences_by_length(cells: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per length, the mean over tasks of the item-paired differences of its cells, with the standard error of that
    mean (cells independent), as a method's own per-length score is the mean over tasks."""
    by_length: dict[str, list[dict]] = {}
    for by_task_length in cells.values():
        for length, cell in by_task_length.items():
            by_length.setdefault(length, []).append(cell)

    def mean_of(differences: list[dict]) -> dict:
        ses = [difference["se"] for difference in differences]
        return {"mean": statistics.fmean(difference["mean"] for difference in differences),
                "se": None if None in ses else math.sqrt(sum(se * se for se in ses)) / len(differences),
                "n": sum(difference["n"] for difference in differences), "tasks": len(differences)}

    return {length: {metric: mean_of([cell[metric] for cell in members]) for metric in ("score", "strict")}
            for length, members in by_length.items()}

def _decode_speed(model, methods, reference, token_ids, context, n_tokens, repeats, progress) -> dict[str, dict]:
    """Decode tokens/s after an untimed prefill of ``context`` tokens; median over repeats, ratio to the reference.

    Repeats are interleaved across methods, and the order rotates each repeat, so drifts in machine load hit every
    method alike instead of whichever happens to run last. A method that fails is reported with its error.
    """
    prompt, continuation = token_ids[:context], token_ids[context : context + n_tokens]
    step_seconds = {method.name: [] for method in methods}
    errors = {}
    bar = tqdm(total=repeats * len(methods), desc=f"decode speed @ {context}", disable=not progress)
    for repeat in range(repeats):
        rotation = repeat % len(methods)
        for method in methods[rotation:] + methods[:rotation]:
            if method.name not in errors:
                failure = {"name": method.name}
                steps = _guarded(
                    failure, f"decode speed @ {context}", method is reference,
                    functools.partial(_timed_decode, model, method, prompt, continuation),
                )
                if steps is None:
                    errors[method.name] = failure["error"]
                else:
                    step_seconds[method.name].append(steps)
            bar.update()
    bar.close()

    medians = {
        name: statistics.median(len(steps) / sum(steps) for steps in runs)
        for name, runs in step_seconds.items()
        if name not in errors
    }
    speeds = {name: {"error": error} for name, error in errors.items()}
    for name, tokens_per_s in medians.items():
        runs = step_seconds[name]
        speeds[name] = {
            "tokens_per_s": tokens_per_s,
            "ratio_to_reference": tokens_per_s / medians[reference.name],
            "tokens_per_s_runs": [len(steps) / sum(steps) for steps in runs],
            # A flush (re-quantizing the history) shows up as one slow step, if one happens within the timed steps.
            "slowest_step_ms": 1000.0 * max(max(steps) for steps in runs),
        }
    return speeds


def _timed_decode(model, method, prompt, continuation) -> list[float]:
    cache = method.make_cache(model)
    prefill(model, cache, prompt)  # untimed
    steps = []
    for token_id in continuation:
        step_started = time.perf_counter()
        decode_step(model, cache, token_id)
        steps.append(time.perf_counter() - step_started)
    return steps


def run_environment() -> dict:
    versions = {}
    for package in ("torch", "transformers", "optimum-quanto", "hqq", "tokenizers"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
    }
