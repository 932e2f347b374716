"""SCD in serving, measured in one run on one pair: the operating points a consumer can be sent (each knowledge base,
i.e. Patch depth and code bits, at several code prefixes; raw bfloat16 KV; the consumer's own prefill) with their
bytes, measured consumer and producer seconds and quality; the bandwidth-aware planner's choice over a bandwidth
sweep and quality budgets; and a progressive payload's quality against the bytes received, beside a one-pass payload
cut at the same bytes.

Quality is the mean KL divergence from the consumer's own prefill over the continuation tokens of held-out windows
(teacher-forced), the reference measured in the same run. Seconds are medians of interleaved repeats on the first
window (:func:`~hf_kvcodecs.bench.scd._interleaved_median_seconds`), on this machine's CPU: the planner's
predictions are for this machine, at the bandwidths swept.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from ..evaluation import fixed_windows, kl_divergence
from ..scd import SCDKnowledgeBase, SCDTransferCache, encode, truncate_payload
from ..scd.model_access import shapes
from ..scd.planner import LOCAL_PREFILL, OperatingPoint, plan_transfer
from .scd import _interleaved_median_seconds, _own_prefill, continuation_scores, producer_cache, raw16_cache

__all__ = ["ServingBenchSettings", "run_serving_bench", "serving_markdown", "serving_plot"]


@dataclass(frozen=True)
class ServingBenchSettings:
    tokens: int = 1024
    windows: int = 4
    continuation_tokens: int = 32
    fractions: tuple[float, ...] = (0.25, 0.5, 1.0)  # code prefixes sent (truncate_payload), per knowledge base
    progressive_fraction: float = 0.5
    budget_points: int = 10  # byte budgets of the progressive curve
    bandwidths_gbps: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0)
    max_kl: tuple[float | None, ...] = (None, 0.1, 0.05)
    repeats: int = 3


def _kl(consumer, cache, context: torch.Tensor, continuation: torch.Tensor, reference: torch.Tensor) -> float:
    _, logprobs = continuation_scores(consumer, cache, context, continuation)
    return float(kl_divergence(reference, logprobs).mean())


def _point_name(kb_name: str, fraction: float) -> str:
    return kb_name if fraction == 1.0 else f"{kb_name} @{fraction:g}"


def run_serving_bench(producer_loaded, consumer_loaded, kbs: dict[str, SCDKnowledgeBase], main: str,
                      token_ids: torch.Tensor, text: dict, settings: ServingBenchSettings | None = None,
                      progress: bool = True) -> dict:
    settings = settings or ServingBenchSettings()
    started = time.perf_counter()
    producer, consumer = producer_loaded.model, consumer_loaded.model
    windows = fixed_windows(token_ids, settings.windows, settings.tokens + settings.continuation_tokens)
    model_shapes = shapes(consumer)
    raw_bytes_per_token = 2 * model_shapes.layers * model_shapes.kv_width * 2  # keys and values, bfloat16
    kl: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    curve: dict[str, list[list[dict]]] = {"progressive": [], "one-pass": []}
    for window in tqdm(windows, desc="SCD serving: quality", disable=not progress):
        context, continuation = window[:settings.tokens], window[settings.tokens:]
        prompt = context[None, :-1]  # the payload covers the context but its last token, which decoding feeds
        reference = continuation_scores(consumer, _own_prefill(consumer, prompt), context, continuation)[1]
        raw = raw16_cache(producer_cache(producer, prompt))
        kl.setdefault("raw bf16 KV", []).append(_kl(consumer, raw, context, continuation, reference))
        sizes["raw bf16 KV"] = raw_bytes_per_token * prompt.shape[1]
        for kb_name, kb in kbs.items():
            payload = encode(producer, prompt, kb)
            for fraction in settings.fractions:
                sent = payload if fraction == 1.0 else truncate_payload(payload, fraction)
                name = _point_name(kb_name, fraction)
                cache = SCDTransferCache.from_payload(sent, consumer, kb)
                kl.setdefault(name, []).append(_kl(consumer, cache, context, continuation, reference))
                sizes[name] = len(sent)
        for layout, payload in (("progressive", encode(producer, prompt, kbs[main],
                                                       progressive=settings.progressive_fraction)),
                                ("one-pass", encode(producer, prompt, kbs[main]))):
            rows = []
            for step in range(1, settings.budget_points + 1):
                budget = round(len(payload) * step / settings.budget_points)
                row = {"byte_budget": budget}
                for policy in ("accept", "recompute"):
                    try:
                        cache = SCDTransferCache.from_stream(payload, consumer, kbs[main], byte_budget=budget,
                                                             partial=policy, input_ids=prompt)
                    except ValueError as error:  # accept refuses a cut that leaves layers undecodable
                        row[policy] = {"refused": str(error)[:160]}
                        continue
                    report = cache.transfer_report["stream"]
                    row[policy] = {"kl": _kl(consumer, cache, context, continuation, reference),
                                   "bytes_received": report["bytes_received"],
                                   "layers_at_base_rank": len(report["layers_at_base_rank"]),
                                   "layers_recomputed": len(report["layers_recomputed"]),
                                   "consumer_seconds": cache.transfer_report["total_seconds"]}
                rows.append(row)
            curve[layout].append(rows)
    timing = _timings(producer, consumer, kbs, windows[0][None, :settings.tokens - 1], settings)
    points = [OperatingPoint(LOCAL_PREFILL, "local", 0, timing["local prefill"], kl=0.0,
                             detail="the consumer's own prefill: the reference"),
              OperatingPoint("raw bf16 KV", "raw", sizes["raw bf16 KV"], timing["raw bf16 KV rebuild"],
                             timing["producer prefill"], statistics.fmean(kl["raw bf16 KV"]),
                             "the producer's KV as it is")]
    for kb_name in kbs:
        for fraction in settings.fractions:
            name = _point_name(kb_name, fraction)
            points.append(OperatingPoint(name, "scd", sizes[name], timing[f"{name} rebuild"],
                                         timing[f"{kb_name} encode"], statistics.fmean(kl[name]),
                                         f"{kbs[kb_name].code_bits}-bit codes, prefix {fraction:g}"))
    sweeps = {}
    for on_path in (True, False):
        key = "producer_on_path" if on_path else "codes_ready"
        sweeps[key] = {str(budget): [plan_transfer(points, bandwidth, max_kl=budget, producer_on_path=on_path).to_dict()
                                     for bandwidth in settings.bandwidths_gbps]
                       for budget in settings.max_kl}
    return {
        "settings": asdict(settings), "text": text, "main_knowledge_base": main,
        "producer": getattr(producer_loaded, "description", None), "consumer": getattr(consumer_loaded, "description",
                                                                                         None),
        "knowledge_bases": {name: {"save_id": kb.save_id, "code_bits": kb.code_bits,
                                   "recompute_blocks": [[layer.index, layer.depth] for layer in kb.plan
                                                        if layer.recomputes]} for name, kb in kbs.items()},
        "points": [asdict(point) for point in points], "kl_by_window": kl, "timing_seconds": timing,
        "plans": sweeps, "progressive_curve": _average_curve(curve), "seconds": time.perf_counter() - started,
    }


@torch.inference_mode()
def _timings(producer, consumer, kbs: dict[str, SCDKnowledgeBase], prompt: torch.Tensor,
             settings: ServingBenchSettings) -> dict[str, float]:
    source = producer_cache(producer, prompt)
    timed: dict[str, Callable[[], object]] = {
        "local prefill": lambda: _own_prefill(consumer, prompt),
        "producer prefill": lambda: producer_cache(producer, prompt),
        "raw bf16 KV rebuild": lambda: raw16_cache(source),
    }
    for kb_name, kb in kbs.items():
        payload = encode(producer, prompt, kb)
        timed[f"{kb_name} encode"] = lambda kb=kb: encode(producer, prompt, kb)
        for fraction in settings.fractions:
            sent = payload if fraction == 1.0 else truncate_payload(payload, fraction)
            timed[f"{_point_name(kb_name, fraction)} rebuild"] = \
                lambda sent=sent, kb=kb: SCDTransferCache.from_payload(sent, consumer, kb)
    return _interleaved_median_seconds(timed, settings.repeats)


def _average_curve(curve: dict[str, list[list[dict]]]) -> dict[str, list[dict]]:
    """Per layout and budget step: the windows' mean KL, bytes and work per policy (a policy that refused any
    window is reported as refused at that step)."""
    averaged = {}
    for layout, windows in curve.items():
        rows = []
        for step in zip(*windows):
            row = {"byte_budget": statistics.fmean(r["byte_budget"] for r in step)}
            for policy in ("accept", "recompute"):
                if any("refused" in r[policy] for r in step):
                    row[policy] = {"refused": next(r[policy]["refused"] for r in step if "refused" in r[policy])}
                    continue
                row[policy] = {key: statistics.fmean(r[policy][key] for r in step)
                               for key in step[0][policy]}
            rows.append(row)
        averaged[layout] = rows
    return averaged


def serving_markdown(results: dict) -> str:
    settings = results["settings"]
    lines = [f"# SCD in serving: operating points, the planner, progressive payloads ({results['main_knowledge_base']})",
             "", f"Producer: {results['producer']}; consumer: {results['consumer']}.",
             f"Text: {results['text'].get('name')}; {settings['windows']} windows of {settings['tokens']} tokens, KL "
             f"from the consumer's own prefill over {settings['continuation_tokens']} continuation tokens each. "
             f"Seconds: medians of {settings['repeats']} interleaved repeats on one window, this machine's CPU.", "",
             "| operating point | bytes | consumer s | producer s | KL |", "|---|---:|---:|---:|---:|"]
    for point in results["points"]:
        lines.append(f"| {point['name']} | {point['payload_bytes']:,} | {point['consumer_seconds']:.3f} | "
                     f"{point['producer_seconds']:.3f} | {point['kl']:.4f} |")
    for key, title in (("producer_on_path", "producer's prefill and coding on the critical path"),
                       ("codes_ready", "codes ready (a knowledge-base store hit)")):
        lines += ["", f"Planner's choice, {title}:", "",
                  "| Gbps | " + " | ".join(f"max KL {budget}" for budget in results["plans"][key]) + " |",
                  "|---:|" + "---|" * len(results["plans"][key])]
        for index, bandwidth in enumerate(settings["bandwidths_gbps"]):
            cells = []
            for plans in results["plans"][key].values():
                plan = plans[index]
                cells.append(f"{plan['choice']} ({1000 * plan['predicted_seconds']:.0f} ms)")
            lines.append(f"| {bandwidth:g} | " + " | ".join(cells) + " |")
    lines += ["", f"Progressive payload (base fraction {settings['progressive_fraction']}) against a one-pass payload "
              "cut at the same bytes (means over windows):", "",
              "| layout | budget (bytes) | accept: KL | recompute: KL | layers at base rank | layers recomputed | "
              "consumer s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for layout, rows in results["progressive_curve"].items():
        for row in rows:
            accept = row["accept"]
            recompute = row["recompute"]
            accept_kl = "refused" if "refused" in accept else f"{accept['kl']:.4f}"
            if "refused" in recompute:
                lines.append(f"| {layout} | {row['byte_budget']:,.0f} | {accept_kl} | refused | | | |")
                continue
            lines.append(f"| {layout} | {row['byte_budget']:,.0f} | {accept_kl} | {recompute['kl']:.4f} | "
                         f"{recompute['layers_at_base_rank']:.0f} | {recompute['layers_recomputed']:.0f} | "
                         f"{recompute['consumer_seconds']:.3f} |")
    lines += ["", f"Run time {results['seconds'] / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def serving_plot(results: dict, path) -> None:
    """Left: KL against bytes received (a progressive payload read by an ``accept`` consumer, and the main knowledge
    base's payload cut by its sender to each prefix); middle: the consumer's seconds to its cache against bytes received
    under ``recompute``, progressive against one-pass; right: the planner's predicted time of its choice against
    bandwidth, per quality budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    curve = results["progressive_curve"]
    points = [(row["byte_budget"] / 1024, row["accept"]["kl"]) for row in curve["progressive"] if "kl" in row["accept"]]
    if points:
        left.plot(*zip(*points), "-o", label="progressive payload, cut in transit (accept)")
    main = results["main_knowledge_base"]
    sent = sorted((p["payload_bytes"] / 1024, p["kl"]) for p in results["points"]
                  if p["name"] == main or p["name"].startswith(f"{main} @"))
    left.plot(*zip(*sent), "--s", label="one-pass payload, prefix chosen by the sender")
    left.set_xlabel("bytes received (KiB)")
    left.set_ylabel("KL from the consumer's own prefill (nats)")
    left.set_title(f"quality against bytes ({main})")
    left.legend(fontsize=8)
    for layout, style in (("progressive", "-o"), ("one-pass", "--s")):
        rows = [(row["byte_budget"] / 1024, row["recompute"]["consumer_seconds"]) for row in curve[layout]
                if "consumer_seconds" in row["recompute"]]
        if rows:
            middle.plot(*zip(*rows), style, label=f"{layout} payload")
    local = next(p for p in results["points"] if p["kind"] == "local")["consumer_seconds"]
    middle.axhline(local, color="grey", linestyle=":", label="local prefill")
    middle.set_xlabel("bytes received before the cut (KiB)")
    middle.set_ylabel("consumer seconds to its cache (this CPU)")
    middle.set_title("policy 'recompute': what a cut costs the consumer")
    middle.legend(fontsize=8)
    bandwidths = results["settings"]["bandwidths_gbps"]
    for budget, plans in results["plans"]["codes_ready"].items():
        right.plot(bandwidths, [1000 * plan["predicted_seconds"] for plan in plans], "-o", label=f"max KL {budget}")
    right.axhline(1000 * local, color="grey", linestyle=":", label="local prefill")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("link bandwidth (Gbps)")
    right.set_ylabel("predicted time to the cache (ms, this CPU)")
    right.set_title("the planner's choice (codes ready)")
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
