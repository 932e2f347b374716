"""GSRQ 2-bit calibrated on one kind of text (CPython's documentation) against the mixed calibration text, measured on
kinds of text neither calibration includes, beside quanto 4-bit and fp32 DynamicCache in the same run.

The mixed text (``hf_kvcodecs.text.MIXED``) interleaves reference prose (CPython's ``pydoc_data.topics``), source code
(CPython's standard library) and legal text (Debian packages' copyright files). The held-out kinds
(``hf_kvcodecs.text.HELD_OUT_KINDS``) are Debian changelogs, C headers and manual pages in roff. For every held-out
kind the harness of ``bench kv`` (``hf_kvcodecs.bench.harness.evaluate_methods``) measures teacher-forced KL and
perplexity over windows of that text and the pass key in haystacks of that text; per kind the report gives each
method's KL as a multiple of quanto 4-bit's and its pass keys against quanto's, the issue's target being KL within
1.5x quanto 4-bit's and no fewer pass keys.

    python benchmarks/gsrq_mixed_calibration.py --threads 1 --windows 4 --passkey-trials 2 \
        --out benchmarks/results/gsrq_mixed_calibration
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path

import torch

from hf_kvcodecs.bench.harness import evaluate_methods, full_precision_method, shipped_baselines
from hf_kvcodecs.bench.kv import codec_layout, gsrq_methods
from hf_kvcodecs.models import load_model
from hf_kvcodecs.text import HELD_OUT_KINDS, MIXED, load_corpus, tokenize_corpus

LAYOUTS = {"default": (None,), "conditional": ("conditional_heads",)}
BASELINE = "quanto-4"
TARGET_KL_RATIO = 1.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calibrations", nargs="+", default=["python-docs", MIXED])
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["default", "conditional"],
                        help="key layouts of the GSRQ rows; 'conditional' is calibrated on the last calibration only")
    parser.add_argument("--kinds", nargs="+", default=list(HELD_OUT_KINDS), help="held-out evaluation texts")
    parser.add_argument("--bits", type=float, default=2.0)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--passkey-trials", type=int, default=2)
    parser.add_argument("--store", type=Path, default=None, help="codebook store (default: the library's)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild summary.{json,md} from the kinds' result files in --out, measuring nothing")
    args = parser.parse_args()
    if args.report_only:
        summary = json.loads((args.out / "summary.json").read_text())
        for kind in summary["kinds"]:
            results = json.loads((args.out / f"{kind}.json").read_text())
            summary["kinds"][kind] = kind_summary(results, summary["kinds"][kind]["text"])
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        (args.out / "summary.md").write_text(summary_markdown(summary))
        print((args.out / "summary.md").read_text())
        return
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)

    loaded = load_model("default")
    methods = [full_precision_method(loaded.model),
               *[m for m in shipped_baselines(loaded.model, only=[BASELINE]) if m.family != "full precision"]]
    for calibration in args.calibrations:
        for layout_name in args.layouts:
            if layout_name != "default" and calibration != args.calibrations[-1]:
                continue
            layout = codec_layout(*LAYOUTS[layout_name])
            for method in gsrq_methods(loaded, rates=(args.bits,), learners=("l2",), seeds=(0,), text=calibration,
                                       store=args.store, layout=layout):
                methods.append(dataclasses.replace(
                    method, name=f"GSRQ {args.bits:g}-bit{layout[0] or ', default layout'}, calibrated on {calibration}"))

    summary = {"command": "python benchmarks/gsrq_mixed_calibration.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if v is not None and not isinstance(v, bool)),
               "calibrations": {m.name: m.extra.get("calibration_text") for m in methods if m.family not in
                                ("full precision", "transformers QuantizedCache")},
               "kinds": {}}
    for kind in args.kinds:
        corpus = load_corpus(kind, default=kind)
        results = evaluate_methods(loaded.model, loaded.tokenizer, methods,
                                   eval_token_ids=tokenize_corpus(loaded.tokenizer, corpus),
                                   eval_description=corpus.description, n_windows=args.windows,
                                   passkey_trials=args.passkey_trials, greedy_prompts=0, speed_contexts=())
        (args.out / f"{kind}.json").write_text(json.dumps(results, indent=1, default=str))
        summary["kinds"][kind] = kind_summary(results, corpus.description)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        (args.out / "summary.md").write_text(summary_markdown(summary))
    print((args.out / "summary.md").read_text())


def kind_summary(results: dict, description: str) -> dict:
    entries = {entry["name"]: entry for entry in results["methods"]}
    baseline = next(entry for entry in results["methods"] if entry["name"].startswith("quanto 4-bit"))
    rows = {}
    for name, entry in entries.items():
        if entry.get("error"):
            rows[name] = {"error": entry["error"]}
            continue
        perplexity = entry["perplexity"]
        passkey = entry.get("passkey") or {"correct": 0, "trials": 0}
        windows = list(zip(perplexity["window_kl"], baseline["perplexity"]["window_kl"]))
        rows[name] = {
            "kl": perplexity["kl_mean"], "delta_ppl_pct": perplexity["delta_ppl_pct"],
            "delta_ppl_pct_se": perplexity["delta_ppl_pct_se"],
            "kl_ratio_to_quanto_4": perplexity["kl_mean"] / baseline["perplexity"]["kl_mean"]
            if baseline["perplexity"]["kl_mean"] else None,
            "windows_kl_above_quanto_4": sum(a > b for a, b in windows), "windows": len(windows),
            "passkey": passkey["correct"], "passkey_trials": passkey["trials"],
        }
        if entry["family"] not in ("full precision", "transformers QuantizedCache"):
            rows[name]["meets_target"] = bool(rows[name]["kl_ratio_to_quanto_4"] is not None
                                              and rows[name]["kl_ratio_to_quanto_4"] <= TARGET_KL_RATIO
                                              and passkey["correct"] >= (baseline.get("passkey") or passkey)["correct"])
    return {"text": description, "rows": rows, "calibration_pairs": calibration_pairs(results)}


def calibration_pairs(results: dict) -> list[dict]:
    """GSRQ rows of one layout calibrated on different texts, paired per window: the later calibration's KL minus the
    first one's, its mean and standard error over windows."""
    rows = [entry for entry in results["methods"] if ", calibrated on " in entry["name"] and not entry.get("error")]
    pairs = []
    for index, first in enumerate(rows):
        for second in rows[index + 1:]:
            if first["name"].split(", calibrated on ")[0] != second["name"].split(", calibrated on ")[0]:
                continue
            differences = [b - a for a, b in zip(first["perplexity"]["window_kl"], second["perplexity"]["window_kl"])]
            se = statistics.stdev(differences) / math.sqrt(len(differences)) if len(differences) > 1 else None
            pairs.append({"first": first["name"], "second": second["name"], "kl_difference": statistics.mean(differences),
                          "se": se, "beyond_2_se": se is not None and abs(statistics.mean(differences)) > 2 * se})
    return pairs


