"""Transform-coded residual vector quantization of per-head KV vectors (the GSRQ codec).

A head vector ``x`` (``[d]``) is coded as
    s   = rms(x)                                 per-token, per-head scale: 8 bits, log-uniform in a per-head range
                                                 fitted at calibration (``scale_bits=8``, the default), or fp16;
                                                 the *stored* scale is re-chosen after the shape is coded, so the
                                                 decoded vector keeps the input's norm (see ``_refit_gains``)
    z   = (x / s - mean_h) @ basis_h             per-head decorrelating transform (PCA/KLT; identity when disabled),
                                                 optionally in a metric-whitened space (see ``metric`` below)
    z is split into groups of ``group_dim`` consecutive components; the codec is an ordered list of *stages*,
    each a (group, codebook) pair: stage m codes the running residual of its group with one ``codebook_bits`` index.
Stages are allocated greedily across groups by the weighted error they remove on calibration data (reverse
water-filling in practice: high-variance principal components get more stages, weak ones none), so a lower bit rate
is exactly a prefix of the stage list, and one calibration serves every rate up to the largest one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..kernels import MAX_BEAM_WIDTH, residual_encode
from .base import KVCodec
from .kmeans import DEFAULT_LEARNER, fit_codebook, nearest_codeword
from .scales import (
    FP16_SCALE_BITS,
    LOG_SCALE_BITS,
    quantize_scales,
)

SCALE_BIT_CHOICES = (LOG_SCALE_BITS, FP16_SCALE_BITS)
# Octaves added below and above the calibration samples' scale range: held-out tokens a little outside it are still
# coded without clamping. On the default model the widened ranges span 2.5-6.4 octaves, a step of at most 0.025 octave
# (1.8 % in scale, ~3e-5 relative MSE: negligible next to the 1e-2 of the vector code).
LOG_SCALE_MARGIN = 1.0
_EPS = 1e-8
# Changes whenever encode() picks other codes or scales for the same codebooks (2: least-squares gain after the codes;
# 3: norm-restoring gain; 4: beam search). Files stay readable across revisions; the calibration store re-calibrates
# so stored held-out statistics describe the encoder in use.
ENCODER_REVISION = 4
# How encode() chooses the stored scale after the codes (see TransformResidualVQ._refit_gains).
GAIN_CHOICES = ("norm", "least_squares", "rms")
DEFAULT_GAIN = "norm"
MAX_NORM_STRETCH = 16.0  # the norm gain never multiplies a decoded shape's length by more than this
# Code paths encode() keeps per group while searching its stages (1: greedy). On the default model at 2 bits, 8 beams
# cut teacher-forced KL by 12-15 % against greedy (4: 12 %, 32: no further gain). The search costs encoding time:
# it lengthens a prefill, and decode steps only a little (they encode at each flush).
DEFAULT_BEAM_WIDTH = 8


@dataclass
class TransformResidualVQ(KVCodec):
    """One fitted codec for one layer's keys or values, one code per head vector with codebooks shared by the heads
    (the ``per_head`` layout). Tensors are float32 on the codec's device."""

    layout = "per_head"
    supports_metric = True

    @staticmethod
    def fit(samples: torch.Tensor, **settings):
        return fit_transform_residual_vq(samples, **settings)

    mean: torch.Tensor  # [H, D]
    basis: torch.Tensor  # [H, D, D] analysis transform; columns are components in coding order
    stage_groups: torch.Tensor  # [S] int64, group index of each stage
    codebooks: torch.Tensor  # [S, K, group_dim]
    group_dim: int
    stats: dict = field(default_factory=dict)  # fit diagnostics (JSON-serialisable)
    synthesis: torch.Tensor | None = None  # [H, D, D] inverse of ``basis``; None when ``basis`` is orthogonal
    log_scale_range: torch.Tensor | None = None  # [H, 2] log2 (low, high) of 8-bit scales; None: fp16 scales
    _bags: tuple | None = field(default=None, repr=False, compare=False)  # see _group_bags
    _table_source: TransformResidualVQ | None = field(default=None, repr=False, compare=False)
    _operands: tuple | None = field(default=None, repr=False, compare=False)
    _levels: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [H, 256] 8-bit scale values
    _centre: torch.Tensor | None = field(default=None, repr=False, compare=False)  # see _coding_space_mean

    @property
    def num_heads(self) -> int:
        return self.mean.shape[0]

    @property
    def head_dim(self) -> int:
        return self.mean.shape[1]

    @property
    def num_stages(self) -> int:
        return self.codebooks.shape[0]

    @property
    def codebook_bits(self) -> int:
        return int(math.log2(self.codebooks.shape[1]))

    def truncated(self, num_stages: int) -> TransformResidualVQ:
        """The same codec at a lower rate: the first ``num_stages`` stages (a prefix of the greedy allocation)."""
        if not 0 <= num_stages <= self.num_stages:
            raise ValueError(f"num_stages must be in [0, {self.num_stages}], got {num_stages}.")
        prefix = TransformResidualVQ(
            self.mean, self.basis, self.stage_groups[:num_stages], self.codebooks[:num_stages], self.group_dim, self.stats,
            self.synthesis, self.log_scale_range,
        )
        prefix._table_source = self._table_source or self  # lower rates read a prefix of the same derived tables
        return prefix

    def to(self, device=None, dtype=None) -> TransformResidualVQ:
        move = lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else None)  # noqa: E731
        return TransformResidualVQ(
            move(self.mean), move(self.basis), self.stage_groups.to(device), move(self.codebooks), self.group_dim, self.stats,
            None if self.synthesis is None else move(self.synthesis),
            None if self.log_scale_range is None else self.log_scale_range.to(device),
        )

    # ---- coding ---------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, gain: str = DEFAULT_GAIN,
               beam_width: int = DEFAULT_BEAM_WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: ``[H, N, D]`` -> (codes ``[H, N, S]`` uint8, stored scales ``[H, N]``: :attr:`scale_dtype`).

        ``beam_width``: code paths kept per group while its stages are searched (1: greedy, each stage takes the
        nearest codeword; more find codes with less total error, at about ``beam_width`` times the work).
        ``gain`` chooses the stored scale once the codes are chosen (the decoder is the same for all three):
        ``"norm"`` (default) makes each decoded vector as long as its input, ``"least_squares"`` minimizes each
        vector's squared error, ``"rms"`` keeps the RMS the vector was normalized by. See :meth:`_refit_gains`.
        """
        check_encoder_options(gain, beam_width)
        self._check_input(x)
        levels = self.scale_level_table(x.device)
        scales, scale_values = quantize_scales(_rms(x), self.log_scale_range, levels)
        z = self._analyze(x.float(), scale_values)  # coded relative to the scale the decoder will use
        num_heads, n, dim = z.shape
        # hf_kvcodecs::residual_encode: compiled loop on CPU, Triton kernels on CUDA, kernels/reference.py otherwise
        codes = residual_encode(z.reshape(num_heads * n, dim), self.codebooks, self.stage_groups, beam_width)
        codes = codes.reshape(num_heads, n, self.num_stages)
        if gain == "rms":
            return codes, scales
        return codes, self._refit_gains(z, codes, scales, scale_values, gain)

    def _refit_gains(self, z, codes, scales, scale_values, gain):
        """Stored scales re-chosen once the shape is coded, from the input ``a`` and the decoded shape ``b`` in the
        coding space (where the codec's error metric is plain squared distance).

        Residual VQ returns a shape shorter than its input (the part of the vector it misses is, on average,
        orthogonal to what it returns), so decoding with the RMS shrinks every vector. ``"norm"`` undoes that:
        gain ``|a| / |b|``, the decoded vector is as long as the input. For attention this matters more than the
        squared error: a shrunken key flattens its attention scores, a shrunken value dims its contribution (on the
        default model it cuts teacher-forced KL by a fifth at 2 bits against the least-squares gain, though its
        squared error is higher). ``"least_squares"``: gain ``<a, b> / |b|^2``, the smallest error for that shape;
        each vector keeps the RMS level when that is better after quantization. Neither costs bits.
        """
        centre = self._coding_space_mean()
        target = z + centre  # x / s in the coding space
        return refit_gains(target, centre + self._coded_transform(codes), scales, scale_values, gain, self.log_scale_range,
                           self.scale_level_table(z.device))

    def _coding_space_mean(self) -> torch.Tensor:
        """``[H, 1, D]`` the mean in the coding space (kept: every flush of a cache refits gains with it)."""
        if self._centre is None or self._centre.device != self.mean.device:
            self._centre = torch.einsum("hd,hde->he", self.mean, self.basis)[:, None, :]
        return self._centre

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """Inverse of :meth:`encode`: ``[H, N, S]`` codes and ``[H, N]`` stored scales -> ``[H, N, D]``."""
        num_codes = codes.shape[-1]
        if num_codes != self.num_stages:
            raise ValueError(f"Got {num_codes} codes per vector but the codec has {self.num_stages} stages.")
        return self._synthesize(self._coded_transform(codes), self.scale_values(scales).to(self.codebooks.dtype)).to(dtype)

    def _coded_transform(self, codes: torch.Tensor) -> torch.Tensor:
        """Sum of the codewords of ``[H, N, S]`` codes in the transform domain: ``[H, N, D]``.

        One fused gather-and-sum (``embedding_bag``) over the ``[S*K, group_dim]`` codebooks, one bag per token and
        group, instead of a Python loop of gathers and slice-adds. A table of every codeword placed in a full-width
        row would sum the same floats in the same order, but it would hold ``head_dim / group_dim`` times the
        codebooks' bytes (84 MiB for the default model's keys), only to add zeros.
        """
        num_heads, n, num_codes = codes.shape
        if num_codes == 0:
            return torch.zeros(num_heads, n, self.head_dim, device=codes.device, dtype=self.codebooks.dtype)
        order, first_rows, group_starts = self._group_bags(codes.device)
        vectors = num_heads * n
        index = codes.reshape(vectors, num_codes).long().gather(1, order.expand(vectors, -1)).add_(first_rows)
        offsets = torch.arange(0, vectors * num_codes, num_codes, device=codes.device)[:, None] + group_starts
        z = F.embedding_bag(index.reshape(-1), self.codebooks.reshape(-1, self.group_dim), offsets.reshape(-1),
                            mode="sum")  # a group no stage codes is an empty bag: zeros
        return z.reshape(num_heads, n, self.head_dim)

    def _group_bags(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """How :meth:`_coded_transform` regroups a vector's codes into one bag per group: (the stages sorted by their
        group, stable, so each group's codewords are added in stage order; the first codebook row of each of those
        stages; where each group's stages start in that order). A few integers per stage, built once per device."""
        if self._bags is None or self._bags[0].device != device:
            groups = self.stage_groups.to(device)
            order = torch.sort(groups, stable=True).indices
            counts = torch.bincount(groups, minlength=self.head_dim // self.group_dim)
            self._bags = (order, order * self.codebooks.shape[1], torch.cumsum(counts, 0) - counts)
        return self._bags

    def attention_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean ``[H, D]``, synthesis ``[H, D, D]``, codebooks ``[S, K, g]``, stage groups ``[S]``) as the
        ``hf_kvcodecs::coded_attention`` op takes them: a vector is ``s * (mean + z @ synthesis)``. The synthesis of
        an orthogonal transform is the basis transposed, a view: kernels that read it contiguous copy it per call
        rather than every cache of the model holding a second copy of the basis."""
        if self._operands is None or self._operands[0].device != self.mean.device:
            synthesis = self.basis.transpose(1, 2) if self.synthesis is None else self.synthesis
            self._operands = (self.mean.contiguous(), synthesis, self.codebooks.contiguous(),
                              self.stage_groups.contiguous())
        return self._operands

    def reconstruct(self, x: torch.Tensor, gain: str = DEFAULT_GAIN, beam_width: int = DEFAULT_BEAM_WIDTH) -> torch.Tensor:
        codes, scales = self.encode(x, gain, beam_width)
        return self.decode(codes, scales, dtype=x.dtype)

    def _analyze(self, x, scales):
        return torch.einsum("hnd,hde->hne", x / scales.clamp_min(_EPS)[..., None] - self.mean[:, None, :], self.basis)

    def _synthesize(self, z, scales):
        synthesis = self.basis.transpose(1, 2) if self.synthesis is None else self.synthesis
        return torch.baddbmm(self.mean[:, None, :], z, synthesis).mul_(scales[..., None])

    def _check_input(self, x):
        if x.ndim != 3 or x.shape[0] != self.num_heads or x.shape[2] != self.head_dim:
            raise ValueError(
                f"Expected [heads={self.num_heads}, tokens, head_dim={self.head_dim}] vectors, got {tuple(x.shape)}: "
                "these codebooks were fitted for a model with a different number of KV heads or head size."
            )

    # ---- serialization --------------------------------------------------------------------------------------
    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        tensors = {
            f"{prefix}.mean": self.mean.contiguous(),
            f"{prefix}.basis": self.basis.contiguous(),
            f"{prefix}.stage_groups": self.stage_groups.contiguous(),
            f"{prefix}.codebooks": self.codebooks.contiguous(),
        }
        if self.synthesis is not None:
            tensors[f"{prefix}.synthesis"] = self.synthesis.contiguous()
        if self.log_scale_range is not None:
            tensors[f"{prefix}.log_scale_range"] = self.log_scale_range.contiguous()
        return tensors

    def consistency_problems(self, codebook_bits: int, group_dim: int, scale_bits: int) -> list[str]:
        """What is wrong with a codec read from a file that says these sizes (empty when it is consistent)."""
        heads, dim = self.mean.shape
        expected_codebook = (self.num_stages, 2 ** codebook_bits, group_dim)
        problems = []
        if tuple(self.basis.shape) != (heads, dim, dim):
            problems.append(f"basis {tuple(self.basis.shape)} != {(heads, dim, dim)}")
        if self.synthesis is not None and tuple(self.synthesis.shape) != (heads, dim, dim):
            problems.append(f"synthesis {tuple(self.synthesis.shape)} != {(heads, dim, dim)}")
        if tuple(self.codebooks.shape) != expected_codebook:
            problems.append(f"codebooks {tuple(self.codebooks.shape)} != {expected_codebook}")
        if self.stage_groups.numel() != self.num_stages or (self.stage_groups.numel() and (
                int(self.stage_groups.min()) < 0 or int(self.stage_groups.max()) >= dim // group_dim)):
            problems.append("stage_groups out of range")
        if self.scale_bits != scale_bits:
            problems.append(f"{self.scale_bits}-bit scales where the config says {scale_bits}")
        elif self.log_scale_range is not None and not _valid_scale_range(self.log_scale_range, heads):
            problems.append(f"log_scale_range {tuple(self.log_scale_range.shape)} is not [{heads}, 2] with low < high")
        checked = (self.mean, self.basis, self.codebooks) + (() if self.synthesis is None else (self.synthesis,))
        checked += () if self.log_scale_range is None else (self.log_scale_range,)
        if not all(torch.isfinite(tensor).all() for tensor in checked):
            problems.append("non-finite values")
        return problems

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor], prefix: str, group_dim: int, num_heads: int | None = None,
                        stats=None):
        return cls(
            tensors[f"{prefix}.mean"].float(),
            tensors[f"{prefix}.basis"].float(),
            tensors[f"{prefix}.stage_groups"].long(),
            tensors[f"{prefix}.codebooks"].float(),
            group_dim,
            stats or {},
            tensors[f"{prefix}.synthesis"].float() if f"{prefix}.synthesis" in tensors else None,
            tensors[f"{prefix}.log_scale_range"].float() if f"{prefix}.log_scale_range" in tensors else None,
        )


def _valid_scale_range(log_scale_range: torch.Tensor, heads: int) -> bool:
    return tuple(log_scale_range.shape) == (heads, 2) and bool((log_scale_range[:, 0] < log_scale_range[:, 1]).all())


def refit_gains(target, coded, scales, scale_values, gain: str, log_scale_range, levels=None):
    """Stored scales ``[H, N]`` re-chosen for decoded shapes ``coded`` of inputs ``target`` (both ``[H, N, D]``, in a
    space where the error is plain squared distance; ``scales``/``scale_values``: the stored RMS scales and their
    values; ``levels``: as :func:`quantize_scales` takes them). See :meth:`TransformResidualVQ._refit_gains` for
    ``gain``."""
    coded_energy = coded.pow(2).sum(-1).clamp_min(_EPS)
    overlap = (target * coded).sum(-1)
    refitted, refitted_values = quantize_scales((scale_values * overlap / coded_energy).clamp_min(_EPS), log_scale_range,
                                                levels)

    def error(gain):  # |a - g b|^2 up to the |a|^2 both share, with a = s * target
        return gain.pow(2) * coded_energy - 2 * gain * scale_values * overlap

    least_squares = torch.where(error(refitted_values) < error(scale_values), refitted, scales)
    if gain == "least_squares":
        return least_squares
    ratio = target.pow(2).sum(-1).div(coded_energy).sqrt()
    stretched = quantize_scales((scale_values * ratio).clamp(_EPS, torch.finfo(torch.float16).max), log_scale_range,
                                levels)[0]
    # Stretching a shape that captured almost none of the vector (or points away from it) would add error rather than
    # restore length; such vectors (a decoded shape 16x shorter than the input, or none of it) take the least-squares
    # gain.
    degenerate = (ratio > MAX_NORM_STRETCH) | (overlap <= 0)
    return torch.where(degenerate, least_squares, stretched)


def check_bit_rate(name: str, value) -> float:
    """A bit rate (bits per KV element) given by a user, as a float, or a clear error naming the option."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number of bits per KV element (e.g. 2.0), got {value!r}.")
    return float(value)


