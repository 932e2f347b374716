"""Perplexity of a (compressed) model on fixed windows of real text, paired against a reference from the same run.

Two protocols:
- :func:`forward_nll`: one forward pass per window, every token scored. Measures weight quantization.
- :func:`decode_nll`: prefill a context into a cache, then feed the continuation one token per call, scoring only
  those steps. Measures a compressed KV cache too (it returns exact states on the prefill call, so prefill logits
  would not see it; see shared/docs/benchmark-protocol.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm


def fixed_windows(token_ids: torch.Tensor, num_windows: int, window_tokens: int) -> list[torch.Tensor]:
    """``num_windows`` windows of ``window_tokens`` tokens, evenly spread over the text (deterministic)."""
    total = token_ids.numel()
    if num_windows < 1 or window_tokens < 2:
        raise ValueError(f"Need at least 1 window of at least 2 tokens, got {num_windows} x {window_tokens}.")
    if total < window_tokens:
        raise ValueError(f"The evaluation text has {total} tokens, fewer than one window of {window_tokens}.")
    if num_windows * window_tokens > total:
        raise ValueError(
            f"{num_windows} windows of {window_tokens} tokens need {num_windows * window_tokens} tokens, but the "
            f"evaluation text has {total}. Use fewer or shorter windows, or more text."
        )
    last_start = total - window_tokens
    starts = [round(i * last_start / max(num_windows - 1, 1)) for i in range(num_windows)]
    return [token_ids[start : start + window_tokens] for start in starts]


@dataclass
class WindowScores:
    """Mean negative log-likelihood (nats per token) of each window, and the tokens scored in each."""

    nll: list[float]
    tokens: list[int]
    logprobs: list[torch.Tensor] | None = None  # per window [scored tokens, vocab], kept for KL when asked

    @property
    def perplexity(self) -> float:
        return math.exp(sum(n * t for n, t in zip(self.nll, self.tokens)) / sum(self.tokens))


@torch.no_grad()  # not inference_mode: quanto's tensor subclasses cannot run under it
def forward_nll(model, windows: list[torch.Tensor], *, progress: bool = True, description: str = "perplexity") -> WindowScores:
    nll, tokens = [], []
    for window in tqdm(windows, desc=description, disable=not progress, leave=False):
        ids = window[None].to(model.device)
        logits = model(ids, use_cache=False).logits[0, :-1].float()
        losses = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
        nll.append(float(losses.mean()))
        tokens.append(int(losses.numel()))
    return WindowScores(nll, tokens)


@torch.no_grad()  # not inference_mode: quanto's tensor subclasses cannot run under it
def decode_nll(model, windows: list[torch.Tensor], context_tokens: int, make_cache: Callable[[], object], *,
               keep_logprobs: bool = False, progress: bool = True, description: str = "decode perplexity") -> WindowScores:
    """Prefill ``context_tokens`` of each window into ``make_cache()``, then score the rest one token per call."""
    nll, tokens, kept = [], [], []
    for window in tqdm(windows, desc=description, disable=not progress, leave=False):
        if window.numel() <= context_tokens + 1:
            raise ValueError(f"Windows of {window.numel()} tokens leave nothing to decode after {context_tokens} context tokens.")
        ids = window[None].to(model.device)
        cache = make_cache()
        logits = model(ids[:, :context_tokens], cache=cache, use_cache=True).logits[:, -1:]
        steps = [logits]
        for position in range(context_tokens, ids.shape[1] - 1):
            steps.append(model(ids[:, position : position + 1], cache=cache, use_cache=True).logits)
        logprobs = torch.cat(steps, dim=1)[0].float().log_softmax(-1)
        targets = ids[0, context_tokens:]
        losses = -logprobs.gather(-1, targets[:, None])[:, 0]
        nll.append(float(losses.mean()))
        tokens.append(int(losses.numel()))
        if keep_logprobs:
            kept.append(logprobs)
    return WindowScores(nll, tokens, kept if keep_logprobs else None)


def paired_comparison(scores: WindowScores, reference: WindowScores) -> dict:
    """Perplexity, its change against ``reference`` (in %, with the standard error of the paired per-window NLL
    differences), and KL / top-1 agreement when both kept their log-probabilities."""
    differences = [a - b for a, b in zip(scores.nll, reference.nll)]
    mean = sum(differences) / len(differences)
    if len(differences) > 1:
        se = math.sqrt(sum((d - mean) ** 2 for d in differences) / (len(differences) - 1) / len(differences))
    else:
        se = None
    ratio = scores.perplexity / reference.perplexity
    result = {
        "perplexity": scores.perplexity,
        "delta_ppl_pct": 100 * (ratio - 1),
        # d(exp(x))/dx = exp(x): the standard error of the mean NLL difference, carried to a perplexity ratio.
        "delta_ppl_pct_se": None if se is None else 100 * ratio * se,
        "windows": len(scores.nll),
        "scored_tokens": sum(scores.tokens),
    }
    if scores.logprobs is not None and reference.logprobs is not None:
        kl = [(ref.exp() * (ref - own)).sum(-1) for own, ref in zip(scores.logprobs, reference.logprobs)]
        agree = [(own.argmax(-1) == ref.argmax(-1)).float() for own, ref in zip(scores.logprobs, reference.logprobs)]
        result["kl_mean"] = float(torch.cat(kl).mean())
        result["top1_agreement"] = float(torch.cat(agree).mean())
    return result
