"""Method-agnostic calibration: run a model over real text with hooks and stream the statistics a codec is fitted
on, without holding every activation. Each method's fitting code (``gsrq.calibrate``) builds on it."""

from .collect import KVSamples, collect_kv_samples

__all__ = ["KVSamples", "collect_kv_samples"]
