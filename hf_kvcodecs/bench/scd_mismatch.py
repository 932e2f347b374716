"""`bench scd-mismatch`: how far a (producer, consumer) pair's caches disagree, the profile an SCD pair is picked by.

Per held-out window of real text (context + continuation tokens), the consumer decodes the continuation teacher-forced
after a cache of the context (all but its last token) built three ways, all from :mod:`.scd`'s builders:

- ``oracle``: the consumer's own prefill (the reference);
- ``raw-16``: the producer's KV of every layer in 16 bits (the whole semantic mismatch of the pair);
- ``droidspeak-k``: the producer's KV below layer k (16 bits) and its residual stream entering layer k; the consumer
  recomputes layers k.. from it (DroidSpeak-style). k = 0 is the consumer's own prefill from the producer's
  embeddings; the larger k, the more of the producer is reused, and for a real mismatch the larger the error.

Also scored, outside the verdict: ``producer`` (the producer decoding with its own cache), the quality gap of the two
models themselves. Everything is paired per window with the oracle (:func:`evaluation.paired_comparison`): Δ
perplexity ± standard error, mean KL(oracle || method) ± standard error over windows, top-1 agreement.

The gate a pair must pass to be worth testing SCD on: raw-16 costs at least ``gate_delta_ppl_pct`` % perplexity, and
the error grows with depth: the mean KL of droidspeak-k rises strictly with k, up to raw-16's (every layer reused).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import DynamicCache

from ..evaluation import WindowScores, divergence_metrics, fixed_windows, paired_comparison
from ..scd.model_access import shapes, unwrapped
from .scd import continuation_scores, droidspeak_cache, producer_cache, raw16_cache

ORACLE, RAW, PRODUCER = "oracle", "raw-16", "producer"


@dataclass
class MismatchSettings:
    windows: int = 8
    context_tokens: int = 1024
    continuation_tokens: int = 64
    droidspeak_layers: tuple[int, ...] = (5, 10, 15, 20, 25)
    gate_delta_ppl_pct: float = 10.0  # raw-16 must cost at least this much perplexity against the oracle

    def __post_init__(self) -> None:
        self.droidspeak_layers = tuple(sorted(set(int(layer) for layer in self.droidspeak_layers)))
        if self.windows < 1 or self.context_tokens < 2 or self.continuation_tokens < 1:
            raise ValueError("Need at least 1 window, 2 context tokens and 1 continuation token.")


def droidspeak_name(layer: int) -> str:
    return f"droidspeak-{layer}"


def producer_states(producer, ids: torch.Tensor, layers) -> tuple[DynamicCache, dict[int, torch.Tensor]]:
    """One producer prefill of ``ids`` ``[1, T]``: its cache (what :func:`.scd.producer_cache` builds) and the residual
    stream entering each of ``layers`` (what :func:`.scd.producer_hidden_state` captures, one forward each), read from
    ``output_hidden_states`` (entry k is the input of layer k). tests/test_scd_pairs.py checks both are identical."""
    cache = DynamicCache(config=unwrapped(producer).config.get_text_config(decoder=True))
    with torch.inference_mode():
        output = producer(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1, output_hidden_states=True)
    return cache, {layer: output.hidden_states[layer].clone() for layer in layers}


def check_pair(producer, consumer, settings: MismatchSettings) -> int:
    """The consumer can read the producer's KV and hidden states; the number of layers."""
    ours, theirs = shapes(producer), shapes(consumer)
    if ours != theirs:
        raise ValueError(f"The producer's shapes {ours} differ from the consumer's {theirs}; raw KV and DroidSpeak "
                         "transfer need the same architecture.")
    wrong = [layer for layer in settings.droidspeak_layers if not 0 <= layer < ours.layers]
    if wrong:
        raise ValueError(f"DroidSpeak layers {wrong} are outside 0..{ours.layers - 1} (the models have {ours.layers} "
                         "layers; reusing all of them is raw-16).")
    return ours.layers


def reused_layers(method: str, num_layers: int) -> int | None:
    """Layers of the producer's KV the consumer reads (None: the producer's own decoding, not a transfer)."""
    if method == PRODUCER:
        return None
    if method == ORACLE:
        return 0
    return num_layers if method == RAW else int(method.rsplit("-", 1)[1])


def bytes_per_token(model_shapes, method: str) -> float:
    """What a method sends per context token: 16-bit KV of the layers reused, plus the 16-bit hidden state."""
    if method in (ORACLE, PRODUCER):
        return 0.0
    if method == RAW:
        return 2 * model_shapes.layers * model_shapes.kv_width * 2
    layer = int(method.rsplit("-", 1)[1])
    return 2 * layer * model_shapes.kv_width * 2 + 2 * model_shapes.hidden


