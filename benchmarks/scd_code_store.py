"""The SCD code store on the default model: N real documents put once, served to two fine-tuned consumers.

Producer: the default model (SmolLM2-135M). Consumers: the LoRA expert (``artifacts/expert-python-r64``) and the full
fine-tune (``artifacts/expert-python-full``), with knowledge bases fitted with shared encoders (the LoRA pair's first,
the full fine-tune's with ``--encoders-from`` it; default settings otherwise):

    hf-kvcodecs scd fit --consumer artifacts/expert-python-r64 --threads 1 --out artifacts/kb-store-lora
    hf-kvcodecs scd fit --consumer artifacts/expert-python-full --threads 1 --out artifacts/kb-store-full \\
        --encoders-from artifacts/kb-store-lora

(``--fit`` fits whichever is missing, the same way.) Documents: Debian's licences (/usr/share/common-licenses, one
file per distinct text), the first ``--tokens`` tokens of each as the prompt and the next ``--continuation`` tokens
to score.

Per document: one ``put`` per stored precision (``widths``, ``float16``), and per consumer a fresh ``encode`` and the
store's ``payload_for``, each rebuilt with ``SCDTransferCache.from_payload`` and scored teacher-forced on the
continuation against the consumer's own prefill (the oracle): mean KL(oracle || cache) per token and top-1 agreement
with the oracle, plus KL(fresh || served) and top-1 agreement between the served and the fresh cache. Bytes: the
store's entries, against (a) each consumer's bf16 KV cache of the prompt (what a KV store keeps per model) and (b)
each consumer's SCD payload, cumulated over the first N documents.

    PYTHONPATH=. python benchmarks/scd_code_store.py --out benchmarks/results/scd_code_store
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvcodecs.evaluation import kl_divergence
from hf_kvcodecs.models import load_model
from hf_kvcodecs.scd import SCDFitSettings, SCDKnowledgeBase, SCDTransferCache, encode, fit_knowledge_base
from hf_kvcodecs.scd.code_store import SCDCodeStore
from hf_kvcodecs.scd.encoder_sharing import encoder_fingerprint
from hf_kvcodecs.scd.fit import continuation_logprobs
from hf_kvcodecs.scd.model_access import unwrapped

LICENCES = Path("/usr/share/common-licenses")
PRECISIONS = ("widths", "float16")


def documents(tokenizer, count: int, tokens: int) -> list[tuple[str, torch.Tensor]]:
    """The first ``count`` distinct licences (by name) with at least ``tokens`` token ids, as 1-D id tensors."""
    seen, found = set(), []
    for path in sorted(LICENCES.iterdir()):
        text = path.read_text(errors="replace")
        if text in seen:  # GPL is GPL-3, LGPL is LGPL-3, GFDL is GFDL-1.3
            continue
        seen.add(text)
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        if ids.numel() >= tokens:
            found.append((path.name, ids[:tokens]))
        if len(found) == count:
            return found
    raise SystemExit(f"Only {len(found)} distinct licences under {LICENCES} hold {tokens} tokens; lower --documents "
                     "or --tokens.")


def fit_missing(producer, consumer, directory: Path, encoders_from: Path | None) -> SCDKnowledgeBase:
    from hf_kvcodecs.cli.defaults import CALIBRATION_TEXT
    from hf_kvcodecs.text import load_corpus, tokenize_corpus

    corpus = load_corpus(None, default=CALIBRATION_TEXT)
    ids = tokenize_corpus(producer.tokenizer, corpus)
    settings = SCDFitSettings(encoders_from=None if encoders_from is None else str(encoders_from))
    kb = fit_knowledge_base(producer.model, consumer.model, ids, settings=settings, text_info=corpus,
                            tokenizer=producer.tokenizer, producer_name=producer.description,
                            consumer_name=consumer.description)
    kb.save(directory)
    return SCDKnowledgeBase.load(directory)


def kv_bytes_bf16(cache) -> int:
    return sum(2 * (layer.keys.numel() + layer.values.numel()) for layer in cache.layers)


def score(consumer, cache, context, continuation, oracle) -> tuple[torch.Tensor, float, float]:
    logprobs = continuation_logprobs(consumer, cache, context, continuation)
    kl = float(kl_divergence(oracle, logprobs).mean())
    top1 = float((logprobs.argmax(-1) == oracle.argmax(-1)).float().mean())
    return logprobs, kl, top1


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    producer = load_model("default")
    paths = {"lora": args.consumer_lora, "full": args.consumer_full}
    consumers = {name: load_model(str(path)) for name, path in paths.items()}
    kb_dirs = {"lora": args.kb_lora, "full": args.kb_full}
    kbs = {}
    for name in ("lora", "full"):
        if not (kb_dirs[name] / "scd_knowledge_base.json").exists():
            if not args.fit:
                raise SystemExit(f"{kb_dirs[name]} holds no knowledge base; fit it (see this file's docstring) or "
                                 "pass --fit.")
            kbs[name] = fit_missing(producer, consumers[name], kb_dirs[name],
                                    kb_dirs["lora"] if name == "full" else None)
        else:
            kbs[name] = SCDKnowledgeBase.load(kb_dirs[name])
    fingerprints = {name: encoder_fingerprint(kb) for name, kb in kbs.items()}
    if len(set(fingerprints.values())) != 1:
        raise SystemExit(f"The knowledge bases do not share encoders ({fingerprints}); fit the full fine-tune's with "
                         f"--encoders-from {kb_dirs['lora']}.")
    docs = documents(producer.tokenizer, args.documents, args.tokens + args.continuation)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        stores = {precision: SCDCodeStore(Path(scratch) / precision, precision=precision) for precision in PRECISIONS}
        lora_only = SCDCodeStore(Path(scratch) / "lora_only")
        for name, ids in tqdm(docs, desc="documents"):
            context, continuation = ids[None, :args.tokens], ids[None, args.tokens:]
            prompt = context[:, :-1]  # the cache covers the context but its last token
            row = {"document": name, "prompt_tokens": int(prompt.shape[1]), "consumers": {}}
            for precision, store in stores.items():
                started = time.perf_counter()
                key = store.put(producer.model, prompt, list(kbs.values()))
                row[f"store_{precision}_bytes"] = store.entry_bytes(key)
                row[f"put_{precision}_seconds"] = time.perf_counter() - started
            # the same prompt stored for the first consumer alone: what registering the second one adds
            key = lora_only.put(producer.model, prompt, [kbs["lora"]])
            row["store_widths_lora_only_bytes"] = lora_only.entry_bytes(key)
            for consumer_name, kb in kbs.items():
                model = consumers[consumer_name].model
                oracle_cache = DynamicCache(config=unwrapped(model).config.get_text_config(decoder=True))
                with torch.inference_mode():
                    model(input_ids=prompt, cache=oracle_cache, use_cache=True, logits_to_keep=1)
                    kv_bytes = kv_bytes_bf16(oracle_cache)  # the prompt's cache, before scoring extends it
                    oracle = continuation_logprobs(model, oracle_cache, context, continuation)
                started = time.perf_counter()
                fresh_payload = encode(producer.model, prompt, kb)
                encode_seconds = time.perf_counter() - started
                with torch.inference_mode():
                    fresh_cache = SCDTransferCache.from_payload(fresh_payload, model, kb, input_ids=prompt)
                    fresh, fresh_kl, fresh_top1 = score(model, fresh_cache, context, continuation, oracle)
                entry = {"kv_bf16_bytes": kv_bytes, "payload_bytes": len(fresh_payload),
                         "encode_seconds": encode_seconds, "fresh_kl": fresh_kl, "fresh_top1_vs_oracle": fresh_top1}
                for precision, store in stores.items():
                    started = time.perf_counter()
                    served_payload = store.payload_for(kb, prompt)
                    entry[f"serve_{precision}_seconds"] = time.perf_counter() - started
                    with torch.inference_mode():
                        served_cache = SCDTransferCache.from_payload(served_payload, model, kb, input_ids=prompt)
                        served, kl, top1 = score(model, served_cache, context, continuation, oracle)
                    entry[f"served_{precision}"] = {
                        "payload_bytes": len(served_payload), "kl": kl, "top1_vs_oracle": top1,
                        "kl_fresh_to_served": float(kl_divergence(fresh, served).mean()),
                        "top1_vs_fresh": float((served.argmax(-1) == fresh.argmax(-1)).float().mean()),
                        "payload_identical": served_payload == fresh_payload}
                row["consumers"][consumer_name] = entry
            rows.append(row)
    return summarize(args, producer, paths, kbs, fingerprints, rows)


def summarize(args, producer, paths, kbs, fingerprints, rows) -> dict:
    def mean(values) -> float:
        values = list(values)
        return sum(values) / len(values)

    scaling = []
    for count in range(1, len(rows) + 1):
        first = rows[:count]
        scaling.append({
            "documents": count,
            **{f"store_{precision}_bytes": sum(r[f"store_{precision}_bytes"] for r in first) for precision in PRECISIONS},
            "store_widths_lora_only_bytes": sum(r["store_widths_lora_only_bytes"] for r in first),
            "kv_bf16_lora_bytes": sum(r["consumers"]["lora"]["kv_bf16_bytes"] for r in first),
            "scd_payload_lora_bytes": sum(r["consumers"]["lora"]["payload_bytes"] for r in first),
            "kv_bf16_both_consumers_bytes": sum(c["kv_bf16_bytes"] for r in first for c in r["consumers"].values()),
            "scd_payloads_both_consumers_bytes": sum(c["payload_bytes"] for r in first for c in r["consumers"].values()),
        })
    quality = {}
    for name in kbs:
        entries = [r["consumers"][name] for r in rows]
        quality[name] = {"fresh_kl": mean(e["fresh_kl"] for e in entries),
                         "fresh_top1_vs_oracle": mean(e["fresh_top1_vs_oracle"] for e in entries),
                         "payload_bytes_per_document": mean(e["payload_bytes"] for e in entries)}
        for precision in PRECISIONS:
            served = [e[f"served_{precision}"] for e in entries]
            quality[name][precision] = {
                "kl": mean(s["kl"] for s in served), "top1_vs_oracle": mean(s["top1_vs_oracle"] for s in served),
                "kl_fresh_to_served": mean(s["kl_fresh_to_served"] for s in served),
                "top1_vs_fresh": mean(s["top1_vs_fresh"] for s in served),
                "identical_payloads": sum(s["payload_identical"] for s in served),
                "serve_seconds": mean(e[f"serve_{precision}_seconds"] for e in entries)}
    return {
        "benchmark": "scd_code_store", "producer": producer.description,
        "consumers": {name: {"model": str(paths[name]), "knowledge_base": str(path), "save_id": kbs[name].save_id,
                             "code_format": kbs[name].code_format, "code_bits": kbs[name].code_bits,
                             "bytes_per_coded_token": kbs[name].bytes_per_token(),
                             "fit_kl": kbs[name].fitting.get("kl"),
                             "patch_layers": kbs[name].patch_layers}
                      for name, path in (("lora", args.kb_lora), ("full", args.kb_full))},
        "encoder_fingerprint": fingerprints["lora"], "documents": len(rows), "prompt_tokens": args.tokens - 1,
        "continuation_tokens": args.continuation, "threads": args.threads, "machine": platform.machine(),
        "torch": torch.__version__, "scaling": scaling, "quality": quality, "rows": rows,
    }


def markdown(results: dict) -> str:
    last = results["scaling"][-1]
    n = last["documents"]
    lines = [
        f"# SCD code store: {n} licences of {results['prompt_tokens']} tokens, put once, served to two consumers",
        "",
        f"Producer: {results['producer']}. Consumers: LoRA expert and full fine-tune, knowledge bases with one encoder "
        f"fingerprint (`{results['encoder_fingerprint'][:16]}...`). {results['threads']} thread(s), "
        f"{results['machine']}, torch {results['torch']}.",
        "",
        "| consumer | KB | bytes/coded token |",
        "|---|---|---|",
    ]
    for name, info in results["consumers"].items():
        lines.append(f"| {name} | {info['code_format']} {info['code_bits']}-bit, Patch {info['patch_layers']} | "
                     f"{info['bytes_per_coded_token']:.0f} |")
    lines += ["", "## Bytes for N documents served to both consumers", "",
              "| N | store (widths) | store (float16) | SCD payloads x2 | bf16 KV x2 |", "|---|---|---|---|---|"]
    for row in results["scaling"]:
        lines.append(f"| {row['documents']} | {row['store_widths_bytes'] / 1e6:.2f} MB | "
                     f"{row['store_float16_bytes'] / 1e6:.2f} MB | {row['scd_payloads_both_consumers_bytes'] / 1e6:.2f} MB "
                     f"| {row['kv_bf16_both_consumers_bytes'] / 1e6:.1f} MB |")
    lines += ["", f"Consumers served, at N={n}: one (LoRA) / two (LoRA + full fine-tune).", "",
              "| consumers | store (widths) | SCD payloads | bf16 KV |", "|---|---|---|---|",
              f"| 1 | {last['store_widths_lora_only_bytes'] / 1e6:.2f} MB | {last['scd_payload_lora_bytes'] / 1e6:.2f} MB | "
              f"{last['kv_bf16_lora_bytes'] / 1e6:.1f} MB |",
              f"| 2 | {last['store_widths_bytes'] / 1e6:.2f} MB | {last['scd_payloads_both_consumers_bytes'] / 1e6:.2f} MB "
              f"| {last['kv_bf16_both_consumers_bytes'] / 1e6:.1f} MB |"]
    lines += ["", f"At N={n}: the widths store holds {last['store_widths_bytes'] / last['scd_payloads_both_consumers_bytes']:.2f}x "
              f"the bytes of the two consumers' payloads and {last['store_widths_bytes'] / last['kv_bf16_both_consumers_bytes']:.4f}x "
              "their bf16 KV caches.", "",
              "## Quality: served from the store vs a fresh encode (same run, same documents)", "",
              "Teacher-forced on the next tokens of each document; KL in nats per token from the consumer's own "
              "prefill (oracle).", "",
              "| consumer | source | KL(oracle) | top-1 = oracle | KL(fresh ‖ served) | top-1 = fresh | identical payloads |",
              "|---|---|---|---|---|---|---|"]
    for name, q in results["quality"].items():
        lines.append(f"| {name} | fresh encode | {q['fresh_kl']:.4f} | {q['fresh_top1_vs_oracle']:.3f} | - | - | - |")
        for precision in PRECISIONS:
            s = q[precision]
            lines.append(f"| {name} | store ({precision}) | {s['kl']:.4f} | {s['top1_vs_oracle']:.3f} | "
                         f"{s['kl_fresh_to_served']:.5f} | {s['top1_vs_fresh']:.3f} | {s['identical_payloads']}/{n} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scaling = results["scaling"]
    n = [row["documents"] for row in scaling]
    figure, (axis, by_consumers) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("kv_bf16_both_consumers_bytes", "bf16 KV, per consumer (x2)"),
                       ("scd_payloads_both_consumers_bytes", "SCD payload, per consumer (x2)"),
                       ("store_float16_bytes", "code store, float16 codes"),
                       ("store_widths_bytes", "code store, union widths")):
        axis.plot(n, [row[key] / 1e6 for row in scaling], marker="o", label=label)
    axis.set_yscale("log")
    axis.set_xlabel("documents (1K-token licences)")
    axis.set_ylabel("bytes stored (MB, log)")
    axis.set_title("Serving two consumers of one producer")
    axis.legend(fontsize=8)
    last = scaling[-1]
    for keys, label in ((("kv_bf16_lora_bytes", "kv_bf16_both_consumers_bytes"), "bf16 KV"),
                        (("scd_payload_lora_bytes", "scd_payloads_both_consumers_bytes"), "SCD payloads"),
                        (("store_widths_lora_only_bytes", "store_widths_bytes"), "code store, union widths")):
        by_consumers.plot([1, 2], [last[key] / 1e6 for key in keys], marker="o", label=label)
    by_consumers.set_yscale("log")
    by_consumers.set_xticks([1, 2], ["LoRA", "LoRA + full FT"])
    by_consumers.set_xlabel("consumers served")
    by_consumers.set_ylabel(f"bytes stored for {last['documents']} documents (MB, log)")
    by_consumers.set_title("Adding a consumer")
    by_consumers.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--consumer-lora", type=Path, default=Path("artifacts/expert-python-r64"))
    parser.add_argument("--consumer-full", type=Path, default=Path("artifacts/expert-python-full"))
    parser.add_argument("--kb-lora", type=Path, default=Path("artifacts/kb-store-lora"))
    parser.add_argument("--kb-full", type=Path, default=Path("artifacts/kb-store-full"))
    parser.add_argument("--fit", action="store_true", help="fit a missing knowledge base (minutes per pair)")
    parser.add_argument("--documents", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=1024, help="prompt tokens per document (+1: the last is fed "
                                                                 "again as the first continuation input)")
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/scd_code_store"))
    args = parser.parse_args()
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scd_code_store.json").write_text(json.dumps(results, indent=2))
    text = markdown(results)
    (args.out / "scd_code_store.md").write_text(text)
    plot(results, args.out / "scd_code_store.png")
    print(text)


if __name__ == "__main__":
    main()
