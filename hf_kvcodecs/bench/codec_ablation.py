"""Codec ablation: which codebook learner, weighting and layout make the transform-coded residual VQ best.

Every configuration is calibrated on calibration text and measured on held-out evaluation text, for keys and values
separately, at fixed total rates in bits per KV element that *include* the fp16 per-token scale. Measured per layer,
then averaged over layers (and seeds):

* relative MSE in the original KV space,
* mean cosine similarity between each vector and its reconstruction (what attention scores mostly depend on),
* mean norm ratio ``||x_hat|| / ||x||`` (every codec is decoded with the least-squares gain, which makes it equal
  the cosine; the cache's default gain restores the norm instead),
* the Gaussian rate-distortion reference at the same index bits, computed on the evaluation vectors. It is a
  yardstick, not a lower bound: a Gaussian is the hardest source for its covariance, so real (non-Gaussian) vectors
  can in principle be coded below it, and the codec also spends the 16-bit scale that the reference does not get.

Two studies:

1. learner study: every learner in ``CODEBOOK_LEARNERS`` x {unweighted, scale^2-weighted}, default layout
   (pre-RoPE keys, per-head PCA, 8-dim groups);
2. layout study: for the best GSKM variant and the best l2 variant of study 1, one layout change at a time -- no
   transform, 16-dim groups, post-RoPE keys (fitted and evaluated on post-RoPE keys).

RoPE rotates each key by an orthogonal map (times ``attention_scaling``, the same for a key and its reconstruction),
so relative MSE, cosine and norm ratio of a pre-RoPE codec are the same whether measured before or after RoPE: the
pre- and post-RoPE rows are directly comparable.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace

import torch
from tqdm.auto import tqdm

from ..calibration.collect import KVSamples, collect_kv_samples
from ..codecs.kmeans import CODEBOOK_LEARNERS
from ..codecs.residual import (
    FP16_SCALE_BITS,
    fit_transform_residual_vq,
    gaussian_rate_distortion_reference,
    relative_mse,
    stages_for_rate,
)
from ..integrations.loading import loaded_from
from ..models import model_fingerprint
from ..rope import find_rotary_parameters
from ..text import CALIBRATION_DEFAULT, EVALUATION_DEFAULT, load_corpus, tokenize_corpus

KINDS = ("keys", "values")
_EPS = 1e-12


@dataclass(frozen=True)
class AblationConfig:
    """One codec configuration; ``key_space`` only affects keys (values carry no RoPE)."""

    learner: str
    weighted: bool
    transform: str = "pca"
    group_dim: int = 8
    key_space: str = "pre_rope"  # "pre_rope" or "post_rope"
    study: str = "learner"  # "learner" or "layout"

    @property
    def kinds(self) -> tuple[str, ...]:
        # A post-RoPE row differs from its pre-RoPE twin only for keys; repeating the values would be a duplicate.
        return ("keys",) if self.key_space == "post_rope" else KINDS

    @property
    def name(self) -> str:
        parts = [f"{self.learner}, {'weighted' if self.weighted else 'unweighted'}"]
        if self.transform != "pca":
            parts.append(f"transform {self.transform}")
        if self.group_dim != 8:
            parts.append(f"group_dim {self.group_dim}")
        if self.key_space != "pre_rope":
            parts.append("post-RoPE keys")
        return "; ".join(parts)


def vector_metrics(x: torch.Tensor, x_hat: torch.Tensor) -> dict[str, float]:
    """Relative MSE over all vectors, mean cosine similarity and mean norm ratio of ``[..., D]`` vectors."""
    x, x_hat = x.float(), x_hat.float()
    norms, reconstructed_norms = x.norm(dim=-1), x_hat.norm(dim=-1)
    cosine = (x * x_hat).sum(dim=-1) / (norms * reconstructed_norms).clamp_min(_EPS)
    return {
        "relative_mse": relative_mse(x, x_hat),
        "cosine": float(cosine.mean()),
        "norm_ratio": float((reconstructed_norms / norms.clamp_min(_EPS)).mean()),
    }


def run_codec_ablation(
    model,
    tokenizer,
    *,
    layers=(0, 5, 11, 17, 23, 29),
    bits=(1.0, 2.0),
    seeds=(0,),
    calibration_windows: int = 16,
    eval_windows: int = 8,
    window_tokens: int = 512,
    sampled_tokens_per_window: int = 256,
    codebook_bits: int = 8,
    calibration_text=None,
    evaluation_text=None,
    progress: bool = True,
) -> dict:
    """Run the learner and layout studies on ``layers`` of a RoPE model; returns a JSON-serialisable dict.

    ``calibration_text`` / ``evaluation_text`` are text sources for :func:`hf_kvcodecs.text.load_corpus` (``None``:
    CPython docs for calibration, Debian licences for evaluation). ``seeds`` re-fit every codec (k-means seeding
    and the fitting subset) on the same samples, so their spread is the learner's own variability.
    """
    started = time.perf_counter()
    fingerprint = model_fingerprint(model.config)
    head_dim = fingerprint["head_dim"]
    layers, bits, seeds = tuple(int(layer) for layer in layers), tuple(float(b) for b in bits), tuple(seeds)
    if not set(layers) <= set(range(fingerprint["num_hidden_layers"])):
        raise ValueError(f"layers {layers} are not all in 0..{fingerprint['num_hidden_layers'] - 1}.")
    # The ablation compares learners and layouts at fixed index bits: fp16 scales for every configuration, so that its
    # rates and tables stay comparable with the recorded ablation (benchmarks/results/codec_ablation.md).
    stages = {b: stages_for_rate(b, head_dim, codebook_bits, FP16_SCALE_BITS) for b in bits}

    rope = find_rotary_parameters(model)
    corpora, samples = {}, {}
    for split, source, default, windows, collect_seed in (
        ("calibration", calibration_text, CALIBRATION_DEFAULT, calibration_windows, 0),
        ("evaluation", evaluation_text, EVALUATION_DEFAULT, eval_windows, 1),
    ):
        corpus = load_corpus(source, default=default)
        collected = collect_kv_samples(
            model, tokenize_corpus(tokenizer, corpus), window_tokens=window_tokens,
            sampled_tokens_per_window=sampled_tokens_per_window, num_windows=windows, rope=rope, seed=collect_seed,
            progress=progress, description=f"collecting {split} KV",
        )
        samples[split] = collected
        corpora[split] = {**corpus.to_dict(), "windows": collected.windows, "tokens_seen": collected.tokens_seen,
                          "vectors_per_layer_and_head": collected.values[0].shape[1]}

    references = _rate_distortion_references(samples["evaluation"], layers, bits, stages, codebook_bits)
    measure = _Measurer(samples, layers, stages, seeds, codebook_bits, head_dim, references, progress)

    learner_configs = [AblationConfig(learner, weighted) for learner in CODEBOOK_LEARNERS for weighted in (False, True)]
    learner_rows = [measure(config) for config in learner_configs]
    rows = list(learner_rows)
    best_l2 = min((row for row in learner_rows if row["config"]["learner"] == "l2"), key=_score)
    best_gskm = min((row for row in learner_rows if row["config"]["learner"] != "l2"), key=_score)
    for base_row in (best_gskm, best_l2):
        base = AblationConfig(**base_row["config"])
        for change in ({"transform": "none"}, {"group_dim": 16}, {"key_space": "post_rope"}):
            rows.append(measure(replace(base, study="layout", **change)))
    measure.close()

    return {
        "model": {"name_or_path": loaded_from(model.config) or "", **fingerprint},
        "settings": {
            "layers": list(layers), "bits_per_element": list(bits), "seeds": list(seeds),
            "stages": {_label(b): s for b, s in stages.items()}, "codebook_bits": codebook_bits,
            "scale_bits": FP16_SCALE_BITS, "window_tokens": window_tokens,
            "sampled_tokens_per_window": sampled_tokens_per_window, "torch_threads": torch.get_num_threads(),
        },
        "corpora": corpora,
        "rate_distortion_reference": references,
        "selection": {
            "score": "geometric mean of relative MSE over keys/values and all rates (so values' larger errors do not "
            "dominate), learner study only",
            "best_gskm": best_gskm["name"], "best_l2": best_l2["name"],
            "best_gskm_score_over_best_l2": _score(best_gskm) / _score(best_l2),
        },
        "rows": rows,
        "elapsed_seconds": time.perf_counter() - started,
    }


def _label(bits: float) -> str:
    return f"{bits:g}"


def _space(kind: str, key_space: str) -> str:
    return f"keys_{key_space}" if kind == "keys" else "values"


def _vectors(samples: KVSamples, space: str, layer: int) -> torch.Tensor:
    source = {
        "keys_pre_rope": samples.keys_pre_rope, "keys_post_rope": samples.keys_post_rope, "values": samples.values,
    }
    return source[space][layer]


def _rate_distortion_references(evaluation: KVSamples, layers, bits, stages, codebook_bits) -> dict:
    """Gaussian reference per coded space and rate, at the index bits the codec actually spends, mean over layers."""
    references = {}
    for space in ("keys_pre_rope", "keys_post_rope", "values"):
        references[space] = {
            _label(b): sum(
                gaussian_rate_distortion_reference(_vectors(evaluation, space, layer), stages[b] * codebook_bits)
                for layer in layers
            ) / len(layers)
            for b in bits
        }
    return references


def _score(row: dict) -> float:
    relative_mses = [cell["relative_mse"] for kind in row["metrics"].values() for cell in kind.values()]
    return math.exp(sum(math.log(max(value, _EPS)) for value in relative_mses) / len(relative_mses))


class _Measurer:
    """Fits one configuration on calibration vectors and measures it on evaluation vectors, for all layers/seeds."""

    def __init__(self, samples, layers, stages, seeds, codebook_bits, head_dim, references, progress):
        self.samples, self.layers, self.stages, self.seeds = samples, layers, stages, seeds
        self.bits = tuple(stages)
        self.codebook_bits, self.head_dim, self.references = codebook_bits, head_dim, references
        self.bar = tqdm(desc="fitting codecs", unit="codec", disable=not progress)

    def close(self) -> None:
        self.bar.close()

    def __call__(self, config: AblationConfig) -> dict:
        metrics = {}
        for kind in config.kinds:
            space = _space(kind, config.key_space)
            # per_seed[bits][seed] -> list over layers of the metric dicts
            per_seed = {b: {seed: [] for seed in self.seeds} for b in self.bits}
            for layer in self.layers:
                calibration = _vectors(self.samples["calibration"], space, layer)
                evaluation = _vectors(self.samples["evaluation"], space, layer)
                for seed in self.seeds:
                    self.bar.set_postfix_str(f"{config.name} | {kind} L{layer} s{seed}")
                    # One fit at the highest rate serves every lower rate: stages are allocated greedily, so a lower
                    # rate is a prefix of the stage list.
                    codec = fit_transform_residual_vq(
                        calibration, max_stages=max(self.stages.values()), group_dim=config.group_dim,
                        codebook_bits=self.codebook_bits, learner=config.learner, weighted=config.weighted,
                        transform=config.transform, scale_bits=FP16_SCALE_BITS, seed=seed,
                    )
                    for b in self.bits:
                        # The ablation ranks codecs by squared error, so each is measured with the gain that
                        # minimizes it (the cache's default norm-restoring gain trades some of it for attention),
                        # and with the greedy encoder the codebooks were fitted with (the cache's beam search
                        # lowers every codec's error further).
                        reconstruction = codec.truncated(self.stages[b]).reconstruct(
                            evaluation, gain="least_squares", beam_width=1)
                        per_seed[b][seed].append(vector_metrics(evaluation, reconstruction))
                    self.bar.update(1)
            metrics[kind] = {
                _label(b): self._aggregate(per_seed[b], self.references[space][_label(b)], b) for b in self.bits
            }
        return {"name": config.name, "config": asdict(config), "metrics": metrics}

    def _aggregate(self, per_seed: dict, reference: float, bits: float) -> dict:
        cell = {"bits_per_element": (self.stages[bits] * self.codebook_bits + FP16_SCALE_BITS) / self.head_dim}
        for metric in ("relative_mse", "cosine", "norm_ratio"):
            seed_means = [sum(layer[metric] for layer in layers) / len(layers) for layers in per_seed.values()]
            cell[metric] = sum(seed_means) / len(seed_means)
            # Sample standard deviation across seeds of the layer-averaged metric (0 with a single seed).
            cell[f"{metric}_seed_std"] = _std(seed_means)
        cell["per_layer_relative_mse"] = [
            sum(per_seed[seed][i]["relative_mse"] for seed in per_seed) / len(per_seed) for i in range(len(self.layers))
        ]
        cell["rate_distortion_reference"] = reference
        cell["over_reference"] = cell["relative_mse"] / max(reference, _EPS)
        return cell


def _std(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


# ---- report ---------------------------------------------------------------------------------------------------------
def ablation_markdown(results: dict) -> str:
    """A Markdown report: setup, relative-MSE table with the rate-distortion references, cosine / norm-ratio table,
    and the winners per kind and rate."""
    settings, rows = results["settings"], results["rows"]
    rates = [_label(b) for b in settings["bits_per_element"]]
    columns = [(kind, rate) for kind in KINDS for rate in rates]
    several_seeds = len(settings["seeds"]) > 1
    l2_control = next(row for row in rows if row["config"]["learner"] == "l2" and not row["config"]["weighted"]
                      and row["config"]["study"] == "learner")
    model = results["model"]  # "description" is optional: callers holding a LoadedModel may add its description
    stages = ", ".join(f"{rate} b/elt = {settings['stages'][rate]} stages" for rate in rates)
    lines = [
        "# Codec ablation: codebook learner, weighting and layout of the transform-coded residual VQ",
        "",
        f"- Model: {model.get('description') or model['name_or_path'] or model['model_type']} "
        f"({model['num_hidden_layers']} layers, "
        f"{model['num_key_value_heads']} KV heads, head_dim {model['head_dim']}); layers {settings['layers']}",
        f"- Calibration: {_corpus_line(results['corpora']['calibration'])}",
        f"- Evaluation (held out): {_corpus_line(results['corpora']['evaluation'])}",
        f"- Rates include the fp16 per-token scale: {stages} of {2 ** settings['codebook_bits']}-word codebooks",
        f"- Seeds: {settings['seeds']}" + (" (± = standard deviation across seeds)" if several_seeds else ""),
        "- Metrics are computed per layer in the original KV space and averaged over layers. Default layout: "
        "pre-RoPE keys, per-head PCA, 8-dim groups. 'vs l2' = geometric mean over the cells of the row's relative "
        "MSE divided by the unweighted l2 row's (below 1 = better than l2).",
        f"- Selection for the layout study ({results['selection']['score']}): best GSKM = "
        f"`{results['selection']['best_gskm']}`, best l2 = `{results['selection']['best_l2']}`",
        f"- {results['elapsed_seconds']:.0f} s in all, {settings['torch_threads']} torch thread(s)",
        "",
        "## Relative MSE on held-out text",
        "",
        _table_header(["study", "configuration"] + [f"{kind} {rate} b" for kind, rate in columns] + ["vs l2"]),
    ]
    for row in rows:
        cells = [_cell(row, kind, rate, "relative_mse", ".4f", several_seeds) for kind, rate in columns]
        lines.append(_table_row([row["config"]["study"], row["name"]] + cells + [f"{_ratio_to(row, l2_control):.3f}"]))
    references = results["rate_distortion_reference"]
    # Values have no RoPE, so the post-RoPE reference row only has key columns.
    for key_space, label, value_space in (("keys_pre_rope", "pre-RoPE keys; values", "values"),
                                          ("keys_post_rope", "post-RoPE keys", None)):
        cells = [
            f"{references[key_space if kind == 'keys' else value_space][rate]:.4f}"
            if kind == "keys" or value_space else "" for kind, rate in columns
        ]
        lines.append(_table_row(["reference", f"Gaussian rate-distortion reference ({label})"] + cells + [""]))

    lines += [
        "",
        "## Mean cosine similarity / mean norm ratio ||x̂||/||x||",
        "",
        _table_header(["study", "configuration"] + [f"{kind} {rate} b" for kind, rate in columns]),
    ]
    for row in rows:
        cells = [
            f"{row['metrics'][kind][rate]['cosine']:.4f} / {row['metrics'][kind][rate]['norm_ratio']:.4f}"
            if kind in row["metrics"] else "" for kind, rate in columns
        ]
        lines.append(_table_row([row["config"]["study"], row["name"]] + cells))

    lines += ["", "## Best configuration per kind and rate (lowest relative MSE)", ""]
    for kind, rate in columns:
        candidates = [row for row in rows if kind in row["metrics"]]
        learner_candidates = [row for row in candidates if row["config"]["study"] == "learner"]
        best_learner = min(learner_candidates, key=lambda row: row["metrics"][kind][rate]["relative_mse"])
        best_overall = min(candidates, key=lambda row: row["metrics"][kind][rate]["relative_mse"])
        control = l2_control["metrics"][kind][rate]["relative_mse"]
        lines.append(
            f"- {kind} {rate} b/elt: learner study `{best_learner['name']}` "
            f"({best_learner['metrics'][kind][rate]['relative_mse']:.4f}, unweighted l2 {control:.4f}); "
            f"overall `{best_overall['name']}` ({best_overall['metrics'][kind][rate]['relative_mse']:.4f}, "
            f"{best_overall['metrics'][kind][rate]['over_reference']:.1f}x the Gaussian reference)"
        )
    lines += _per_layer_comparison(rows, results["selection"]["best_gskm"], l2_control, settings["layers"], columns)
    lines += ["", "## Pre- vs post-RoPE keys (same learner, PCA, 8-dim groups)", ""]
    for row in rows:
        if row["config"]["key_space"] != "post_rope":
            continue
        pre = next(
            other for other in rows
            if other["config"] == {**row["config"], "key_space": "pre_rope", "study": "learner"}
        )
        comparisons = []
        for rate in rates:
            pre_error = pre["metrics"]["keys"][rate]["relative_mse"]
            post_error = row["metrics"]["keys"][rate]["relative_mse"]
            comparisons.append(
                f"{rate} b/elt {pre_error:.4f} pre vs {post_error:.4f} post ({post_error / max(pre_error, _EPS):.2f}x)"
            )
        lines.append(f"- `{pre['name']}`: " + ", ".join(comparisons))
    return "\n".join(lines) + "\n"


def _per_layer_comparison(rows, best_gskm_name, l2_control, layers, columns) -> list[str]:
    """Per-layer relative MSE of the best GSKM row over the unweighted l2 row: the paired layer-to-layer spread shows
    whether a small average difference between learners is systematic."""
    best_gskm = next(row for row in rows if row["name"] == best_gskm_name and row["config"]["study"] == "learner")
    lines = [
        "",
        f"## `{best_gskm_name}` / `{l2_control['name']}` relative MSE, per layer (below 1 = GSKM better)",
        "",
        _table_header(["layer"] + [f"{kind} {rate} b" for kind, rate in columns]),
    ]
    for index, layer in enumerate(layers):
        ratios = [
            best_gskm["metrics"][kind][rate]["per_layer_relative_mse"][index]
            / max(l2_control["metrics"][kind][rate]["per_layer_relative_mse"][index], _EPS)
            for kind, rate in columns
        ]
        lines.append(_table_row([str(layer)] + [f"{ratio:.3f}" for ratio in ratios]))
    return lines


def _corpus_line(corpus: dict) -> str:
    return (
        f"{corpus['description']}; {corpus['windows']} windows, {corpus['tokens_seen']} tokens run, "
        f"{corpus['vectors_per_layer_and_head']} sampled vectors per layer and head"
    )


def _cell(row: dict, kind: str, rate: str, metric: str, spec: str, with_spread: bool) -> str:
    if kind not in row["metrics"]:
        return ""
    cell = row["metrics"][kind][rate]
    text = format(cell[metric], spec)
    return f"{text} ± {format(cell[f'{metric}_seed_std'], spec)}" if with_spread else text


def _ratio_to(row: dict, control: dict) -> float:
    """Geometric mean of the row's relative MSE over the control's, over the cells the row has."""
    logs = [
        math.log(max(cell["relative_mse"], _EPS) / max(control["metrics"][kind][rate]["relative_mse"], _EPS))
        for kind, cells in row["metrics"].items() for rate, cell in cells.items()
    ]
    return math.exp(sum(logs) / len(logs))


def _table_header(names: list[str]) -> str:
    return _table_row(names) + "\n" + _table_row(["---"] * len(names))


def _table_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"
