"""`bench scd`: SCD against the ways a consumer can get a prompt's cache, in one harness and one run.

Every method hands the consumer a cache of the same context (all but its last token) built from the producer's
prefill, except the oracle, which is the consumer's own prefill:

- ``oracle``: the consumer prefills itself (the reference of every quality number);
- ``raw-16``: the producer's KV in 16 bits, no fix (shows the semantic mismatch of a fine-tuned consumer);
- ``kivi-8`` / ``kivi-4``: the producer's KV quantized KIVI-style (keys per channel over groups of tokens, values per
  token), asymmetric, one float16 scale and zero per group;
- ``kvtc-like``: a PCA code of the producer's own KV with per-component bit allocation (a same-model codec in the
  manner of KVTC: the SCD code path with a whitened knowledge base fitted for producer -> producer), truncated to
  SCD's bytes;
- ``gsrq-B``: the producer's KV coded by GSRQ at B bits per element (its codebooks fitted for the producer), decoded;
- ``droidspeak-L``: the producer's KV for layers below L plus its hidden state entering layer L; the consumer
  recomputes layers L.. itself from that hidden state;
- ``scd``: the knowledge base's Reuse codes and Patch codes.

Quality: teacher-forced continuation perplexity, KL from the oracle and top-1 agreement on held-out windows of real
text, paired per window; pass-key retrieval, RULER-style multi-key needles and fact look-up over real records (exact
match and token F1 of greedy answers, also pooled over all questions; see :mod:`.retrieval`); chat-templated
instructions scored against the oracle's answers. Cost: bytes per token on the wire; producer prefill + code, consumer rebuild and
oracle prefill times measured at several context lengths in the same run; TTFT modelled from them plus bytes / bandwidth (see :func:`ttft_table`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import DynamicCache

from ..evaluation import WindowScores, paired_comparison, paired_difference, token_nll
from ..scd import SCDKnowledgeBase, SCDTransferCache, encode, truncate_payload
from ..scd.model_access import decoder_layers, shapes, unwrapped
from .instructions import instruction_prompts
from .retrieval import (
    PACKAGE_DATABASE,
    exact_match,
    fact_lookup_prompts,
    first_line,
    multikey_needle_prompts,
    package_records,
    passkey_prompts,
    token_f1,
)

# A datasheet figure, not a measurement: NVIDIA H100 / H200 SXM dense BF16 tensor-core peak. GPU-class prefill times
# are modelled as the prefill's FLOPs at GPU_MFU of this peak (an assumption stated in every report).
GPU_PEAK_FLOPS = 989e12
GPU_MFU = 0.3
GPU_SOURCE = ("NVIDIA H100/H200 SXM datasheet dense BF16 peak 989 TFLOPS, at an assumed 30 % model FLOPs "
              "utilisation; a modelled figure, not a measurement")


@dataclass
class SCDBenchSettings:
    windows: int = 8  # held-out windows for the quality metrics
    context_tokens: int = 1024
    continuation_tokens: int = 64
    cost_contexts: tuple[int, ...] = (1024, 4096, 8192)
    cost_repeats: int = 3
    bandwidths_gbps: tuple[float, ...] = (1, 2, 5, 10, 25, 50, 100, 200, 400)
    passkey_trials: int = 6
    needle_trials: int = 8  # RULER-style multi-key needles in the evaluation text (see bench.retrieval)
    needles: int = 4  # key/number sentences per needle prompt, one of them asked
    fact_trials: int = 8  # fact look-up questions over Debian's package database (see bench.retrieval)
    fact_records: str = str(PACKAGE_DATABASE)
    instruction_trials: int = 8  # chat-templated instructions over licence paragraphs (see bench.instructions)
    instruction_tokens: int = 48
    kivi_group: int = 64  # tokens per key-channel group, channels per value-token group
    droidspeak_layers: tuple[int, ...] = (10, 20)
    gsrq_bits: tuple[float, ...] = (2.0,)
    seed: int = 0


# ---- caches for the consumer --------------------------------------------------------------------------------------


def producer_cache(producer, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=unwrapped(producer).config.get_text_config(decoder=True))
    with torch.inference_mode():
        producer(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def _fake_quantize(tensor: torch.Tensor, bits: int, dim: int, group: int) -> torch.Tensor:
    """Asymmetric min/max quantization of ``tensor`` in groups of ``group`` along ``dim``."""
    moved = tensor.transpose(dim, -1)
    size = moved.shape[-1]
    padded = torch.nn.functional.pad(moved, (0, (-size) % group))
    grouped = padded.reshape(*padded.shape[:-1], -1, group)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    scale = ((high - low) / (2**bits - 1)).clamp_min(1e-8).half().float()
    low = low.half().float()
    restored = torch.round((grouped - low) / scale).clamp(0, 2**bits - 1) * scale + low
    return restored.reshape(padded.shape)[..., :size].transpose(dim, -1)


def kivi_cache(source: DynamicCache, bits: int, group: int) -> DynamicCache:
    """KIVI-style: keys quantized per channel (groups of ``group`` tokens), values per token (groups of ``group``
    channels)."""
    cache = DynamicCache()
    for index, layer in enumerate(source.layers):
        keys = _fake_quantize(layer.keys.float(), bits, dim=2, group=group)  # along tokens, per channel
        values = _fake_quantize(layer.values.float(), bits, dim=3, group=group)  # along channels, per token
        cache.update(keys.to(layer.keys.dtype), values.to(layer.values.dtype), index)
    return cache


def kivi_bytes_per_token(model_shapes, bits: int, group: int) -> float:
    elements = 2 * model_shapes.layers * model_shapes.kv_width
    return elements * bits / 8 + elements * 2 * 2 / group  # codes + float16 scale and zero per group


def raw16_cache(source: DynamicCache) -> DynamicCache:
    cache = DynamicCache()
    for index, layer in enumerate(source.layers):
        cache.update(layer.keys.half().to(layer.keys.dtype), layer.values.half().to(layer.values.dtype), index)
    return cache


def gsrq_cache(producer, ids: torch.Tensor, codebooks, bits: float) -> tuple[DynamicCache, float]:
    """The producer's KV coded by GSRQ (its sinks and recent window exact, as GSRQCache keeps them), decoded into a
    cache the consumer reads; and the bytes per token the codes and exact tokens take."""
    from ..gsrq import GSRQCache

    config = unwrapped(producer).config
    coded = GSRQCache(config, codebooks=codebooks, bits=bits, attention="dequantize")
    with torch.inference_mode():
        producer(input_ids=ids, cache=coded, use_cache=True, logits_to_keep=1)
    cache = DynamicCache()
    for index, layer in enumerate(coded.layers):
        keys, values = layer.dequantized_keys_and_values()
        cache.update(keys, values, index)
    model_shapes = shapes(producer)
    rates = coded.bits_per_element()
    regions = coded.layers[0].region_lengths()
    tokens = ids.shape[1]
    exact = min(tokens, regions["sinks"] + regions["window"])
    per_element_bits = ((tokens - exact) * (rates["keys"] + rates["values"]) / 2 + exact * 16) / tokens
    return cache, per_element_bits * 2 * model_shapes.layers * model_shapes.kv_width / 8


def producer_hidden_state(producer, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The residual stream entering ``layer`` on the producer ``[1, T, d]``."""
    captured = {}

    def hook(module, args, kwargs):
        captured["hidden"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

    handle = decoder_layers(producer)[layer].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.inference_mode():
            producer(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return captured["hidden"]


def droidspeak_cache(consumer, ids: torch.Tensor, source: DynamicCache, hidden: torch.Tensor, layer: int) -> DynamicCache:
    """Layers below ``layer`` from the producer's KV, layers from ``layer`` on recomputed by the consumer starting
    from the producer's hidden state (sent in 16 bits)."""
    sent = hidden.half().to(hidden.dtype)

    def hook(module, args, kwargs):
        if args:
            return (sent, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": sent}

    cache = DynamicCache(config=unwrapped(consumer).config.get_text_config(decoder=True))
    handle = decoder_layers(consumer)[layer].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.inference_mode():
            consumer(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    finally:
        handle.remove()
    for index in range(layer):
        cache.layers[index].keys = source.layers[index].keys.half().to(source.layers[index].keys.dtype)
        cache.layers[index].values = source.layers[index].values.half().to(source.layers[index].values.dtype)
    return cache


# ---- scoring ------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def continuation_scores(consumer, cache, context: torch.Tensor, continuation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced (NLL per token, log-probabilities ``[N, V]``) of ``continuation`` given a cache of the context
    but its last token, which is fed first."""
    inputs = torch.cat((context[-1:], continuation[:-1]))[None]
    start = context.numel() - 1
    positions = torch.arange(start, start + inputs.shape[1])[None]
    logits = consumer(input_ids=inputs, cache=cache, position_ids=positions, use_cache=True).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return token_nll(logprobs, continuation), logprobs


def method_caches(producer, consumer, kb: SCDKnowledgeBase, kvtc_kb: SCDKnowledgeBase | None, ids: torch.Tensor,
                  settings: SCDBenchSettings, gsrq_codebooks=None, extra_kbs: dict | None = None,
                  ) -> dict[str, tuple[Callable[[], object], float]]:
    """Per method: a function building the consumer's cache of ``ids`` ``[1, T]``, and its bytes per token."""
    model_shapes = shapes(producer)
    raw_bytes = 2 * model_shapes.layers * model_shapes.kv_width * 2
    source = producer_cache(producer, ids)
    payload = encode(producer, ids, kb)
    methods: dict[str, tuple[Callable[[], object], float]] = {
        "oracle": (lambda: _own_prefill(consumer, ids), 0.0),
        "raw-16": (lambda: raw16_cache(source), raw_bytes),
        "kivi-8": (lambda: kivi_cache(source, 8, settings.kivi_group), kivi_bytes_per_token(model_shapes, 8, settings.kivi_group)),
        "kivi-4": (lambda: kivi_cache(source, 4, settings.kivi_group), kivi_bytes_per_token(model_shapes, 4, settings.kivi_group)),
        "scd": (lambda: SCDTransferCache.from_payload(payload, consumer, kb), len(payload) / ids.shape[1]),
    }
    for name, other in (extra_kbs or {}).items():  # more SCD operating points (other budgets, forced Patch layers)
        other_payload = encode(producer, ids, other)
        methods[name] = (lambda other=other, other_payload=other_payload:
                         SCDTransferCache.from_payload(other_payload, consumer, other), len(other_payload) / ids.shape[1])
    if kvtc_kb is not None:
        full = encode(producer, ids, kvtc_kb)
        fraction = equal_bytes_fraction(full, len(payload))
        kvtc_payload = truncate_payload(full, fraction)
        methods["kvtc-like"] = (lambda: SCDTransferCache.from_payload(kvtc_payload, producer, kvtc_kb),
                                len(kvtc_payload) / ids.shape[1])
    if gsrq_codebooks is not None:
        for bits in settings.gsrq_bits:
            coded, size = gsrq_cache(producer, ids, gsrq_codebooks, bits)
            methods[f"gsrq-{bits:g}"] = (lambda coded=coded: coded, size)
    for layer in settings.droidspeak_layers:
        if 0 < layer < model_shapes.layers:
            hidden = producer_hidden_state(producer, ids, layer)
            methods[f"droidspeak-{layer}"] = (
                lambda layer=layer, hidden=hidden: droidspeak_cache(consumer, ids, source, hidden, layer),
                2 * layer * model_shapes.kv_width * 2 + 2 * model_shapes.hidden)
    return methods


def equal_bytes_fraction(payload: bytes, target_bytes: int) -> float:
    """The truncation fraction whose payload is closest to ``target_bytes`` (bisection on the fraction)."""
    low, high = 1e-3, 1.0
    for _ in range(14):
        middle = (low + high) / 2
        if len(truncate_payload(payload, middle)) > target_bytes:
            high = middle
        else:
            low = middle
    return low


def _own_prefill(consumer, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=unwrapped(consumer).config.get_text_config(decoder=True))
    with torch.inference_mode():
        consumer(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def quality(producer, consumer, kb, kvtc_kb, windows: list[torch.Tensor], settings: SCDBenchSettings,
            progress: bool = True, gsrq_codebooks=None, extra_kbs: dict | None = None) -> dict:
    nlls: dict[str, list[torch.Tensor]] = {}
    logprobs: dict[str, list[torch.Tensor]] = {}
    bytes_per_token: dict[str, list[float]] = {}
    for window in tqdm(windows, desc="SCD quality", disable=not progress):
        context, continuation = window[:settings.context_tokens], window[settings.context_tokens:]
        methods = method_caches(producer, consumer, kb, kvtc_kb, context[:-1][None], settings, gsrq_codebooks,
                                extra_kbs)
        for name, (build, size) in methods.items():
            nll, rows = continuation_scores(consumer, build(), context, continuation)
            nlls.setdefault(name, []).append(nll)
            logprobs.setdefault(name, []).append(rows)
            bytes_per_token.setdefault(name, []).append(size)
    reference = WindowScores(nlls["oracle"], logprobs["oracle"])
    results = {}
    for name in nlls:
        scores = WindowScores(nlls[name], logprobs[name])
        results[name] = {**paired_comparison(scores, reference), "bytes_per_token": statistics.mean(bytes_per_token[name])}
    return results


def pairwise(quality_results: dict, against: str = "scd") -> dict:
    """Every other SCD operating point and DroidSpeak row against ``against``, paired by window: the mean
    difference (other - against) of the per-window NLL and KL, with standard errors, and the bytes ratio."""
    base = quality_results[against]
    rows = {}
    for name, row in quality_results.items():
        if name == against or not name.startswith(("scd", "droidspeak-")):
            continue
        rows[name] = {"nll": paired_difference(row["window_nll"], base["window_nll"]),
                      "kl": paired_difference(row["window_kl"], base["window_kl"]),
                      "bytes_ratio": row["bytes_per_token"] / base["bytes_per_token"]}
    return rows


# ---- retrieval: pass-key and fact look-up ---------------------------------------------------------------------


def retrieval(producer, consumer, tokenizer, kb, kvtc_kb, prompts, settings: SCDBenchSettings, answer_tokens: int,
              description: str, progress=True, gsrq_codebooks=None, extra_kbs: dict | None = None,
              clean: Callable[[str], str] = first_line) -> dict:
    """Greedy answers of the consumer after each method's cache of the prompt (all but its last token); exact match
    and token F1 against the real answer (each answer passed through ``clean`` first), per method, plus the answers
    themselves."""
    scores: dict[str, list[tuple[float, float, str]]] = {}
    for ids, expected in tqdm(prompts, desc=description, disable=not progress):
        methods = method_caches(producer, consumer, kb, kvtc_kb, ids[:-1][None], settings, gsrq_codebooks, extra_kbs)
        for name, (build, _) in methods.items():
            output = consumer.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                                       cache=build(), max_new_tokens=answer_tokens, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id)
            answer = clean(tokenizer.decode(output[0, ids.numel():], skip_special_tokens=True))
            scores.setdefault(name, []).append((exact_match(answer, expected), token_f1(answer, expected), answer))
    return {name: {"exact_match": statistics.mean(s[0] for s in values), "f1": statistics.mean(s[1] for s in values),
                   "trials": len(values), "answers": [s[2] for s in values],
                   "per_question_exact_match": [s[0] for s in values], "per_question_f1": [s[1] for s in values],
                   "expected": [expected for _, expected in prompts]} for name, values in scores.items()}


def passkey(producer, consumer, tokenizer, kb, kvtc_kb, text_ids, settings: SCDBenchSettings, progress=True,
            gsrq_codebooks=None, extra_kbs: dict | None = None) -> dict:
    prompts = passkey_prompts(tokenizer, text_ids, settings.passkey_trials, settings.context_tokens, settings.seed)
    return retrieval(producer, consumer, tokenizer, kb, kvtc_kb, prompts, settings, 6, "SCD pass-key", progress,
                     gsrq_codebooks, extra_kbs)


def retrieval_overall(*tasks: dict) -> dict:
    """Every retrieval question of every task pooled, per method: exact match and F1 with their standard errors, and
    the F1 difference from the oracle paired by question (other minus oracle)."""
    pooled: dict[str, dict[str, list[float]]] = {}
    for task in tasks:
        for name, row in task.items():
            entry = pooled.setdefault(name, {"em": [], "f1": []})
            entry["em"] += row.get("per_question_exact_match", [])
            entry["f1"] += row.get("per_question_f1", [])
    reference = pooled.get("oracle")
    overall = {}
    for name, entry in pooled.items():
        if not entry["f1"]:
            continue
        count = len(entry["f1"])
        overall[name] = {
            "questions": count, "exact_match": statistics.mean(entry["em"]), "f1": statistics.mean(entry["f1"]),
            "exact_match_se": statistics.stdev(entry["em"]) / count ** 0.5 if count > 1 else None,
            "f1_se": statistics.stdev(entry["f1"]) / count ** 0.5 if count > 1 else None,
            "f1_vs_oracle": paired_difference(entry["f1"], reference["f1"]) if reference and
            len(reference["f1"]) == count else None}
    return overall


def multikey_needles(producer, consumer, tokenizer, kb, kvtc_kb, text_ids, settings: SCDBenchSettings, progress=True,
                     gsrq_codebooks=None, extra_kbs: dict | None = None) -> dict:
    prompts = multikey_needle_prompts(tokenizer, text_ids, settings.needle_trials, settings.context_tokens,
                                      settings.seed, settings.needles)
    return retrieval(producer, consumer, tokenizer, kb, kvtc_kb, prompts, settings, 10, "SCD multi-key needles",
                     progress, gsrq_codebooks, extra_kbs)


def fact_lookup(producer, consumer, tokenizer, kb, kvtc_kb, settings: SCDBenchSettings, progress=True,
                gsrq_codebooks=None, extra_kbs: dict | None = None) -> dict:
    prompts = fact_lookup_prompts(tokenizer, package_records(settings.fact_records), settings.fact_trials,
                                  settings.context_tokens)
    return retrieval(producer, consumer, tokenizer, kb, kvtc_kb, prompts, settings, 24, "SCD fact look-up", progress,
                     gsrq_codebooks, extra_kbs)


def instructions(producer, consumer, tokenizer, kb, kvtc_kb, settings: SCDBenchSettings, progress=True,
                 gsrq_codebooks=None, extra_kbs: dict | None = None) -> dict:
    """Chat-templated instructions about real licence paragraphs (see :mod:`.instructions`): each method's greedy
    answer scored by token F1 against the oracle's answer to the same prompt (the oracle scores 1)."""
    prompts = instruction_prompts(tokenizer, settings.instruction_trials, settings.seed)
    references = []
    for ids, _ in prompts:
        with torch.inference_mode():
            output = consumer.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                                       max_new_tokens=settings.instruction_tokens, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id)
        references.append((ids, tokenizer.decode(output[0, ids.numel():], skip_special_tokens=True).strip()))
    results = retrieval(producer, consumer, tokenizer, kb, kvtc_kb, references, settings, settings.instruction_tokens,
                        "SCD instructions", progress, gsrq_codebooks, extra_kbs, clean=str.strip)
    for row in results.values():
        row["prompts"] = [description for _, description in prompts]
    return results


# ---- cost and TTFT ------------------------------------------------------------------------------------------------


def _interleaved_median_seconds(functions: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, timed round-robin (one call of each per repeat): on a shared machine the load
    drifts over minutes, and timing one method's repeats before the next one's would put that drift into their ratios."""
    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            started = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def prefill_flops(model_shapes, parameters: int, tokens: int) -> float:
    """Forward FLOPs of a prefill: 2 per weight per token plus the causal attention's two T x T products."""
    return 2 * parameters * tokens + 2 * model_shapes.layers * tokens * tokens * model_shapes.kv_width * 3


def cost_at(producer, consumer, kb, text_ids: torch.Tensor, tokens: int, settings: SCDBenchSettings,
            gpu_prefill_s: float, gsrq_codebooks=None, extra_kbs: dict | None = None) -> dict:
    ids = text_ids[:tokens][None]
    payload = encode(producer, ids, kb)
    source = producer_cache(producer, ids)
    step = torch.tensor([[int(text_ids[tokens])]])
    oracle_cache = _own_prefill(consumer, ids)

    def first_step():
        with torch.inference_mode():
            consumer(input_ids=step, cache=oracle_cache, position_ids=torch.tensor([[tokens]]), use_cache=True)
        oracle_cache.crop(-1)  # the next repeat times the same first step

    timed: dict[str, Callable[[], object]] = {
        "oracle_prefill_s": lambda: _own_prefill(consumer, ids),
        "producer_prefill_s": lambda: producer_cache(producer, ids),
        "scd_encode_s": lambda: encode(producer, ids, kb),
        "scd_rebuild_s": lambda: SCDTransferCache.from_payload(payload, consumer, kb),
        "kivi_rebuild_s": lambda: kivi_cache(source, 4, settings.kivi_group),
        "first_step_s": first_step,
    }
    if gsrq_codebooks is not None and settings.gsrq_bits:
        from ..gsrq import GSRQCache

        coded = GSRQCache(unwrapped(producer).config, codebooks=gsrq_codebooks, bits=settings.gsrq_bits[0],
                          attention="dequantize")
        with torch.inference_mode():
            producer(input_ids=ids, cache=coded, use_cache=True, logits_to_keep=1)
        timed["gsrq_encode_s"] = lambda: producer(
            input_ids=ids, cache=GSRQCache(unwrapped(producer).config, codebooks=gsrq_codebooks,
                                           bits=settings.gsrq_bits[0], attention="dequantize"),
            use_cache=True, logits_to_keep=1)
        timed["gsrq_rebuild_s"] = lambda: [layer.dequantized_keys_and_values() for layer in coded.layers]
    for name, other in (extra_kbs or {}).items():
        other_payload = encode(producer, ids, other)
        timed[f"{name}_encode_s"] = lambda other=other: encode(producer, ids, other)
        timed[f"{name}_rebuild_s"] = lambda other=other, other_payload=other_payload: SCDTransferCache.from_payload(
            other_payload, consumer, other)
    return {**_interleaved_median_seconds(timed, settings.cost_repeats),
            "scd_bytes_per_token": len(payload) / tokens,
            "gpu_class_oracle_prefill_s": gpu_prefill_s}


def cost(producer, consumer, kb, text_ids: torch.Tensor, settings: SCDBenchSettings, progress=True,
         gsrq_codebooks=None, extra_kbs: dict | None = None) -> dict:
    model_shapes = shapes(consumer)
    parameters = sum(p.numel() for name, p in unwrapped(consumer).named_parameters() if "lora_" not in name)
    rows = {}
    for tokens in tqdm(settings.cost_contexts, desc="SCD cost", disable=not progress):
        if text_ids.numel() < tokens + 1:
            continue
        gpu = prefill_flops(model_shapes, parameters, tokens) / (GPU_PEAK_FLOPS * GPU_MFU)
        rows[tokens] = cost_at(producer, consumer, kb, text_ids, tokens, settings, gpu, gsrq_codebooks, extra_kbs)
    return rows


def ttft_table(cost_rows: dict, bytes_per_token: dict[str, float], settings: SCDBenchSettings, num_layers: int,
               *, gpu_class: bool, producer_on_path: bool) -> dict:
    """Modelled TTFT (seconds) per method, context and bandwidth.

    oracle = its prefill + the first step; a transfer = [producer prefill or SCD encode, when on the critical
    path] + bytes / bandwidth + the consumer's rebuild (SCD: measured; raw and KIVI: the KIVI dequantization,
    measured; GSRQ: decoding its codes, measured; DroidSpeak: its share of the consumer's prefill) + the first
    step. ``gpu_class`` scales every compute
    term by the ratio of the modelled GPU-class prefill to the measured CPU one at that length."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for tokens, row in cost_rows.items():
        scale = row["gpu_class_oracle_prefill_s"] / row["oracle_prefill_s"] if gpu_class else 1.0
        compute = {name: value * scale for name, value in row.items() if name.endswith("_s")}
        for method, size in bytes_per_token.items():
            for bandwidth in settings.bandwidths_gbps:
                if method == "oracle":
                    seconds = compute["oracle_prefill_s"] + compute["first_step_s"]
                else:
                    wire = size * tokens * 8 / (bandwidth * 1e9)
                    if method == "scd":
                        before, rebuild = compute["scd_encode_s"], compute["scd_rebuild_s"]
                    elif method.startswith("droidspeak-"):
                        layer = int(method.split("-")[1])
                        before = compute["producer_prefill_s"]
                        rebuild = compute["oracle_prefill_s"] * (num_layers - layer) / num_layers
                    elif method == "kvtc-like":
                        before, rebuild = compute["scd_encode_s"], compute["scd_rebuild_s"]
                    elif f"{method}_rebuild_s" in compute:
                        before, rebuild = compute[f"{method}_encode_s"], compute[f"{method}_rebuild_s"]
                    elif method.startswith("gsrq-"):
                        before, rebuild = compute["gsrq_encode_s"], compute["gsrq_rebuild_s"]
                    else:
                        before, rebuild = compute["producer_prefill_s"], compute["kivi_rebuild_s"]
                    seconds = (before if producer_on_path else 0.0) + wire + rebuild + compute["first_step_s"]
                table.setdefault(method, {}).setdefault(str(tokens), {})[str(bandwidth)] = seconds
    return table


def speedups(table: dict) -> dict:
    return {method: {tokens: {bw: table["oracle"][tokens][bw] / seconds for bw, seconds in by_bw.items()}
                     for tokens, by_bw in by_tokens.items()}
            for method, by_tokens in table.items() if method != "oracle"}


def settings_dict(settings: SCDBenchSettings) -> dict:
    return {name: list(value) if isinstance(value, tuple) else value for name, value in asdict(settings).items()}


def best_speedup(table: dict, method: str) -> tuple[float, str, str]:
    found = max(((value, tokens, bw) for tokens, by_bw in speedups(table)[method].items() for bw, value in by_bw.items()),
                default=(math.nan, "", ""))
    return found


# ---- the whole benchmark ------------------------------------------------------------------------------------------


def run_scd_bench(producer_loaded, consumer_loaded, kb: SCDKnowledgeBase, kvtc_kb: SCDKnowledgeBase | None,
                  evaluation_ids: torch.Tensor, evaluation_description: str, settings: SCDBenchSettings,
                  progress: bool = True, gsrq_codebooks=None, extra_kbs: dict | None = None) -> dict:
    """Quality, pass-key retrieval, cost and the modelled TTFT sweeps, all in one run (see the module docstring)."""
    from ..evaluation import fixed_windows

    started = time.perf_counter()
    producer, consumer = producer_loaded.model, consumer_loaded.model
    span = settings.context_tokens + settings.continuation_tokens
    windows = fixed_windows(evaluation_ids, settings.windows, span)
    quality_results = quality(producer, consumer, kb, kvtc_kb, windows, settings, progress, gsrq_codebooks, extra_kbs)
    passkey_results = passkey(producer, consumer, consumer_loaded.tokenizer, kb, kvtc_kb, evaluation_ids, settings,
                              progress, gsrq_codebooks, extra_kbs) if settings.passkey_trials else {}
    needle_results = multikey_needles(producer, consumer, consumer_loaded.tokenizer, kb, kvtc_kb, evaluation_ids,
                                      settings, progress, gsrq_codebooks, extra_kbs) if settings.needle_trials else {}
    fact_results = fact_lookup(producer, consumer, consumer_loaded.tokenizer, kb, kvtc_kb, settings, progress,
                               gsrq_codebooks, extra_kbs) if settings.fact_trials else {}
    instruction_results = instructions(producer, consumer, consumer_loaded.tokenizer, kb, kvtc_kb, settings, progress,
                                       gsrq_codebooks, extra_kbs) if settings.instruction_trials else {}
    cost_rows = cost(producer, consumer, kb, evaluation_ids, settings, progress, gsrq_codebooks, extra_kbs)
    num_layers = shapes(consumer).layers
    sizes = {name: row["bytes_per_token"] for name, row in quality_results.items()}
    sweeps = {}
    for gpu_class in (False, True):
        for on_path in (False, True):
            key = f"{'gpu_class' if gpu_class else 'cpu_measured'}__{'producer_prefill_on_path' if on_path else 'codes_ready'}"
            sweeps[key] = ttft_table(cost_rows, sizes, settings, num_layers, gpu_class=gpu_class,
                                     producer_on_path=on_path)
    return {
        "producer": producer_loaded.description, "consumer": consumer_loaded.description,
        "knowledge_base": {**_plan_summary(kb), "calibration_text": kb.fitting.get("text")},
        "other_knowledge_bases": {name: _plan_summary(other) for name, other in (extra_kbs or {}).items()},
        "evaluation_text": evaluation_description, "settings": settings_dict(settings),
        "raw_16bit_bytes_per_token": 2 * num_layers * shapes(consumer).kv_width * 2,
        "quality": quality_results, "passkey": passkey_results, "needles": needle_results,
        "fact_lookup": fact_results, "retrieval_overall": retrieval_overall(passkey_results, needle_results, fact_results),
        "instructions": instruction_results, "pairwise_vs_scd": pairwise(quality_results),
        "cost": {str(k): v for k, v in cost_rows.items()},
        "ttft": sweeps, "speedup": {key: speedups(table) for key, table in sweeps.items()},
        "gpu_class_source": GPU_SOURCE, "seconds": time.perf_counter() - started,
    }


def _plan_summary(kb: SCDKnowledgeBase) -> dict:
    modes = sorted({layer.patch_mode for layer in kb.plan if layer.kind == "patch"})
    return {"save_id": kb.save_id, "plan_patch_layers": kb.patch_layers,
            # what the plan does, not what a fit was asked for (a plan built without a fit has no settings)
            "patch_mode": "+".join(modes) if modes else "none",
            "recompute_blocks": [[layer.index, layer.depth] for layer in kb.plan if layer.recomputes],
            "code_bits": kb.code_bits, "bytes_per_coded_token": kb.bytes_per_token(), "fit_kl": kb.fitting.get("kl"),
            "fit_budget_kl": kb.fitting.get("budget_kl")}


def scd_markdown(results: dict) -> str:
    raw = results["raw_16bit_bytes_per_token"]
    lines = [f"# bench scd: {results['producer']} -> {results['consumer']}", "",
             f"Evaluation text: {results['evaluation_text']}. Calibration text of the knowledge base: "
             f"{(results['knowledge_base'].get('calibration_text') or {}).get('description', '?')}.", "",
             f"Quality on {results['settings']['windows']} windows of {results['settings']['context_tokens']} context "
             f"+ {results['settings']['continuation_tokens']} continuation tokens (teacher-forced), paired per window "
             "with the oracle (the consumer's own prefill); pass-key: "
             f"{results['settings']['passkey_trials']} prompts of {results['settings']['context_tokens']} tokens; "
             f"fact look-up: {results['settings'].get('fact_trials', 0)} questions, each the version of one package "
             f"in a context of real records of {results['settings'].get('fact_records')}; multi-key needles: "
             f"{results['settings'].get('needle_trials', 0)} RULER-style prompts with "
             f"{results['settings'].get('needles', 0)} key/number needles each (see bench.retrieval). All: every "
             "retrieval question pooled, exact match and F1 with their standard errors.", "",
             f"instructions: {results['settings'].get('instruction_trials', 0)} chat-templated prompts over licence "
             "paragraphs, token F1 of each greedy answer against the oracle's.", "",
             "| method | bytes/token | vs 16-bit | ppl | Δppl % ± se | KL | top-1 | pass-key EM | needles EM | fact EM | "
             "all EM ± se | all F1 ± se | instr. F1 vs oracle |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in results["quality"].items():
        size = row["bytes_per_token"]
        ratio = f"{raw / size:.1f}x" if size else "-"
        se = row["delta_ppl_pct_se"]
        key = results["passkey"].get(name, {})
        fact = results.get("fact_lookup", {}).get(name, {})
        instruction = results.get("instructions", {}).get(name, {})
        needle = results.get("needles", {}).get(name, {})
        pooled = results.get("retrieval_overall", {}).get(name, {})
        lines.append(f"| {name} | {size:.0f} | {ratio} | {row['perplexity']:.3f} | {row['delta_ppl_pct']:+.2f} ± "
                     f"{(se or 0):.2f} | {row.get('kl_mean', 0):.4f} | {row.get('top1_agreement', 1):.3f} | "
                     f"{key.get('exact_match', float('nan')):.2f} | {needle.get('exact_match', float('nan')):.2f} | "
                     f"{fact.get('exact_match', float('nan')):.2f} | "
                     f"{pooled.get('exact_match', float('nan')):.2f} ± {pooled.get('exact_match_se', float('nan')):.2f} | "
                     f"{pooled.get('f1', float('nan')):.2f} ± {pooled.get('f1_se', float('nan')):.2f} | "
                     f"{instruction.get('f1', float('nan')):.2f} |")
    lines += ["", "Against `scd`, paired by window (other minus scd; negative: the other is better):", "",
              "| method | bytes vs scd | ΔNLL (nats/token) ± se | ΔKL ± se |", "|---|---:|---:|---:|"]
    for name, row in results.get("pairwise_vs_scd", {}).items():
        lines.append(f"| {name} | {row['bytes_ratio']:.2f}x | {row['nll']['mean']:+.4f} ± {row['nll']['se'] or 0:.4f} "
                     f"| {row['kl']['mean']:+.4f} ± {row['kl']['se'] or 0:.4f} |")
    lines += ["", "SCD operating points:", ""]
    for name, summary in (("scd", results["knowledge_base"]), *results.get("other_knowledge_bases", {}).items()):
        blocks = ", ".join(f"{first}..{first + depth - 1}" for first, depth in summary.get("recompute_blocks", []))
        lines.append(f"- {name}: Patch layers {summary.get('plan_patch_layers')} ({summary.get('patch_mode')}"
                     f"{'; recomputed layers ' + blocks if blocks else ''}), {summary.get('code_bits')}-bit codes, "
                     + (f"fit KL {summary['fit_kl']:.4f} (budget {summary.get('fit_budget_kl')})" if summary.get("fit_kl")
                      is not None else f"a fixed plan, no budget search ({summary.get('built_by', 'no fit')})"))
    lines += ["", "Cost, measured on this machine (median of repeats, seconds):", "",
              "| tokens | oracle prefill | producer prefill | SCD encode | SCD rebuild | KIVI dequant | first step | "
              "GPU-class oracle prefill (modelled) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for tokens, row in results["cost"].items():
        lines.append(f"| {tokens} | {row['oracle_prefill_s']:.3f} | {row['producer_prefill_s']:.3f} | "
                     f"{row['scd_encode_s']:.3f} | {row['scd_rebuild_s']:.3f} | {row['kivi_rebuild_s']:.3f} | "
                     f"{row['first_step_s']:.4f} | {row['gpu_class_oracle_prefill_s']:.5f} |")
    lines += ["", f"GPU-class figures: {results['gpu_class_source']}.", ""]
    for key, table in results["speedup"].items():
        lines += [f"TTFT speed-up over the oracle, {key.replace('__', ', ').replace('_', ' ')}:", "",
                  "| method | tokens | " + " | ".join(f"{bw} Gbps" for bw in results["settings"]["bandwidths_gbps"]) + " |",
                  "|---|---:|" + "---:|" * len(results["settings"]["bandwidths_gbps"])]
        for method, by_tokens in table.items():
            for tokens, by_bw in by_tokens.items():
                lines.append(f"| {method} | {tokens} | " + " | ".join(f"{value:.2f}" for value in by_bw.values()) + " |")
        lines.append("")
    return "\n".join(lines)


def scd_bytes_plot(results: dict, path) -> None:
    """Quality against bytes per token on the wire, one point per method: KL from the oracle (left) and Δppl
    (right); the oracle sends nothing and is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    raw = results["raw_16bit_bytes_per_token"]
    for method, row in results["quality"].items():
        if method == "oracle" or not row["bytes_per_token"]:
            continue
        marker = "*" if method.startswith("scd") else "o"
        for axis, value in ((axes[0], max(row.get("kl_mean", 0.0), 1e-5)), (axes[1], row["delta_ppl_pct"])):
            axis.scatter(row["bytes_per_token"], value, marker=marker, s=70 if marker == "*" else 30)
            axis.annotate(method, (row["bytes_per_token"], value), fontsize=7)
    for axis, label in ((axes[0], "KL from the oracle (nats/token)"), (axes[1], "Δppl vs the oracle (%)")):
        axis.set_xscale("log")
        axis.axvline(raw, color="grey", lw=0.5)
        for ratio in (4, 16):
            axis.axvline(raw / ratio, color="grey", lw=0.5, ls=":")
        axis.set_xlabel("bytes per token on the wire (dotted: 4x and 16x fewer than 16-bit KV)")
        axis.set_ylabel(label)
    axes[0].set_yscale("log")
    axes[1].set_yscale("symlog", linthresh=1.0)
    figure.suptitle(f"{results['producer']} -> {results['consumer']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def scd_plot(results: dict, path) -> None:
    """Quality (KL from the oracle) against modelled GPU-class TTFT at a few bandwidths: the Pareto picture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = results["ttft"]["gpu_class__codes_ready"]
    tokens = max(results["cost"], key=int)
    bandwidths = [bw for bw in ("10", "100", "200") if bw in sweep["oracle"][tokens]]
    figure, axes = plt.subplots(1, len(bandwidths), figsize=(5 * len(bandwidths), 4), squeeze=False)
    for axis, bandwidth in zip(axes[0], bandwidths):
        for method, row in results["quality"].items():
            seconds = sweep[method][tokens][bandwidth]
            axis.scatter(seconds * 1e3, max(row.get("kl_mean", 0.0), 1e-5), label=method)
            axis.annotate(method, (seconds * 1e3, max(row.get("kl_mean", 0.0), 1e-5)), fontsize=7)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel(f"modelled GPU-class TTFT at {tokens} tokens (ms)")
        axis.set_ylabel("KL from the oracle (nats/token)")
        axis.set_title(f"{bandwidth} Gbps, codes ready")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
