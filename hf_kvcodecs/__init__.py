"""hf_kvcodecs: drop-in KV-cache compression for Hugging Face transformers.

Importing the package registers ``cache_implementation="gsrq"`` with ``transformers``' ``generate()`` and
``quant_method="hf_kvcodecs"`` with its quantizers, so ``from_pretrained`` loads models compressed by hf_kvcodecs.
"""

from .cache import GSRQCache
from .cache.rope import model_rope_inv_freq
from .codecs.gsrq_codebooks import GSRQCodebooks
from .integrations.attention import enable_code_attention, register_code_attention
from .integrations.transformers_patch import register_cache_implementation
from .quantization import KVCodecsConfig
from .quantization import register as _register_quantization

__version__ = "0.1.0"

register_cache_implementation("gsrq", GSRQCache)
register_code_attention()
_register_quantization()


def __getattr__(name):  # calibration pulls in tqdm/text helpers: import it only when asked for
    if name == "calibrate_gsrq":
        from .calibration import calibrate_gsrq

        return calibrate_gsrq
    raise AttributeError(f"module 'hf_kvcodecs' has no attribute {name!r}")


__all__ = ["GSRQCache", "GSRQCodebooks", "KVCodecsConfig", "enable_code_attention", "model_rope_inv_freq", "calibrate_gsrq", "register_cache_implementation", "__version__"]
