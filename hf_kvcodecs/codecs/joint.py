"""One residual-VQ code for all KV heads of a token (the cross-head GSRQ codec).

The KV heads of one layer are far from independent: on the default model a PCA over the three heads' vectors taken
together (each head divided by its own RMS first) leaves 1.3-2.9x less Gaussian rate-distortion error at 2 bits per
element than three per-head PCAs, and all of that comes from correlation between heads, none from moving bits between
them (measured with block-diagonal water-filling). So this codec keeps a per-token, per-head scale (8 bits, as
:class:`~.residual.TransformResidualVQ`) and codes the ``H * D`` shape vector with one transform and one ordered list
of residual stages, ``H`` times as many as a per-head codec at the same rate.

Codes are ``[1, N, S]`` (one row per token, shared by every head) and scales ``[H, N]``. For attention each head
reads the same codes through its own slice of the synthesis matrix (:meth:`JointHeadResidualVQ.attention_operands`),
so the ``coded_attention`` op and its kernels take these codes like per-head ones, with ``Dt = H * D`` transform
components instead of ``D``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels import residual_encode
from .base import KVCodec
from .residual import (
    DEFAULT_BEAM_WIDTH,
    DEFAULT_GAIN,
    LOG_SCALE_BITS,
    LOG_SCALE_MARGIN,
    SCALE_BIT_CHOICES,
    TransformResidualVQ,
    _rms,
    check_encoder_options,
    fit_transform_residual_vq,
    quantize_scales,
    refit_gains,
)

# Values joint, keys per head. Coding either kind jointly over the heads lowers teacher-forced KL on the default model
# (values about as much as keys, both together the most). Joint values cost one pass over the shared codes in the
# decode-time value histogram; joint keys make every key rebuilt for attention sum H times as many rows, which slows
# CPU decode most at long contexts, so they are opt-in. `hf-kvcodecs bench decode` measures all three. Keys per head
# have each head's own codebooks ("per_head_codebooks", see codecs/conditional.py): teacher-forced KL about a third
# lower than codebooks shared by the heads, read by the same compiled CPU loop at the same cost; it needs keys coded
# before RoPE (the default key space), and keys coded after RoPE keep the shared codebooks.
DEFAULT_KEY_LAYOUT = "per_head_codebooks"
POST_ROPE_KEY_LAYOUT = "per_head"
# Values are coded given the token's decoded keys ("given_keys", codecs/given_keys.py) when the keys are coded before
# RoPE: at 2 bits, against values coded jointly without the prediction, teacher-forced KL about a third lower and
# perplexity lower (paired, on bench kv's windows), at a CPU decode cost of up to ~15 %, kept small because the
# compiled loop forms the prediction's key sums while it rebuilds the keys. The prediction needs the keys before RoPE,
# so keys coded after RoPE keep jointly coded values.
DEFAULT_VALUE_LAYOUT = "given_keys"
POST_ROPE_VALUE_LAYOUT = "joint_heads"


def default_key_layout(key_space: str = "pre_rope") -> str:
    """The key layout a calibration uses when none is given, for keys coded in ``key_space``."""
    return DEFAULT_KEY_LAYOUT if key_space == "pre_rope" else POST_ROPE_KEY_LAYOUT


def default_value_layout(key_space: str = "pre_rope") -> str:
    """The value layout a calibration uses when none is given, for keys coded in ``key_space``."""
    return DEFAULT_VALUE_LAYOUT if key_space == "pre_rope" else POST_ROPE_VALUE_LAYOUT


def resolve_layouts(key_space: str = "pre_rope", key_layout: str | None = None,
                    value_layout: str | None = None) -> tuple[str, str]:
    """``(key_layout, value_layout)`` with each None replaced by the default for keys coded in ``key_space``.

    Every place that names codebooks by their settings (calibration, the codebook store's identity, the benchmark's
    rate check) resolves through here, so an explicit default and a left-out setting always mean the same layout.
    """
    return key_layout or default_key_layout(key_space), value_layout or default_value_layout(key_space)


@dataclass
class JointHeadResidualVQ(KVCodec):
    """Per-head scales plus one :class:`TransformResidualVQ` (one "head" of ``H * D`` components, unit scale) for the
    normalized shapes of all heads together (the ``joint_heads`` layout). Same interface as the per-head codec, with
    :attr:`code_heads` = 1."""

    layout = "joint_heads"
    joint_code = True

    @staticmethod
    def fit(samples: torch.Tensor, **settings):
        return fit_joint_head_residual_vq(samples, **settings)

    shape_codec: TransformResidualVQ  # mean [1, H*D], basis [1, H*D, H*D], codebooks and stages over H*D components
    num_heads: int
    log_scale_range: torch.Tensor | None  # [H, 2] log2 range of the 8-bit per-head scale levels; None: fp16 scales
    stats: dict = field(default_factory=dict)
    _levels: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _table_source: JointHeadResidualVQ | None = field(default=None, repr=False, compare=False)
    _operands: tuple | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.shape_codec.num_heads != 1 or self.shape_codec.head_dim % self.num_heads:
            raise ValueError("A joint-head codec's shape codec must code one vector of num_heads * head_dim components.")

    # ---- sizes ----------------------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.shape_codec.head_dim // self.num_heads

    @property
    def num_stages(self) -> int:
        return self.shape_codec.num_stages

    @property
    def group_dim(self) -> int:
        return self.shape_codec.group_dim

    @property
    def codebook_bits(self) -> int:
        return self.shape_codec.codebook_bits

    @property
    def codebooks(self) -> torch.Tensor:
        return self.shape_codec.codebooks

    @property
    def stage_groups(self) -> torch.Tensor:
        return self.shape_codec.stage_groups

    @property
    def mean(self) -> torch.Tensor:
        return self.shape_codec.mean

    def truncated(self, num_stages: int) -> JointHeadResidualVQ:
        """The same codec at a lower rate: the first ``num_stages`` stages of the shape code."""
        prefix = JointHeadResidualVQ(self.shape_codec.truncated(num_stages), self.num_heads, self.log_scale_range,
                                     self.stats)
        prefix._table_source = self._table_source or self
        return prefix

    def to(self, device=None, dtype=None) -> JointHeadResidualVQ:
        return JointHeadResidualVQ(
            self.shape_codec.to(device, dtype), self.num_heads,
            None if self.log_scale_range is None else self.log_scale_range.to(device), self.stats,
        )

    # ---- coding ---------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, gain: str = DEFAULT_GAIN,
               beam_width: int = DEFAULT_BEAM_WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: ``[H, N, D]`` -> (codes ``[1, N, S]`` uint8, stored per-head scales ``[H, N]``).

        ``gain`` and ``beam_width`` as in :meth:`TransformResidualVQ.encode`; the gain is chosen per head, from that
        head's slice of the decoded shape.
        """
        check_encoder_options(gain, beam_width)
        self._check_input(x)
        levels = self.scale_level_table(x.device)
        scales, scale_values = quantize_scales(_rms(x), self.log_scale_range, levels)
        shape = self._joint(x.float() / scale_values[..., None])  # [1, N, H*D]
        inner = self.shape_codec
        z = torch.einsum("hnd,hde->hne", shape - inner.mean[:, None, :], inner.basis)
        codes = residual_encode(z[0], inner.codebooks, inner.stage_groups, beam_width)[None]
        if gain == "rms":
            return codes, scales
        # per head, from that head's slice of the input and decoded shapes
        return codes, refit_gains(self._split(shape), self._decoded_shapes(codes), scales, scale_values, gain,
                                  self.log_scale_range, levels)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """Inverse of :meth:`encode`: codes ``[1, N, S]`` and stored scales ``[H, N]`` -> ``[H, N, D]``."""
        if codes.shape[-1] != self.num_stages:
            raise ValueError(f"Got {codes.shape[-1]} codes per vector but the codec has {self.num_stages} stages.")
        return (self._decoded_shapes(codes) * self.scale_values(scales).float()[..., None]).to(dtype)

    def reconstruct(self, x: torch.Tensor, gain: str = DEFAULT_GAIN, beam_width: int = DEFAULT_BEAM_WIDTH) -> torch.Tensor:
        codes, scales = self.encode(x, gain, beam_width)
        return self.decode(codes, scales, dtype=x.dtype)

    def _decoded_shapes(self, codes):
        """Decoded unit-scale shapes ``[H, N, D]`` of codes ``[1, N, S]``."""
        inner = self.shape_codec
        unit = torch.ones(1, codes.shape[1], device=codes.device)
        return self._split(inner._synthesize(inner._coded_transform(codes), unit))

    def _joint(self, x):  # [H, N, D] -> [1, N, H*D]
        return x.permute(1, 0, 2).reshape(1, x.shape[1], -1)

    def _split(self, joint):  # [1, N, H*D] -> [H, N, D]
        return joint[0].reshape(joint.shape[1], self.num_heads, self.head_dim).permute(1, 0, 2)

    def _check_input(self, x):
        if x.ndim != 3 or x.shape[0] != self.num_heads or x.shape[2] != self.head_dim:
            raise ValueError(
                f"Expected [heads={self.num_heads}, tokens, head_dim={self.head_dim}] vectors, got {tuple(x.shape)}: "
                "these codebooks were fitted for a model with a different number of KV heads or head size."
            )

    # ---- attention ------------------------------------------------------------------------------------------
    def attention_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean ``[H, D]``, synthesis ``[H, H*D, D]``, codebooks ``[S, K, g]``, stage groups ``[S]``): head ``h``
        of a token is ``s_h * (mean[h] + z @ synthesis[h])`` with ``z`` the token's ``H*D`` transform components. The
        synthesis is a view of the shape codec's (of its basis, transposed, for an orthogonal transform): kernels that
        read it contiguous copy it per call rather than every cache of the model holding a second copy."""
        if self._operands is None or self._operands[0].device != self.mean.device:
            inner = self.shape_codec
            synthesis = inner.basis[0].transpose(0, 1) if inner.synthesis is None else inner.synthesis[0]  # [Dt, H*D]
            per_head = synthesis.reshape(synthesis.shape[0], self.num_heads, self.head_dim).permute(1, 0, 2)
            self._operands = (inner.mean[0].reshape(self.num_heads, self.head_dim).contiguous(), per_head,
                              inner.codebooks.contiguous(), inner.stage_groups.contiguous())
        return self._operands

    # ---- serialization --------------------------------------------------------------------------------------
    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        tensors = self.shape_codec.state_dict(f"{prefix}.shape")
        if self.log_scale_range is not None:
            tensors[f"{prefix}.log_scale_range"] = self.log_scale_range.contiguous()
        return tensors

    def consistency_problems(self, codebook_bits: int, group_dim: int, scale_bits: int) -> list[str]:
        """What is wrong with a codec read from a file that says these sizes (empty when it is consistent)."""
        heads, scale_range = self.num_heads, self.log_scale_range
        if self.scale_bits != scale_bits:
            return [f"{self.scale_bits}-bit scales where the config says {scale_bits}"]
        if scale_range is not None and (
                tuple(scale_range.shape) != (heads, 2) or not bool((scale_range[:, 0] < scale_range[:, 1]).all())
                or not bool(torch.isfinite(scale_range).all())):
            return [f"log_scale_range {tuple(scale_range.shape)} is not [{heads}, 2] with low < high"]
        # the shape code has no scale of its own
        return self.shape_codec.consistency_problems(codebook_bits, group_dim, self.shape_codec.scale_bits)

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor], prefix: str, group_dim: int, num_heads: int, stats=None):
        shape_codec = TransformResidualVQ.from_state_dict(tensors, f"{prefix}.shape", group_dim)
        scale_range = tensors.get(f"{prefix}.log_scale_range")
        return cls(shape_codec, num_heads, None if scale_range is None else scale_range.float(), stats or {})


def fit_joint_head_residual_vq(
    samples: torch.Tensor,
    *,
    max_stages: int,
    scale_bits: int = LOG_SCALE_BITS,
    metric: torch.Tensor | None = None,
    **fit_settings,
) -> JointHeadResidualVQ:
    """Fit a cross-head codec on calibration vectors ``samples`` (``[H, N, D]``): per-head 8-bit scale levels as the
    per-head codec fits them, then :func:`fit_transform_residual_vq` on the normalized shapes of all heads joined
    (``[1, N, H*D]``, ``max_stages`` stages), weighted by each token's mean squared scale."""
    if samples.ndim != 3:
        raise ValueError(f"samples must be [heads, tokens, head_dim], got {tuple(samples.shape)}.")
    if metric is not None:
        raise ValueError("The joint-head codec has no error metric option (metric='attention'); use the per-head layout.")
    if scale_bits not in SCALE_BIT_CHOICES:
        raise ValueError(f"scale_bits must be one of {SCALE_BIT_CHOICES}, got {scale_bits!r}.")
    x = samples.float()
    num_heads, n, _ = x.shape
    log_scale_range = None
    if scale_bits == LOG_SCALE_BITS:
        log_rms = torch.log2(_rms(x))
        log_scale_range = torch.stack(
            [log_rms.min(dim=1).values - LOG_SCALE_MARGIN, log_rms.max(dim=1).values + LOG_SCALE_MARGIN], dim=1
        )
    scale_values = quantize_scales(_rms(x), log_scale_range)[1]  # [H, N]
    shapes = (x / scale_values[..., None]).permute(1, 0, 2).reshape(1, n, -1)
    shape_codec = fit_transform_residual_vq(
        shapes, max_stages=max_stages, scale_bits=scale_bits, normalized_weights=scale_values.pow(2).mean(0, keepdim=True),
        **fit_settings,
    )
    shape_codec.stats["layout"] = "joint_heads"
    return JointHeadResidualVQ(shape_codec, num_heads, log_scale_range, shape_codec.stats)
