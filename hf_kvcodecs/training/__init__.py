"""SQuaT: label-free quantization-aware distillation of a fake-quantized student (``SQuaTTrainer``).

The learnable quantizers live in :mod:`hf_kvcodecs.codecs.learnable`; the fake-quant and packed layers and
``KVCodecsConfig(activation_bits=...)`` in :mod:`hf_kvcodecs.quantization`, which this package builds on.
"""

from .losses import chunked_kl, chunked_nll, clip_fraction, feature_terms
from .trainer import SQuaTConfig, SQuaTTrainer, quantized_linear_modules

__all__ = ["SQuaTConfig", "SQuaTTrainer", "chunked_kl", "chunked_nll", "clip_fraction", "feature_terms",
           "quantized_linear_modules"]
