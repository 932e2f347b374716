"""Equal-bytes sweep of SCD code formats on one (producer, consumer) pair: the fit's statistics, maps and held-out
KL judge (as `hf-kvcodecs scd fit` builds them), then at each rank knob tau and flat precision the KL to the oracle of
the flat plan and of its whitened re-coding at the same bytes (with and without the per-token gain byte).

    .venv/bin/python benchmarks/results/scd_code_format/sweep_equal_bytes.py --producer artifacts/draft-w3g32 \
        --consumer default --windows 12 --out benchmarks/results/scd_code_format/sweep.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from hf_kvcodecs.cli._common import load_model
from hf_kvcodecs.cli.defaults import CALIBRATION_TEXT
from hf_kvcodecs.scd.coding import whiten_plan
from hf_kvcodecs.scd.fit import (
    BudgetJudge,
    SCDFitSettings,
    _fit_maps,
    _Prompt,
    accumulate_pair_moments,
    continuation_logprobs,
    plan_for,
)
from hf_kvcodecs.scd.knowledge_base import SCDKnowledgeBase, plan_bytes_per_token
from hf_kvcodecs.scd.model_access import prefill_with_taps, unwrapped
from hf_kvcodecs.text import load_corpus, tokenize_corpus


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--producer", default="artifacts/draft-w3g32")
    parser.add_argument("--consumer", default="default")
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--taus", type=float, nargs="+", default=[0.002, 0.01, 0.03, 0.1])
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    settings = SCDFitSettings(windows=args.windows, max_patch_layers=0)
    corpus = load_corpus(None, default=CALIBRATION_TEXT)
    producer = load_model(argparse.Namespace(model=args.producer, threads=1))
    consumer = producer if args.consumer == args.producer else load_model(argparse.Namespace(model=args.consumer,
                                                                                             threads=1))
    ids = tokenize_corpus(producer.tokenizer, corpus)
    # the statistics windows and held-out prompts exactly as fit_knowledge_base cuts them
    prompt_tokens = settings.holdout_context + settings.holdout_continuation
    holdout_tokens = settings.holdout_prompts * prompt_tokens
    statistics_ids, holdout_ids = ids[:-holdout_tokens], ids[-holdout_tokens:]
    count = min(settings.windows, statistics_ids.numel() // settings.window_tokens)
    stride = statistics_ids.numel() // count
    windows = [statistics_ids[i * stride: i * stride + settings.window_tokens] for i in range(count)]
    moments = accumulate_pair_moments(producer.model, consumer.model, windows, skip_first=settings.exact_tokens,
                                      progress=False)
    maps, curves = _fit_maps(moments, settings)
    layers = len(maps["keys"])
    prompts = []
    for index in range(settings.holdout_prompts):
        window = holdout_ids[index * prompt_tokens:(index + 1) * prompt_tokens][None]
        context, continuation = window[:, :settings.holdout_context], window[:, settings.holdout_context:]
        captures = []
        prefill_with_taps(producer.model, context[:, :-1], None, captures.append, all_residuals=True)
        oracle = DynamicCache(config=unwrapped(consumer.model).config.get_text_config(decoder=True))
        with torch.inference_mode():
            consumer.model(input_ids=context[:, :-1], cache=oracle, use_cache=True, logits_to_keep=1)
            reference = continuation_logprobs(consumer.model, oracle, context, continuation)
        prompts.append(_Prompt(context, continuation, captures, reference))
    working = SCDKnowledgeBase([], {i: maps["keys"][i] for i in range(layers)},
                               {i: maps["values"][i] for i in range(layers)}, {}, 8, settings.exact_tokens, {}, {},
                               None, residuals={i: maps["residuals"][i] for i in range(layers)})
    judge = BudgetJudge(consumer.model, working, prompts)
    prepared = time.perf_counter() - started
    rows = []
    for bits in args.bits:
        for tau in args.taus:
            flat = plan_for(tau, {}, curves)
            variants = {"flat": flat, "whitened": whiten_plan(flat, working, bits, False),
                        "whitened+gain": whiten_plan(flat, working, bits, True)}
            for name, plan in variants.items():
                measured = time.perf_counter()
                kl = judge.kl(plan, bits)
                rows.append({"bits": bits, "tau": tau, "format": name, "kl": kl,
                             "bytes_per_token": plan_bytes_per_token(plan, bits),
                             "components": sum(layer.components() for layer in plan),
                             "seconds": time.perf_counter() - measured})
                print(json.dumps(rows[-1]), flush=True)
    result = {"producer": producer.description, "consumer": consumer.description, "calibration_text":
              corpus.description, "windows": len(windows), "statistics_tokens": moments.tokens,
              "holdout_prompts": settings.holdout_prompts, "holdout_context": settings.holdout_context,
              "holdout_continuation": settings.holdout_continuation, "exact_tokens": settings.exact_tokens,
              "prepare_seconds": prepared, "seconds": time.perf_counter() - started, "threads": 1,
              "torch": torch.__version__, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
