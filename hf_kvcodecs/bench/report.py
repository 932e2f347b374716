"""Write benchmark results (from ``harness.evaluate_methods``) as JSON, a Markdown table and a quality-vs-bits plot,
and, when the run has them (``harness.long_context_tasks``), the long-context task scores as a section and a plot."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

from ..evaluation import task_suite_table
from .harness import FULL_PRECISION, TRANSFORMERS_QUANTIZED

MISSING = "–"


def write_reports(results: dict, out_dir) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and ``quality_vs_bits.png`` into ``out_dir``, and
    ``long_context_vs_length.png`` when the results hold long-context tasks; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "results.json",
        "markdown": out_dir / "results.md",
        "plot": out_dir / "quality_vs_bits.png",
    }
    # default=str: a method's free-form ``extra`` may hold values JSON has no type for (paths, dtypes).
    paths["json"].write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    paths["markdown"].write_text(markdown_report(results), encoding="utf-8")
    plot_quality_vs_bits(results, paths["plot"])
    if results.get("long_context", {}).get("methods"):
        paths["long_context_plot"] = out_dir / "long_context_vs_length.png"
        plot_long_context(results["long_context"], paths["long_context_plot"], results["model"]["description"])
    return paths


def markdown_report(results: dict) -> str:
    settings = results["settings"]
    model = results["model"]
    versions = ", ".join(f"{name} {version}" for name, version in results["environment"]["versions"].items() if version)
    lines = [
        "# KV-cache benchmark",
        "",
        f"- Model: {model['description']} ({model['num_hidden_layers']} layers, {model['num_key_value_heads']} KV heads, "
        f"head_dim {model['head_dim']}, {model['dtype']})",
        f"- Evaluation text: {results['evaluation_text']['description']} ({results['evaluation_text']['tokens']} tokens)",
        f"- Perplexity, KL, top-1: {settings['n_windows']} windows, each {settings['context_len']} tokens prefilled, then "
        f"{settings['continuation_len']} teacher-forced decode steps scored (prefill logits are never scored); "
        f"KL and top-1 against `{results['reference']}`; Δppl ± standard error of the paired per-window differences",
        f"- Greedy agreement: {settings['greedy_prompts']} prompts of {settings['context_len']} tokens, "
        f"{settings['greedy_tokens']} generated tokens; prefix = tokens equal to the reference before the first "
        "divergence, agree = fraction of positions equal",
        f"- Pass key: haystacks of {settings['passkey_lengths']} tokens, needle depths {settings['passkey_depths']}, "
        f"keys per cell: {settings['passkey_trials_per_cell']}, question fed in decode mode",
        f"- Memory: bytes of every tensor each cache holds, as bits per K/V element, after prefill "
        f"({settings['context_len']} tokens) and after the continuation; tables shared by all caches of a method are "
        "listed apart (shared MiB)",
        f"- Speed: {settings['speed_tokens']} decode steps timed after an untimed prefill, median of "
        f"{settings['speed_repeats']} interleaved repeats, ratio to the reference from the same run",
        f"- Check: reference decode loop vs one no-cache forward, max |Δ log p| = "
        f"{format_number(results['checks'].get('fp_decode_vs_full_forward_max_abs_logprob_diff'), '.1e')}",
        f"- {results['environment']['date']}; {versions}; Python {results['environment']['python']}; "
        f"{settings['torch_threads']} torch threads; {results['elapsed_seconds']:.0f} s in all",
    ]
    lines += [f"- Adjusted: {note}" for note in results["adjustments"]]

    speed_contexts = settings["speed_contexts"]
    header = [
        "method", "family", "bits/elt prefill", "bits/elt decode", "shared MiB", "ppl", "Δppl % ± se", "KL",
        "top-1", "greedy prefix", "greedy agree", "pass key",
    ] + [f"tok/s @{context} (× ref)" for context in speed_contexts]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for entry in results["methods"]:
        lines.append("| " + " | ".join(_row(entry, speed_contexts, len(header))) + " |")
    lines += _seed_spread(results["methods"])
    lines += _paired_section(results["methods"])
    lines += _long_context_section(results.get("long_context"))
    return "\n".join(lines) + "\n"


# How many standard errors a two-sided ~95 % interval spans (normal approximation of the paired mean).
_Z95 = 1.96


def paired_comparisons(entries: list[dict], baseline_bits: float = 4.0) -> list[dict]:
    """Every compressed method that is not a shipped cache against every shipped ``baseline_bits`` cache, paired
    by evaluation window (perplexity, KL) and by haystack (pass key).

    Two caches scored on the same windows share most of their variance (a hard window is hard for both), so the
    paired difference has a much smaller standard error than the two Δppl ± se figures side by side suggest.
    ``ppl_ratio_pct`` = 100 (exp(mean over windows of NLL_method − NLL_baseline) − 1), i.e. how much higher the
    method's perplexity is than the baseline's, with a delta-method standard error and a ~95 % interval.
    """
    def measured(entry):
        return "perplexity" in entry and "window_nll" in entry["perplexity"] and "error" not in entry

    baselines = [entry for entry in entries if entry.get("family") == TRANSFORMERS_QUANTIZED
                 and entry.get("nominal_bits") == baseline_bits and measured(entry)]
    methods = [entry for entry in entries if entry.get("family") not in (TRANSFORMERS_QUANTIZED, FULL_PRECISION)
               and measured(entry)]
    comparisons = []
    for method in methods:
        for baseline in baselines:
            ours, theirs = method["perplexity"], baseline["perplexity"]
            if len(ours["window_nll"]) != len(theirs["window_nll"]):
                continue  # not the same windows: nothing to pair
            differences = [a - b for a, b in zip(ours["window_nll"], theirs["window_nll"])]
            count = len(differences)
            mean = sum(differences) / count
            se = (math.sqrt(sum((d - mean) ** 2 for d in differences) / (count - 1) / count) if count > 1 else None)
            comparison = {
                "method": method["name"], "baseline": baseline["name"], "windows": count,
                "ppl_ratio_pct": 100.0 * (math.exp(mean) - 1.0),
                "ppl_ratio_pct_se": None if se is None else 100.0 * math.exp(mean) * se,
                "ppl_ratio_pct_interval": None if se is None else [
                    100.0 * (math.exp(mean - _Z95 * se) - 1.0), 100.0 * (math.exp(mean + _Z95 * se) - 1.0)],
                "windows_method_better": sum(d < 0 for d in differences),
            }
            if "window_kl" in ours and "window_kl" in theirs:
                kl_differences = [a - b for a, b in zip(ours["window_kl"], theirs["window_kl"])]
                kl_mean = sum(kl_differences) / count
                comparison["kl_difference"] = kl_mean
                comparison["kl_difference_se"] = (
                    math.sqrt(sum((d - kl_mean) ** 2 for d in kl_differences) / (count - 1) / count)
                    if count > 1 else None)
            ours_keys = (method.get("passkey") or {}).get("answers")
            their_keys = (baseline.get("passkey") or {}).get("answers")
            if ours_keys and their_keys and len(ours_keys) == len(their_keys):
                pairs = [(a["correct"], b["correct"]) for a, b in zip(ours_keys, their_keys)]
                comparison["passkey"] = {"both": pairs.count((True, True)), "only_method": pairs.count((True, False)),
                                         "only_baseline": pairs.count((False, True)),
                                         "neither": pairs.count((False, False))}
            comparisons.append(comparison)
    return comparisons


def _paired_section(entries: list[dict]) -> list[str]:
    comparisons = paired_comparisons(entries)
    if not comparisons:
        return []
    lines = ["", "## Paired against the shipped 4-bit caches", "",
             "Differences measured on the same windows and haystacks. ppl vs baseline = how much higher the method's "
             "perplexity is than the baseline's (mean over windows of the NLL difference; negative: lower), ± its "
             f"standard error and a ~95 % interval (± {_Z95} se); windows better = windows where the method's NLL is "
             "lower; pass key: haystacks both / only the method / only the baseline / neither answered.", "",
             "| method | baseline | windows | ppl vs baseline % ± se | ~95 % interval | windows better | "
             "KL difference ± se | pass key both / only method / only baseline / neither |",
             "|---|---|---|---|---|---|---|---|"]
    for item in comparisons:
        interval = item["ppl_ratio_pct_interval"]
        passkey = item.get("passkey")
        lines.append(
            f"| {item['method']} | {item['baseline']} | {item['windows']} | "
            f"{_with_error(item['ppl_ratio_pct'], item['ppl_ratio_pct_se'])} | "
            + (MISSING if interval is None else f"{interval[0]:+.2f} – {interval[1]:+.2f}") + " | "
            f"{item['windows_method_better']}/{item['windows']} | "
            + (MISSING if "kl_difference" not in item else
               f"{item['kl_difference']:+.4f}" + ("" if item["kl_difference_se"] is None
                                                   else f" ± {item['kl_difference_se']:.4f}")) + " | "
            + (MISSING if passkey is None else
               f"{passkey['both']} / {passkey['only_method']} / {passkey['only_baseline']} / {passkey['neither']}")
            + " |")
    return lines


def _long_context_section(suite: dict | None) -> list[str]:
    """The long-context task scores per method (``task_suite_table``) and each method's item-paired difference from
    the reference per context length."""
    if suite is None:
        return []
    options = suite["options"]
    lines = ["", "## Long-context tasks (RULER-style)", "",
             f"Tasks {', '.join(options['tasks'])} at {', '.join(map(str, options['lengths']))} tokens (prompt plus "
             f"answer, in the model's tokens), {options['items_per_cell']} items per task and length (seed "
             f"{options['seed']}), the same items for every method; haystacks from {options['corpus']}. Each item: one "
             "fresh cache, the prompt prefilled" + (f" in a multiple of {suite['prefill_alignment']} tokens and the "
                                                   "rest fed one token per call" if suite["prefill_alignment"] > 1
                                                   else "") +
             ", then a greedy answer within the task's budget. Score: RULER's (fraction of the expected strings in "
             "the answer) in % ± standard error over items; strict exact match in % in brackets; mean per length = "
             f"mean over tasks. {suite['elapsed_seconds']:.0f} s in all.", ""]
    if suite["methods"]:
        lines += task_suite_table(suite["methods"])
    if suite["not_run"]:
        lines += [""] + [f"- Not run: {name}: {reason}".replace("|", "/") for name, reason in suite["not_run"].items()]
    if suite["vs_reference"]:
        lengths = [str(length) for length in options["lengths"]]
        lines += ["", f"Paired against `{suite['reference']}`, item by item: the method's score minus the reference's "
                  "in points, mean over tasks ± its standard error (strict exact match in brackets); overall: over "
                  "every item.", "",
                  "| method | " + " | ".join(f"Δ {length}" for length in lengths) + " | Δ overall |",
                  "|---" * (len(lengths) + 2) + "|"]
        for name, compared in suite["vs_reference"].items():
            cells = [_points(compared["lengths"][length]) if length in compared["lengths"] else MISSING
                     for length in lengths]
            lines.append(f"| {name} | " + " | ".join(cells + [_points(compared["overall"])]) + " |")
    return lines


def _points(difference: dict) -> str:
    """A paired score difference in points ± se, the strict exact match's in brackets."""
    score, strict = difference["score"], difference["strict"]
    return (f"{100 * score['mean']:+.1f}" + ("" if score["se"] is None else f" ± {100 * score['se']:.1f}")
            + f" ({100 * strict['mean']:+.0f})")


