"""GSRQ prefill time against the encoder's search: beam widths and greedy-then-refine, each beside fp32 DynamicCache.

The GSRQ prefill is the model's forward pass plus the encoding of every prompt token (keys ``per_head_codebooks``,
values ``given_keys`` on the default model at 2 bits). This script times the prefill of real text for each encoder
lever next to fp32 DynamicCache in the same process (median of interleaved repeats, the order rotating each repeat,
ratios to the same run's DynamicCache), and measures what each lever costs in quality the way ``bench decode`` does:
teacher-forced KL against fp32 DynamicCache and top-1 agreement over windows from the end of the text
(``hf_kvcodecs.evaluation.paired``), plus the relative squared reconstruction error of the coded keys and values
(``Σ||x - x̂||² / Σ||x||²`` over the coded region of every layer, keys after RoPE as attention sees them).

Levers: beam width 1 (greedy), 2, 4, 8 (the default), and "refine": after the encoder's codes, one pass over the
stages re-chooses each stage's codeword as the nearest to its group's target minus every other stage's codeword (the
error can only fall; the codes keep their format, so the decoder is unchanged).

    python benchmarks/gsrq_prefill_encoder.py --threads 1 --contexts 1024 4096 --repeats 3 \
        --out benchmarks/results/gsrq_prefill_encoder
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_kvcodecs.bench.decode import GSRQ_BITS, QUALITY
from hf_kvcodecs.codecs import joint, residual
from hf_kvcodecs.evaluation import decode_logprobs, divergence_metrics
from hf_kvcodecs.gsrq import GSRQCache
from hf_kvcodecs.gsrq.store import ensure_codebooks
from hf_kvcodecs.integrations.attention import enable_code_attention
from hf_kvcodecs.models import load_model
from hf_kvcodecs.rope import model_rope_inv_freq
from hf_kvcodecs.text import EVALUATION_DEFAULT, load_corpus, tokenize_corpus

REFERENCE = "fp32 DynamicCache"
# (name, beam width, refine pass after the search)
LEVERS = [("beam 8 (default)", 8, False), ("beam 4", 4, False), ("beam 2", 2, False), ("beam 1 (greedy)", 1, False),
          ("greedy + refine", 1, True), ("beam 2 + refine", 2, True)]


def refine_codes(z: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, stage_groups: torch.Tensor) -> torch.Tensor:
    """One pass over the stages in order: each stage's codeword re-chosen as the nearest to what the group's other
    stages leave of ``z`` ``[R, D]``. The current codeword is a candidate, so no vector's error grows."""
    rows, dim = z.shape
    stages, _, group_dim = codebooks.shape
    books = codebooks.float()
    half_norms = 0.5 * books.pow(2).sum(-1)  # [S, K]
    chosen = codes.long()
    remainder = z.float().reshape(rows, dim // group_dim, group_dim).clone()
    groups = [int(group) for group in stage_groups.tolist()]
    for stage, group in enumerate(groups):
        remainder[:, group] -= books[stage][chosen[:, stage]]
    for stage, group in enumerate(groups):
        target = remainder[:, group] + books[stage][chosen[:, stage]]
        best = torch.addmm(half_norms[stage], target, books[stage].T, alpha=-1.0).argmin(-1)  # |c|²/2 - t.c
        remainder[:, group] = target - books[stage][best]
        chosen[:, stage] = best
    return chosen.to(torch.uint8)


@contextlib.contextmanager
def refined_encoder(enabled: bool):
    """The codecs' encoder followed by :func:`refine_codes` (swapped in where the codecs call it) while active."""
    if not enabled:
        yield
        return
    searched = residual.residual_encode

    def search_then_refine(z, codebooks, stage_groups, beam_width=1):
        return refine_codes(z, searched(z, codebooks, stage_groups, beam_width), codebooks, stage_groups)

    residual.residual_encode = joint.residual_encode = search_then_refine
    try:
        yield
    finally:
        residual.residual_encode = joint.residual_encode = searched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--windows", type=int, default=QUALITY["windows"])
    parser.add_argument("--only", nargs="+", default=None, help="lever names to keep (substrings)")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gsrq_prefill_encoder"))
    parser.add_argument("--render", action="store_true", help="only rewrite results.md from --out's results.json")
    args = parser.parse_args()
    if args.render:
        results = json.loads((args.out / "results.json").read_text())
        (args.out / "results.md").write_text(_markdown(results, [(REFERENCE, None, False)] + LEVERS))
        return
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    loaded = load_model("default")
    model = loaded.model
    codebooks, directory, _ = ensure_codebooks(loaded, progress=False)
    enable_code_attention(model)
    token_ids = tokenize_corpus(loaded.tokenizer, corpus := load_corpus(None, default=EVALUATION_DEFAULT))
    levers = [lever for lever in LEVERS if args.only is None or any(part in lever[0] for part in args.only)]

    def make_cache(beam_width):
        if beam_width is None:
            return DynamicCache()
        return GSRQCache(model.config, codebooks=codebooks, bits=GSRQ_BITS, attention="codes", beam_width=beam_width,
                         rope_inv_freq=model_rope_inv_freq(model))

    methods = [(REFERENCE, None, False)] + levers
    results = {"model": loaded.description, "text": corpus.description, "codebooks": str(directory),
               "key_layout": codebooks.layout("keys"), "value_layout": codebooks.layout("values"),
               "threads": args.threads, "repeats": args.repeats, "contexts": args.contexts, "machine": platform.processor()
               or platform.machine(), "torch": torch.__version__, "quality": {}, "prefill": {}}
    if not args.skip_quality:
        results["quality"] = _quality(model, methods, make_cache, token_ids, args.windows)
    for context in args.contexts:
        runs = {name: [] for name, _, _ in methods}
        prompt = token_ids[None, :context]
        for repeat in range(args.repeats):
            order = methods[repeat % len(methods):] + methods[:repeat % len(methods)]
            for name, beam_width, refine in order:
                cache = make_cache(beam_width)
                with refined_encoder(refine), torch.inference_mode():
                    began = time.perf_counter()
                    model(prompt, cache=cache, logits_to_keep=1)
                    runs[name].append(time.perf_counter() - began)
            print(f"@{context} repeat {repeat + 1}: " + ", ".join(f"{n} {r[-1]:.2f}s" for n, r in runs.items()), flush=True)
        reference = statistics.median(runs[REFERENCE])
        results["prefill"][str(context)] = {
            name: {"median_s": statistics.median(r), "ratio_to_fp32": statistics.median(r) / reference, "runs_s": r}
            for name, r in runs.items()}
    results["seconds"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "results.md").write_text(_markdown(results, methods))
    print(_markdown(results, methods))


def _quality(model, methods, make_cache, token_ids, windows: int) -> dict:
    """KL / top-1 against fp32 DynamicCache (teacher-forced, as ``bench decode``) and the coded region's relative
    reconstruction error, on windows from the end of the text."""
    context, continuation = QUALITY["context"], QUALITY["continuation"]
    span = context + continuation + 1
    first = token_ids.numel() - windows * span
    spans = [token_ids[first + i * span: first + (i + 1) * span] for i in range(windows)]
    exact = []
    with torch.inference_mode():
        for window in spans:
            cache = DynamicCache()
            model(window[None, :context], cache=cache)
            exact.append([(layer.keys, layer.values) for layer in cache.layers])
    reference_rows, out = None, {}
    for name, beam_width, refine in methods:
        rows, errors = [], {"keys": [0.0, 0.0], "values": [0.0, 0.0]}
        for window, states in zip(spans, exact):
            measure = None if beam_width is None else functools.partial(_add_errors, states=states, errors=errors)
            with refined_encoder(refine), torch.inference_mode():
                rows.append(decode_logprobs(model, make_cache(beam_width), window, context, after_prefill=measure))
        metrics = divergence_metrics(rows, reference_rows)
        if reference_rows is None:
            reference_rows = rows
        if beam_width is not None:
            metrics.update({f"{kind}_relative_error": e / total for kind, (e, total) in errors.items()})
        out[name] = metrics
        print(name, {k: v for k, v in metrics.items()}, flush=True)
    return out


def _add_errors(cache, states, errors) -> None:
    """Adds each layer's squared error of the coded tokens and their squared norm into ``errors[kind]``."""
    for layer, (keys, values) in zip(cache.layers, states):
        lengths = layer.region_lengths()
        coded = slice(lengths["sinks"], lengths["sinks"] + lengths["codes"])
        got_keys, got_values = layer.dequantized_keys_and_values()
        for kind, got, want in (("keys", got_keys, keys), ("values", got_values, values)):
            errors[kind][0] += (got[..., coded, :].float() - want[..., coded, :]).pow(2).sum().item()
            errors[kind][1] += want[..., coded, :].pow(2).sum().item()


def _paired_change(window_kl, baseline_kl) -> str:
    """Mean per-window KL change against the default encoder, ± the standard error of the paired differences."""
    if not window_kl or not baseline_kl or len(window_kl) < 2:
        return ""
    differences = [own - base for own, base in zip(window_kl, baseline_kl)]
    error = statistics.stdev(differences) / len(differences) ** 0.5
    return f"{statistics.mean(differences):+.4f} ± {error:.4f}"


def _markdown(results: dict, methods) -> str:
    contexts = [str(c) for c in results["prefill"]]
    lines = [
        "# GSRQ prefill vs encoder search",
        "",
        f"- Model: {results['model']}; text: {results['text']}; keys {results['key_layout']}, values "
        f"{results['value_layout']}, {GSRQ_BITS:g} bits; {results['threads']} torch thread(s); {results['machine']}.",
        f"- Prefill: median of {results['repeats']} interleaved repeats, ratio to fp32 DynamicCache of the same run.",
        f"- Quality: teacher-forced KL(fp32 DynamicCache || cache) and top-1 agreement over {QUALITY['continuation']} "
        f"decoded tokens after {QUALITY['context']}-token prefills; per-window KL in the JSON for paired comparisons; "
        "relative error Σ||x - x̂||² / Σ||x||² over the coded tokens of every layer.",
        "",
        "| encoder | " + " | ".join(f"prefill ×fp32 @{c}" for c in contexts)
        + " | KL | ΔKL vs beam 8 (paired ± s.e.) | top-1 | key rel. err | value rel. err |",
        "|---|" + "---:|" * (len(contexts) + 5),
    ]
    baseline = results["quality"].get(LEVERS[0][0], {}).get("window_kl")
    for name, _, _ in methods:
        if not all(name in results["prefill"][c] for c in contexts):
            continue
        q = results["quality"].get(name, {})
        cells = [f"{results['prefill'][c][name]['ratio_to_fp32']:.2f}× ({results['prefill'][c][name]['median_s']:.2f} s)"
                 for c in contexts]
        cells += [f"{q['kl_mean']:.4f}" if "kl_mean" in q else "", _paired_change(q.get("window_kl"), baseline) if name != REFERENCE else "",
                  f"{q['top1_agreement']:.3f}" if q else "",
                  f"{q['keys_relative_error']:.4f}" if "keys_relative_error" in q else "",
                  f"{q['values_relative_error']:.4f}" if "values_relative_error" in q else ""]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
