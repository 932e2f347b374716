"""`hf-kvcodecs bench kv`: GSRQ (GSKM and l2 k-means codebooks) against the caches transformers ships, side by side."""

from __future__ import annotations

import logging
from pathlib import Path

from ..cache import GSRQCache
from ..codecs.kmeans import DEFAULT_LEARNER
from ..calibration.store import ensure_codebooks
from ..models import LoadedModel
from ..text import EVALUATION_DEFAULT, load_corpus, tokenize_corpus
from .harness import CacheMethod, evaluate_methods, shipped_baselines
from .report import write_reports

logger = logging.getLogger(__name__)

GSRQ_RATES = (1.0, 2.0)  # bits per KV element, fp16 scales included
GSRQ_LEARNERS = {DEFAULT_LEARNER: "gsrq", "l2": "l2-rvq"}  # learner -> family label in reports

# Full-run and quick-run measurement settings (quick: a smoke test of the whole pipeline in a few minutes).
FULL = dict(context_len=1024, continuation_len=64, n_windows=4, greedy_prompts=2, greedy_tokens=32, passkey_trials=2,
            passkey_lengths=(512, 1024, 2048), speed_contexts=(1024, 4096), speed_tokens=32, speed_repeats=3)
QUICK = dict(context_len=256, continuation_len=16, n_windows=1, greedy_prompts=1, greedy_tokens=8, passkey_trials=1,
             passkey_lengths=(256,), passkey_depths=(0.5,), speed_contexts=(256,), speed_tokens=4, speed_repeats=1)
QUICK_CALIBRATION = dict(num_windows=4, holdout_windows=1, n_iter=4, fit_rows=2048)


def gsrq_methods(loaded: LoadedModel, *, rates=GSRQ_RATES, learners=tuple(GSRQ_LEARNERS), text=None, store=None,
                 window_length: int = 32, flush_interval: int = 32, num_sink_tokens: int = 4,
                 calibration: dict | None = None, progress: bool = True) -> list[CacheMethod]:
    """One calibration per learner at the highest rate (lower rates are prefixes), one method per (learner, rate)."""
    methods = []
    for learner in learners:
        codebooks, directory, reused = ensure_codebooks(
            loaded, store=store, text=text, progress=progress, learner=learner, bits=max(rates), **(calibration or {})
        )
        for bits in rates:
            cache_settings = dict(codebooks=codebooks, bits=bits, window_length=window_length,
                                  flush_interval=flush_interval, num_sink_tokens=num_sink_tokens)
            label = f"GSRQ ({learner} codebooks)" if learner.startswith("gskm") else "same codec, l2 k-means codebooks"
            methods.append(CacheMethod(
                name=f"{label} {bits:g}-bit",
                make_cache=lambda model, s=cache_settings: GSRQCache(model.config, **s),
                family=GSRQ_LEARNERS.get(learner, learner),
                nominal_bits=bits,
                extra={
                    "learner": learner, "bits": bits, "window_length": window_length, "flush_interval": flush_interval,
                    "num_sink_tokens": num_sink_tokens, "codebooks": str(directory),
                    "calibration_seconds": round(codebooks.calibration["seconds_total"], 1),
                    "calibration_reused": reused, "calibration_text": codebooks.calibration["text"]["description"],
                    "holdout_relative_mse": codebooks.calibration["holdout_mean"] if bits == max(rates) else None,
                },
            ))
    return methods


def run_kv_benchmark(loaded: LoadedModel, *, out: str | Path, text=None, calibration_text=None, quick: bool = False,
                     store=None, progress: bool = True) -> dict:
    corpus = load_corpus(text, default=EVALUATION_DEFAULT)
    token_ids = tokenize_corpus(loaded.tokenizer, corpus)
    methods = shipped_baselines(loaded.model) + gsrq_methods(
        loaded, text=calibration_text, store=store, progress=progress,
        calibration=QUICK_CALIBRATION if quick else None,
    )
    results = evaluate_methods(
        loaded.model, loaded.tokenizer, methods, eval_token_ids=token_ids, eval_description=corpus.description,
        model_description=loaded.description, progress=progress, **(QUICK if quick else FULL),
    )
    results["command"] = "hf-kvcodecs bench kv" + (" --quick" if quick else "") + f" --model {loaded.name}"
    results["files"] = {name: str(path) for name, path in write_reports(results, out).items()}
    return results
