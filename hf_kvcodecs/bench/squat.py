"""`bench squat`: SQuaT against its ablations and round-to-nearest, every arm with the same data, steps and seed.

Per setting (``WxAy``: weight bits, activation bits at the blocks' linear inputs, 16 = floating point) the runs are
the float teacher and RTN (measured inside every run, before its training) and one trained student per arm:
next-token cross-entropy QAT (no teacher), logit-only KD-QAT, KD-QAT with the feature term against the raw teacher,
the feature term alone on SQuaT's target (feature-only) and SQuaT. SQuaT and the raw-teacher ablation run with every
seed given; the comparison between them is paired per evaluation window, per seed and over seeds. Every run keeps
the mechanism the trainer logs per distilled layer (activation step drift, clipped fraction, feature floor, feature
term). Results are written after every run, so a long CPU run can be committed as it goes.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import fields, replace
from pathlib import Path

from ..training.run import BENCH_ARMS, SQuaTRunSettings, run_squat

PAIRED_ARMS = ("squat", "raw-teacher-feature")
ARM_ORDER = ("cross-entropy", "logit-kd", "feature-only", "raw-teacher-feature", "squat")
# the logged terms kept per run (per distilled layer i: squat_layer{i}_<name>), in the order the tables show them
MECHANISM = ("step_drift", "step_drift_abs", "clip_fraction", "feature_floor", "feature")
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
                    progress: bool = True, reference_seeds: list[int] | None = None) -> dict:
    """Train and evaluate every arm at every setting. SQuaT and its raw-teacher ablation run every seed of ``seeds``;
    the other arms run ``reference_seeds`` (default: the first of ``seeds``)."""
    out = Path(out)
    reference_seeds = list(reference_seeds) if reference_seeds else seeds[:1]
    out.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(arms) - set(BENCH_ARMS))
    if unknown:
        raise ValueError(f"Unknown arm(s) {unknown}; choose from {sorted(BENCH_ARMS)}.")
    results = {"train_text": train_description, "eval_text": eval_description, "base_settings": vars(base).copy(),
               "runs": {}}
    path = out / "squat.json"
    if path.is_file():  # a rerun continues where an interrupted one stopped
        results["runs"] = json.loads(path.read_text()).get("runs", {})
        check_same_settings(results["runs"], base, path)
    for setting in settings:
        weight_bits, activation_bits = parse_setting(setting)
        for arm in arms:
            for seed in seeds if arm in PAIRED_ARMS else reference_seeds:
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
                results["runs"][key]["mechanism"] = mechanism_series(report["log_history"])
                path.write_text(json.dumps(results, indent=1))
    results["comparisons"] = comparisons(results["runs"])
    results["over_seeds"] = over_seeds(results["runs"])
    results["over_seeds_against"] = {other: pooled for other in ARM_ORDER if other not in PAIRED_ARMS
                                     if (pooled := over_seeds(results["runs"], other))}
    path.write_text(json.dumps(results, indent=1))
    (out / "squat.md").write_text(squat_markdown(results))
    if results["runs"]:
        squat_plot(results, out / "squat.png")
        if any(run.get("mechanism") for run in results["runs"].values()):
            mechanism_plot(results, out / "squat_mechanism.png")
    return results


def mechanism_series(log_history: list[dict]) -> dict:
    """``{logged name: [[step, value], ...]}`` of the training logs' SQuaT terms: the loss terms (``squat_kd``,
    ``squat_feature``, ``squat_feature_floor``, ``squat_ce``) and, per distilled layer, ``squat_layer{i}_*``."""
    series: dict[str, list] = {}
    for entry in log_history:
        if "loss" not in entry:
            continue
        for name, value in entry.items():
            if name.startswith("squat_"):
                series.setdefault(name, []).append([entry["step"], float(value)])
    return series


def mechanism_summary(mechanism: dict) -> dict:
    """Per distilled layer: ``{name: (first logged, last logged)}`` of every quantity in MECHANISM."""
    layers: dict[int, dict] = {}
    for name, points in mechanism.items():
        match = re.fullmatch(r"squat_layer(\d+)_(\w+)", name)
        if match and match.group(2) in MECHANISM and points:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = (points[0][1], points[-1][1])
    return dict(sorted(layers.items()))


def check_same_settings(runs: dict, base: SQuaTRunSettings, path: Path) -> None:
    """Refuse to continue a results file whose runs were trained with other steps, data or learning rates: their rows
    would be compared as if they were equal."""
    wanted = {name: value for name, value in json.loads(json.dumps(vars(base))).items() if name not in PER_RUN_SETTINGS}
    # a setting a results file predates had its default then
    defaults = json.loads(json.dumps({field.name: field.default for field in fields(SQuaTRunSettings)}))
    for key, run in runs.items():
        differing = {name: (run["settings"].get(name, defaults[name]), value) for name, value in wanted.items()
                     if run["settings"].get(name, defaults[name]) != value}
        if differing:
            described = ", ".join(f"{name}: {old!r} there, {new!r} now" for name, (old, new) in differing.items())
            raise ValueError(f"{path} holds run {key} made with other settings ({described}). Pass the same "
                             f"settings to continue it, or another --out for a new table.")


def comparisons(runs: dict) -> dict:
    """SQuaT minus raw-teacher-feature per setting and seed (``"W4A2/seed0"``), paired per evaluation window: the NLL
    and, where the runs kept it, the KL to the teacher (``kl_*``)."""
    found = {}
    for key, run in runs.items():
        setting, arm, seed = key.split("/")
        if arm != "squat":
            continue
        other = runs.get(f"{setting}/raw-teacher-feature/{seed}")
        if other is not None:
            found[f"{setting}/{seed}"] = paired_difference(run["trained"]["window_nll"], other["trained"]["window_nll"])
            if "window_kl" in run["trained"] and "window_kl" in other["trained"]:
                kl = paired_difference(run["trained"]["window_kl"], other["trained"]["window_kl"])
                found[f"{setting}/{seed}"].update({"kl_mean_difference": kl["mean_nll_difference"], "kl_se": kl["se"],
                                                   "kl_beyond_noise": kl["beyond_noise"]})
    return found


def over_seeds(runs: dict, other: str = "raw-teacher-feature") -> dict:
    """Per setting, SQuaT minus ``other`` (an arm) over every seed both ran: per evaluation window the difference
    of each seed (NLL and, where kept, KL), the mean over seeds per window, the mean of those with its standard
    error over windows, the standard error over seeds of the seeds' means, and whether every seed has the sign of
    the mean and lies beyond 2 se of its own windows."""
    found = {}
    settings = dict.fromkeys(key.split("/")[0] for key in runs)
    for setting in settings:
        seeds = [key.split("/")[2] for key in runs if key.startswith(f"{setting}/squat/")
                 and f"{setting}/{other}/{key.split('/')[2]}" in runs]
        if not seeds:
            continue
        row = {"seeds": seeds}
        for metric in ("nll", "kl"):
            name = f"window_{metric}"
            pairs = [(runs[f"{setting}/squat/{seed}"]["trained"].get(name),
                      runs[f"{setting}/{other}/{seed}"]["trained"].get(name)) for seed in seeds]
            if any(a is None or b is None for a, b in pairs):
                continue
            per_seed = [[a - b for a, b in zip(first, second)] for first, second in pairs]
            per_window = [statistics.mean(values) for values in zip(*per_seed)]
            pooled = paired_difference(per_window, [0.0] * len(per_window))
            seed_means = [statistics.mean(values) for values in per_seed]
            seed_ses = [paired_difference(values, [0.0] * len(values))["se"] for values in per_seed]
            mean = pooled["mean_nll_difference"]
            row[metric] = {
                "per_seed_window_difference": dict(zip(seeds, per_seed)), "per_window_mean": per_window,
                "mean_difference": mean, "se_over_windows": pooled["se"], "beyond_noise": pooled["beyond_noise"],
                "seed_means": dict(zip(seeds, seed_means)),
                "se_over_seeds": statistics.stdev(seed_means) / math.sqrt(len(seeds)) if len(seeds) > 1 else None,
                "consistent": bool(all(math.copysign(1, m) == math.copysign(1, mean) and abs(m) > 2 * se
                                       for m, se in zip(seed_means, seed_ses))),
            }
        found[setting] = row
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


def mechanism_plot(results: dict, path: Path) -> None:
    """Per distilled layer, the activation step's drift and the feature floor over training steps, one line per arm
    and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    for key, run in results["runs"].items():
        for name, points in run.get("mechanism", {}).items():
            match = re.fullmatch(r"squat_layer(\d+)_(step_drift|feature_floor|feature)", name)
            if not match or not points:
                continue
            axis = axes[("step_drift", "feature_floor", "feature").index(match.group(2))]
            axis.plot(*zip(*points), label=f"{key} L{match.group(1)}", lw=1)
    for axis, title in zip(axes, ("activation step drift log(s_t/s_0)", "feature floor E|Q_s(f_t)-f_t|^2/E|f_t|^2",
                                  "feature term (vs the arm's target)")):
        axis.set_title(title, fontsize=9)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
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
    if base.get("distillation_layers") is not None:
        text += f"; distilled feature at decoder layer(s) {', '.join(map(str, base['distillation_layers']))}"
    return text


