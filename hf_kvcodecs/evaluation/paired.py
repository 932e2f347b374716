"""Next-token quality of a (compressed) model against a reference from the same run, paired window by window.

Every benchmark, the compress pipeline and training evaluate through this module, so a Δ perplexity means the same
thing everywhere:
- windows of held-out real text (:func:`fixed_windows`, :func:`strided_windows`);
- per-token negative log-likelihoods (:func:`token_nll`) from one forward pass per window (:func:`forward_nll`, for
  weight quantization) or from teacher-forced decoding through a cache (:func:`decode_logprobs`,
  :func:`decode_nll`): the context is prefilled, then the continuation is fed one token per call and only those
  steps are scored, so a compressed KV cache is what they attend to (a prefill call gets exact states; see
  shared/docs/benchmark-protocol.md);
- the paired statistics (:func:`perplexity_metrics`, :func:`divergence_metrics`, :func:`paired_comparison`):
  perplexity, its change against the reference with the standard error of the per-window NLL differences (a hard
  window is hard for both models, so the paired difference is far tighter than two perplexities side by side), KL
  divergence from the reference's next-token distribution and top-1 agreement.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm


def fixed_windows(token_ids: torch.Tensor, num_windows: int, window_tokens: int) -> list[torch.Tensor]:
    """``num_windows`` windows of ``window_tokens`` tokens, evenly spread from the start to the end of the text
    (deterministic, non-overlapping)."""
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


def strided_windows(token_ids: torch.Tensor, num_windows: int, span: int) -> tuple[list[torch.Tensor], list[int]]:
    """``num_windows`` non-overlapping spans a whole stride apart, from the start of the text (so they cover different
    documents), and their start offsets."""
    if num_windows < 1:
        raise ValueError("n_windows must be at least 1.")
    if num_windows * span > len(token_ids):
        raise ValueError(
            f"{num_windows} windows of {span} tokens need {num_windows * span} tokens; the evaluation text has "
            f"{len(token_ids)}. Use a longer text, fewer windows or a shorter context."
        )
    stride = (len(token_ids) - span) // max(num_windows - 1, 1)
    starts = [index * stride for index in range(num_windows)]
    return [token_ids[start : start + span] for start in starts], starts


def token_nll(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood (float64, nats) of each target under its row of log-probabilities ``[T, V]``."""
    return -logprobs.gather(1, targets[:, None]).squeeze(1).double()


def decode_step(model, cache, token_id) -> torch.Tensor:
    """One single-token forward through the cache; the next-token logits (float32)."""
    step = torch.as_tensor(token_id, dtype=torch.long).reshape(1, 1)
    return model(step, cache=cache, use_cache=True).logits[0, -1].float()


def prefill(model, cache, token_ids: torch.Tensor) -> None:
    model(token_ids[None], cache=cache, use_cache=True, logits_to_keep=1)


def decode_logprobs(model, cache, window: torch.Tensor, context_tokens: int,
                    after_prefill: Callable[[object], None] | None = None) -> torch.Tensor:
    """Prefill ``window[:context_tokens]`` into ``cache``, then feed ``window[context_tokens:-1]`` one token per call:
    the log-probabilities ``[len(window) - context_tokens - 1, V]`` (float32) that predict
    ``window[context_tokens + 1:]``. ``after_prefill(cache)`` runs between the two (e.g. to measure memory)."""
    prefill(model, cache, window[:context_tokens])
    if after_prefill is not None:
        after_prefill(cache)
    return torch.stack([torch.log_softmax(decode_step(model, cache, token_id), dim=-1)
                        for token_id in window[context_tokens:-1]])


def perplexity_metrics(nlls: list[torch.Tensor], reference_nlls: list[torch.Tensor] | None) -> dict:
    """Perplexity over all scored tokens and per window, and its change against the reference, paired by window.

    ``nlls`` / ``reference_nlls``: per window, the per-token NLL (:func:`token_nll`); ``None`` for the reference
    itself. The change is ``exp(mean paired window-NLL difference) - 1`` (in %), with the standard error of that mean
    carried through the exponential.
    """
    window_nll = torch.stack([nll.mean() for nll in nlls])
    metrics = {
        "scored_tokens": sum(len(nll) for nll in nlls),
        "ppl": math.exp(torch.cat(nlls).mean().item()),
        "window_ppl": [math.exp(value) for value in window_nll.tolist()],
        "window_nll": window_nll.tolist(),
    }
    if reference_nlls is None:
        metrics.update(delta_ppl_pct=0.0, delta_ppl_pct_se=0.0, window_delta_ppl_pct=[0.0] * len(nlls))
        return metrics
    if len(reference_nlls) != len(nlls):
        raise ValueError(f"{len(nlls)} windows scored against a reference of {len(reference_nlls)}.")
    reference_window_nll = torch.stack([nll.mean() for nll in reference_nlls])
    # With equally many tokens per window, the mean paired NLL difference is exactly the pooled log-ppl ratio.
    differences = window_nll - reference_window_nll
    ratio = math.exp(differences.mean().item())
    standard_error = differences.std().item() / math.sqrt(len(differences)) if len(differences) > 1 else None
    metrics.update(
        delta_ppl_pct=100.0 * (ratio - 1.0),
        # delta method: d(100 * exp(x)) = 100 * exp(x) dx
        delta_ppl_pct_se=None if standard_error is None else 100.0 * ratio * standard_error,
        window_delta_ppl_pct=[100.0 * (math.exp(value) - 1.0) for value in differences.tolist()],
    )
    return metrics


