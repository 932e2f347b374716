from .collect import KVSamples, collect_kv_samples
from .gsrq import calibrate_gsrq, fit_gsrq_codebooks

__all__ = ["KVSamples", "calibrate_gsrq", "collect_kv_samples", "fit_gsrq_codebooks"]