def check_encoder_options(gain: str, beam_width: int) -> None:
    """Clear errors for encoder options (they also arrive through ``cache_config``)."""
    if gain not in GAIN_CHOICES:
        raise ValueError(f"gain must be one of {GAIN_CHOICES}, got {gain!r}.")
    if isinstance(beam_width, bool) or not isinstance(beam_width, int) or not 1 <= beam_width <= MAX_BEAM_WIDTH:
        raise ValueError(f"beam_width must be an integer from 1 (greedy) to {MAX_BEAM_WIDTH}, got {beam_width!r}.")


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.float().pow(2).mean(dim=-1).sqrt().clamp_min(_EPS)


def fit_transform_residual_vq(
    samples: torch.Tensor,
    *,
    max_stages: int,
    group_dim: int = 8,
    codebook_bits: int = 8,
    learner: str = DEFAULT_LEARNER,
    weighted: bool = True,
    transform: str = "pca",
    metric: torch.Tensor | None = None,
    scale_bits: int = LOG_SCALE_BITS,
    n_iter: int = 15,
    fit_rows: int = 16384,
    seed: int = 0,
    progress: bool = False,
    normalized_weights: torch.Tensor | None = None,
) -> TransformResidualVQ:
    """Fit a codec on calibration vectors ``samples`` (``[H, N, D]``).

    ``weighted`` uses the squared per-token scale as sample weight (the "weighted GSKM": the objective becomes the
    error in the original KV space). ``transform`` is ``"pca"`` (per-head KLT of the normalized vectors) or
    ``"none"``. Stage allocation across groups is greedy on the weighted error removed.

    ``metric`` (``[H, D, D]``, symmetric positive semi-definite) makes every error ``e`` count as ``e^T M e`` instead
    of ``|e|^2``: the vectors are whitened by ``M^(1/2)`` before the PCA, so fitting and stage allocation spend bits
    where the model is sensitive (e.g. ``W_o^T W_o`` for values: the error after the output projection).

    ``scale_bits`` is 8 (log-uniform levels between the samples' smallest and largest scale per head, widened by
    ``LOG_SCALE_MARGIN`` octaves each side; the 8 bits saved on every vector buy another stage at the same rate) or
    16 (fp16). The codec is fitted on vectors divided by their *stored* scale, as it will code them.

    ``normalized_weights`` (``[H, N]``): the samples are already divided by their scales, whose squares these are
    (the weights of a weighted fit and of the error); the fitted codec then codes shapes only (its scale is 1,
    stored by the caller). :mod:`.joint` fits its cross-head codec this way.
    """
    if samples.ndim != 3:
        raise ValueError(f"samples must be [heads, tokens, head_dim], got {tuple(samples.shape)}.")
    num_heads, n, head_dim = samples.shape
    if head_dim % group_dim:
        raise ValueError(f"group_dim={group_dim} must divide head_dim={head_dim}.")
    if not 1 <= codebook_bits <= 8:
        raise ValueError(f"codebook_bits must be in 1..8 (codes are stored as uint8), got {codebook_bits}.")
    if scale_bits not in SCALE_BIT_CHOICES:
        raise ValueError(f"scale_bits must be one of {SCALE_BIT_CHOICES}, got {scale_bits!r}.")
    x = samples.float()
    log_scale_range = None
    if normalized_weights is not None:
        if normalized_weights.shape != samples.shape[:2]:
            raise ValueError(f"normalized_weights must be [heads, tokens] = {tuple(samples.shape[:2])}, got "
                             f"{tuple(normalized_weights.shape)}.")
        scales = torch.ones(num_heads, n)
        squared_scales = normalized_weights.float()
    else:
        if scale_bits == LOG_SCALE_BITS:
            log_rms = torch.log2(_rms(x))  # [H, N]
            log_scale_range = torch.stack(
                [log_rms.min(dim=1).values - LOG_SCALE_MARGIN, log_rms.max(dim=1).values + LOG_SCALE_MARGIN], dim=1
            )
        scales = quantize_scales(_rms(x), log_scale_range)[1]
        squared_scales = scales**2
    normalized = x / scales[..., None]
    root, inverse_root = _metric_roots(metric, num_heads, head_dim)
    if transform == "pca":
        mean = normalized.mean(dim=1)
        whitened = torch.bmm(normalized - mean[:, None, :], root)
        weights_for_cov = (squared_scales if weighted else torch.ones_like(scales))[..., None]
        covariance = torch.einsum("hnd,hne->hde", whitened * weights_for_cov, whitened) / weights_for_cov.sum(dim=1)[..., None]
        eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
        components = eigenvectors.flip(-1)  # descending variance: strong components first, so groups share a scale
    elif transform == "none":
        mean = torch.zeros(num_heads, head_dim)
        components = torch.eye(head_dim).expand(num_heads, head_dim, head_dim).clone()
    else:
        raise ValueError(f"transform must be 'pca' or 'none', got {transform!r}.")
    basis = torch.bmm(root, components)
    synthesis = None if metric is None else torch.bmm(components.transpose(1, 2), inverse_root)

    codec = TransformResidualVQ(
        mean, basis, torch.zeros(0, dtype=torch.long), torch.zeros(0, 2**codebook_bits, group_dim), group_dim,
        synthesis=synthesis, log_scale_range=log_scale_range,
    )
    groups = head_dim // group_dim
    weights = (squared_scales if weighted else torch.ones_like(scales)).reshape(-1)  # [H*N]
    residual = codec._analyze(x, scales).reshape(num_heads * n, groups, group_dim)
    # Error is always measured in the original space (s^2-weighted), whatever the learner was trained on.
    error_weights = squared_scales.reshape(-1)
    signal_energy = float((squared_scales[..., None] * torch.bmm(normalized, root) ** 2).sum())  # in the metric
    generator = torch.Generator().manual_seed(seed)
    fit_index = torch.randperm(num_heads * n, generator=generator)[: min(fit_rows, num_heads * n)]

    candidates: dict[int, tuple[torch.Tensor, float]] = {}
    stage_groups, codebooks, stage_stats = [], [], []
    current_error = float((error_weights[:, None] * residual.pow(2).sum(-1)).sum())
    bar = tqdm(total=max_stages, desc="stages", leave=False, disable=not progress)
    for stage in range(max_stages):
        for group in range(groups):
            if group in candidates:
                continue
            target = residual[:, group, :]
            codebook = fit_codebook(
                target[fit_index], 2**codebook_bits, learner=learner, weights=weights[fit_index],
                n_iter=n_iter, seed=seed + 7919 * stage + group,
            )
            decoded = codebook[nearest_codeword(target, codebook)]
            before = (error_weights * target.pow(2).sum(-1)).sum()
            after = (error_weights * (target - decoded).pow(2).sum(-1)).sum()
            candidates[group] = (codebook, float(before - after))
        best_group = max(candidates, key=lambda g: candidates[g][1])
        codebook, reduction = candidates.pop(best_group)
        residual[:, best_group, :] -= codebook[nearest_codeword(residual[:, best_group, :], codebook)]
        current_error -= reduction
        stage_groups.append(best_group)
        codebooks.append(codebook)
        stage_stats.append({"group": best_group, "relative_mse_after": current_error / signal_energy})
        bar.update(1)
    bar.close()
    codec.stage_groups = torch.tensor(stage_groups, dtype=torch.long)
    codec.codebooks = torch.stack(codebooks) if codebooks else codec.codebooks
    codec.stats = {"stages": stage_stats, "learner": learner, "weighted": weighted, "transform": transform,
                   "metric": metric is not None, "scale_bits": scale_bits}
    return codec


