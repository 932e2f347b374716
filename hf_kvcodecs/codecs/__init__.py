"""Pure tensor math for KV codecs: no transformers import here."""

from .conditional import ConditionalHeadResidualVQ, fit_conditional_head_residual_vq
from .joint import JointHeadResidualVQ, fit_joint_head_residual_vq
from .kmeans import CODEBOOK_LEARNERS, fit_codebook, nearest_codeword
from .residual import TransformResidualVQ, fit_transform_residual_vq, gaussian_rate_distortion_reference

__all__ = [
    "CODEBOOK_LEARNERS",
    "fit_codebook",
    "nearest_codeword",
    "TransformResidualVQ",
    "JointHeadResidualVQ",
    "ConditionalHeadResidualVQ",
    "fit_conditional_head_residual_vq",
    "fit_joint_head_residual_vq",
    "fit_transform_residual_vq",
    "gaussian_rate_distortion_reference",
]
