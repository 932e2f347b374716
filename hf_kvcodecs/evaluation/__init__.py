"""The one paired evaluation: next-token NLL, KL divergence and top-1 agreement of a model against a reference,
paired window by window on the same held-out text. Benchmarks, the compress pipeline and training use it."""

from .paired import decode_nll, fixed_windows, forward_nll, paired_comparison

__all__ = ["decode_nll", "fixed_windows", "forward_nll", "paired_comparison"]