def _seed_spread(entries: list[dict]) -> list[str]:
    """Mean and range over calibration seeds of each (family, learner, rate) measured with more than one seed."""
    groups: dict[tuple, list[dict]] = {}
    for entry in entries:
        extra = entry.get("extra") or {}
        if "seed" in extra and "perplexity" in entry:
            groups.setdefault((entry["family"], extra.get("learner"), extra.get("bits")), []).append(entry)
    # rows of one family, learner and rate that share a seed differ in something else: not a spread over seeds
    groups = {key: members for key, members in groups.items() if len(members) > 1
              and len({member["extra"]["seed"] for member in members}) == len(members)}
    if not groups:
        return []
    lines = ["", "## Spread over calibration seeds", "",
             "Each seed is a separate calibration (k-means initialisation and sampled calibration tokens).", "",
             "| family | learner | bits | seeds | KL mean (min – max) | Δppl % mean (min – max) | pass key per seed |",
             "|---|---|---|---|---|---|---|"]
    for (family, learner, bits), members in groups.items():
        kls = [member["perplexity"]["kl_mean"] for member in members]
        ppls = [member["perplexity"]["delta_ppl_pct"] for member in members]
        passkeys = ", ".join(
            f"{member['passkey']['correct']}/{member['passkey']['trials']}" if member.get("passkey") else MISSING
            for member in members
        )
        seeds = ", ".join(str(member["extra"]["seed"]) for member in members)
        lines.append(
            f"| {family} | {learner} | {bits:g} | {seeds} | {sum(kls) / len(kls):.3g} ({min(kls):.3g} – {max(kls):.3g}) | "
            f"{sum(ppls) / len(ppls):+.1f} ({min(ppls):+.1f} – {max(ppls):+.1f}) | {passkeys} |"
        )
    return lines


