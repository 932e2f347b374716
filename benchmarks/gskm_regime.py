"""GSKM vs l2 k-means in the VQLLM regime on real KV: no transform, 32/64-dim sub-vectors, 256-2048-word codebooks.

Our pipeline codes 8-dim groups at 1 bit/dim/stage after RMS normalisation and per-head PCA, where centroid shrinkage
(what GSKM fixes) is small. This script fits one codebook per (layer group, K/V) on raw head vectors of the default
model (SmolLM2-135M-Instruct) split into 32- or 64-dim sub-vectors, as VQLLM does, with l2 k-means and each GSKM
variant of ``hf_kvcodecs.codecs.kmeans``, encodes held-out text greedily (nearest codeword) and reports relative MSE,
mean cosine, mean norm ratio and the attention-output error of each layer group's middle layer.

Two codings per learner:

* ``raw``: the raw sub-vectors, unweighted (no PCA, no normalisation, no gain).
* ``rms``: each head vector divided by its RMS gain ``s = ||x|| / sqrt(head_dim)`` (kept exactly, fp32), the
  sub-vectors of ``x / s`` coded, the fit weighted by ``s^2`` (so its objective is the error on ``x``: the weighted
  variant), decoded as ``s * c``. A plain gain, not a norm-restoring one, so shrinkage stays visible.

    .venv/bin/python benchmarks/gskm_regime.py --threads 1 --out benchmarks/results/gskm_regime
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from hf_kvcodecs.codecs.kmeans import fit_codebook, nearest_codeword

LEARNERS = ("l2", "gskm", "gskm-cosine", "gskm-principal")
WEIGHTINGS = ("raw", "rms")
# Three adjacent layers per group share one codebook per K/V (VQLLM shares one per layer across heads and groups):
# three layers give three times the rows per token, so 2048-word codebooks get >= 64 fit rows per word from ~16K
# tokens, which one CPU thread can run through the model in under two minutes.
LAYER_GROUPS = {"early": (2, 3, 4), "middle": (14, 15, 16), "late": (26, 27, 28)}
CORE_GROUP = "middle"
SEED_CELL = (32, 1024)  # (dim, words) of the cell fitted with two seeds
HELDOUT_BLOCKS = 16  # contiguous token blocks of the held-out text, for paired standard errors
ATTENTION_BLOCK = 256  # query tokens per block of the attention-output error, for its paired standard errors
_EPS = 1e-12


# ----------------------------------------------------------------------------------------------- metric functions


def split_subvectors(heads: torch.Tensor, dim: int) -> torch.Tensor:
    """``[N, D]`` head vectors -> ``[N * D / dim, dim]`` contiguous sub-vectors (row ``r`` is of head row ``r // (D/dim)``)."""
    if heads.shape[-1] % dim:
        raise ValueError(f"head dim {heads.shape[-1]} is not a multiple of the sub-vector dim {dim}")
    return heads.reshape(-1, dim)


def rms_gain(heads: torch.Tensor) -> torch.Tensor:
    """Per-vector RMS ``||x|| / sqrt(D)`` of ``[N, D]`` rows, as ``[N]``."""
    return (heads.norm(dim=-1) / math.sqrt(heads.shape[-1])).clamp_min(_EPS)


def relative_mse(x: torch.Tensor, xhat: torch.Tensor) -> float:
    """``sum ||x - xhat||^2 / sum ||x||^2`` over all rows."""
    return float(((x - xhat) ** 2).sum() / (x**2).sum().clamp_min(_EPS))


def mean_cosine(x: torch.Tensor, xhat: torch.Tensor) -> float:
    """Mean over rows of ``cos(x, xhat)`` (a zero decoded row counts as cosine 0)."""
    dots = (x * xhat).sum(-1)
    return float((dots / (x.norm(dim=-1) * xhat.norm(dim=-1)).clamp_min(_EPS)).mean())


def mean_norm_ratio(x: torch.Tensor, xhat: torch.Tensor) -> float:
    """Mean over rows of ``||xhat|| / ||x||``: below 1 means the decoded vectors are shrunk."""
    return float((xhat.norm(dim=-1) / x.norm(dim=-1).clamp_min(_EPS)).mean())


def vector_metrics(heads: torch.Tensor, decoded: torch.Tensor, dim: int) -> dict:
    """Head-vector metrics (what attention sees) and the sub-vector norm ratio and cosine (the codebook's own)."""
    sub, sub_hat = split_subvectors(heads, dim), split_subvectors(decoded, dim)
    return {"rel_mse": relative_mse(heads, decoded), "cosine": mean_cosine(heads, decoded),
            "norm_ratio": mean_norm_ratio(heads, decoded), "sub_norm_ratio": mean_norm_ratio(sub, sub_hat),
            "sub_cosine": mean_cosine(sub, sub_hat)}


def paired_block_difference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, blocks: int) -> tuple[float, float]:
    """Mean and standard error, over ``blocks`` contiguous row blocks, of ``relMSE(a) - relMSE(b)`` per block."""
    diffs = torch.tensor([relative_mse(xs, as_) - relative_mse(xs, bs)
                          for xs, as_, bs in zip(x.chunk(blocks), a.chunk(blocks), b.chunk(blocks))])
    return float(diffs.mean()), float(diffs.std() / math.sqrt(len(diffs))) if len(diffs) > 1 else float("nan")