def summary_markdown(summary: dict) -> str:
    lines = ["# GSRQ calibration text against held-out kinds of text", "", f"`{summary['command']}`", "",
             f"Target: KL within {TARGET_KL_RATIO}x quanto 4-bit's and no fewer pass keys, on each held-out kind.", ""]
    for kind, found in summary["kinds"].items():
        lines += [f"## {kind}", "", found["text"], "",
                  "| cache | KL | KL / quanto 4-bit | windows above quanto | Δppl % ± se | pass key | target |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for name, row in found["rows"].items():
            if "error" in row:
                lines.append(f"| {name} | error: {row['error']} | | | | | |")
                continue
            ratio = row["kl_ratio_to_quanto_4"]
            lines.append(f"| {name} | {row['kl']:.4f} | {'' if ratio is None else f'{ratio:.2f}'} | "
                         f"{row['windows_kl_above_quanto_4']}/{row['windows']} | {row['delta_ppl_pct']:+.2f} ± "
                         f"{row['delta_ppl_pct_se'] or 0:.2f} | {row['passkey']}/{row['passkey_trials']} | "
                         f"{'' if 'meets_target' not in row else ('met' if row['meets_target'] else 'missed')} |")
        for pair in found.get("calibration_pairs", []):
            se = "" if pair["se"] is None else f" ± {pair['se']:.4f}"
            lines.append(f"- KL of *{pair['second']}* minus *{pair['first']}*, paired per window: "
                         f"{pair['kl_difference']:+.4f}{se} (beyond 2 se: {pair['beyond_2_se']})")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
