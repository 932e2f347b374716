from .collect import KVSamples, collect_kv_samples
from .gsrq import calibrate_gsrq

__all__ = ["KVSamples", "calibrate_gsrq", "collect_kv_samples"]
