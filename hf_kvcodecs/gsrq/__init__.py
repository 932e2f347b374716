"""GSRQ: gain-shape residual quantization of the KV cache.

Owns the cache config, the codec layouts, the codebooks and their file format (local or on the Hub), calibration,
:class:`GSRQCache` (``cache_implementation="gsrq"``) and the glue from its layers to the code-reading attention ops.
"""

from ..integrations.kv_artifacts import register_kv_artifact
from .artifact import GSRQ_CODEBOOKS
from .cache import GSRQCache
from .calibrate import GSRQFitSettings, calibrate_gsrq, fit_gsrq_codebooks
from .codebooks import GSRQCodebooks
from .config import GSRQCacheConfig
from .layer import GSRQLayer
from .loading import load_codebooks

register_kv_artifact(GSRQ_CODEBOOKS)  # checkpoints carry it: save_pretrained writes it, from_pretrained loads it

__all__ = ["GSRQCache", "GSRQCacheConfig", "GSRQCodebooks", "GSRQFitSettings", "GSRQLayer", "calibrate_gsrq",
           "fit_gsrq_codebooks", "load_codebooks"]
