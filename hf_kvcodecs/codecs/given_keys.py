"""Values coded given the same token's decoded keys (the "given_keys" value layout).

A token's keys and values are two linear maps of the same normalized hidden state, which on the default model spans
far fewer directions than it has dimensions: a linear map from a token's pre-RoPE keys (all KV heads) explains
23-88 % of its values' variance (layer 0 most, the last layer least). The keys are coded first anyway, so the decoder
has them: this codec predicts the values from the *decoded* keys (closed loop, so the encoder subtracts exactly the
prediction the decoder will add) and codes only what the prediction leaves, jointly over the heads like the default
value codec, at the same rate.

On the default model (keys per head at 2 bits, codecs fitted on the same samples) the values' held-out relative MSE
at 2 bits per element is 1.4-1.9x lower given the keys than coded jointly without them, the gain largest in the early
layers, whose values the keys explain best (``benchmarks/results/value_prediction.md``). Predicting each value head
from its own key head only recovers about half of that gain, so the prediction reads every key head.

``v^ = k^ @ P + b + r^``: ``k^`` the token's decoded pre-RoPE keys (``[H*D]``), ``P`` ``[H*D, H*D]``, ``b`` ``[H*D]``,
``r^`` the decoded residual (a :class:`~.joint.JointHeadResidualVQ` code). Keys must be coded before RoPE (a
prediction from rotated keys would depend on the position).

Attention over these values needs the prediction term ``sum_t p_t k^_t @ P`` too. ``k^_t`` is linear in the key
codes, so it is one more histogram per key head over the same attention weights (:meth:`attention_prediction`): the
Triton kernel computes it that way (``kernels.reference.fold_value_prediction``), and so does the compiled CPU
attention for keys coded jointly over heads or of a head_dim other than 64 or 128. For keys per head (head_dim 64 or
128) and keys coded conditionally across heads, the compiled CPU loop instead forms ``sum_t p_t k^_t`` while it
rebuilds the keys, tile by tile (each tile's weights against its own peak, rescaled to the row's afterwards), and
multiplies it by ``P``: no histogram per key head, whose cost, one more pass over every key head's codes, would be a
large share of the attention's.
The op ``hf_kvcodecs::coded_attention`` takes the predictor itself (``value_predictor``); its reference adds
``(sum_t p_t k^_t) @ P`` from attention-weighted sums of the coded keys, chunk by chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels import cached_fold_value_prediction
from .base import KVCodec
from .conditional import ridge_regression
from .joint import JointHeadResidualVQ, fit_joint_head_residual_vq
from .residual import DEFAULT_BEAM_WIDTH, DEFAULT_GAIN


@dataclass
class KeyPredictedValueVQ(KVCodec):
    """A joint-head residual codec for ``values - prediction(decoded keys)`` plus the prediction ``[H*D + 1, H*D]``
    (the last row is the bias). Codes ``[1, N, S]`` and scales ``[H, N]`` as the joint codec's; :meth:`encode` and
    :meth:`decode` also take the tokens' decoded pre-RoPE keys ``[H, N, D]``."""

    residual_codec: JointHeadResidualVQ
    predictor: torch.Tensor  # [H*D + 1, H*D] float32
    stats: dict = field(default_factory=dict)

    layout = "given_keys"

    @staticmethod
    def fit(samples: torch.Tensor, **settings):
        return fit_key_predicted_value_vq(samples, **settings)
    kinds = ("values",)
    joint_code = True
    needs_pre_rope_keys = True
    pre_rope_reason = ("predicts values from the decoded keys before RoPE (rotated keys would make the prediction "
                       "depend on the position)")
    needs_keys = True  # the cache hands encode/decode the tokens' decoded keys

    def __post_init__(self):
        width = self.num_heads * self.head_dim
        if tuple(self.predictor.shape) != (width + 1, width):
            raise ValueError(f"predictor must be [{width + 1}, {width}], got {tuple(self.predictor.shape)}.")

    # ---- sizes (those of the residual code) -----------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return self.residual_codec.num_heads

    @property
    def head_dim(self) -> int:
        return self.residual_codec.head_dim

    @property
    def num_stages(self) -> int:
        return self.residual_codec.num_stages

    @property
    def group_dim(self) -> int:
        return self.residual_codec.group_dim

    @property
    def codebook_bits(self) -> int:
        return self.residual_codec.codebook_bits

    @property
    def codebooks(self) -> torch.Tensor:
        return self.residual_codec.codebooks

    @property
    def mean(self) -> torch.Tensor:
        return self.residual_codec.mean

    @property
    def log_scale_range(self) -> torch.Tensor | None:
        return self.residual_codec.log_scale_range

    def scale_values(self, stored: torch.Tensor) -> torch.Tensor:
        return self.residual_codec.scale_values(stored)

    def scale_level_table(self, device) -> torch.Tensor | None:
        return self.residual_codec.scale_level_table(device)

    def truncated(self, num_stages: int) -> KeyPredictedValueVQ:
        """The same codec at a lower rate: a prefix of the residual code (the prediction is the full-rate one)."""
        return KeyPredictedValueVQ(self.residual_codec.truncated(num_stages), self.predictor, self.stats)

    def to(self, device=None, dtype=None) -> KeyPredictedValueVQ:
        return KeyPredictedValueVQ(self.residual_codec.to(device, dtype), self.predictor.to(device=device, dtype=dtype),
                                   self.stats)

    # ---- coding ---------------------------------------------------------------------------------------------
    def prediction(self, keys: torch.Tensor) -> torch.Tensor:
        """``[H, N, D]`` decoded pre-RoPE keys -> the predicted values ``[H, N, D]``."""
        heads, tokens, dim = keys.shape
        if heads != self.num_heads or dim != self.head_dim:
            raise ValueError(f"Expected decoded keys [heads={self.num_heads}, tokens, head_dim={self.head_dim}], got "
                             f"{tuple(keys.shape)}.")
        flat = keys.float().permute(1, 0, 2).reshape(tokens, heads * dim)
        predictor = self.predictor.to(flat.device)
        predicted = torch.addmm(predictor[-1], flat, predictor[:-1])
        return predicted.reshape(tokens, heads, dim).permute(1, 0, 2)

    def encode(self, x: torch.Tensor, keys: torch.Tensor, gain: str = DEFAULT_GAIN,
               beam_width: int = DEFAULT_BEAM_WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: values ``[H, N, D]``, ``keys``: the same tokens' decoded pre-RoPE keys ``[H, N, D]`` -> (codes
        ``[1, N, S]`` uint8, stored per-head scales ``[H, N]``) of the residual."""
        self.residual_codec._check_input(x)
        return self.residual_codec.encode(x.float() - self.prediction(keys), gain, beam_width)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, keys: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """Inverse of :meth:`encode`, given the same decoded keys -> values ``[H, N, D]``."""
        return (self.prediction(keys) + self.residual_codec.decode(codes, scales)).to(dtype)

    def reconstruct(self, x: torch.Tensor, keys: torch.Tensor, gain: str = DEFAULT_GAIN,
                    beam_width: int = DEFAULT_BEAM_WIDTH) -> torch.Tensor:
        codes, scales = self.encode(x, keys, gain, beam_width)
        return self.decode(codes, scales, keys, dtype=x.dtype)

    def attention_operands(self):
        # The residual code's operands alone would silently drop the prediction: callers must ask for both.
        raise NotImplementedError(
            "Values coded given the keys are the residual code plus a prediction from the keys: pass "
            "residual_attention_operands() and value_predictor=codec.predictor to hf_kvcodecs::coded_attention (or, "
            "to the compiled CPU loop, value_predictor for conditional keys, attention_prediction(key_codec) for others)."
        )

    def residual_attention_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual code's operands, as :meth:`JointHeadResidualVQ.attention_operands`."""
        return self.residual_codec.attention_operands()

    def attention_prediction(self, key_codec) -> tuple[torch.Tensor, ...]:
        """The prediction in terms of ``key_codec``'s codes, as the compiled CPU attention adds it where it does not
        form the key sums in its key loop (``kernels.cpu.fuses_value_prediction``):
        (codebooks ``[1 or Hs, S, K, g]``, stage groups ``[1 or Hs, S]``, mean ``[Hs, H, D]``, synthesis
        ``[Hs, H, Dt, D]``, bias ``[H, D]``), so that value head ``h`` of a coded token is its residual plus
        ``sum_j s_j (mean[j, h] + z_j @ synthesis[j, h]) + bias[h]``, ``z_j`` read from source head ``j``'s key codes
        (for joint keys: the shared code, with head ``j``'s scale). Built once per predictor and key operands (the
        fold the op's implementations share)."""
        return cached_fold_value_prediction(self.predictor, key_codec.attention_operands())

    # ---- serialization --------------------------------------------------------------------------------------
    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        tensors = self.residual_codec.state_dict(f"{prefix}.residual")
        tensors[f"{prefix}.predictor"] = self.predictor.contiguous()
        return tensors

    def consistency_problems(self, codebook_bits: int, group_dim: int, scale_bits: int) -> list[str]:
        """What is wrong with a codec read from a file that says these sizes (empty when it is consistent)."""
        if not bool(torch.isfinite(self.predictor).all()):
            return ["non-finite value predictor"]
        return self.residual_codec.consistency_problems(codebook_bits, group_dim, scale_bits)

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor], prefix: str, group_dim: int, num_heads: int,
                        stats=None):
        residual = JointHeadResidualVQ.from_state_dict(tensors, f"{prefix}.residual", group_dim, num_heads,
                                                       (stats or {}).get("residual"))
        return cls(residual, tensors[f"{prefix}.predictor"].float(), stats or {})


