"""The one paired evaluation: next-token NLL, KL divergence and top-1 agreement of a model against a reference,
paired window by window on the same held-out text. Benchmarks, the compress pipeline and training use it."""

from .paired import (
    WindowScores,
    decode_logprobs,
    decode_nll,
    decode_step,
    divergence_metrics,
    fixed_windows,
    forward_nll,
    paired_comparison,
    paired_difference,
    perplexity_metrics,
    prefill,
    strided_windows,
    token_nll,
)

__all__ = ["WindowScores", "decode_logprobs", "decode_nll", "decode_step", "divergence_metrics", "fixed_windows", "forward_nll",
           "paired_comparison", "paired_difference", "perplexity_metrics", "prefill", "strided_windows", "token_nll"]
