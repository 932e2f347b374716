"""`hf-kvcodecs bench split`: how a GSRQ cache's bits are best divided between keys and values.

Per key layout, one calibration at the highest rate any split needs (a lower rate is a prefix of its codebooks'
stages), then, at a fixed average rate, caches whose keys get ``average + offset`` and values ``average - offset`` bits
per element, measured side by side with the full-precision cache on the held-out windows `bench kv` uses
(teacher-forced KL, Δ perplexity, top-1 agreement) and with the bytes each cache holds. The even split of codebooks
calibrated at the average rate itself, what `bench kv` measures, is the control: it shows what calibrating at a
higher rate costs that prefix.
"""

from __future__ import annotations

from pathlib import Path

from ..gsrq import GSRQCache
from ..gsrq.store import ensure_codebooks
from ..integrations.attention import enable_code_attention
from ..models import LoadedModel
from ..text import EVALUATION_DEFAULT, load_corpus, tokenize_corpus
from .harness import CacheMethod, evaluate_methods
from .kv import BENCH_CACHE_SETTINGS, FULL

SPLIT_LAYOUTS = {"default": {}, "conditional-keys": {"key_layout": "conditional_heads"}}  # name -> calibration settings
DEFAULT_OFFSETS = (-0.5, -0.25, 0.0, 0.25, 0.5)
# The quality part of `bench kv`'s measurement, on the same windows (pass key, greedy runs and speed left out).
QUALITY_ONLY = {**{k: FULL[k] for k in ("context_len", "continuation_len", "n_windows")},
                "greedy_prompts": 0, "passkey_trials": 0, "speed_contexts": ()}


def split_methods(codebooks_by_layout: dict, *, average_bits: float, offsets=DEFAULT_OFFSETS) -> list[CacheMethod]:
    """``codebooks_by_layout``: layout name -> (codebooks calibrated at ``average_bits``, codebooks calibrated at
    ``average_bits + max |offset|``). One method for the control and one per offset, per layout."""
    methods = []
    for layout, (control, wide) in codebooks_by_layout.items():
        runs = [(control, 0.0, True)] + [(wide, offset, False) for offset in offsets]
        for codebooks, offset, is_control in runs:
            key_bits, value_bits = average_bits + offset, average_bits - offset
            calibrated = float(codebooks.config["max_bits"])
            settings = dict(codebooks=codebooks, key_bits=key_bits, value_bits=value_bits, **BENCH_CACHE_SETTINGS)
            methods.append(CacheMethod(
                name=f"{layout}: keys {key_bits:g} / values {value_bits:g} bits (calibrated at {calibrated:g})",
                make_cache=lambda model, s=settings: GSRQCache(model.config, **s),
                family="gsrq-split", nominal_bits=average_bits,
                extra={"layout": layout, "key_bits": key_bits, "value_bits": value_bits, "offset": offset,
                       "calibrated_bits": calibrated, "control": is_control,
                       "key_layout": codebooks.layout("keys"), "value_layout": codebooks.layout("values")},
            ))
    return methods


