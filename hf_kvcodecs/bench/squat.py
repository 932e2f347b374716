"""`bench squat`: SQuaT against its ablations and round-to-nearest, every arm with the same data, steps and seed.

Per setting (``WxAy``: weight bits, activation bits at the blocks' linear inputs, 16 = floating point) the runs are
the float teacher and RTN (measured inside every run, before its training) and one trained student per arm:
next-token cross-entropy QAT (no teacher), logit-only KD-QAT, KD-QAT with the feature term against the raw teacher,
and SQuaT. SQuaT and the raw-teacher ablation run with every seed given; the comparison between them is paired per
evaluation window. Results are written after every run, so a long CPU run can be committed as it goes.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import replace
from pathlib import Path

from ..training.run import ARMS, SQuaTRunSettings, run_squat

PAIRED_ARMS = ("squat", "raw-teacher-feature")
ARM_ORDER = ("cross-entropy", "logit-kd", "raw-teacher-feature", "squat")
# what a run's own key says; every other setting must match across the runs of one results file
PER_RUN_SETTINGS = ("weight_bits", "activation_bits", "arm", "seed")


def parse_setting(text: str) -> tuple[int, int | None]:
    match = re.fullmatch(r"W(\d)A(\d+)", text)
    if not match:
        raise ValueError(f"A setting reads WxAy (e.g. W4A16, W2A4), got {text!r}.")
    activation = int(match.group(2))
    return int(match.group(1)), None if activation == 16 else activation


def paired_difference(first: list[float], second: list[float]) -> dict:
    """Mean per-window NLL difference ``first - second`` (nats), its standard error, and whether it is beyond two
    standard errors."""
    differences = [a - b for a, b in zip(first, second)]
    mean = statistics.mean(differences)
    se = statistics.stdev(differences) / math.sqrt(len(differences)) if len(differences) > 1 else float("nan")
    return {"mean_nll_difference": mean, "se": se, "beyond_noise": bool(abs(mean) > 2 * se)}


def run_squat_bench(loaded, train_ids, eval_ids, *, settings: list[str], arms: list[str], seeds: list[int],
                    base: SQuaTRunSettings, out: Path, train_description: str, eval_description: str,
                    progress: bool = True) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise ValueError(f"Unknown arm(s) {unknown}; choose from {sorted(ARMS)}.")
    results = {"train_text": train_description, "eval_text": eval_description, "base_settings": vars(base).copy(),
               "runs": {}}
    path = out / "squat.json"
    if path.is_file():  # a rerun continues where an interrupted one stopped
        results["runs"] = json.loads(path.read_text()).get("runs", {})
        check_same_settings(results["runs"], base, path)
    for setting in settings:
        weight_bits, activation_bits = parse_setting(setting)
        for arm in arms:
            for seed in seeds if arm in PAIRED_ARMS else seeds[:1]:
                key = f"{setting}/{arm}/seed{seed}"
                if key in results["runs"]:
                    continue
                run_settings = replace(base, weight_bits=weight_bits, activation_bits=activation_bits, arm=arm,
                                       seed=seed)
                report = run_squat(loaded, train_ids, eval_ids, run_settings, out / setting / f"{arm}-seed{seed}",
                                   train_description=train_description, eval_description=eval_description,
                                   progress=progress, export=False)
                results["runs"][key] = {name: report[name] for name in
                                        ("settings", "tokens_seen", "train_seconds", "bits_per_weight", "fp", "rtn",
                                         "trained")}
                path.write_text(json.dumps(results, indent=1))
    results["comparisons"] = comparisons(results["runs"])
    path.write_text(json.dumps(results, indent=1))
    (out / "squat.md").write_text(squat_markdown(results))
    if results["runs"]:
        squat_plot(results, out / "squat.png")
    return results


def check_same_settings(runs: dict, base: SQuaTRunSettings, path: Path) -> None:
    """Refuse to continue a results file whose runs were trained with other steps, data or learning rates: their rows
    would be compared as if they were equal."""
    wanted = {name: value for name, value in vars(base).items() if name not in PER_RUN_SETTINGS}
    for key, run in runs.items():
        differing = {name: (run["settings"].get(name), value) for name, value in wanted.items()
                     if run["settings"].get(name) != value}
        if differing:
            described = ", ".join(f"{name}: {old!r} there, {new!r} now" for name, (old, new) in differing.items())
            raise ValueError(f"{path} holds run {key} made with other settings ({described}). Pass the same "
                             f"settings to continue it, or another --out for a new table.")


def comparisons(runs: dict) -> dict:
    found = {}
    for key, run in runs.items():
        setting, arm, seed = key.split("/")
        if arm != "squat":
            continue
        other = runs.get(f"{setting}/raw-teacher-feature/{seed}")
        if other is not None:
            found[f"{setting}/{seed}"] = paired_difference(run["trained"]["window_nll"], other["trained"]["window_nll"])
    return found


def summary_rows(results: dict) -> tuple[list[str], list[tuple[str, dict]]]:
    """The settings measured, and one row per reference or arm and seed: ``{setting: metrics}``."""
    runs = results["runs"]
    settings = list(dict.fromkeys(key.split("/")[0] for key in runs))
    rows = []
    for name, label in (("fp", "fp teacher"), ("rtn", "RTN")):
        rows.append((label, {setting: next(run[name] for key, run in runs.items() if key.startswith(setting + "/"))
                             for setting in settings}))
    arm_seeds = sorted({tuple(key.split("/")[1:]) for key in runs},
                       key=lambda pair: (ARM_ORDER.index(pair[0]) if pair[0] in ARM_ORDER else len(ARM_ORDER), pair[1]))
    for arm, seed in arm_seeds:
        rows.append((f"{arm} ({seed.replace('seed', 'seed ')})",
                     {setting: runs[f"{setting}/{arm}/{seed}"]["trained"] for setting in settings
                      if f"{setting}/{arm}/{seed}" in runs}))
    return settings, rows


def summary_markdown(results: dict) -> list[str]:
    settings, rows = summary_rows(results)
    lines = ["Perplexity (Δ % vs the fp teacher ± se, paired per window); – : not run.", "",
             "| arm | " + " | ".join(settings) + " |", "|---|" + "---:|" * len(settings)]
    for label, by_setting in rows:
        cells = [f"{row['perplexity']:.2f} ({row['delta_ppl_pct']:+.1f} ± {row['delta_ppl_pct_se'] or 0:.1f})"
                 if (row := by_setting.get(setting)) else "–" for setting in settings]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def squat_plot(results: dict, path: Path) -> None:
    """Perplexity of every arm at every setting, on a log axis (4-bit activations cost orders of magnitude)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings, rows = summary_rows(results)
    figure, axis = plt.subplots(figsize=(2.2 * len(settings) + 3, 4.5))
    offset = 0.8 / len(rows)
    for index, (label, by_setting) in enumerate(rows):
        measured = [(number + (index - (len(rows) - 1) / 2) * offset, by_setting[setting]["perplexity"])
                    for number, setting in enumerate(settings) if setting in by_setting]
        axis.plot(*zip(*measured), "o", label=label)
    axis.set_xticks(range(len(settings)), settings)
    axis.set_yscale("log")
    axis.set_ylabel("perplexity on held-out text (log)")
    axis.set_title("bench squat: same data, steps and seed per arm", fontsize=10)
    axis.grid(axis="y", which="both", alpha=0.3)
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def activation_scope(base: dict) -> str:
    """Where the activation steps are and how fast they learn, when not the defaults (every layer, the quantizer
    learning rate)."""
    text = ""
    if base.get("activation_modules"):
        text += " at the inputs of " + ", ".join(f"`{pattern}`" for pattern in base["activation_modules"]) + " only"
    if base.get("activation_step_learning_rate") is not None:
        text += f", learning rate {base['activation_step_learning_rate']:g}"
    return text


