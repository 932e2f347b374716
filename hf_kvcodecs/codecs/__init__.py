"""Pure tensor math for KV codecs: no transformers import here."""

from .kmeans import CODEBOOK_LEARNERS, fit_codebook, nearest_codeword
from .residual import TransformResidualVQ, fit_transform_residual_vq, gaussian_rate_distortion_reference

__all__ = [
    "CODEBOOK_LEARNERS",
    "fit_codebook",
    "nearest_codeword",
    "TransformResidualVQ",
    "fit_transform_residual_vq",
    "gaussian_rate_distortion_reference",
]