def run_bit_split_benchmark(loaded: LoadedModel, *, average_bits=(2.0,), offsets=DEFAULT_OFFSETS,
                            layouts=tuple(SPLIT_LAYOUTS), text=None, calibration_text=None, store=None,
                            progress: bool = True) -> dict:
    if not offsets:
        raise ValueError("offsets must name at least one key-bit offset.")
    unknown = set(layouts) - set(SPLIT_LAYOUTS)
    if unknown:
        raise ValueError(f"unknown layouts {sorted(unknown)}; choose from {sorted(SPLIT_LAYOUTS)}.")
    enable_code_attention(loaded.model)  # measured on the attention path users get
    widest = max(abs(offset) for offset in offsets)
    calibrations, methods = [], []
    for average in average_bits:
        if average - widest <= 0:
            raise ValueError(f"offset {widest:g} leaves no bits at an average of {average:g}.")
        codebooks_by_layout = {}
        for layout in layouts:
            pair = []
            for bits in (average, average + widest):
                codebooks, directory, reused = ensure_codebooks(
                    loaded, store=store, text=calibration_text, progress=progress, learner="l2", bits=bits, seed=0,
                    **SPLIT_LAYOUTS[layout])
                pair.append(codebooks)
                calibrations.append({"layout": layout, "bits": bits, "directory": str(directory), "reused": reused,
                                     "seconds": round(codebooks.calibration["seconds_total"], 1),
                                     "text": codebooks.calibration["text"]["description"]})
            codebooks_by_layout[layout] = tuple(pair)
        methods += split_methods(codebooks_by_layout, average_bits=average, offsets=offsets)
    corpus = load_corpus(text, default=EVALUATION_DEFAULT)
    results = evaluate_methods(
        loaded.model, loaded.tokenizer, methods, eval_token_ids=tokenize_corpus(loaded.tokenizer, corpus),
        eval_description=corpus.description, model_description=loaded.description, progress=progress, **QUALITY_ONLY,
    )
    results["calibrations"] = calibrations
    results["command"] = (f"hf-kvcodecs bench split --average-bits {' '.join(f'{b:g}' for b in average_bits)} "
                          f"--offsets {' '.join(f'{o:g}' for o in offsets)} --model {loaded.name}")
    return results


def split_markdown(results: dict) -> str:
    settings = results["settings"]
    lines = [
        f"Key/value bit split (model: {results['model']['description']}; text: "
        f"{results['evaluation_text']['description']}; {settings['n_windows']} × ({settings['context_len']} "
        f"prefilled + {settings['continuation_len']} decoded) tokens; reference: {results['reference']}; command: "
        f"`{results['command']}`)",
        "",
        "| layout | keys bits | values bits | calibrated at | bits/elt held after prefill | KL | Δppl % ± se | top-1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in results["methods"]:
        extra = entry.get("extra", {})
        if "key_bits" not in extra:
            continue
        if "error" in entry:
            lines.append(f"| {extra['layout']} | {extra['key_bits']:g} | {extra['value_bits']:g} | "
                         f"{extra['calibrated_bits']:g} | failed: {entry['error']} | | | |")
            continue
        perplexity = entry["perplexity"]
        held = entry.get("memory", {}).get("after_prefill", {}).get("bits_per_element")
        lines.append(
            f"| {extra['layout']}{' (control)' if extra['control'] else ''} | {extra['key_bits']:g} | "
            f"{extra['value_bits']:g} | {extra['calibrated_bits']:g} | {held:.2f} | {perplexity['kl_mean']:.4f} | "
            f"{perplexity['delta_ppl_pct']:+.2f} ± {perplexity['delta_ppl_pct_se']:.2f} | "
            f"{perplexity['top1_agreement']:.3f} |")
    return "\n".join(lines) + "\n"


def plot_split(results: dict, path: Path) -> None:
    """KL against the bits moved from values to keys, one line per (layout, average rate); controls as squares."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    series: dict = {}
    for entry in results["methods"]:
        extra = entry.get("extra", {})
        if "key_bits" in extra and "perplexity" in entry:
            key = (extra["layout"], (extra["key_bits"] + extra["value_bits"]) / 2)
            series.setdefault(key, []).append((extra["offset"], entry["perplexity"]["kl_mean"], extra["control"]))
    for index, ((layout, average), points) in enumerate(sorted(series.items())):
        color = plt.get_cmap("tab10")(index)
        swept = sorted((offset, kl) for offset, kl, control in points if not control)
        axis.plot(*zip(*swept), "o-", color=color, label=f"{layout}, {average:g} bits on average")
        for offset, kl, control in points:
            if control:
                axis.plot([offset], [kl], "s", color=color, fillstyle="none", markersize=9,
                          label=f"{layout}, even split of codebooks calibrated at {average:g} bits")
    axis.set_xlabel("bits moved from values to keys (keys: average + x, values: average − x)")
    axis.set_ylabel("KL(reference ‖ GSRQ), nats per token")
    axis.set_yscale("log")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