def coding_rows(heads: torch.Tensor, dim: int, weighting: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """What a codebook sees: sub-vector rows, their fit weights (None: unweighted) and the per-row decode gain."""
    groups = heads.shape[-1] // dim
    if weighting == "raw":
        rows = split_subvectors(heads, dim)
        return rows, None, torch.ones(rows.shape[0])
    if weighting == "rms":
        gain = rms_gain(heads)
        rows = split_subvectors(heads / gain[:, None], dim)
        gain = gain.repeat_interleave(groups)
        return rows, gain**2, gain
    raise ValueError(f"unknown weighting {weighting!r}; choose one of {WEIGHTINGS}")


def encode_rows(rows: torch.Tensor, codebooks: list[torch.Tensor]) -> torch.Tensor:
    """Greedy residual coding: nearest codeword of each stage on the previous stage's residual; returns the decoded rows."""
    residual = rows.clone()
    for codebook in codebooks:
        residual -= codebook[nearest_codeword(residual, codebook)]
    return rows - residual


def decode_heads(heads: torch.Tensor, codebooks: list[torch.Tensor], dim: int, weighting: str) -> torch.Tensor:
    """Code ``[N, D]`` head vectors with ``codebooks`` (one per stage) and return the decoded ``[N, D]``."""
    rows, _, gain = coding_rows(heads, dim, weighting)
    return (encode_rows(rows, codebooks) * gain[:, None]).reshape(heads.shape)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + causal mask) v`` for ``q`` ``[Hq, T, d]``, ``k``/``v`` ``[Hkv, T, d]`` (GQA: each
    key/value head serves ``Hq / Hkv`` consecutive query heads, as transformers' ``repeat_kv``)."""
    repeat = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(repeat, dim=0), v.repeat_interleave(repeat, dim=0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    tokens = q.shape[1]
    mask = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v


def keep_first(decoded: torch.Tensor, exact: torch.Tensor, tokens: int = 1) -> torch.Tensor:
    """``decoded`` ``[W, H, T, D]`` with its first ``tokens`` positions replaced by the exact ones."""
    out = decoded.clone()
    out[:, :, :tokens] = exact[:, :, :tokens]
    return out


def relative_error(exact: torch.Tensor, approx: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm().clamp_min(_EPS))


def centroid_shrinkage(rows: torch.Tensor, codebook: torch.Tensor) -> float:
    """Mean over rows of ``||c(x)|| / ||x||`` with ``c(x)`` the nearest codeword: the codebook's shrinkage."""
    return mean_norm_ratio(rows, codebook[nearest_codeword(rows, codebook)])


# ------------------------------------------------------------------------------------------------------ real KV


@dataclass
class Captured:
    keys: dict  # layer -> [W, Hkv, T, D] pre-RoPE keys (the cache's keys with RoPE undone)
    values: dict  # layer -> [W, Hkv, T, D]
    queries: dict  # attention layer -> [W, Hq, T, D] post-RoPE queries
    attention: dict  # attention layer -> [W, Hq, T, D] softmax(q k^T / sqrt(d)) v with the exact keys and values
    rope: tuple  # (inv_freq, attention_scaling) of the model
    checks: dict


def attention_error(captured: Captured, layer: int, keys_pre: torch.Tensor, values: torch.Tensor,
                    blocks: bool = False):
    """Relative Frobenius error (all windows, query heads, tokens) of the layer's attention output computed with
    ``keys_pre`` (pre-RoPE, rotated here as the model rotates its keys) and ``values`` ``[W, Hkv, T, D]``; with
    ``blocks``, also the error of each block of ``ATTENTION_BLOCK`` query tokens of each window."""
    from hf_kvcodecs.rope import apply_rope, rotary_cos_sin

    keys = apply_rope(keys_pre, *rotary_cos_sin(torch.arange(keys_pre.shape[2])[None], *captured.rope))
    approx = torch.stack([causal_attention(captured.queries[layer][w], keys[w], values[w])
                          for w in range(keys.shape[0])])
    exact = captured.attention[layer]
    overall = relative_error(exact, approx)
    if not blocks:
        return overall
    per_block = [relative_error(e, a) for w in range(exact.shape[0])
                 for e, a in zip(exact[w].split(ATTENTION_BLOCK, dim=1), approx[w].split(ATTENTION_BLOCK, dim=1))]
    return overall, per_block


def capture_kv(lm, windows: list[torch.Tensor], layers: list[int], attention_layers: list[int], desc: str) -> Captured:
    """Run the model over each window with a ``DynamicCache``; keep keys/values of ``layers`` and, for
    ``attention_layers``, the queries (q_proj hook, RoPE applied as transformers does) and the attention output."""
    from transformers import DynamicCache

    from hf_kvcodecs.rope import apply_rope, find_rotary_parameters, rotary_cos_sin, undo_rope

    model = lm.model
    config = model.config
    heads_q, head_dim = config.num_attention_heads, config.head_dim
    inv_freq, scaling = find_rotary_parameters(model)
    decoder = model.model
    stash: dict = {}
    hooks = []
    for layer in attention_layers:
        attention = decoder.layers[layer].self_attn
        hooks.append(attention.q_proj.register_forward_hook(
            lambda _m, _i, out, layer=layer: stash.__setitem__(("q", layer), out.detach())))
        hooks.append(attention.o_proj.register_forward_pre_hook(
            lambda _m, inputs, layer=layer: stash.__setitem__(("o", layer), inputs[0].detach())))
    check_layer = layers[0]
    hooks.append(decoder.layers[check_layer].self_attn.k_proj.register_forward_hook(
        lambda _m, _i, out: stash.__setitem__(("k", check_layer), out.detach())))
    keys = {layer: [] for layer in layers}
    values = {layer: [] for layer in layers}
    queries = {layer: [] for layer in attention_layers}
    outputs = {layer: [] for layer in attention_layers}
    key_check = 0.0
    try:
        for window in tqdm(windows, desc=desc, unit="window"):
            tokens = window.numel()
            cache = DynamicCache(config=config)
            with torch.no_grad():
                decoder(input_ids=window[None], past_key_values=cache, use_cache=True)
            cos, sin = rotary_cos_sin(torch.arange(tokens)[None], inv_freq, scaling)
            for layer in layers:
                pre = undo_rope(cache.layers[layer].keys.float(), cos, sin, scaling)[0]
                keys[layer].append(pre)
                values[layer].append(cache.layers[layer].values.float()[0])
            hooked = stash[("k", check_layer)][0].view(tokens, -1, head_dim).transpose(0, 1)
            key_check = max(key_check, relative_error(hooked, keys[check_layer][-1]))
            for layer in attention_layers:
                q = stash[("q", layer)][0].view(tokens, heads_q, head_dim).transpose(0, 1)
                queries[layer].append(apply_rope(q[None].float(), cos, sin)[0])
                outputs[layer].append(stash[("o", layer)][0].view(tokens, heads_q, head_dim).transpose(0, 1).float())
    finally:
        for hook in hooks:
            hook.remove()
    stack = lambda d: {k: torch.stack(v) for k, v in d.items()}  # noqa: E731
    captured = Captured(stack(keys), stack(values), stack(queries), {}, (inv_freq, scaling), {})
    captured.checks["pre_rope_keys_vs_k_proj_rel_err"] = key_check
    captured.checks["attention_scaling"] = scaling
    # the exact reference: our softmax(q k^T / sqrt(d)) v with the captured keys (RoPE re-applied) and values, checked
    # against the model's own attention output (the o_proj input)
    model_outputs = stack(outputs)
    worst = 0.0
    for layer in attention_layers:
        post_keys = apply_rope(captured.keys[layer], *rotary_cos_sin(torch.arange(windows[0].numel())[None], inv_freq,
                                                                     scaling))
        captured.attention[layer] = torch.stack([
            causal_attention(captured.queries[layer][w], post_keys[w], captured.values[layer][w])
            for w in range(len(windows))])
        worst = max(worst, relative_error(model_outputs[layer], captured.attention[layer]))
    captured.checks["attention_vs_model_rel_err"] = worst if attention_layers else None
    return captured


def group_heads(tensors: dict, layers: tuple[int, ...]) -> torch.Tensor:
    """``{layer: [W, H, T, D]}`` -> ``[W * T * L * H, D]`` head vectors, token-major (contiguous rows = contiguous
    tokens, so row blocks are token blocks)."""
    stacked = torch.stack([tensors[layer] for layer in layers], dim=2)  # [W, H, L, T, D]
    return stacked.permute(0, 3, 2, 1, 4).reshape(-1, stacked.shape[-1]).contiguous()


def ungroup_layer(rows: torch.Tensor, like: torch.Tensor, layers: tuple[int, ...], layer: int) -> torch.Tensor:
    """Inverse of :func:`group_heads` for one layer: ``[W, H, T, D]`` shaped like ``like``."""
    windows, heads, tokens, dim = like.shape
    return rows.reshape(windows, tokens, len(layers), heads, dim)[:, :, layers.index(layer)].permute(0, 2, 1, 3)


# -------------------------------------------------------------------------------------------------------- cells


@dataclass(frozen=True)
class Cell:
    group: str
    kv: str
    dim: int
    words: int
    weighting: str
    learner: str
    seed: int = 0
    stages: int = 1


def plan(args) -> list[Cell]:
    """The cells, ordered so that K and V of one configuration are consecutive (for the joint attention error) and a
    2-stage cell follows its first stage."""
    configs = []
    for dim in args.dims:
        for words in args.words:
            for weighting in WEIGHTINGS:
                if weighting == "rms" and dim not in args.rms_dims:
                    continue
                configs.append((CORE_GROUP, dim, words, weighting, 0, 1))
    seed_dim, seed_words = args.seed_cell
    for group in args.groups:
        if group != CORE_GROUP or seed_dim not in args.dims or seed_words not in args.words:
            configs += [(group, seed_dim, seed_words, weighting, 0, 1) for weighting in WEIGHTINGS]
    configs += [(CORE_GROUP, seed_dim, words, weighting, 1, 1) for words in [seed_words, *args.second_seed_words]
                for weighting in WEIGHTINGS if words == seed_words or (weighting == "raw" or seed_dim in args.rms_dims)]
    if args.stage2:
        configs += [(CORE_GROUP, seed_dim, seed_words, weighting, 0, 2) for weighting in WEIGHTINGS]
    return [Cell(group, kv, dim, words, weighting, learner, seed, stages)
            for group, dim, words, weighting, seed, stages in configs for learner in args.learners for kv in ("K", "V")]


def fit_row_count(args, words: int) -> int:
    """Fit rows for a codebook of ``words`` words: ``rows_per_word`` per word, at least ``min_fit_rows``."""
    return max(args.rows_per_word * words, args.min_fit_rows)


def fit_cell(cell: Cell, fit_heads: torch.Tensor, args, row_index: dict, previous: list[torch.Tensor]) -> tuple:
    """Fit the last stage of ``cell`` on the fit rows (after ``previous`` stages); returns codebook and fit record."""
    rows, weights, _ = coding_rows(fit_heads, cell.dim, cell.weighting)
    if cell.dim not in row_index:  # one fixed random order per dim: every learner and seed fits the same rows, and a
        generator = torch.Generator().manual_seed(1234)  # smaller codebook's rows are a prefix of a larger one's
        row_index[cell.dim] = torch.randperm(rows.shape[0], generator=generator)
    index = row_index[cell.dim][: fit_row_count(args, cell.words)]
    rows = rows[index]
    weights = None if weights is None else weights[index]
    if previous:
        rows = rows - encode_rows(rows, previous)
    history: list[float] = []
    started = time.perf_counter()
    codebook = fit_codebook(rows, cell.words, learner=cell.learner, weights=weights, n_iter=args.max_iter,
                            seed=cell.seed, init_sample=max(8192, 8 * cell.words), tol=args.tol, history=history)
    seconds = time.perf_counter() - started
    w = torch.ones(rows.shape[0]) if weights is None else weights
    energy = float((w * (rows**2).sum(-1)).sum() / w.sum())
    record = {"fit_rows": rows.shape[0], "rows_per_word": rows.shape[0] / cell.words, "iterations": len(history),
              "converged": len(history) > 1 and abs(history[-2] - history[-1]) <= args.tol * history[-2],
              "final_rel_objective_change": (abs(history[-2] - history[-1]) / history[-2]) if len(history) > 1 else None,
              "fit_rel_mse_last_iteration": history[-1] / energy, "fit_seconds": seconds,
              "fit_shrinkage": centroid_shrinkage(rows[: 32768], codebook) if cell.stages == 1 else None}
    return codebook, record


def run(args) -> dict:
    from hf_kvcodecs.evaluation import fixed_windows
    from hf_kvcodecs.models import load_model
    from hf_kvcodecs.text import load_corpus, tokenize_corpus

    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    phases = {}
    lm = load_model("default")
    phases["load_model_s"] = time.perf_counter() - started
    groups = {name: LAYER_GROUPS[name] for name in args.groups}
    layers = sorted({layer for group in groups.values() for layer in group})
    attention_layers = [group[len(group) // 2] for group in groups.values()]
    fit_corpus = load_corpus(args.fit_text, default=args.fit_text)
    heldout_corpus = load_corpus(args.heldout_text, default=args.heldout_text)
    fit_windows = fixed_windows(tokenize_corpus(lm.tokenizer, fit_corpus), args.fit_windows, args.window)
    heldout_windows = fixed_windows(tokenize_corpus(lm.tokenizer, heldout_corpus), args.heldout_windows, args.window)
    mark = time.perf_counter()
    fit = capture_kv(lm, fit_windows, layers, [], "fit text")
    heldout = capture_kv(lm, heldout_windows, layers, attention_layers, "held-out text")
    phases["capture_s"] = time.perf_counter() - mark
    del lm

    data = {}
    for name, group_layers in groups.items():
        for kv, fit_t, held_t in (("K", fit.keys, heldout.keys), ("V", fit.values, heldout.values)):
            data[name, kv] = (group_heads(fit_t, group_layers), group_heads(held_t, group_layers))
    cells = plan(args)
    rows_out, joint = [], []
    codebooks: dict = {}
    decoded_attention: dict = {}
    row_index: dict = {}
    mark = time.perf_counter()
    progress = tqdm(cells, desc="cells", unit="fit")
    for cell in progress:
        progress.set_postfix_str(f"{cell.group} {cell.kv} d{cell.dim} {cell.words}w {cell.weighting} {cell.learner} "
                                 f"s{cell.seed} x{cell.stages}")
        fit_heads, held_heads = data[cell.group, cell.kv]
        base_key = (cell.group, cell.kv, cell.dim, cell.words, cell.weighting, cell.learner, cell.seed)
        previous = codebooks[base_key + (cell.stages - 1,)] if cell.stages > 1 else []
        codebook, record = fit_cell(cell, fit_heads, args, row_index, previous)
        stage_codebooks = previous + [codebook]
        codebooks[base_key + (cell.stages,)] = stage_codebooks
        decoded = decode_heads(held_heads, stage_codebooks, cell.dim, cell.weighting)
        row = asdict(cell) | record | vector_metrics(held_heads, decoded, cell.dim)
        row["_decoded"] = decoded
        # attention output of the group's middle layer on held-out text, this tensor decoded and the other exact
        layer = groups[cell.group][len(groups[cell.group]) // 2]
        exact_k, exact_v = heldout.keys[layer], heldout.values[layer]
        mine = ungroup_layer(decoded, exact_k, groups[cell.group], layer)
        keys_hat, values_hat = (mine, exact_v) if cell.kv == "K" else (exact_k, mine)
        row["attention_layer"] = layer
        # the first token of each window (the attention sink) left exact, as KV codecs usually keep it: coded, that one
        # token dominates the error (see the joint table)
        row["attention_rel_err_sink_exact"], row["_attention_blocks"] = attention_error(
            heldout, layer, keep_first(keys_hat, exact_k), keep_first(values_hat, exact_v), blocks=True)
        config_key = (cell.group, cell.dim, cell.words, cell.weighting, cell.learner, cell.seed, cell.stages)
        if cell.kv == "K":
            decoded_attention[config_key] = mine
        elif config_key in decoded_attention:
            keys_hat = decoded_attention.pop(config_key)
            sink_exact, blocks = attention_error(heldout, layer, keep_first(keys_hat, exact_k), keep_first(mine, exact_v),
                                                 blocks=True)
            joint.append({"group": cell.group, "dim": cell.dim, "words": cell.words, "weighting": cell.weighting,
                          "learner": cell.learner, "seed": cell.seed, "stages": cell.stages, "layer": layer,
                          "attention_rel_err_kv": attention_error(heldout, layer, keys_hat, mine),
                          "attention_rel_err_kv_sink_exact": sink_exact, "_attention_blocks": blocks})
        rows_out.append(row)
        progress.write(f"{cell.group} {cell.kv} d{cell.dim} {cell.words}w {cell.weighting} {cell.learner} s{cell.seed} "
                       f"x{cell.stages}: rel MSE {row['rel_mse']:.4f} cos {row['cosine']:.4f} norm {row['norm_ratio']:.3f} "
                       f"attn {row['attention_rel_err_sink_exact']:.4f} | {record['iterations']} it, last dobj "
                       f"{record['final_rel_objective_change']:.1e}, {record['fit_seconds']:.1f} s")
    phases["fit_and_evaluate_s"] = time.perf_counter() - mark

    # paired differences against l2 of the same cell (same rows, same seed), over held-out token blocks
    by_key = {(r["group"], r["kv"], r["dim"], r["words"], r["weighting"], r["seed"], r["stages"], r["learner"]): r
              for r in rows_out}
    for r in rows_out:
        base = by_key.get((r["group"], r["kv"], r["dim"], r["words"], r["weighting"], r["seed"], r["stages"], "l2"))
        held_heads = data[r["group"], r["kv"]][1]
        if base is None or r is base:
            r["d_rel_mse_vs_l2"], r["d_rel_mse_vs_l2_se"], r["d_cosine_vs_l2"] = 0.0, 0.0, 0.0
            continue
        r["d_rel_mse_vs_l2"], r["d_rel_mse_vs_l2_se"] = paired_block_difference(
            held_heads, r["_decoded"], base["_decoded"], HELDOUT_BLOCKS)
        r["d_cosine_vs_l2"] = r["cosine"] - base["cosine"]
    for r in rows_out:
        del r["_decoded"]
    paired_attention_differences(rows_out, ("group", "kv", "dim", "words", "weighting", "seed", "stages"),
                                 "attention_rel_err_sink_exact")
    paired_attention_differences(joint, ("group", "dim", "words", "weighting", "seed", "stages"),
                                 "attention_rel_err_kv_sink_exact")
    mark = time.perf_counter()
    convergence = convergence_check(args, data, row_index, rows_out) if args.check_tol else []
    phases["convergence_check_s"] = time.perf_counter() - mark
    phases["total_s"] = time.perf_counter() - started
    return {
        "what": "GSKM vs l2 k-means, one greedy VQ stage (and a second residual stage for one cell), real KV, no "
                "transform, VQLLM-sized sub-vectors and codebooks",
        "model": "SmolLM2-135M-Instruct (default model of hf_kvcodecs.models.load_model)",
        "fit_text": fit_corpus.to_dict() | {"name": args.fit_text, "tokens": sum(w.numel() for w in fit_windows)},
        "heldout_text": heldout_corpus.to_dict() | {"name": args.heldout_text,
                                                    "tokens": sum(w.numel() for w in heldout_windows)},
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "out"}
        | {"layer_groups": {k: list(v) for k, v in groups.items()}, "attention_layers": attention_layers,
           "key_space": "pre-RoPE (the DynamicCache's keys with RoPE undone; checked against a k_proj hook)",
           "sub_vectors": "contiguous channels of each 64-dim head vector", "heldout_blocks": HELDOUT_BLOCKS},
        "checks": {"fit": fit.checks, "heldout": heldout.checks},
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
                    "threads": args.threads},
        "phases": phases,
        "rows": rows_out,
        "joint_attention": joint,
        "convergence_check": convergence,
    }


def paired_attention_differences(entries: list[dict], fields: tuple[str, ...], metric: str) -> None:
    """Add ``d_<metric>_vs_l2`` and its standard error over the query-token blocks (paired with l2's blocks in the same
    cell), then drop the per-block errors."""
    base = {_key(e, *fields): e for e in entries if e["learner"] == "l2"}
    for e in entries:
        reference = base.get(_key(e, *fields))
        if reference is None or reference is e:
            e[f"d_{metric}_vs_l2"], e[f"d_{metric}_vs_l2_se"] = 0.0, 0.0
            continue
        diffs = torch.tensor(e["_attention_blocks"]) - torch.tensor(reference["_attention_blocks"])
        e[f"d_{metric}_vs_l2"] = e[metric] - reference[metric]
        e[f"d_{metric}_vs_l2_se"] = float(diffs.std() / math.sqrt(diffs.numel()))
    for e in entries:
        e.pop("_attention_blocks", None)


def convergence_check(args, data: dict, row_index: dict, rows: list[dict]) -> list[dict]:
    """Refit the raw seed cell (seed 0, one stage) of the core group with a tighter tolerance: how much held-out
    relative MSE the main run's stopping rule leaves on the table, next to the learners' differences."""
    import copy

    tight = copy.copy(args)
    tight.tol, tight.max_iter = args.check_tol, args.check_max_iter
    dim, words = args.seed_cell
    main = {(r["kv"], r["learner"]): r for r in rows if (r["group"], r["dim"], r["words"], r["weighting"], r["seed"],
                                                          r["stages"]) == (CORE_GROUP, dim, words, "raw", 0, 1)}
    out = []
    for kv in ("K", "V"):
        fit_heads, held_heads = data[CORE_GROUP, kv]
        for learner in tqdm(args.learners, desc=f"convergence check {kv}", unit="fit"):
            cell = Cell(CORE_GROUP, kv, dim, words, "raw", learner)
            codebook, record = fit_cell(cell, fit_heads, tight, row_index, [])
            metrics = vector_metrics(held_heads, decode_heads(held_heads, [codebook], dim, "raw"), dim)
            reference = main[kv, learner]
            out.append({"group": CORE_GROUP, "kv": kv, "dim": dim, "words": words, "weighting": "raw",
                        "learner": learner, "tol": args.check_tol, "iterations": record["iterations"],
                        "final_rel_objective_change": record["final_rel_objective_change"],
                        "rel_mse": metrics["rel_mse"], "cosine": metrics["cosine"],
                        "rel_mse_main": reference["rel_mse"], "iterations_main": reference["iterations"],
                        "rel_mse_change": metrics["rel_mse"] - reference["rel_mse"]})
    for entry in out:
        l2 = next(e for e in out if e["kv"] == entry["kv"] and e["learner"] == "l2")
        entry["d_rel_mse_vs_l2"] = entry["rel_mse"] - l2["rel_mse"]
    return out


# ------------------------------------------------------------------------------------------------------ reports


def _key(row: dict, *fields: str) -> tuple:
    return tuple(row[f] for f in fields)


def seed_spread(rows: list[dict]) -> dict:
    """For cells fitted with several seeds: per (group, kv, dim, words, weighting, learner) the relative MSE of each
    seed, and per cell the spread of the GSKM-minus-l2 difference across seeds."""
    fields = ("group", "kv", "dim", "words", "weighting", "learner", "stages")
    seeds: dict = {}
    for r in rows:
        seeds.setdefault(_key(r, *fields), {})[r["seed"]] = r
    per_learner, diff_spreads = [], []
    for key, by_seed in seeds.items():
        if len(by_seed) < 2:
            continue
        values = [by_seed[s]["rel_mse"] for s in sorted(by_seed)]
        diffs = [by_seed[s]["d_rel_mse_vs_l2"] for s in sorted(by_seed)]
        entry = dict(zip(fields, key)) | {"rel_mse_by_seed": values, "rel_mse_spread": max(values) - min(values),
                                          "d_rel_mse_vs_l2_by_seed": diffs}
        if key[fields.index("learner")] != "l2":
            entry["d_rel_mse_vs_l2_spread"] = max(diffs) - min(diffs)
            diff_spreads.append(entry["d_rel_mse_vs_l2_spread"])
        per_learner.append(entry)
    return {"cells": per_learner, "max_diff_spread": max(diff_spreads) if diff_spreads else None,
            "mean_diff_spread": sum(diff_spreads) / len(diff_spreads) if diff_spreads else None,
            "max_rel_mse_spread": max((e["rel_mse_spread"] for e in per_learner), default=None)}


def verdict(results: dict) -> dict:
    """Where a GSKM variant beats l2 (lower held-out relative MSE, same cell, same seed) beyond noise: the difference
    must exceed both twice its paired standard error over held-out token blocks and the largest seed-to-seed spread
    of such a difference."""
    spread = results["seeds"]
    seed_noise = spread["max_diff_spread"] or 0.0
    wins, losses, ties = [], [], []
    for r in results["rows"]:
        if r["learner"] == "l2" or r["seed"] != 0:
            continue
        threshold = max(2 * r["d_rel_mse_vs_l2_se"], seed_noise)
        l2 = r["rel_mse"] - r["d_rel_mse_vs_l2"]
        entry = {k: r[k] for k in ("group", "kv", "dim", "words", "weighting", "learner", "stages")} | {
            "d_rel_mse": r["d_rel_mse_vs_l2"], "d_rel_mse_pct": 100 * r["d_rel_mse_vs_l2"] / l2, "threshold": threshold,
            "d_cosine": r["d_cosine_vs_l2"]}
        (wins if r["d_rel_mse_vs_l2"] < -threshold else losses if r["d_rel_mse_vs_l2"] > threshold else ties).append(entry)
    best = min(wins + ties + losses, key=lambda e: e["d_rel_mse_pct"], default=None)
    return {"seed_noise": seed_noise, "wins": wins, "losses": losses, "ties": ties, "best": best,
            "comparisons": len(wins) + len(losses) + len(ties)}


def seed_cells(results: dict) -> str:
    cells = sorted({(r["dim"], r["words"]) for r in results["rows"] if r["seed"] > 0})
    return ", ".join(f"{dim}-dim {words}-word" for dim, words in cells)


def _fmt(value, digits=4):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _cell_label(e: dict) -> str:
    stages = "" if e.get("stages", 1) == 1 else f", {e['stages']} stages"
    return f"{e['group']} {e['kv']} d{e['dim']} {e['words']} words {e['weighting']} {e['learner']}{stages}"


def _range(values, fmt="{:+.1f}") -> str:
    values = sorted(values)
    return fmt.format(values[0]) if len(values) == 1 or values[0] == values[-1] else \
        f"{fmt.format(values[0])} to {fmt.format(values[-1])}"


def attention_summary(results: dict) -> dict:
    """GSKM-minus-l2 differences of the attention-output error (first token exact), single-sided (one of K/V decoded)
    and joint (both decoded), and which are beyond noise: twice their paired standard error over query-token blocks
    and the largest seed-to-seed spread of such a difference."""
    out = {}
    for name, entries, fields, metric in (
        ("single", results["rows"], ("group", "kv", "dim", "words", "weighting", "stages", "learner"),
         "attention_rel_err_sink_exact"),
        ("joint", results["joint_attention"], ("group", "dim", "words", "weighting", "stages", "learner"),
         "attention_rel_err_kv_sink_exact"),
    ):
        d, se = f"d_{metric}_vs_l2", f"d_{metric}_vs_l2_se"
        by_seed: dict = {}
        for e in entries:
            by_seed.setdefault(_key(e, *fields), {})[e["seed"]] = e
        spread = max((max(x[d] for x in runs.values()) - min(x[d] for x in runs.values())
                      for key, runs in by_seed.items() if len(runs) > 1 and key[-1] != "l2"), default=0.0)
        comparisons = [e for e in entries if e["seed"] == 0 and e["learner"] != "l2"]
        labelled = [{k: e[k] for k in fields + ("stages",)} | {"d": e[d], "se": e[se]} for e in comparisons]
        out[name] = {"seed_spread": spread, "comparisons": len(comparisons),
                     "wins": [e for e in labelled if e["d"] < -max(2 * e["se"], spread)],
                     "losses": [e for e in labelled if e["d"] > max(2 * e["se"], spread)],
                     "d_range": [min((e[d] for e in comparisons), default=0.0), max((e[d] for e in comparisons), default=0.0)],
                     "level": [min(e[metric] for e in entries), max(e[metric] for e in entries)] if entries else None}
    runs: dict = {}
    for j in results["joint_attention"]:
        runs.setdefault(_key(j, "group", "dim", "words", "weighting", "stages", "learner"), []).append(j["attention_rel_err_kv"])
    out["all_tokens_seed_spread"] = max((max(v) - min(v) for v in runs.values() if len(v) > 1), default=0.0)
    return out


def verdict_text(results: dict) -> str:
    v = results["verdict"]
    n, wins, losses = v["comparisons"], v["wins"], v["losses"]
    every = wins + losses + v["ties"]
    count = {(kind, kv): sum(e["kv"] == kv for e in v[kind]) for kind in ("wins", "losses") for kv in "KV"}
    total = {kv: sum(e["kv"] == kv for e in every) for kv in "KV"}
    if wins:
        scope = ("on values only" if not count["wins", "K"] else "on keys only" if not count["wins", "V"] else "in places")
        answer = f"Yes, {scope}, by at most {max(-e['d_rel_mse_pct'] for e in wins):.1f} % in relative MSE"
    else:
        answer = "No"
    parts = [f"**Does GSKM beat l2 in this regime? {answer}.** "
             f"Across {n} GSKM-vs-l2 comparisons (same cell, same fit rows, seed 0), a GSKM variant has a lower held-out "
             f"relative MSE than l2 beyond noise in {len(wins)} (values: {count['wins', 'V']} of {total['V']}; keys: "
             f"{count['wins', 'K']} of {total['K']}) and a higher one in {len(losses)} (keys: {count['losses', 'K']}, "
             f"values: {count['losses', 'V']}); noise = twice the paired standard error over {HELDOUT_BLOCKS} held-out "
             f"token blocks, and at least the largest seed-to-seed spread of a GSKM-minus-l2 difference "
             f"({v['seed_noise']:.4f} in relative MSE; {CORE_GROUP} group, 2 seeds: {seed_cells(results)})."]
    if wins:
        top = min(wins, key=lambda e: e["d_rel_mse_pct"])
        where = sorted({f"{e['kv']} {e['weighting']}" for e in wins})
        parts.append(f"The wins are {_range([e['d_rel_mse_pct'] for e in wins])} % in relative MSE (cosine "
                     f"{_range([e['d_cosine'] for e in wins], '{:+.3f}')}), in {', '.join(where)}; the largest is "
                     f"{_cell_label(top)}: {top['d_rel_mse']:+.4f} ({top['d_rel_mse_pct']:+.1f} %), cosine "
                     f"{top['d_cosine']:+.3f}.")
    elif v["best"] is not None:
        best = v["best"]
        parts.append(f"The closest GSKM gets is {_cell_label(best)} at {best['d_rel_mse']:+.4f} ({best['d_rel_mse_pct']:+.1f} %), "
                     "inside the noise.")
    if losses:
        parts.append(f"The losses are {_range([e['d_rel_mse_pct'] for e in losses])} % (largest: "
                     f"{_cell_label(max(losses, key=lambda e: e['d_rel_mse_pct']))}).")
    rows = [r for r in results["rows"] if r["seed"] == 0]
    index = {_key(r, "group", "kv", "dim", "words", "weighting", "stages", "learner"): r for r in rows}
    gain_pct, beats = [], 0
    pairs = 0
    for r in rows:
        if r["weighting"] != "raw" or r["learner"] != "l2":
            continue
        rms_l2 = index.get(_key(r, "group", "kv", "dim", "words") + ("rms", r["stages"], "l2"))
        if rms_l2 is None:
            continue
        best_raw_gskm = min(index[_key(r, "group", "kv", "dim", "words", "weighting", "stages") + (name,)]["rel_mse"]
                            for name in LEARNERS if name != "l2" and
                            _key(r, "group", "kv", "dim", "words", "weighting", "stages") + (name,) in index)
        pairs += 1
        beats += rms_l2["rel_mse"] < best_raw_gskm
        gain_pct.append(100 * (rms_l2["rel_mse"] - r["rel_mse"]) / r["rel_mse"])
    if pairs:
        parts.append(f"A plain per-vector RMS gain with l2 (`rms` l2, 16 uncounted bits per head vector) changes relative "
                     f"MSE by {_range(gain_pct)} % against raw l2 and beats the best raw GSKM in {beats} of {pairs} cells; "
                     f"with that gain, GSKM wins {sum(e['weighting'] == 'rms' for e in wins)} of "
                     f"{sum(e['weighting'] == 'rms' for e in every)} comparisons.")
    core = [r for r in rows if r["group"] == CORE_GROUP and r["stages"] == 1 and r["learner"] == "l2" and r["weighting"] == "raw"]
    if core:
        ratio = {kv: [r["sub_norm_ratio"] for r in core if r["kv"] == kv] for kv in "KV"}
        parts.append(f"Shrinkage is there on values (sub-vector norm ratio of raw l2 codebooks "
                     f"{_range(ratio['V'], '{:.2f}')}, {CORE_GROUP} group) and small on keys ({_range(ratio['K'], '{:.2f}')}).")
    attention = results.get("attention")
    if attention and attention["joint"]["comparisons"]:
        joint, single = attention["joint"], attention["single"]
        where = sorted({f"{e['group']} d{e['dim']} {e['words']} words {e['weighting']}" + ("" if e["stages"] == 1 else " 2 stages")
                        for e in joint["wins"]})
        parts.append(f"In the attention output (the layer's real queries; keys and values decoded, first token exact: relative "
                     f"error {_range(joint['level'], '{:.2f}')}), GSKM minus l2 is {_range(joint['d_range'], '{:+.3f}')}; "
                     f"beyond noise (twice the paired SE over {ATTENTION_BLOCK}-token query blocks, and the seed spread "
                     f"{joint['seed_spread']:.3f}) GSKM is lower in {len(joint['wins'])} and higher in {len(joint['losses'])} "
                     f"of {joint['comparisons']} comparisons" + (f" (lower in: {'; '.join(where)})" if where else "") + ". "
                     f"With only one of K/V decoded, GSKM is lower beyond noise in {len(single['wins'])} "
                     f"(keys {sum(e['kv'] == 'K' for e in single['wins'])}, values {sum(e['kv'] == 'V' for e in single['wins'])}) "
                     f"and higher in {len(single['losses'])} of {single['comparisons']} (seed spread {single['seed_spread']:.3f}). "
                     f"With the first token coded as well, the error is dominated by that one token (seed spread up to "
                     f"{attention['all_tokens_seed_spread']:.2f}) and is not compared.")
    check = results.get("convergence_check")
    if check:
        change = [c["rel_mse_change"] for c in check]
        gaps = {kv: [c["d_rel_mse_vs_l2"] for c in check if c["kv"] == kv and c["learner"] != "l2"] for kv in "KV"}
        parts.append(f"Refitting the raw seed cell to tolerance {check[0]['tol']:g} ({_range([c['iterations'] for c in check], '{}')} "
                     f"iterations) changes its relative MSE by {_range(change, '{:+.4f}')} and leaves GSKM minus l2 at "
                     f"{_range(gaps['V'], '{:+.4f}')} on values and {_range(gaps['K'], '{:+.4f}')} on keys.")
    return " ".join(parts)


def headline_rows(results: dict) -> list[dict]:
    """Per core-group cell (seed 0): l2 and the best GSKM variant by held-out relative MSE."""
    rows = [r for r in results["rows"] if r["group"] == CORE_GROUP and r["seed"] == 0]
    joint = {_key(j, "dim", "words", "weighting", "stages", "learner"): j for j in results["joint_attention"]
             if j["group"] == CORE_GROUP and j["seed"] == 0}
    cells: dict = {}
    for r in rows:
        cells.setdefault(_key(r, "kv", "dim", "words", "weighting", "stages"), {})[r["learner"]] = r
    out = []
    for key, by_learner in cells.items():
        l2 = by_learner.get("l2")
        others = [r for name, r in by_learner.items() if name != "l2"]
        if l2 is None or not others:
            continue
        best = min(others, key=lambda r: r["rel_mse"])
        kv, dim, words, weighting, stages = key
        jl2, jbest = joint.get((dim, words, weighting, stages, "l2")), joint.get((dim, words, weighting, stages, best["learner"]))
        out.append({"kv": kv, "dim": dim, "words": words, "weighting": weighting, "stages": stages, "l2": l2, "best": best,
                    "d_attention_joint": jbest["d_attention_rel_err_kv_sink_exact_vs_l2"] if jl2 and jbest else None})
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["group"] == CORE_GROUP and r["seed"] == 0 and r["stages"] == 1]
    panels = [(kv, dim) for kv in ("K", "V") for dim in sorted({r["dim"] for r in rows})]
    fig, axes = plt.subplots(3, len(panels), figsize=(3.4 * len(panels), 8.0), squeeze=False)
    colors = dict(zip(LEARNERS, ("black", "tab:blue", "tab:orange", "tab:green")))
    for column, (kv, dim) in enumerate(panels):
        for weighting, style in (("raw", "-"), ("rms", "--")):
            for learner in LEARNERS:
                line = sorted((r for r in rows if (r["kv"], r["dim"], r["weighting"], r["learner"]) ==
                               (kv, dim, weighting, learner)), key=lambda r: r["words"])
                if not line:
                    continue
                words = [r["words"] for r in line]
                delta = [100 * r["d_rel_mse_vs_l2"] / (r["rel_mse"] - r["d_rel_mse_vs_l2"]) for r in line]
                for row_index, values in enumerate(([r["rel_mse"] for r in line], delta, [r["sub_norm_ratio"] for r in line])):
                    axes[row_index][column].plot(words, values, style, marker="o", markersize=3,
                                                 color=colors[learner], label=f"{learner} ({weighting})")
        for row_index, metric in enumerate(("held-out relative MSE", "rel MSE vs l2 (%)", "sub-vector norm ratio")):
            axis = axes[row_index][column]
            axis.set_xscale("log", base=2)
            axis.set_title(f"{kv}, {dim}-dim" if row_index == 0 else "", fontsize=9)
            axis.set_xlabel("codebook words" if row_index == 2 else "", fontsize=8)
            axis.set_ylabel(metric if column == 0 else "", fontsize=8)
            axis.tick_params(labelsize=7)
            axis.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.suptitle(f"GSKM vs l2, one VQ stage, {CORE_GROUP} layers {LAYER_GROUPS[CORE_GROUP]}, held-out text", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=72)
    plt.close(fig)


def markdown(results: dict, command: str) -> str:
    s, rows = results["settings"], results["rows"]
    lines = [
        "# GSKM vs l2 k-means in the VQLLM regime (real KV, no transform)",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {results['machine']['platform']}, torch {results['machine']['torch']}, "
        f"{results['machine']['threads']} thread(s), a CPU shared with another benchmark job. Runtime "
        f"{results['phases']['total_s'] / 60:.1f} min (model load {results['phases']['load_model_s']:.0f} s, KV capture "
        f"{results['phases']['capture_s']:.0f} s, fits and evaluation {results['phases']['fit_and_evaluate_s']:.0f} s).",
        "",
        "## Verdict",
        "",
        verdict_text(results),
        "",
        f"## Headline ({CORE_GROUP} group {LAYER_GROUPS[CORE_GROUP]}, seed 0): l2 vs the best GSKM variant per cell",
        "",
        "| K/V | dim | words | coding | stages | l2 rel MSE | l2 cosine | l2 norm ratio | best GSKM | its rel MSE | Δ % ± SE | "
        "Δ cosine | Δ attn err ± SE (this K/V decoded) | Δ attn err (K and V decoded with that learner) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[f"| {h['kv']} | {h['dim']} | {h['words']} | {h['weighting']} | {h['stages']} | {h['l2']['rel_mse']:.4f} | "
          f"{h['l2']['cosine']:.4f} | {h['l2']['norm_ratio']:.3f} | {h['best']['learner']} | {h['best']['rel_mse']:.4f} | "
          f"{100 * h['best']['d_rel_mse_vs_l2'] / h['l2']['rel_mse']:+.2f} ± {100 * h['best']['d_rel_mse_vs_l2_se'] / h['l2']['rel_mse']:.2f} | "
          f"{h['best']['cosine'] - h['l2']['cosine']:+.4f} | "
          f"{h['best']['d_attention_rel_err_sink_exact_vs_l2']:+.4f} ± {h['best']['d_attention_rel_err_sink_exact_vs_l2_se']:.4f} | "
          f"{_fmt(h['d_attention_joint'])} |" for h in headline_rows(results)],
        "",
        "## Setup",
        "",
        f"* Model: {results['model']}; 30 layers, 3 KV heads, head_dim 64.",
        f"* Fit text: `{s['fit_text']}` ({results['fit_text']['description']}), {results['fit_text']['tokens']} tokens "
        f"in {s['fit_windows']} windows of {s['window']}.",
        f"* Held-out text: `{s['heldout_text']}` ({results['heldout_text']['description']}), "
        f"{results['heldout_text']['tokens']} tokens in {s['heldout_windows']} windows of {s['window']}; unlike the fit "
        "text (licence prose vs the Python language reference).",
        f"* KV: captured from a `transformers.DynamicCache` after a forward pass with `use_cache=True`. Keys are coded "
        f"**pre-RoPE** (the cache's post-RoPE keys with RoPE undone, as VQLLM codes k_proj outputs; relative difference "
        f"from a k_proj hook {results['checks']['fit']['pre_rope_keys_vs_k_proj_rel_err']:.1e}); values as cached.",
        f"* Layer groups (one codebook per group and K/V, shared by the group's 3 layers and 3 heads and by the "
        f"sub-vectors of a head): {s['layer_groups']}. The full grid runs on the `{CORE_GROUP}` group; the other groups "
        f"run the {SEED_CELL[0]}-dim {SEED_CELL[1]}-word cell.",
        "* Sub-vectors: contiguous 32 or 64 channels of each 64-dim head vector. No PCA, no normalisation before coding.",
        "* Codings: `raw` = raw sub-vectors, unweighted fit. `rms` = head vector divided by its RMS gain "
        "`s = ||x||/8` (kept exactly in fp32; it would cost 16 bits per head vector in fp16, not counted here), fit "
        "weighted by `s^2` (the *weighted* learners: their objective is the error on the raw vectors), decoded as "
        f"`s * c` (plain gain, no norm restoration). `rms` runs at dims {s['rms_dims']}.",
        f"* Learners (hf_kvcodecs.codecs.kmeans): {', '.join(s['learners'])}. Greedy nearest-codeword encoding for all.",
        f"* Fit: max({s['rows_per_word']} x words, {s['min_fit_rows']}) sub-vector rows per codebook (a fixed random "
        "subsample of the group's fit rows, the same for every learner and seed, nested across sizes; "
        f"{max(s['rows_per_word'] * max(s['words']), s['min_fit_rows'])} rows at {max(s['words'])} words). k-means++ seeding "
        f"on max(8192, 8 x words) rows; at most {s['max_iter']} iterations, stopping when the training objective changes "
        f"by less than {s['tol']:g} (relative); the table gives the iterations run and the last relative change.",
        f"* Seeds: seed 0 everywhere; seed 1 too for the {CORE_GROUP} cells {seed_cells(results)}.",
        f"* Second stage: {'a second residual stage of the same size and learner on the ' + CORE_GROUP + ' ' + str(SEED_CELL[0]) + '-dim ' + str(SEED_CELL[1]) + '-word cell' if s['stage2'] else 'not run'}.",
        "* Metrics on held-out head vectors (64-dim): relative MSE `sum||x-x̂||²/sum||x||²`, mean cosine, mean norm ratio "
        "`||x̂||/||x||`; the sub-vector norm ratio is the codebook's own shrinkage. Δ vs l2: paired difference of "
        f"relative MSE with its standard error over {HELDOUT_BLOCKS} contiguous held-out token blocks.",
        f"* Attention-output error: layers {s['attention_layers']} (each group's middle layer), held-out windows, the "
        "model's real queries (q_proj hook, RoPE applied as transformers applies it), `softmax(q k^T/sqrt(d)) v` with a "
        "causal mask and GQA, decoded keys (RoPE re-applied) *or* decoded values with the other exact (`attn err`), and "
        "both decoded (joint table; the all-tokens column there codes the first token too); relative Frobenius error vs "
        "the same computation with exact tensors (which matches "
        f"the model's own attention output to {results['checks']['heldout']['attention_vs_model_rel_err']:.1e}). All "
        "tokens are coded (no fp16 recent window) except where a column says `sink exact`: each window's first token exact. "
        f"Δ attn err ± SE: paired over the {ATTENTION_BLOCK}-token query blocks of the held-out windows.",
        "",
        "Reduced to fit ~25 minutes on one shared CPU thread: the full dim x words grid only on one layer group (the "
        "others get the VQLLM 32-dim 1024-word cell); the `rms` coding only at the dims listed; two seeds only on the cells "
        "named above; "
        "the second stage only on one cell; ~16K fit tokens (pooled over 3 layers per group so that 2048-word codebooks "
        "still get >= 64 rows per word); fit rows scaled with the codebook (64 per word, at least 65536) instead of 131072 "
        "for every size; iterations capped (see Fit).",
        "",
        "## Seed cell: both seeds and the spread",
        "",
        "| group | K/V | coding | learner | rel MSE seed 0 | rel MSE seed 1 | spread | Δ vs l2 seed 0 | Δ vs l2 seed 1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in results["seeds"]["cells"]:
        r0, r1 = e["rel_mse_by_seed"][:2]
        d0, d1 = e["d_rel_mse_vs_l2_by_seed"][:2]
        lines.append(f"| {e['group']} | {e['kv']} | {e['weighting']} | {e['learner']} | {r0:.4f} | {r1:.4f} | "
                     f"{e['rel_mse_spread']:.4f} | {d0:+.4f} | {d1:+.4f} |")
    lines += ["", "## All cells (held-out)", "",
              "| group | K/V | dim | words | coding | learner | seed | stages | rel MSE | Δ vs l2 ± SE | cosine | "
              "norm ratio | sub-vec norm ratio | attn err, sink exact | iters | last Δobj | fit s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        delta = "" if r["learner"] == "l2" else f"{r['d_rel_mse_vs_l2']:+.4f} ± {r['d_rel_mse_vs_l2_se']:.4f}"
        lines.append(
            f"| {r['group']} | {r['kv']} | {r['dim']} | {r['words']} | {r['weighting']} | {r['learner']} | {r['seed']} | "
            f"{r['stages']} | {r['rel_mse']:.4f} | {delta} | {r['cosine']:.4f} | {r['norm_ratio']:.3f} | "
            f"{r['sub_norm_ratio']:.3f} | {r['attention_rel_err_sink_exact']:.4f} | "
            f"{r['iterations']} | "
            f"{_fmt(r['final_rel_objective_change'], 5)} | {r['fit_seconds']:.1f} |")
    lines += ["", "## Attention-output error with decoded keys and values (held-out)", "",
              "| group | layer | dim | words | coding | learner | seed | stages | rel err, all tokens coded | rel err, sink exact "
              "| Δ vs l2 ± SE (sink exact) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for j in results["joint_attention"]:
        lines.append(f"| {j['group']} | {j['layer']} | {j['dim']} | {j['words']} | {j['weighting']} | {j['learner']} | "
                     f"{j['seed']} | {j['stages']} | {j['attention_rel_err_kv']:.4f} | {j['attention_rel_err_kv_sink_exact']:.4f} | "
                     + ("" if j["learner"] == "l2" else f"{j['d_attention_rel_err_kv_sink_exact_vs_l2']:+.4f} ± "
                        f"{j['d_attention_rel_err_kv_sink_exact_vs_l2_se']:.4f}") + " |")
    if results.get("convergence_check"):
        c0 = results["convergence_check"][0]
        lines += ["", f"## Convergence check ({c0['group']} {c0['dim']}-dim {c0['words']} words, raw, seed 0, refitted "
                  f"to tolerance {c0['tol']:g})", "",
                  "| K/V | learner | iters (main) | iters | last Δobj | rel MSE (main) | rel MSE | change | Δ vs l2 |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in results["convergence_check"]:
            lines.append(f"| {c['kv']} | {c['learner']} | {c['iterations_main']} | {c['iterations']} | "
                         f"{_fmt(c['final_rel_objective_change'], 5)} | {c['rel_mse_main']:.4f} | {c['rel_mse']:.4f} | "
                         f"{c['rel_mse_change']:+.4f} | {c['d_rel_mse_vs_l2']:+.4f} |")
    lines += ["", "`gskm_regime.png`: held-out relative MSE, its difference from l2 (%) and the sub-vector norm ratio vs "
              "codebook size per learner "
              f"({CORE_GROUP} group, one stage, seed 0; solid raw, dashed rms).", ""]
    return "\n".join(lines)


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fit-text", default="python-docs")
    parser.add_argument("--heldout-text", default="debian-licenses")
    parser.add_argument("--window", type=int, default=1024, help="tokens per forward window")
    parser.add_argument("--fit-windows", type=int, default=16)
    parser.add_argument("--heldout-windows", type=int, default=4)
    parser.add_argument("--groups", nargs="+", default=list(LAYER_GROUPS), choices=list(LAYER_GROUPS))
    parser.add_argument("--dims", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--rms-dims", type=int, nargs="*", default=[32], help="dims that also run the rms coding")
    parser.add_argument("--words", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--learners", nargs="+", default=list(LEARNERS), choices=list(LEARNERS))
    parser.add_argument("--seed-cell", type=int, nargs=2, default=list(SEED_CELL), metavar=("DIM", "WORDS"),
                        help="the cell fitted with a second seed, also run on the other layer groups and with 2 stages")
    parser.add_argument("--second-seed-words", type=int, nargs="*", default=[256],
                        help="further codebook sizes (at the seed cell's dim, core group) fitted with a second seed")
    parser.add_argument("--rows-per-word", type=int, default=64)
    parser.add_argument("--min-fit-rows", type=int, default=65536)
    parser.add_argument("--max-iter", type=int, default=20)
    parser.add_argument("--tol", type=float, default=1e-3)
    parser.add_argument("--no-stage2", dest="stage2", action="store_false")
    parser.add_argument("--check-tol", type=float, default=1e-4,
                        help="tolerance of the convergence check refits (0: no check)")
    parser.add_argument("--check-max-iter", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gskm_regime"))
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="only rewrite the Markdown and PNG next to an earlier run's JSON (no model, no fits)")
    args = parser.parse_args()
    if args.render is not None:
        results = json.loads(args.render.read_text())
        results["seeds"] = seed_spread(results["rows"])
        results["verdict"] = verdict(results)
        results["attention"] = attention_summary(results)
        args.render.write_text(json.dumps(results, indent=1, default=str))
        (args.render.parent / "gskm_regime.md").write_text(markdown(results, results["command"]))
        plot(results, args.render.parent / "gskm_regime.png")
        print(verdict_text(results))
        return
    if "l2" not in args.learners:
        parser.error("--learners must include l2 (every comparison is against it)")
    results = run(args)
    results["seeds"] = seed_spread(results["rows"])
    results["verdict"] = verdict(results)
    results["attention"] = attention_summary(results)
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join([".venv/bin/python", *sys.argv])
    results["command"] = command
    (args.out / "gskm_regime.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "gskm_regime.md").write_text(markdown(results, command))
    plot(results, args.out / "gskm_regime.png")
    print(verdict_text(results))


if __name__ == "__main__":
    main()
