"""How much of a token's values its decoded keys predict, and what that buys the value code (exploration).

For a few layers of the default model: keys and values sampled from calibration text (CPython's docs) and held-out
text (Debian licences), the keys coded by the stored default calibration's 2-bit key codecs (l2, seed 0, keys per
head), then on held-out values, relative MSE of
  * the joint value codec (the default layout) fitted on these samples,
  * a prediction from the decoded keys of all KV heads (ridge least squares with a bias) plus a joint codec of what
    it leaves (the "given_keys" layout),
  * the same with each value head predicted from its own key head only,
at 2 and 1 bits per element (45 and 21 stages). Writes benchmarks/results/value_prediction.{md,json}.

    .venv/bin/python benchmarks/explore_value_prediction.py [--layers 0 8 15 22 29]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_kvcodecs.cache.rope import find_rotary_parameters
from hf_kvcodecs.calibration.collect import collect_kv_samples
from hf_kvcodecs.calibration.store import ensure_codebooks
from hf_kvcodecs.codecs.conditional import ridge_regression
from hf_kvcodecs.codecs.joint import fit_joint_head_residual_vq
from hf_kvcodecs.codecs.residual import relative_mse
from hf_kvcodecs.models import load_model
from hf_kvcodecs.text import CALIBRATION_DEFAULT, EVALUATION_DEFAULT, load_corpus, tokenize_corpus

RESULTS = Path(__file__).resolve().parent / "results"
FIT = dict(group_dim=8, codebook_bits=8, learner="l2", weighted=True, transform="pca", n_iter=12, fit_rows=8192)
RATES = ((2, 45), (1, 21))  # bits per element, joint value stages (3 heads of 64, 8-bit scales)


def predict(sources: torch.Tensor, solution: torch.Tensor) -> torch.Tensor:
    return torch.cat([sources, torch.ones(sources.shape[0], 1)], 1) @ solution


def fit_prediction(sources: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ridge_regression(torch.cat([sources, torch.ones(sources.shape[0], 1)], 1), targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 8, 15, 22, 29])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    loaded = load_model()
    codebooks, directory, _ = ensure_codebooks(loaded, learner="l2", bits=2.0, seed=0, progress=True)
    key_codecs = codebooks.codecs_at("keys", codebooks.stages_for_bits(2.0, "keys"))
    rope = find_rotary_parameters(loaded.model)
    calibration = load_corpus(None, default=CALIBRATION_DEFAULT)
    evaluation = load_corpus(None, default=EVALUATION_DEFAULT)
    train = collect_kv_samples(loaded.model, tokenize_corpus(loaded.tokenizer, calibration)[: 16 * 512], num_windows=16,
                               rope=rope, seed=0, description="calibration samples")
    test = collect_kv_samples(loaded.model, tokenize_corpus(loaded.tokenizer, evaluation)[: 8 * 512], num_windows=8,
                              rope=rope, seed=1, description="held-out samples")
    rows = []
    for layer in args.layers:
        values, test_values = train.values[layer], test.values[layer]
        heads, tokens, dim = values.shape
        flat = lambda x: x.float().permute(1, 0, 2).reshape(x.shape[1], -1)  # noqa: E731
        split = lambda x: x.reshape(-1, heads, dim).permute(1, 0, 2).contiguous()  # noqa: E731
        keys = key_codecs[layer].reconstruct(train.keys_pre_rope[layer])
        test_keys = key_codecs[layer].reconstruct(test.keys_pre_rope[layer])
        all_heads = fit_prediction(flat(keys), flat(values))
        predicted = split(predict(flat(test_keys), all_heads))
        train_residual = split(flat(values) - predict(flat(keys), all_heads))
        own_head = [fit_prediction(keys[h], values[h]) for h in range(heads)]
        own_predicted = torch.stack([predict(test_keys[h], own_head[h]) for h in range(heads)])
        own_residual = torch.stack([values[h] - predict(keys[h], own_head[h]) for h in range(heads)])
        seed = 2 * layer + 1
        codecs = {
            "joint values": (fit_joint_head_residual_vq(values, max_stages=45, seed=seed, **FIT), 0),
            "given all key heads": (fit_joint_head_residual_vq(train_residual, max_stages=45, seed=seed, **FIT), predicted),
            "given own key head": (fit_joint_head_residual_vq(own_residual, max_stages=45, seed=seed, **FIT), own_predicted),
        }
        row = {"layer": layer, "energy_left_by_prediction": {
            "all key heads": relative_mse(test_values, predicted), "own key head": relative_mse(test_values, own_predicted)}}
        for bits, stages in RATES:
            for name, (codec, prediction) in codecs.items():
                decoded = prediction + codec.truncated(stages).reconstruct((test_values - prediction).contiguous())
                row[f"{name}, {bits} bit"] = relative_mse(test_values, decoded)
        rows.append(row)
        print(json.dumps(row), flush=True)
    results = {
        "model": loaded.description, "key_codebooks": str(directory), "calibration_text": calibration.description,
        "evaluation_text": evaluation.description, "train_samples": int(train.values[0].shape[1]),
        "test_samples": int(test.values[0].shape[1]), "seconds": round(time.perf_counter() - started, 1), "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "value_prediction.json").write_text(json.dumps(results, indent=2))
    names = [f"{name}, {bits} bit" for bits, _ in RATES for name in ("joint values", "given all key heads", "given own key head")]
    lines = [
        "# Values predicted from the same token's decoded keys (`benchmarks/explore_value_prediction.py`)", "",
        f"- Model: {results['model']}; keys coded by {directory.name} at 2 bits (per head)",
        f"- Fit on {results['train_samples']} tokens per layer of {results['calibration_text']}; held out: "
        f"{results['test_samples']} tokens of {results['evaluation_text']}",
        f"- Held-out relative MSE of the values; {results['seconds']:.0f} s", "",
        "| layer | energy left, all key heads | energy left, own key head | " + " | ".join(names) + " |",
        "|---" * (3 + len(names)) + "|",
    ]
    for row in rows:
        left = row["energy_left_by_prediction"]
        lines.append(f"| {row['layer']} | {left['all key heads']:.3f} | {left['own key head']:.3f} | "
                     + " | ".join(f"{row[name]:.4f}" for name in names) + " |")
    (RESULTS / "value_prediction.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
