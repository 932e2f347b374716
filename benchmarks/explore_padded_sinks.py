"""Exploration: what exact sinks are worth to a left-padded row of a batch.

``generate()`` left-pads the shorter prompts of a batch. Until 2026-12-01 the GSRQ cache counted its exact sink slots
in cache positions, so a padded row kept pad tokens (masked out) in them and coded its own first tokens; now the sink
region grows by the longest left padding (read from the position ids), so every row keeps its first real tokens exact.
This script measures both on the default model with ``bench kv``'s teacher-forced protocol, batched for real:

* each of the evaluation windows becomes a batch of two rows, the full 1024-token context and the same context
  without its first ``--padding`` tokens, left-padded to the same length; both rows are then fed the same 64-token
  continuation one token per step (attention mask and position ids as ``generate()`` builds them);
* the padded row's next-token distributions are compared with an fp32 ``DynamicCache`` run of that shorter prompt
  alone (KL, top-1, Δppl), for the fp32 cache batched (checks the harness: must be ~0), GSRQ alone, GSRQ batched, and
  GSRQ batched with the sink slots counted in cache positions (the earlier behaviour, emulated by reporting no
  padding to the cache).

    .venv/bin/python benchmarks/explore_padded_sinks.py           # ~10 min on a 2-core CPU with stored codebooks
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from unittest import mock

import torch
from tqdm import tqdm
from transformers import DynamicCache

from hf_kvcodecs.bench.harness import _evaluation_windows
from hf_kvcodecs.bench.kv import BENCH_CACHE_SETTINGS
from hf_kvcodecs.cache import GSRQCache, gsrq as gsrq_module
from hf_kvcodecs.calibration.store import ensure_codebooks
from hf_kvcodecs.integrations.attention import enable_code_attention
from hf_kvcodecs.models import load_model
from hf_kvcodecs.text import EVALUATION_DEFAULT, load_corpus, tokenize_corpus

CONTEXT, CONTINUATION = 1024, 64


@torch.inference_mode()
def teacher_forced_logprobs(model, rows: torch.Tensor, pads: list[int], make_cache) -> torch.Tensor:
    """Log-probabilities ``[B, CONTINUATION, V]`` of each row's last ``CONTINUATION`` tokens, decoded one step at a time.

    ``rows``: ``[B, L + CONTINUATION + 1]`` token ids whose first ``pads[b]`` entries are padding."""
    batch, length = rows.shape[0], rows.shape[1] - CONTINUATION - 1
    mask = torch.ones(batch, length, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate() builds them
    cache = make_cache(model)
    model(rows[:, :length], attention_mask=mask, position_ids=positions, cache=cache, logits_to_keep=1)
    steps = []
    for step in range(CONTINUATION):  # each step feeds one token and predicts the next, against the cache
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
        positions = positions[:, -1:] + 1
        logits = model(rows[:, length + step : length + step + 1], attention_mask=mask, position_ids=positions,
                       cache=cache).logits
        steps.append(logits)
    return torch.log_softmax(torch.cat(steps, dim=1).float(), dim=-1)


def compare(reference: torch.Tensor, candidate: torch.Tensor, targets: torch.Tensor) -> dict:
    """KL(reference || candidate), top-1 agreement and perplexity change over ``[N, V]`` log-probabilities."""
    kl = (reference.exp() * (reference - candidate)).sum(-1).mean().item()
    top1 = (reference.argmax(-1) == candidate.argmax(-1)).float().mean().item()
    nll = lambda logprobs: -logprobs.gather(-1, targets[:, None]).mean().item()  # noqa: E731
    return {"kl": kl, "top1": top1, "delta_ppl_pct": 100 * (math.exp(nll(candidate) - nll(reference)) - 1)}


def run(loaded, padding: int, windows: int, rates, progress: bool = True) -> dict:
    model = loaded.model
    attention = "codes" if enable_code_attention(model) else "dequantize"
    codebooks, directory, _ = ensure_codebooks(loaded, learner="l2", bits=max(rates), seed=0)
    evaluation = load_corpus(None, default=EVALUATION_DEFAULT)
    token_ids = tokenize_corpus(loaded.tokenizer, evaluation)
    spans, starts = _evaluation_windows(token_ids, windows, CONTEXT + CONTINUATION + 1)
    pad_id = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0

    def gsrq(bits):
        return lambda m: GSRQCache(m.config, codebooks=codebooks, bits=bits, **BENCH_CACHE_SETTINGS)

    configurations = [("fp32 DynamicCache, batched", lambda m: DynamicCache(config=m.config), "batched", None)]
    for bits in rates:
        configurations += [(f"GSRQ {bits:g}-bit, prompt alone", gsrq(bits), "alone", bits),
                           (f"GSRQ {bits:g}-bit, batched, sinks after the padding (now)", gsrq(bits), "batched", bits),
                           (f"GSRQ {bits:g}-bit, batched, sinks counted in cache positions (before)", gsrq(bits),
                            "positional", bits)]
    collected = {name: [] for name, *_ in configurations}
    references, targets = [], []
    for span in tqdm(spans, desc="windows", disable=not progress):
        short = span[padding:]
        padded = torch.cat([torch.full((padding,), pad_id, dtype=span.dtype), short])
        batch = torch.stack([span, padded])
        alone = short[None]
        references.append(teacher_forced_logprobs(model, alone, [0], lambda m: DynamicCache(config=m.config))[0])
        targets.append(short[-CONTINUATION:])
        for name, make_cache, mode, _ in configurations:
            if mode == "alone":
                logprobs = teacher_forced_logprobs(model, alone, [0], make_cache)[0]
            elif mode == "positional":  # the cache is told of no padding: sink slots are the first cache positions
                with mock.patch.object(gsrq_module, "_left_padding", lambda positions: 0):
                    logprobs = teacher_forced_logprobs(model, batch, [0, padding], make_cache)[1]
            else:
                logprobs = teacher_forced_logprobs(model, batch, [0, padding], make_cache)[1]
            collected[name].append(logprobs)
    reference, target = torch.cat(references), torch.cat(targets)
    rows = [{"method": name, "bits": bits, **compare(reference, torch.cat(collected[name]), target)}
            for name, _, _, bits in configurations]
    return {"model": loaded.description, "evaluation_text": evaluation.description, "window_starts": starts,
            "context_tokens": CONTEXT, "padding_tokens": padding, "continuation_tokens": CONTINUATION,
            "cache_settings": BENCH_CACHE_SETTINGS, "attention": attention, "codebooks": str(directory), "rows": rows}


def markdown(results: dict) -> str:
    lines = [f"Padded row: {results['context_tokens'] - results['padding_tokens']}-token prompts left-padded by "
             f"{results['padding_tokens']} next to their full {results['context_tokens']}-token context, "
             f"{results['continuation_tokens']} teacher-forced steps, {len(results['window_starts'])} windows of "
             f"{results['evaluation_text']}; reference: fp32 DynamicCache on the prompt alone; GSRQ attention path: "
             f"{results['attention']}.", "",
             "| method | KL | top-1 | Δppl % |", "|---|---|---|---|"]
    for row in results["rows"]:
        lines.append(f"| {row['method']} | {row['kl']:.4f} | {row['top1']:.3f} | {row['delta_ppl_pct']:+.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--padding", type=int, default=256, help="left padding of the shorter row")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--bits", type=float, nargs="+", default=[2.0, 1.0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if not 0 < args.padding < CONTEXT:
        parser.error(f"--padding must be between 1 and {CONTEXT - 1}")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    results = run(load_model(args.model), args.padding, args.windows, args.bits)
    results["seconds"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "padded_sinks.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "padded_sinks.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
