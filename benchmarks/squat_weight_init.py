"""Weight-grid initialisations before any training: round-to-nearest perplexity of the default model at W2/W3/W4,
groups of 64, for each ``weight_init`` (min-max, MSE-clipped, ParetoQ's stretched grid), paired per window with the
float model on held-out Debian licence text. It shows where a QAT run starts.

    python benchmarks/squat_weight_init.py --threads 2 --windows 4 --out benchmarks/results/squat_weight_init.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from hf_kvcodecs.cli.defaults import EVALUATION_TEXT
from hf_kvcodecs.evaluation import fixed_windows
from hf_kvcodecs.models import load_model
from hf_kvcodecs.quantization import KVCodecsConfig, quantize_model
from hf_kvcodecs.text import load_corpus, tokenize_corpus
from hf_kvcodecs.training.run import evaluation_row, paired_scores

GRIDS = (("minmax", False), ("mse", False), ("stretched", True), ("mse", True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--windows", type=int, default=4, help="evaluation windows of 1024 tokens")
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/squat_weight_init.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("default")
    teacher = loaded.model.eval()
    evaluation = load_corpus(None, default=EVALUATION_TEXT)
    windows = fixed_windows(tokenize_corpus(loaded.tokenizer, evaluation), args.windows, 1024)
    fp_nlls, _ = paired_scores(teacher, None, windows, False)
    rows = []
    for bits in args.bits:
        for weight_init, symmetric in GRIDS:
            started = time.perf_counter()
            config = KVCodecsConfig(weight_bits=bits, group_size=64, mode="fake", symmetric=symmetric,
                                    weight_init=weight_init)
            student = quantize_model(copy.deepcopy(teacher), config).eval()
            row = evaluation_row(*paired_scores(student, teacher, windows, False), fp_nlls)
            row.update(bits=bits, weight_init=weight_init, symmetric=symmetric,
                       seconds=time.perf_counter() - started)
            rows.append(row)
            print(f"W{bits} g64 {weight_init:9s} symmetric={symmetric!s:5s} ppl {row['perplexity']:12.3f} "
                  f"Δ {row['delta_ppl_pct']:+10.1f} % ± {row['delta_ppl_pct_se']:.1f}  KL {row['kl_mean']:.3f}",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": loaded.description, "eval_text": evaluation.description,
                                    "windows": args.windows, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
