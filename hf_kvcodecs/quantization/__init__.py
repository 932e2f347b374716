"""Weight quantization that saves, loads and travels to the Hub with the model's KV codebooks.

``quant_method="hf_kvcodecs"`` is registered with transformers when ``hf_kvcodecs`` is imported.
:func:`export_compressed_tensors` writes a quantized model as a compressed-tensors checkpoint, which plain
transformers and vLLM load without hf_kvcodecs.
"""

from ..codecs.weight_quantization import dequantize_weight, fake_quantize, pack_codes, quantize_weight, unpack_codes
from .compressed_tensors_export import export_compressed_tensors
from .config import FORMAT_VERSION, KV_CODEBOOKS_FOLDER, QUANT_METHOD, KVCodecsConfig
from .modules import FakeQuantLinear, PackedLinear, dequantized_weight_cache
from .quantizer import (
    KVCodecsHfQuantizer,
    attach_kv_codebooks,
    pack_fake_quantized,
    quantize_model,
    quantized_modules,
    register,
)

__all__ = [
    "FORMAT_VERSION",
    "KV_CODEBOOKS_FOLDER",
    "QUANT_METHOD",
    "FakeQuantLinear",
    "KVCodecsConfig",
    "KVCodecsHfQuantizer",
    "PackedLinear",
    "attach_kv_codebooks",
    "dequantize_weight",
    "dequantized_weight_cache",
    "export_compressed_tensors",
    "fake_quantize",
    "pack_codes",
    "pack_fake_quantized",
    "quantize_model",
    "quantize_weight",
    "quantized_modules",
    "register",
    "unpack_codes",
]