def window_scores(producer, consumer, window: torch.Tensor, settings: MismatchSettings) -> dict[str, tuple]:
    """Per method: (per-token NLL, log-probabilities) of the window's continuation decoded by the consumer."""
    context, continuation = window[:settings.context_tokens], window[settings.context_tokens:]
    ids = context[:-1][None]
    source, hidden = producer_states(producer, ids, settings.droidspeak_layers)
    builders = {ORACLE: lambda: producer_cache(consumer, ids), RAW: lambda: raw16_cache(source)}
    for layer in settings.droidspeak_layers:
        builders[droidspeak_name(layer)] = lambda layer=layer: droidspeak_cache(consumer, ids, source, hidden[layer],
                                                                                  layer)
    scores = {name: continuation_scores(consumer, build(), context, continuation) for name, build in builders.items()}
    scores[PRODUCER] = continuation_scores(producer, source, context, continuation)  # last: it extends source
    return scores


def run_mismatch_profile(producer_loaded, consumer_loaded, token_ids: torch.Tensor, text: dict,
                         settings: MismatchSettings | None = None, progress: bool = True) -> dict:
    """The profile of a pair on windows of ``token_ids`` (``text``: what they are, for the report)."""
    settings = settings or MismatchSettings()
    started = time.perf_counter()
    producer, consumer = producer_loaded.model, consumer_loaded.model
    num_layers = check_pair(producer, consumer, settings)
    windows = fixed_windows(token_ids, settings.windows, settings.context_tokens + settings.continuation_tokens)
    nlls: dict[str, list[torch.Tensor]] = {}
    logprobs: dict[str, list[torch.Tensor]] = {}
    for window in tqdm(windows, desc="SCD mismatch profile", disable=not progress):
        for name, (nll, rows) in window_scores(producer, consumer, window, settings).items():
            nlls.setdefault(name, []).append(nll)
            logprobs.setdefault(name, []).append(rows)
    reference = WindowScores(nlls[ORACLE], logprobs[ORACLE])
    model_shapes = shapes(consumer)
    methods = {}
    for name in nlls:
        scores = reference if name == ORACLE else WindowScores(nlls[name], logprobs[name])
        row = paired_comparison(scores, reference)
        window_kl = divergence_metrics(logprobs[name], None if name == ORACLE else logprobs[ORACLE])["window_kl"]
        row["kl_se"] = statistics.stdev(window_kl) / math.sqrt(len(window_kl)) if len(window_kl) > 1 else None
        row["window_kl"] = window_kl
        row["window_delta_nll"] = [float(own.mean() - oracle.mean()) for own, oracle in zip(nlls[name], nlls[ORACLE])]
        row["reused_layers"] = reused_layers(name, num_layers)
        row["bytes_per_token"] = bytes_per_token(model_shapes, name)
        methods[name] = row
    return {
        "producer": producer_loaded.description, "consumer": consumer_loaded.description,
        "evaluation_text": text, "settings": {name: list(value) if isinstance(value, tuple) else value
                                              for name, value in asdict(settings).items()},
        "num_layers": num_layers, "torch_threads": torch.get_num_threads(),
        "methods": methods, "gate": gate(methods, settings), "seconds": time.perf_counter() - started,
    }


def depth_curve(methods: dict, settings: MismatchSettings) -> list[tuple[int, str]]:
    """(layers reused, method) from the shallowest DroidSpeak transition to raw-16 (every layer reused)."""
    return [(layer, droidspeak_name(layer)) for layer in settings.droidspeak_layers] + [
        (methods[RAW]["reused_layers"], RAW)]


def gate(methods: dict, settings: MismatchSettings) -> dict:
    """Whether the pair has a real mismatch (see the module docstring), with the facts it is decided on."""
    raw = methods[RAW]
    curve = depth_curve(methods, settings)
    kls = [methods[name]["kl_mean"] for _, name in curve]
    deltas = [methods[name]["delta_ppl_pct"] for _, name in curve]
    raw_ok = raw["delta_ppl_pct"] >= settings.gate_delta_ppl_pct
    grows = len(kls) > 1 and all(later > earlier for earlier, later in zip(kls, kls[1:]))
    lower = raw["delta_ppl_pct"] - 2 * (raw["delta_ppl_pct_se"] or 0.0)
    return {
        "raw16_delta_ppl_pct": raw["delta_ppl_pct"], "raw16_delta_ppl_pct_se": raw["delta_ppl_pct_se"],
        "raw16_threshold_pct": settings.gate_delta_ppl_pct, "raw16_passes": raw_ok,
        "raw16_passes_by_2se": lower >= settings.gate_delta_ppl_pct,
        "depth_curve_methods": [name for _, name in curve], "depth_curve_kl": kls, "depth_curve_delta_ppl_pct": deltas,
        "kl_grows_with_depth": grows,
        "delta_ppl_grows_with_depth": len(deltas) > 1 and all(b > a for a, b in zip(deltas, deltas[1:])),
        "passes": raw_ok and grows,
    }