def _row(entry: dict, speed_contexts: list[int], width: int) -> list[str]:
    if "skipped" in entry or ("error" in entry and "perplexity" not in entry):
        status = f"skipped: {entry['skipped']}" if "skipped" in entry else f"failed: {entry['error']}"
        return [entry["name"], entry["family"], status.replace("|", "/")] + [""] * (width - 3)
    memory = entry.get("memory", {})
    perplexity = entry.get("perplexity", {})
    greedy = entry.get("greedy", {})
    passkey = entry.get("passkey", {})
    cells = [
        entry["name"] + (f" (failed: {entry['error']})".replace("|", "/") if "error" in entry else ""),
        entry["family"],
        format_number(memory.get("after_prefill", {}).get("bits_per_element"), ".2f"),
        format_number(memory.get("after_decode", {}).get("bits_per_element"), ".2f"),
        format_number(memory["shared_bytes"] / 2**20, ".2f") if "shared_bytes" in memory else MISSING,
        format_number(perplexity.get("ppl"), ".3f"),
        _with_error(perplexity.get("delta_ppl_pct"), perplexity.get("delta_ppl_pct_se")),
        format_number(perplexity.get("kl_mean"), ".3g"),
        format_number(perplexity.get("top1_agreement"), ".3f"),
        format_number(greedy.get("prefix_match_tokens"), ".1f"),
        format_number(greedy.get("position_agreement"), ".2f"),
        f"{passkey['accuracy']:.2f} ({passkey['correct']}/{passkey['trials']})" if passkey else MISSING,
    ]
    for context in speed_contexts:
        speed = entry.get("speed", {}).get(str(context))
        if speed is None:
            cells.append(MISSING)
        elif "error" in speed:
            cells.append("failed")
        else:
            cells.append(f"{speed['tokens_per_s']:.1f} ({speed['ratio_to_reference']:.2f}×)")
    return cells


