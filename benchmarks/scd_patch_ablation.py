"""SCD's Patch at equal bytes: one (producer, consumer) pair's statistics fitted once, then plans that differ only in
their Patch layers (none; projection-only at layer l; recompute from layer l for depth d) at the same rank knob
``tau`` and code precision, each measured on held-out windows of evaluation text, paired per window with the oracle
(the consumer's own prefill), beside raw producer KV and DroidSpeak-style recompute from layer k.

Each plan's cache is built by the same code path the fit's budget and a payload take (``encode_layer`` on the
producer's captured states, ``rebuild_into`` on the consumer); bytes are the codes, scales and RMS per coded token
(``SCDKnowledgeBase.bytes_per_token``; the payload's header and exact tokens aside).

    python benchmarks/scd_patch_ablation.py --producer artifacts/draft-w3g32 --consumer default --threads 2 \
        --plans none project:8 recompute:8:22 recompute:5:25 --taus 0.0 0.03 --bits 8 4 --droidspeak 5 10 \
        --out benchmarks/results/scd_patch_ablation_w3g32
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import DynamicCache

from hf_kvcodecs.bench.scd import (
    continuation_scores,
    droidspeak_cache,
    gsrq_cache,
    producer_cache,
    producer_hidden_state,
    raw16_cache,
)
from hf_kvcodecs.cli.defaults import CALIBRATION_TEXT, EVALUATION_TEXT
from hf_kvcodecs.evaluation import WindowScores, fixed_windows, paired_comparison, paired_difference
from hf_kvcodecs.models import load_model
from hf_kvcodecs.scd import SCDKnowledgeBase
from hf_kvcodecs.scd.cache import rebuild_into
from hf_kvcodecs.scd.coding import encode_layer, whiten_plan
from hf_kvcodecs.scd.encode import exact_columns
from hf_kvcodecs.scd.fit import SCDFitSettings, _fit_maps, accumulate_pair_moments, plan_for
from hf_kvcodecs.scd.model_access import model_identity, prefill_with_taps, tokenizer_sha256, unwrapped
from hf_kvcodecs.text import load_corpus, tokenize_corpus

EXACT_TOKENS = 4


def parse_plan(spec: str) -> tuple[str, dict[int, int]]:
    """``none``, ``project:L[,L...]`` or ``recompute:L:D[,L:D...]`` -> (mode, {first layer: depth})."""
    if spec == "none":
        return "none", {}
    mode, _, rest = spec.partition(":")
    if mode == "project":
        return mode, {int(layer): 1 for layer in rest.split(",")}
    if mode == "recompute":
        return mode, {int(part.split(":")[0]): int(part.split(":")[1]) for part in rest.split(",")}
    raise ValueError(f"A plan is none, project:L or recompute:L:D, got {spec!r}.")


def fitted_maps(producer, consumer, ids: torch.Tensor, windows: int, modes: set[str]):
    """Reuse and Patch maps at full rank and their error curves, per Patch mode needed (one statistics pass each)."""
    count = min(windows, ids.numel() // 512)
    stride = ids.numel() // count
    chunks = [ids[i * stride:i * stride + 512] for i in range(count)]
    maps, curves = {}, {}
    for mode in sorted(modes):
        settings = SCDFitSettings(patch_mode=mode, ridge=1e-4)
        moments = accumulate_pair_moments(producer, consumer, chunks, skip_first=EXACT_TOKENS, patch_mode=mode)
        maps[mode], curves[mode] = _fit_maps(moments, settings)
    return maps, curves


def knowledge_base(plan, maps, bits: int, identities, code_format: str = "flat",
                   fitting: dict | None = None) -> SCDKnowledgeBase:
    """The plan's knowledge base; ``whitened`` re-codes it at the bytes of its flat ``bits``-bit codes. ``fitting``
    records where its statistics came from (saved with it)."""
    layers = {layer.index for layer in plan}
    kb = SCDKnowledgeBase(plan, {i: maps["keys"][i] for i in layers}, {i: maps["values"][i] for i in layers},
                          {i: maps["inputs"][i] for i in layers} if "inputs" in maps else {}, bits, EXACT_TOKENS,
                          *identities, fitting or {}, residuals={i: maps["residuals"][i] for i in layers}
                          if "residuals" in maps else {})
    if code_format == "whitened" and bits < 16:
        kb.plan = whiten_plan(kb.plan, kb, bits, False)
    return kb


@torch.inference_mode()
def rebuilt_cache(consumer, kb: SCDKnowledgeBase, captures, ids: torch.Tensor) -> DynamicCache:
    mask = torch.ones_like(ids)
    start = exact_columns(mask, kb.exact_tokens)
    sections = {"input.attention_mask": mask.to(torch.uint8), "input.exact_token_ids": ids[:, :start]}
    for layer_plan, capture in zip(kb.plan, captures):
        sections.update(encode_layer(capture, layer_plan, kb, start, kb.code_bits))
    cache = DynamicCache(config=unwrapped(consumer).config.get_text_config(decoder=True))
    rebuild_into(cache, consumer, kb, kb.plan, sections, kb.code_bits)
    return cache


def score_window(producer, consumer, window: torch.Tensor, points: dict, modes: set[str], droidspeak: list[int],
                 context_tokens: int = 1024, gsrq_codebooks=None, gsrq_bits: tuple[float, ...] = (),
                 gsrq_sizes: dict | None = None) -> dict:
    """Per method: the continuation's per-token NLL and log-probabilities after that method's cache of the context.
    ``gsrq_sizes`` collects the GSRQ rows' bytes per token (codes, scales and exact tokens held)."""
    context, continuation = window[:context_tokens], window[context_tokens:]
    ids = context[:-1][None]
    captures = []
    prefill_with_taps(producer, ids, None, captures.append, all_inputs="project" in modes,
                      all_residuals="recompute" in modes)
    source = producer_cache(producer, ids)
    caches = {"oracle": lambda: producer_cache(consumer, ids), "raw-16": lambda: raw16_cache(source)}
    for layer in droidspeak:
        hidden = producer_hidden_state(producer, ids, layer)
        caches[f"droidspeak-{layer}"] = lambda layer=layer, hidden=hidden: droidspeak_cache(
            consumer, ids, source, hidden, layer)
    for bits in gsrq_bits:  # the producer's KV coded by GSRQ with codebooks fitted for the producer
        coded, size = gsrq_cache(producer, ids, gsrq_codebooks, bits)
        caches[f"gsrq-{bits:g}"] = lambda coded=coded: coded
        if gsrq_sizes is not None:
            gsrq_sizes.setdefault(f"gsrq-{bits:g}", []).append(size)
    for name, kb in points.items():
        caches[name] = lambda kb=kb: rebuilt_cache(consumer, kb, captures, ids)
    return {name: continuation_scores(consumer, build(), context, continuation) for name, build in caches.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--producer", required=True)
    parser.add_argument("--consumer", default="default")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plans", nargs="+", default=["none", "project:8", "recompute:8:22"])
    parser.add_argument("--taus", type=float, nargs="+", default=[0.0, 0.03])
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--droidspeak", type=int, nargs="*", default=[5, 10])
    parser.add_argument("--code-format", choices=["flat", "whitened"], default="flat",
                        help="codes at flat bits, or whitened at the same bytes (the fit's default)")
    parser.add_argument("--save-knowledge-bases", type=Path, default=None,
                        help="also save every plan's knowledge base under this folder (one sub-folder per plan), for "
                             "`hf-kvcodecs bench scd --knowledge-base / --more-knowledge-bases`")
    parser.add_argument("--fit-windows", type=int, default=12, help="calibration windows of 512 tokens")
    parser.add_argument("--windows", type=int, default=8, help="evaluation windows of 1024 + 64 tokens")
    parser.add_argument("--gsrq-codebooks", type=Path, default=None,
                        help="GSRQ codebooks calibrated for the producer (`hf-kvcodecs calibrate --model PRODUCER`): "
                             "adds the GSRQ-coded producer KV baseline at --gsrq-bits")
    parser.add_argument("--gsrq-bits", type=float, nargs="*", default=[2.0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    producer, consumer = load_model(args.producer), load_model(args.consumer)
    calibration = load_corpus(None, default=CALIBRATION_TEXT)
    evaluation = load_corpus(None, default=EVALUATION_TEXT)
    plans = {spec: parse_plan(spec) for spec in args.plans}
    modes = {"recompute" if mode != "project" else "project" for mode, _ in plans.values()}
    maps, curves = fitted_maps(producer.model, consumer.model, tokenize_corpus(producer.tokenizer, calibration),
                               args.fit_windows, modes)
    identities = ({**model_identity(producer.model), "name": producer.description},
                  {**model_identity(consumer.model), "name": consumer.description},
                  tokenizer_sha256(producer.tokenizer))
    points = {}
    for spec, (mode, patches) in plans.items():
        key = "project" if mode == "project" else "recompute"
        for tau in args.taus:
            for bits in args.bits:
                kb = knowledge_base(plan_for(tau, patches, curves[key]), maps[key], bits, identities,
                                    args.code_format, {"text": {"description": calibration.description},
                                                       "settings": {"patch_mode": mode, "tau": tau, "plan": spec,
                                                                    "fit_windows": args.fit_windows,
                                                                    "window_tokens": 512}})
                name = f"{spec} tau={tau:g} {bits}-bit"
                if args.save_knowledge_bases is not None:
                    kb.save(args.save_knowledge_bases / name.replace(" ", "_").replace(":", "-").replace("=", ""))
                else:
                    kb.save_id = "in-memory ablation"  # never saved: built and decoded in this process
                points[name] = kb
    gsrq_codebooks, gsrq_bits, gsrq_sizes = None, (), {}
    if args.gsrq_codebooks is not None:
        from hf_kvcodecs.gsrq.loading import load_codebooks

        gsrq_codebooks, gsrq_bits = load_codebooks(str(args.gsrq_codebooks)), tuple(args.gsrq_bits)
        gsrq_codebooks.check_fits(unwrapped(producer.model).config)
    windows = fixed_windows(tokenize_corpus(producer.tokenizer, evaluation), args.windows, 1024 + 64)
    nlls: dict[str, list] = {}
    logprobs: dict[str, list] = {}
    for window in tqdm(windows, desc="SCD Patch ablation"):
        for name, (nll, rows) in score_window(producer.model, consumer.model, window, points, modes,
                                              args.droidspeak, gsrq_codebooks=gsrq_codebooks, gsrq_bits=gsrq_bits,
                                              gsrq_sizes=gsrq_sizes).items():
            nlls.setdefault(name, []).append(nll)
            logprobs.setdefault(name, []).append(rows)
    reference = WindowScores(nlls["oracle"], logprobs["oracle"])
    model_layers = len(maps["recompute" if "recompute" in maps else "project"]["keys"])
    raw_bytes = 2 * model_layers * maps[next(iter(maps))]["keys"][0].decoder.shape[1] * 2
    rows = {}
    for name in nlls:
        row = paired_comparison(WindowScores(nlls[name], logprobs[name]), reference)
        if name in points:
            kb = points[name]
            row.update(bytes_per_token=kb.bytes_per_token(), recomputed_layers=sum(
                layer.depth for layer in kb.plan if layer.recomputes), plan=[layer.to_dict() for layer in kb.plan])
        elif name in gsrq_sizes:
            row.update(bytes_per_token=sum(gsrq_sizes[name]) / len(gsrq_sizes[name]), recomputed_layers=0)
        elif name.startswith("droidspeak-"):
            layer = int(name.split("-")[1])
            row.update(bytes_per_token=layer * raw_bytes / model_layers + 2 * consumer.model.config.hidden_size,
                       recomputed_layers=model_layers - layer)
        else:
            row.update(bytes_per_token=raw_bytes if name == "raw-16" else 0, recomputed_layers=0 if name == "raw-16"
                       else model_layers)
        rows[name] = row
    versus = {}
    for name in points:
        spec, setting = name.split(" ", 1)
        for other in points:
            if other != name and other.endswith(setting) and other.split(" ", 1)[0] != spec:
                versus[f"{name} vs {other.split(' ', 1)[0]}"] = {
                    "nll": paired_difference(rows[name]["window_nll"], rows[other]["window_nll"]),
                    "kl": paired_difference(rows[name]["window_kl"], rows[other]["window_kl"]),
                    "bytes_ratio": rows[name]["bytes_per_token"] / rows[other]["bytes_per_token"]}
    results = {"producer": producer.description, "consumer": consumer.description,
               "calibration_text": calibration.description, "evaluation_text": evaluation.description,
               "settings": vars(args) | {"out": str(args.out)}, "raw_16bit_bytes_per_token": raw_bytes,
               "rows": rows, "paired_at_equal_settings": versus, "seconds": time.perf_counter() - started}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scd_patch_ablation.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "scd_patch_ablation.md").write_text(markdown(results))
    plot(results, args.out / "scd_patch_ablation.png")
    print(markdown(results))


def markdown(results: dict) -> str:
    raw = results["raw_16bit_bytes_per_token"]
    lines = [f"# SCD Patch at equal bytes: {results['producer']} -> {results['consumer']}", "",
             f"Statistics: {results['calibration_text']}. Evaluation: {results['evaluation_text']}, "
             f"{results['settings']['windows']} windows of 1024 + 64 tokens, teacher-forced, paired per window with "
             "the oracle. Bytes: codes, scales and RMS per coded token (header and 4 exact tokens aside); codes "
             f"{results['settings'].get('code_format', 'flat')}.", "",
             "| method | bytes/token | vs 16-bit | recomputed layers | Δppl % ± se | KL | top-1 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, row in sorted(results["rows"].items(), key=lambda item: -item[1]["bytes_per_token"]):
        size = row["bytes_per_token"]
        lines.append(f"| {name} | {size:.0f} | {raw / size if size else math.inf:.1f}x | {row['recomputed_layers']} | "
                     f"{row['delta_ppl_pct']:+.2f} ± {row['delta_ppl_pct_se'] or 0:.2f} | {row.get('kl_mean', 0):.4f} | "
                     f"{row.get('top1_agreement', 1):.3f} |")
    lines += ["", "Paired at the same rank knob and precision (first minus second; negative: the first is better):",
              "", "| comparison | bytes ratio | ΔNLL ± se (nats/token) | ΔKL ± se |", "|---|---:|---:|---:|"]
    for name, row in results["paired_at_equal_settings"].items():
        lines.append(f"| {name} | {row['bytes_ratio']:.2f} | {row['nll']['mean']:+.4f} ± {row['nll']['se'] or 0:.4f} | "
                     f"{row['kl']['mean']:+.4f} ± {row['kl']['se'] or 0:.4f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    for name, row in results["rows"].items():
        if not row["bytes_per_token"]:
            continue
        marker = "*" if name.startswith("recompute") else "s" if name.startswith("project") else \
            "^" if name.startswith("none") else "o"
        axis.scatter(row["bytes_per_token"], max(row.get("kl_mean", 0.0), 1e-4), marker=marker)
        axis.annotate(name, (row["bytes_per_token"], max(row.get("kl_mean", 0.0), 1e-4)), fontsize=6)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("bytes per token")
    axis.set_ylabel("KL from the oracle (nats/token)")
    axis.set_title("SCD Patch modes at equal settings (*: recompute, s: project, ^: none, o: baselines)", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