def _metric_roots(metric, num_heads: int, head_dim: int):
    """``M^(1/2)`` and ``M^(-1/2)`` per head (identity without a metric), normalized to unit mean eigenvalue."""
    if metric is None:
        identity = torch.eye(head_dim).expand(num_heads, head_dim, head_dim).clone()
        return identity, identity
    if metric.shape != (num_heads, head_dim, head_dim):
        raise ValueError(f"metric must be [{num_heads}, {head_dim}, {head_dim}], got {tuple(metric.shape)}.")
    symmetric = 0.5 * (metric.double() + metric.double().transpose(1, 2))
    eigenvalues, eigenvectors = torch.linalg.eigh(symmetric)
    eigenvalues = eigenvalues / eigenvalues.mean(dim=-1, keepdim=True).clamp_min(1e-30)
    # A floor keeps the inverse bounded: directions the metric ignores still get (cheaply) reconstructed.
    eigenvalues = eigenvalues.clamp_min(1e-4)
    root = eigenvectors @ torch.diag_embed(eigenvalues.sqrt()) @ eigenvectors.transpose(1, 2)
    inverse_root = eigenvectors @ torch.diag_embed(eigenvalues.rsqrt()) @ eigenvectors.transpose(1, 2)
    return root.float(), inverse_root.float()


