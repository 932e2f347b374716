"""Exploration (not a shipped codec): does coding the keys with per-head codebooks, or each KV head conditionally on
the heads before it, close the quality gap to the joint-head key codec without its decode cost?

Four key codecs at 2 bits per element, the same jointly coded values (the default calibration's) in all of them, on
``bench kv``'s teacher-forced protocol (fp32 DynamicCache reference, held-out licence texts):

* ``per-head keys`` — ``--key-layout per_head`` (the default until 2026-12-03): one PCA per head, residual codebooks
  shared by the heads;
* ``joint keys`` — ``hf-kvcodecs calibrate --key-layout joint_heads``: one code over the three heads (3x the stages,
  every key rebuilt from 3x the codebook rows on the CPU code path);
* ``per-head keys, own codebooks`` — each head fitted on its own (its own PCA and codebooks; the CPU code path reads
  keys from per-head folded tables already, so this would cost decoding nothing);
* ``conditional keys`` — head 0 as above; head h coded as the residual of a least-squares linear prediction from the
  *decoded* keys of heads 0..h-1 (closed loop: the decoder forms the same prediction), same stages per head. On the CPU
  code path this would add a 64x(64h) matrix-vector product per token to the key loop (the prediction does not commute
  with RoPE, so it cannot move to the query side).

Own codebooks per head became the default key layout on 2026-12-03 (``per_head_codebooks``). Conditional keys have
since become a layout of the cache (``hf-kvcodecs calibrate --key-layout conditional_heads``,
:mod:`hf_kvcodecs.codecs.conditional`, with ridge-regularized predictors and a code-reading CPU loop); this script
keeps its own plain least-squares version, which produced ``benchmarks/results/key_codebooks.md``.

The last two are built here from the default calibration's own samples (same windows, seeds and fit settings) and
decoded through the dequantize path; the first two go through the same path. Also reported: the keys' held-out relative
MSE over all layers (the calibration's held-out windows).

    .venv/bin/python benchmarks/explore_key_codebooks.py --seeds 0 1      # ~25 min per seed on a 2-core CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hf_kvcodecs.bench.harness import CacheMethod, evaluate_methods, full_precision_method
from hf_kvcodecs.cache import GSRQCache
from hf_kvcodecs.cache.rope import find_rotary_parameters
from hf_kvcodecs.calibration.collect import collect_kv_samples
from hf_kvcodecs.calibration.store import calibration_defaults, ensure_codebooks
from hf_kvcodecs.codecs.residual import fit_transform_residual_vq, relative_mse
from hf_kvcodecs.models import load_model
from hf_kvcodecs.text import CALIBRATION_DEFAULT, EVALUATION_DEFAULT, load_corpus, tokenize_corpus

BITS = 2.0


class HeadwiseKeyCodec:
    """One single-head codec per KV head; with ``predictors[h]`` (``[h*D, D]``), head h codes ``k_h - [k^_0..k^_h-1] @ P``.

    Implements what ``GSRQCache``'s dequantize path asks of a key codec; nothing else (no code-reading attention, no
    serialization)."""

    def __init__(self, head_codecs, predictors):
        self.head_codecs, self.predictors = head_codecs, predictors
        self.num_heads = self.code_heads = len(head_codecs)
        self.head_dim = head_codecs[0].head_dim
        self.num_stages = head_codecs[0].num_stages
        self.scale_dtype = head_codecs[0].scale_dtype
        self.mean = head_codecs[0].mean

    def to(self, device=None, dtype=None):
        if device is not None and torch.device(device) != self.mean.device:
            raise ValueError("this exploratory codec runs on CPU only")
        return self

    def truncated(self, num_stages):
        if num_stages != self.num_stages:
            raise ValueError(f"built for {self.num_stages} stages, asked for {num_stages}")
        return self

    def bits_per_element(self):
        return self.head_codecs[0].bits_per_element()

    def _prediction(self, head, decoded):
        if self.predictors[head] is None:
            return 0.0
        return torch.cat(decoded, -1) @ self.predictors[head]

    def encode(self, x, gain="norm", beam_width=8):
        codes, scales, decoded = [], [], []
        for head, codec in enumerate(self.head_codecs):
            prediction = self._prediction(head, decoded)
            head_codes, head_scales = codec.encode((x[head].float() - prediction)[None], gain=gain, beam_width=beam_width)
            decoded.append(prediction + codec.decode(head_codes, head_scales)[0])
            codes.append(head_codes[0])
            scales.append(head_scales[0])
        return torch.stack(codes), torch.stack(scales)

    def decode(self, codes, scales, dtype=torch.float32):
        decoded = []
        for head, codec in enumerate(self.head_codecs):
            prediction = self._prediction(head, decoded)
            decoded.append(prediction + codec.decode(codes[head : head + 1], scales[head : head + 1])[0])
        return torch.stack(decoded).to(dtype)

    def reconstruct(self, x, gain="norm", beam_width=8):
        return self.decode(*self.encode(x, gain=gain, beam_width=beam_width))


def fit_headwise(keys, stages, fit_settings, layer_seed, conditional: bool) -> HeadwiseKeyCodec:
    codecs, predictors, decoded = [], [], []
    for head in range(keys.shape[0]):
        target, predictor = keys[head], None
        if conditional and head > 0:
            sources = torch.cat(decoded, -1)
            predictor = torch.linalg.lstsq(sources.double(), keys[head].double()).solution.float()
            target = keys[head] - sources @ predictor
        codec = fit_transform_residual_vq(target[None], max_stages=stages, seed=layer_seed + 1000 * head, **fit_settings)
        codecs.append(codec)
        predictors.append(predictor)
        decoded.append((0.0 if predictor is None else sources @ predictor) + codec.reconstruct(target[None])[0])
    return HeadwiseKeyCodec(codecs, predictors)


def run_seed(loaded, seed: int, passkey_trials: int, progress: bool) -> dict:
    # keys per head with codebooks shared by the heads (the default layout until own codebooks per head replaced it)
    per_head, _, _ = ensure_codebooks(loaded, seed=seed, key_layout="per_head", progress=progress)
    joint, _, _ = ensure_codebooks(loaded, seed=seed, key_layout="joint_heads", progress=progress)
    defaults = calibration_defaults()  # what the default calibration above was fitted with
    window, sampled, windows, holdout = (defaults[name] for name in
                                         ("window_tokens", "sampled_tokens_per_window", "num_windows", "holdout_windows"))
    fit_settings = dict(n_iter=defaults["n_iter"], fit_rows=defaults["fit_rows"])
    model = loaded.model
    rope = find_rotary_parameters(model)
    token_ids = tokenize_corpus(loaded.tokenizer, load_corpus(None, default=CALIBRATION_DEFAULT))
    train = collect_kv_samples(model, token_ids[: windows * window], window_tokens=window, sampled_tokens_per_window=sampled,
                               num_windows=windows, rope=rope, seed=seed, progress=progress)
    test = collect_kv_samples(model, token_ids[windows * window : (windows + holdout) * window], window_tokens=window,
                              sampled_tokens_per_window=sampled, num_windows=holdout, rope=rope, seed=seed + 1,
                              progress=progress)
    stages = per_head.stages_for_bits(BITS, "keys")
    started = time.perf_counter()
    own, conditional = [], []
    for layer, keys in enumerate(tqdm(train.keys_pre_rope, desc="fitting per-head / conditional key codecs",
                                      disable=not progress)):
        own.append(fit_headwise(keys, stages, fit_settings, seed + 2 * layer, conditional=False))
        conditional.append(fit_headwise(keys, stages, fit_settings, seed + 2 * layer, conditional=True))
    fit_seconds = time.perf_counter() - started
    variants = {
        "per-head keys": (per_head, per_head.codecs_at("keys", stages)),
        "joint keys": (joint, joint.codecs_at("keys", joint.stages_for_bits(BITS, "keys"))),
        "per-head keys, own codebooks": (dataclasses.replace(per_head, key_codecs=own), own),
        "conditional keys": (dataclasses.replace(per_head, key_codecs=conditional), conditional),
    }
    key_mse = {}
    for name, (_, codecs) in variants.items():
        errors = [relative_mse(test.keys_pre_rope[layer], codec.reconstruct(test.keys_pre_rope[layer]))
                  for layer, codec in enumerate(codecs)]
        key_mse[name] = sum(errors) / len(errors)

    def method(name, codebooks):
        return CacheMethod(name, lambda m: GSRQCache(m.config, codebooks=codebooks, bits=BITS, attention="dequantize"),
                           "gsrq", BITS)

    evaluation = load_corpus(None, default=EVALUATION_DEFAULT)
    results = evaluate_methods(
        model, loaded.tokenizer,
        [full_precision_method(model)] + [method(name, codebooks) for name, (codebooks, _) in variants.items()],
        eval_token_ids=tokenize_corpus(loaded.tokenizer, evaluation), eval_description=evaluation.description,
        greedy_prompts=0, passkey_trials=passkey_trials, speed_contexts=(), progress=progress,
    )
    rows = []
    for entry in results["methods"][1:]:
        quality = entry["perplexity"]
        rows.append({"seed": seed, "method": entry["name"], "kl": quality["kl_mean"], "delta_ppl_pct": quality["delta_ppl_pct"],
                     "delta_ppl_pct_se": quality["delta_ppl_pct_se"], "top1": quality["top1_agreement"],
                     "passkey": entry.get("passkey"), "key_relative_mse": key_mse[entry["name"]]})
    return {"seed": seed, "rows": rows, "fit_seconds": fit_seconds, "evaluation_text": evaluation.description}


def markdown(runs: list[dict]) -> str:
    lines = ["| seed | keys | held-out key rel. MSE | KL | Δppl % ± se | top-1 | pass key |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        for row in run["rows"]:
            passkey = row["passkey"]
            cell = f"{passkey['accuracy']:.2f} ({passkey['correct']}/{passkey['trials']})" if isinstance(passkey, dict) and "accuracy" in passkey else "-"
            lines.append(f"| {row['seed']} | {row['method']} | {row['key_relative_mse']:.4f} | {row['kl']:.4f} | "
                         f"{row['delta_ppl_pct']:+.2f} ± {row['delta_ppl_pct_se']:.2f} | {row['top1']:.3f} | {cell} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--passkey-trials", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(loaded, seed, args.passkey_trials, progress=True))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "key_codebooks.json").write_text(json.dumps(runs, indent=1, default=str))
        (args.out / "key_codebooks.md").write_text(markdown(runs))
        print(markdown(runs), flush=True)


if __name__ == "__main__":
    main()
