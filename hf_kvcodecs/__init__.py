"""hf_kvcodecs: drop-in KV-cache, KV-transfer and weight compression for Hugging Face transformers.

Importing the package registers ``cache_implementation="gsrq"`` and ``"scd"`` with ``transformers``' ``generate()``, the
code-reading attention implementations, and ``quant_method="hf_kvcodecs"`` with its quantizers, so
``from_pretrained`` loads models compressed by hf_kvcodecs.
"""

from .gsrq import GSRQCache, GSRQCacheConfig, GSRQCodebooks, calibrate_gsrq
from .integrations.attention import enable_code_attention, register_code_attention
from .integrations.transformers_patch import register_cache_implementation
from .quantization import KVCodecsConfig
from .quantization import register as _register_quantization
from .rope import model_rope_inv_freq
from .scd import SCDKnowledgeBase, SCDTransferCache
from .version import __version__

register_cache_implementation("gsrq", GSRQCache)
register_cache_implementation("scd", SCDTransferCache)
register_code_attention()
_register_quantization()

_LAZY = {"SQuaTConfig": "training", "SQuaTTrainer": "training"}  # Trainer pulls in accelerate: only on first use


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GSRQCache", "GSRQCacheConfig", "GSRQCodebooks", "KVCodecsConfig", "SCDKnowledgeBase", "SCDTransferCache",
           "SQuaTConfig", "SQuaTTrainer", "enable_code_attention", "model_rope_inv_freq", "calibrate_gsrq",
           "register_cache_implementation", "__version__"]