def fit_key_predicted_value_vq(samples: torch.Tensor, *, decoded_keys: torch.Tensor, max_stages: int,
                               metric: torch.Tensor | None = None, **fit_settings) -> KeyPredictedValueVQ:
    """Fit on calibration values ``samples`` ``[H, N, D]`` and the same tokens' keys as the cache will decode them
    (``decoded_keys`` ``[H, N, D]``, pre-RoPE): the prediction by ridge-regularized least squares (with a bias), then
    a joint-head residual codec on what it leaves."""
    if samples.shape != decoded_keys.shape:
        raise ValueError(f"values {tuple(samples.shape)} and decoded keys {tuple(decoded_keys.shape)} must have the "
                         "same [heads, tokens, head_dim] shape.")
    if metric is not None:
        raise ValueError("The given-keys value codec has no error metric option (metric='attention'); use the "
                         "per-head layout.")
    heads, tokens, dim = samples.shape
    flat = lambda x: x.float().permute(1, 0, 2).reshape(tokens, heads * dim)  # noqa: E731
    sources = torch.cat([flat(decoded_keys), torch.ones(tokens, 1)], dim=1)
    predictor = ridge_regression(sources, flat(samples))
    residuals = (flat(samples) - sources @ predictor).reshape(tokens, heads, dim).permute(1, 0, 2).contiguous()
    residual_codec = fit_joint_head_residual_vq(residuals, max_stages=max_stages, **fit_settings)
    explained = 1 - float(residuals.pow(2).sum() / samples.float().pow(2).sum().clamp_min(1e-30))
    stats = {"layout": KeyPredictedValueVQ.layout, "residual": residual_codec.stats,
             "energy_explained_by_keys": round(explained, 4)}
    return KeyPredictedValueVQ(residual_codec, predictor, stats)