def _number(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def mismatch_markdown(results: dict) -> str:
    settings, gate_facts, text = results["settings"], results["gate"], results["evaluation_text"]
    verdict = "PASS" if gate_facts["passes"] else "FAIL"
    lines = [
        f"# bench scd-mismatch: {results['producer']} -> {results['consumer']}", "",
        f"Evaluation text: {text.get('description')}" + (f" ({text['part']})" if text.get("part") else "")
        + f"; {text.get('tokens')} tokens.", "",
        f"{settings['windows']} windows of {settings['context_tokens']} context + {settings['continuation_tokens']} "
        "continuation tokens, teacher-forced; every method paired per window with the oracle (the consumer's own "
        "prefill): Δppl ± standard error of the paired per-window differences, mean KL(oracle || method) ± standard "
        f"error over windows, top-1 agreement. {results['num_layers']} layers; torch threads "
        f"{results['torch_threads']}; {results['seconds']:.0f} s.", "",
        "| method | producer layers reused | bytes/token | ppl | Δppl % ± se | KL ± se | top-1 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in results["methods"].items():
        reused = "-" if row["reused_layers"] is None else str(row["reused_layers"])
        label = f"{name} (own cache, not a transfer)" if name == PRODUCER else name
        lines.append(f"| {label} | {reused} | {row['bytes_per_token']:.0f} | {row['perplexity']:.3f} | "
                     f"{row['delta_ppl_pct']:+.2f} ± {_number(row['delta_ppl_pct_se'], '.2f')} | "
                     f"{row.get('kl_mean', 0.0):.4f} ± {_number(row['kl_se'], '.4f')} | "
                     f"{row.get('top1_agreement', 1.0):.3f} |")
    curve = " -> ".join(f"{name} {kl:.4f}" for name, kl in zip(gate_facts["depth_curve_methods"],
                                                                gate_facts["depth_curve_kl"]))
    lines += [
        "", f"## Gate: {verdict}", "",
        f"- raw-16 Δppl {gate_facts['raw16_delta_ppl_pct']:+.2f} ± "
        f"{_number(gate_facts['raw16_delta_ppl_pct_se'], '.2f')} % against the threshold "
        f"+{gate_facts['raw16_threshold_pct']:g} %: {'pass' if gate_facts['raw16_passes'] else 'fail'} "
        f"({'also' if gate_facts['raw16_passes_by_2se'] else 'not'} by two standard errors)",
        f"- error grows with depth (mean KL strictly rising with the layers reused): "
        f"{'yes' if gate_facts['kl_grows_with_depth'] else 'no'}: {curve}",
        f"- Δppl rising with depth too (not gated, noisier): {'yes' if gate_facts['delta_ppl_grows_with_depth'] else 'no'}",
    ]
    return "\n".join(lines) + "\n"


def mismatch_plot(results: dict, path) -> None:
    """Δppl (± se) and KL against the layers of producer KV reused: oracle at 0, DroidSpeak-k, raw-16 at all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    names = [ORACLE, *results["gate"]["depth_curve_methods"]]
    layers = [methods[name]["reused_layers"] for name in names]
    deltas = [methods[name]["delta_ppl_pct"] for name in names]
    errors = [methods[name]["delta_ppl_pct_se"] or 0.0 for name in names]
    kls = [methods[name].get("kl_mean", 0.0) for name in names]
    kl_errors = [methods[name]["kl_se"] or 0.0 for name in names]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.errorbar(layers, deltas, yerr=errors, marker="o", capsize=3)
    left.axhline(results["gate"]["raw16_threshold_pct"], color="grey", linestyle="--", linewidth=1,
                 label=f"gate: raw-16 ≥ +{results['gate']['raw16_threshold_pct']:g} %")
    left.set_ylabel("Δ perplexity vs the oracle (%)")
    right.errorbar(layers, kls, yerr=kl_errors, marker="o", capsize=3, color="tab:red")
    right.set_ylabel("mean KL(oracle || method) (nats/token)")
    for axis in (left, right):
        for x, y, name in zip(layers, deltas if axis is left else kls, names):
            axis.annotate(name, (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
        axis.set_xlabel("producer layers reused (droidspeak-k: k; raw-16: all)")
    left.legend(fontsize=8)
    verdict = "PASS" if results["gate"]["passes"] else "FAIL"
    producer = results.get("producer_name") or _short(results["producer"])
    consumer = results.get("consumer_name") or _short(results["consumer"])
    figure.suptitle(f"{producer} -> {consumer} on {_short(results['evaluation_text'].get('name') or 'the text', 40)}"
                    f"{' (tail)' if results['evaluation_text'].get('part') else ''}: gate {verdict}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _short(description: str, limit: int = 70) -> str:
    return description if len(description) <= limit else description[:limit - 3] + "..."