def mechanism_markdown(results: dict) -> list[str]:
    """Per run and distilled layer, the logged mechanism: first and last logged value of each quantity."""
    rows = []
    for key, run in results["runs"].items():
        setting, arm, seed = key.split("/")
        for layer, values in mechanism_summary(run.get("mechanism", {})).items():
            cells = [f"{values[name][0]:.4g} → {values[name][1]:.4g}" if name in values else "–" for name in MECHANISM]
            rows.append(f"| {setting} | {arm} | {seed.removeprefix('seed')} | {layer} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return ["", "The mechanism the trainer logged per distilled layer (first → last training log; each log is the mean "
            "since the previous one): drift `log(s_t/s_0)` of the activation step, the same in absolute value (per-"
            "channel steps), fraction of the teacher's feature values outside the student's range, the bound "
            "`E‖Q_s(f_t) − f_t‖² / E‖f_t‖²` (feature floor), and the layer's feature term (its value against the "
            "arm's own target; in the loss only for arms with a feature term).", "",
            "| setting | arm | seed | layer | step drift | abs drift | clip fraction | feature floor | feature term |",
            "|---|---|---:|---:|---|---|---|---|---|", *rows]


def over_seeds_markdown(results: dict) -> list[str]:
    lines = over_seeds_table(results.get("over_seeds", {}), "raw-teacher-feature")
    for other, pooled in results.get("over_seeds_against", {}).items():
        lines += over_seeds_table(pooled, other)
    return lines


def over_seeds_table(pooled: dict, other: str) -> list[str]:
    lines = []
    for setting, row in pooled.items():
        for metric, label in (("nll", "NLL (nats/token)"), ("kl", "KL to the teacher (nats/token)")):
            if metric not in row:
                continue
            data = row[metric]
            seeds = row["seeds"]
            lines += ["", f"{setting}: SQuaT minus {other}, per-window {label}, paired per evaluation "
                      f"window over seeds {', '.join(s.removeprefix('seed') for s in seeds)}:", "",
                      "| window | " + " | ".join(f"seed {s.removeprefix('seed')}" for s in seeds) + " | mean over seeds |",
                      "|---:|" + "---:|" * (len(seeds) + 1)]
            for index, mean in enumerate(data["per_window_mean"]):
                lines.append(f"| {index} | " + " | ".join(f"{data['per_seed_window_difference'][s][index]:+.4f}"
                                                           for s in seeds) + f" | {mean:+.4f} |")
            seed_se = data["se_over_seeds"]
            lines += ["", f"Mean {data['mean_difference']:+.4f} ± {data['se_over_windows']:.4f} (se over windows of "
                      f"the seed-mean difference; beyond 2 se: {data['beyond_noise']}); seed means "
                      + ", ".join(f"{m:+.4f}" for m in data["seed_means"].values())
                      + (f", se over seeds {seed_se:.4f}" if seed_se is not None else "")
                      + f"; every seed beyond 2 se of its windows with the mean's sign: {data['consistent']}."]
    return lines


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
    lines += mechanism_markdown(results)
    if results.get("comparisons"):
        lines += ["", "SQuaT minus the raw-teacher-feature ablation per seed, paired per evaluation window (nats/token):",
                  "", "| setting / seed | NLL difference | se | beyond 2 se | KL difference | se | beyond 2 se |",
                  "|---|---:|---:|---|---:|---:|---|"]
        for key, row in results["comparisons"].items():
            kl = (f"{row['kl_mean_difference']:+.4f} | {row['kl_se']:.4f} | {row['kl_beyond_noise']}"
                  if "kl_mean_difference" in row else "– | – | –")
            lines.append(f"| {key} | {row['mean_nll_difference']:+.4f} | {row['se']:.4f} | {row['beyond_noise']} | "
                         f"{kl} |")
    lines += over_seeds_markdown(results)
    return "\n".join(lines) + "\n"