def squat_markdown(results: dict) -> str:
    base = results["base_settings"]
    grid = base.get("weight_init", "minmax") + (", symmetric" if base.get("symmetric") else "")
    lines = ["# bench squat", "", f"Training text: {results['train_text']}; evaluation text: {results['eval_text']}.",
             "", f"Training: {base['steps']} steps x {base['batch_size']} x {base['sequence_tokens']} tokens, weight "
             f"learning rate {base['learning_rate']:g}, quantizer learning rate {base['quantizer_learning_rate']:g}; "
             f"weight groups of {base['group_size']}, {grid} start; {base.get('activation_granularity', 'tensor')} "
             f"activation steps{activation_scope(base)}; {base['eval_windows']} evaluation windows of "
             f"{base['eval_tokens']} tokens.",
             "", *summary_markdown(results), "",
             "Every run:", "", "| setting | arm | seed | bits/weight (layers / all) | ppl | Δppl % ± se vs fp | KL to fp | steps | "
             "tokens seen | train s |", "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    shown_reference = set()
    for key, run in results["runs"].items():
        setting, arm, seed = key.split("/")
        bits = run["bits_per_weight"]
        if setting not in shown_reference:
            shown_reference.add(setting)
            quantized_bits = f"{bits['quantized_linear_layers']:.2f} / {bits['all_parameters']:.2f}"
            for name in ("fp", "rtn"):
                row = run[name]
                lines.append(f"| {setting} | {'fp teacher' if name == 'fp' else 'RTN'} | - | "
                             f"{'16' if name == 'fp' else quantized_bits} | {row['perplexity']:.3f} | {row['delta_ppl_pct']:+.2f} ± {row['delta_ppl_pct_se'] or 0:.2f} | "
                             f"{row['kl_mean']:.4f} | 0 | 0 | 0 |")
        row = run["trained"]
        lines.append(f"| {setting} | {arm} | {seed.removeprefix('seed')} | {bits['quantized_linear_layers']:.2f} / "
                     f"{bits['all_parameters']:.2f} | {row['perplexity']:.3f} | {row['delta_ppl_pct']:+.2f} ± "
                     f"{row['delta_ppl_pct_se'] or 0:.2f} | {row['kl_mean']:.4f} | {run['settings']['steps']} | "
                     f"{run['tokens_seen']:,} | {run['train_seconds']:.0f} |")
    if results.get("comparisons"):
        lines += ["", "SQuaT minus the raw-teacher-feature ablation, per-window NLL (nats), paired:", "",
                  "| setting / seed | mean difference | se | beyond 2 se |", "|---|---:|---:|---|"]
        for key, row in results["comparisons"].items():
            lines.append(f"| {key} | {row['mean_nll_difference']:+.4f} | {row['se']:.4f} | {row['beyond_noise']} |")
    return "\n".join(lines) + "\n"