def lowest_bit_rate(head_dim: int, codebook_bits: int, scale_bits: int = LOG_SCALE_BITS, heads: int = 1) -> float:
    """Bits per element of one residual stage plus the scales: the lowest rate a codec offers (``heads`` as in
    :func:`stages_for_rate`)."""
    return (heads * scale_bits + codebook_bits) / (heads * head_dim)


def stages_for_rate(bits_per_element: float, head_dim: int, codebook_bits: int, scale_bits: int = LOG_SCALE_BITS,
                    heads: int = 1) -> int:
    """Residual stages that fit in ``bits_per_element`` once the scale of each head vector is paid for; ``heads`` > 1
    for one code over that many head vectors (a joint-head codec), each with its own scale."""
    elements = heads * head_dim
    index_bits = bits_per_element * elements - heads * scale_bits
    if index_bits < 0:
        raise ValueError(
            f"{bits_per_element} bits per element is less than the {scale_bits}-bit scale alone costs "
            f"({scale_bits / head_dim:.3f} bits per element at head_dim {head_dim})."
        )
    return math.floor(index_bits / codebook_bits + 1e-9)


def relative_mse(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return float((x.float() - x_hat.float()).pow(2).sum() / x.float().pow(2).sum().clamp_min(_EPS))


def gaussian_rate_distortion_reference(samples: torch.Tensor, code_bits_per_vector: float) -> float:
    """Relative MSE of the ideal (infinite-dimensional) code for a Gaussian source with the samples' second moments.

    Reverse water-filling over the eigenvalues of each head's second-moment matrix at ``code_bits_per_vector`` bits
    per head vector. A yardstick for reports, not a strict bound: a Gaussian is the hardest source for its covariance
    (real KV vectors can be coded below it), and the codec also spends the scale bits the reference does not get.
    """
    x = samples.float()
    total_distortion, total_energy = 0.0, 0.0
    for head in range(x.shape[0]):
        moments = x[head].T @ x[head] / x.shape[1]
        eigenvalues = torch.linalg.eigvalsh(moments).clamp_min(1e-20).double()
        distortion = _water_fill(eigenvalues, code_bits_per_vector)
        total_distortion += distortion
        total_energy += float(eigenvalues.sum())
    return total_distortion / total_energy


def joint_rate_distortion_reference(samples: torch.Tensor, code_bits_per_vector: float) -> float:
    """:func:`gaussian_rate_distortion_reference` for one code over all heads of a token (``H * code_bits_per_vector``
    bits for the ``H * D`` vector): lower than the per-head reference by what the heads share."""
    heads, n, dim = samples.shape
    joint = samples.float().permute(1, 0, 2).reshape(1, n, heads * dim)
    return gaussian_rate_distortion_reference(joint, heads * code_bits_per_vector)


def _water_fill(eigenvalues: torch.Tensor, rate_bits: float) -> float:
    if rate_bits <= 0:
        return float(eigenvalues.sum())
    low, high = 1e-30, float(eigenvalues.max())
    for _ in range(200):  # bisection on the water level theta (in log space)
        theta = math.sqrt(low * high)
        rate = float(0.5 * torch.log2(eigenvalues / theta).clamp_min(0).sum())
        if rate > rate_bits:
            low = theta
        else:
            high = theta
    theta = high
    return float(torch.minimum(eigenvalues, torch.tensor(theta, dtype=eigenvalues.dtype)).sum())