def format_number(value, spec: str) -> str:
    return MISSING if value is None else format(value, spec)


def _with_error(value, error) -> str:
    if value is None:
        return MISSING
    return f"{value:+.2f}" + ("" if error is None else f" ± {error:.2f}")


_MARKERS = "osD^vP<>Xph*"


def plot_quality_vs_bits(results: dict, path: Path) -> None:
    """Δppl % (with its standard error) and KL against measured bits per element, one labelled point per method.

    The point is the size right after prefill; a bar reaches to the size after the continuation, when a
    full-precision residual window has grown in between. A method without a measurement is placed at its nominal
    bits and says so in its label. Each family (full precision, transformers' caches, TurboQuant, each GSRQ variant)
    has its own marker, so that a run's many rows stay apart once the colours repeat.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ppl_axis, kl_axis) = plt.subplots(1, 2, figsize=(13, 6.5))
    colors = plt.get_cmap("tab20").colors
    markers = {}
    for index, entry in enumerate(results["methods"]):
        perplexity = entry.get("perplexity")
        if perplexity is None:
            continue
        memory = entry.get("memory", {})
        prefill_bits = memory.get("after_prefill", {}).get("bits_per_element")
        decode_bits = memory.get("after_decode", {}).get("bits_per_element")
        label = entry["name"]
        if not prefill_bits:
            if entry["nominal_bits"] is None:
                continue
            prefill_bits = decode_bits = entry["nominal_bits"]
            label += " (nominal bits)"
        growth = [[0.0], [max((decode_bits or prefill_bits) - prefill_bits, 0.0)]]
        marker = markers.setdefault(entry["family"], _MARKERS[len(markers) % len(_MARKERS)])
        se = perplexity.get("delta_ppl_pct_se")
        for axis, value, error in (
            (ppl_axis, perplexity["delta_ppl_pct"], None if se is None else [se]),
            (kl_axis, perplexity["kl_mean"], None),
        ):
            # A legend (same colour in both panels) instead of text labels: methods at nearly the same point
            # would otherwise get overlapping, ambiguous labels.
            axis.errorbar([prefill_bits], [value], xerr=growth, yerr=error, fmt=marker, capsize=3,
                          color=colors[index % len(colors)], label=label if axis is ppl_axis else None)

    ppl_axis.set_ylabel("Δ perplexity vs reference (%)")
    kl_axis.set_ylabel("KL(reference ‖ method), nats per token")
    # symlog keeps a collapsed method (hundreds of %) and near-lossless ones (a fraction of a %) readable together.
    ppl_axis.set_yscale("symlog", linthresh=1.0)
    kl_axis.set_yscale("symlog", linthresh=1e-3)
    for axis in (ppl_axis, kl_axis):
        axis.set_xlabel("measured bits per K/V element (point: after prefill; bar: after decode)")
        axis.axhline(0.0, color="grey", linewidth=0.8)
        axis.grid(True, alpha=0.3)
    settings = results["settings"]
    title = (
        f"{results['model']['description']}: {settings['n_windows']} × ({settings['context_len']} prefilled + "
        f"{settings['continuation_len']} decoded) tokens of {results['evaluation_text']['description']}"
    )
    figure.suptitle(textwrap.fill(title, width=160), fontsize=9)
    figure.legend(loc="lower center", ncol=3, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.16, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_long_context(suite: dict, path: Path, model_description: str = "") -> None:
    """The long-context score against the context length, one line per method: mean over tasks per length, error
    bars one standard error (none where a cell has a single item)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [int(length) for length in suite["options"]["lengths"]]
    # the legend (two columns below the axes) grows with the methods, the axes keep their size
    legend_inches = 0.3 + 0.2 * math.ceil(len(suite["methods"]) / 2)
    figure, axis = plt.subplots(figsize=(9, 5 + legend_inches))
    colors = plt.get_cmap("tab20").colors
    for index, (name, result) in enumerate(suite["methods"].items()):
        points = [(length, result["lengths"][str(length)]) for length in lengths if str(length) in result["lengths"]]
        errors = [100 * (point["se"] or 0.0) for _, point in points]
        axis.errorbar([length for length, _ in points], [100 * point["mean"] for _, point in points], yerr=errors,
                      marker=_MARKERS[index % len(_MARKERS)], capsize=3, color=colors[index % len(colors)],
                      linestyle="--" if name == suite["reference"] else "-", label=name)
    axis.set_xscale("log", base=2)
    axis.set_xticks(lengths, [str(length) for length in lengths])
    axis.minorticks_off()
    axis.set_xlabel("context length (tokens of prompt and answer)")
    axis.set_ylabel("score, % (mean over tasks ± se)")
    axis.set_ylim(-2, 102)
    axis.grid(True, alpha=0.3)
    options = suite["options"]
    title = (f"{model_description}: RULER-style tasks {', '.join(options['tasks'])}, "
             f"{options['items_per_cell']} items per task and length")
    figure.suptitle(textwrap.fill(title, width=110), fontsize=9)
    figure.legend(loc="lower center", ncol=2, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, legend_inches / (5 + legend_inches), 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)