def kl_divergence(reference_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """``KL(reference || model)`` per position, in nats, from log-probability rows ``[..., V]``: the one KL every
    benchmark, the SCD fit and the SQuaT evaluation report."""
    return (reference_logprobs.exp() * (reference_logprobs - logprobs)).sum(-1)


def divergence_metrics(logprobs: list[torch.Tensor], reference_logprobs: list[torch.Tensor] | None) -> dict:
    """Mean KL divergence ``KL(reference || model)`` of the next-token distributions, top-1 agreement, and the KL per
    window (for comparisons paired by window); ``reference_logprobs`` None: the reference against itself."""
    if reference_logprobs is None:
        return {"kl_mean": 0.0, "top1_agreement": 1.0, "window_kl": [0.0] * len(logprobs)}
    kls = [kl_divergence(reference, own).double() for own, reference in zip(logprobs, reference_logprobs)]
    top1 = [(reference.argmax(-1) == own.argmax(-1)).double() for own, reference in zip(logprobs, reference_logprobs)]
    return {"kl_mean": torch.cat(kls).mean().item(), "top1_agreement": torch.cat(top1).mean().item(),
            "window_kl": [kl.mean().item() for kl in kls]}


@dataclass
class WindowScores:
    """Per window: the per-token NLL (float64), and the log-probability rows ``[scored tokens, V]`` when kept (for KL
    and top-1 agreement)."""

    nlls: list[torch.Tensor]
    logprobs: list[torch.Tensor] | None = None

    @property
    def perplexity(self) -> float:
        return math.exp(torch.cat(self.nlls).mean().item())


@torch.no_grad()  # not inference_mode: quanto's tensor subclasses cannot run under it
def forward_nll(model, windows: list[torch.Tensor], *, progress: bool = True, description: str = "perplexity") -> WindowScores:
    """One forward pass per window, every token after the first scored (no cache involved)."""
    nlls = []
    for window in tqdm(windows, desc=description, disable=not progress, leave=False):
        ids = window[None].to(model.device)
        logits = model(ids, use_cache=False).logits[0, :-1].float()
        nlls.append(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none").double())
    return WindowScores(nlls)


@torch.no_grad()  # not inference_mode: quanto's tensor subclasses cannot run under it
def decode_nll(model, windows: list[torch.Tensor], context_tokens: int, make_cache: Callable[[], object], *,
               keep_logprobs: bool = False, progress: bool = True, description: str = "decode perplexity") -> WindowScores:
    """Prefill ``context_tokens`` of each window into ``make_cache()``, then score the rest one token per call: the
    prefill's last position predicts the first continuation token, each decode step the next."""
    nlls, kept = [], []
    for window in tqdm(windows, desc=description, disable=not progress, leave=False):
        if window.numel() <= context_tokens + 1:
            raise ValueError(f"Windows of {window.numel()} tokens leave nothing to decode after {context_tokens} context tokens.")
        ids = window[None].to(model.device)
        cache = make_cache()
        steps = [model(ids[:, :context_tokens], cache=cache, use_cache=True).logits[:, -1:]]
        for position in range(context_tokens, ids.shape[1] - 1):
            steps.append(model(ids[:, position : position + 1], cache=cache, use_cache=True).logits)
        logprobs = torch.cat(steps, dim=1)[0].float().log_softmax(-1)
        nlls.append(token_nll(logprobs, ids[0, context_tokens:]))
        if keep_logprobs:
            kept.append(logprobs)
    return WindowScores(nlls, kept if keep_logprobs else None)


def paired_comparison(scores: WindowScores, reference: WindowScores) -> dict:
    """Perplexity, its change against ``reference`` (in %, ± the standard error of the paired per-window NLL
    differences), and KL / top-1 agreement when both kept their log-probabilities."""
    paired = perplexity_metrics(scores.nlls, None if scores is reference else reference.nlls)
    result = {
        "perplexity": paired["ppl"],
        "delta_ppl_pct": paired["delta_ppl_pct"],
        "delta_ppl_pct_se": paired["delta_ppl_pct_se"],
        "windows": len(scores.nlls),
        "scored_tokens": paired["scored_tokens"],
    }
    result["window_nll"] = paired["window_nll"]
    if scores.logprobs is not None and reference.logprobs is not None:
        divergence = divergence_metrics(scores.logprobs, None if scores is reference else reference.logprobs)
        result["kl_mean"] = divergence["kl_mean"]
        result["top1_agreement"] = divergence["top1_agreement"]
        result["window_kl"] = divergence["window_kl"]
    return result


def paired_difference(values: list[float], reference_values: list[float]) -> dict:
    """Mean of the per-window differences ``values - reference_values`` and its standard error (windows paired)."""
    if len(values) != len(reference_values) or not values:
        raise ValueError(f"{len(values)} windows paired with {len(reference_values)}; pair the same windows.")
    differences = torch.tensor(values, dtype=torch.float64) - torch.tensor(reference_values, dtype=torch.float64)
    standard_error = differences.std().item() / math.sqrt(len(differences)) if len(differences) > 1 else None
    return {"mean": differences.mean().item(), "se": standard_error, "windows": len(values)}
