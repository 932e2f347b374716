"""Low-rank maps between two sets of vectors, fitted from streamed second moments: PCA codes with a least-squares
decoder, and reduced-rank regression; plus the per-token scalar quantization of their codes.

Everything is fitted from :class:`CrossMoments` (sums and products accumulated in float64 over any number of
batches), so a caller never holds the activations it fits on.

Why PCA codes decode progressively: PCA scores are uncorrelated, so the ridge least-squares decoder from the first
``r'`` scores is exactly the first ``r'`` rows of the decoder from all ``r`` of them. One decoder then serves every
truncation of the code, and dropping trailing components is the least-squares optimal way to spend fewer bytes.
Reduced-rank regression is nested the same way: its rank-``r'`` solution keeps the first ``r'`` directions of the
rank-``r`` one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CrossMoments:
    """Streaming first and second moments of inputs ``a`` ``[N, Da]`` and targets ``b`` ``[N, Db]`` (float64).

    With ``paired=False`` only the moments of ``a`` are kept (``b`` is then ``a``: a plain PCA).
    """

    def __init__(self, input_dim: int, output_dim: int | None = None, *, paired: bool = True):
        self.input_dim = int(input_dim)
        self.paired = bool(paired)
        self.output_dim = int(output_dim if output_dim is not None else input_dim) if paired else self.input_dim
        self.count = 0
        self.sum_a = torch.zeros(self.input_dim, dtype=torch.float64)
        self.aa = torch.zeros(self.input_dim, self.input_dim, dtype=torch.float64)
        if self.paired:
            self.sum_b = torch.zeros(self.output_dim, dtype=torch.float64)
            self.ab = torch.zeros(self.input_dim, self.output_dim, dtype=torch.float64)
            self.bb = torch.zeros(self.output_dim, self.output_dim, dtype=torch.float64)

    def update(self, a: torch.Tensor, b: torch.Tensor | None = None) -> None:
        a = a.reshape(-1, self.input_dim).to(torch.float64)
        self.count += a.shape[0]
        self.sum_a += a.sum(0)
        self.aa += a.T @ a
        if self.paired:
            if b is None:
                raise ValueError("These moments pair inputs with targets: pass both a and b.")
            b = b.reshape(-1, self.output_dim).to(torch.float64)
            if b.shape[0] != a.shape[0]:
                raise ValueError(f"a has {a.shape[0]} rows and b has {b.shape[0]}; they must be the same tokens.")
            self.sum_b += b.sum(0)
            self.ab += a.T @ b
            self.bb += b.T @ b

    def _require(self, rows: int = 2) -> None:
        if self.count < rows:
            raise ValueError(f"Only {self.count} vectors were accumulated; fitting needs at least {rows}.")

    @property
    def mean_a(self) -> torch.Tensor:
        self._require(1)
        return self.sum_a / self.count

    @property
    def mean_b(self) -> torch.Tensor:
        return self.mean_a if not self.paired else self.sum_b / max(self.count, 1)

    def covariance_aa(self) -> torch.Tensor:
        self._require()
        mean = self.mean_a
        return self.aa / self.count - torch.outer(mean, mean)

    def covariance_ab(self) -> torch.Tensor:
        if not self.paired:
            return self.covariance_aa()
        self._require()
        return self.ab / self.count - torch.outer(self.mean_a, self.mean_b)

    def covariance_bb(self) -> torch.Tensor:
        if not self.paired:
            return self.covariance_aa()
        self._require()
        mean = self.mean_b
        return self.bb / self.count - torch.outer(mean, mean)


@dataclass
class LowRankMap:
    """``decode(encode(a)) = ((a - input_mean) @ encoder) @ decoder + output_mean``, of rank ``encoder.shape[1]``.

    ``encoder`` ``[Da, r]`` lives with the sender, ``decoder`` ``[r, Db]`` with the receiver. ``component_energy``
    ``[r]`` is the variance of each code component (decreasing), which bounds what dropping it costs.
    """

    input_mean: torch.Tensor
    encoder: torch.Tensor
    decoder: torch.Tensor
    output_mean: torch.Tensor
    component_energy: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.encoder.shape[1])

    def encode(self, a: torch.Tensor) -> torch.Tensor:
        return (a - self.input_mean.to(a.dtype)) @ self.encoder.to(a.dtype)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes ``[..., r']`` with ``r' <= rank`` decode through the first ``r'`` rows (a progressive prefix)."""
        used = codes.shape[-1]
        if used > self.rank:
            raise ValueError(f"Codes have {used} components; this map has rank {self.rank}.")
        return codes @ self.decoder[:used].to(codes.dtype) + self.output_mean.to(codes.dtype)

    def truncated(self, rank: int) -> LowRankMap:
        rank = max(0, min(int(rank), self.rank))
        return LowRankMap(self.input_mean, self.encoder[:, :rank], self.decoder[:rank], self.output_mean,
                          self.component_energy[:rank])

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.input_mean": self.input_mean, f"{prefix}.encoder": self.encoder,
                f"{prefix}.decoder": self.decoder, f"{prefix}.output_mean": self.output_mean,
                f"{prefix}.component_energy": self.component_energy}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> LowRankMap:
        names = ("input_mean", "encoder", "decoder", "output_mean", "component_energy")
        missing = [name for name in names if f"{prefix}.{name}" not in tensors]
        if missing:
            raise KeyError(f"{prefix}: missing {', '.join(missing)}")
        made = cls(*(tensors[f"{prefix}.{name}"] for name in names))
        problems = made.shape_problems()
        if problems:
            raise ValueError(f"{prefix}: " + "; ".join(problems))
        return made

    def shape_problems(self) -> list[str]:
        problems = []
        if self.encoder.ndim != 2 or self.decoder.ndim != 2:
            return ["encoder and decoder must be matrices"]
        d_in, rank = self.encoder.shape
        if self.decoder.shape[0] != rank:
            problems.append(f"decoder has {self.decoder.shape[0]} rows for an encoder of rank {rank}")
        if tuple(self.input_mean.shape) != (d_in,):
            problems.append(f"input_mean has shape {tuple(self.input_mean.shape)}, expected ({d_in},)")
        if tuple(self.output_mean.shape) != (self.decoder.shape[1],):
            problems.append(f"output_mean has shape {tuple(self.output_mean.shape)}, expected ({self.decoder.shape[1]},)")
        if tuple(self.component_energy.shape) != (rank,):
            problems.append(f"component_energy has shape {tuple(self.component_energy.shape)}, expected ({rank},)")
        for name in ("input_mean", "encoder", "decoder", "output_mean", "component_energy"):
            if not torch.isfinite(getattr(self, name)).all():
                problems.append(f"{name} holds non-finite values")
        return problems


def _ridge(eigenvalues: torch.Tensor, ridge: float) -> float:
    """An absolute ridge from a relative one: ``ridge`` times the mean variance."""
    return float(ridge) * float(eigenvalues.clamp_min(0).mean())


def principal_components(covariance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (decreasing, clamped at 0) and eigenvectors (columns, sign-fixed so each has a positive largest
    entry: fits on the same data give the same codes) of a symmetric covariance."""
    eigenvalues, vectors = torch.linalg.eigh(covariance.to(torch.float64))
    order = torch.argsort(eigenvalues, descending=True)
    eigenvalues, vectors = eigenvalues[order].clamp_min(0), vectors[:, order]
    signs = torch.sign(vectors.gather(0, vectors.abs().argmax(0, keepdim=True)))
    signs[signs == 0] = 1
    return eigenvalues, vectors * signs


def fit_pca_map(moments: CrossMoments, rank: int, *, ridge: float = 1e-4) -> LowRankMap:
    """Consumer-agnostic codes: the top-``rank`` principal components of the inputs, decoded to the targets by ridge
    least squares (``ridge`` relative to the mean input variance). With targets equal to inputs and ``ridge=0`` this
    is plain PCA reconstruction (decoder = encoder transposed)."""
    eigenvalues, vectors = principal_components(moments.covariance_aa())
    rank = _check_rank(rank, moments.input_dim)
    # components with no variance carry no information; a zero-variance code would divide by zero below
    usable = int((eigenvalues > eigenvalues[0].clamp_min(1e-300) * 1e-12).sum()) if eigenvalues.numel() else 0
    rank = min(rank, usable)
    basis = vectors[:, :rank]
    energy = eigenvalues[:rank]
    cross = basis.T @ moments.covariance_ab()  # Cov(z, b) [r, Db]
    decoder = cross / (energy + _ridge(eigenvalues, ridge))[:, None]
    return LowRankMap(moments.mean_a.float(), basis.float(), decoder.float(), moments.mean_b.float(), energy.float())


def fit_reduced_rank_map(moments: CrossMoments, rank: int, *, ridge: float = 1e-4) -> LowRankMap:
    """Consumer-specific codes: reduced-rank ridge regression from inputs to targets (the codes carry what predicts
    the targets, not what varies most in the inputs). Its code components are ordered by the variance of the fitted
    targets they explain, so prefixes decode as the lower-rank solutions."""
    rank = _check_rank(rank, min(moments.input_dim, moments.output_dim))
    caa, cab = moments.covariance_aa(), moments.covariance_ab()
    eigenvalues = torch.linalg.eigvalsh(caa).clamp_min(0)
    regularized = caa + _ridge(eigenvalues, ridge) * torch.eye(caa.shape[0], dtype=caa.dtype)
    coefficients = torch.linalg.solve(regularized, cab)  # full-rank ridge solution [Da, Db]
    fitted_covariance = coefficients.T @ caa @ coefficients  # covariance of the fitted targets [Db, Db]
    fitted_variance, directions = principal_components(fitted_covariance)
    directions = directions[:, :rank]
    encoder = coefficients @ directions  # [Da, r]
    code_energy = torch.einsum("ir,ij,jr->r", encoder, caa, encoder)
    return LowRankMap(moments.mean_a.float(), encoder.float(), directions.T.float(), moments.mean_b.float(),
                      code_energy.float())


def _check_rank(rank: int, limit: int) -> int:
    if int(rank) < 1:
        raise ValueError(f"A low-rank map needs rank >= 1, got {rank}.")
    return min(int(rank), int(limit))


def relative_error_by_rank(moments: CrossMoments, pca: LowRankMap) -> torch.Tensor:
    """``[r + 1]``: the relative squared error E||b - b_hat||^2 / E||b - mean_b||^2 on the fitting data when the first
    ``k`` components of ``pca`` are kept, for k = 0..r. Closed form from the moments (no second pass)."""
    cbb = moments.covariance_bb()
    total = float(torch.trace(cbb))
    encoder, decoder = pca.encoder.double(), pca.decoder.double()
    czz = encoder.T @ moments.covariance_aa() @ encoder  # Cov(z, z) [r, r]
    czb = encoder.T @ moments.covariance_ab()  # Cov(z, b) [r, Db]
    # error(k) = tr(Cbb) - 2 tr(G_k^T Czb_k) + tr(G_k^T Czz_k G_k) with G_k the first k decoder rows; both traces
    # grow by one row (and column) of their matrices at each k, so cumulative sums give every k at once
    cross = (decoder * czb).sum(1).cumsum(0)
    products = czz * (decoder @ decoder.T)
    quadratic = (2 * torch.tril(products, -1).sum(1) + products.diagonal()).cumsum(0)
    errors = (total - 2 * cross + quadratic).clamp_min(0) / max(total, 1e-300)
    return torch.cat((torch.ones(1, dtype=torch.float64), errors))


def quantize_codes(codes: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-token quantization of codes ``[..., r]``: integer codes in ``[-(2^(b-1)-1), 2^(b-1)-1]`` (int8)
    and one float16 scale per token. ``bits=16`` keeps float16 codes and unit scales. A scale is computed over all
    components, so a prefix of the components dequantizes with the same scale. ``bits=32`` keeps float32 codes
    (lossless: for exactness checks)."""
    if bits in (16, 32):
        dtype = torch.float16 if bits == 16 else torch.float32
        return codes.to(dtype), torch.ones(codes.shape[:-1], dtype=torch.float16)
    if bits not in (2, 3, 4, 5, 6, 7, 8):
        raise ValueError(f"Code bits must be 16, 32 or between 2 and 8, got {bits}.")
    levels = 2 ** (bits - 1) - 1
    peak = codes.abs().amax(-1).float()
    scale = (peak / levels).clamp_min(torch.finfo(torch.float16).tiny).to(torch.float16)
    quantized = torch.round(codes.float() / scale.float()[..., None]).clamp_(-levels, levels).to(torch.int8)
    return quantized, scale


def dequantize_codes(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return quantized.to(dtype) * scale.to(dtype)[..., None]


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit integers ``[..., r]`` (in [-8, 7]) packed two per byte ``[..., ceil(r / 2)]`` (uint8)."""
    if values.shape[-1] % 2:
        values = torch.nn.functional.pad(values, (0, 1))
    nibbles = (values.to(torch.int16) & 0xF).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``count`` signed values per row (int8)."""
    low, high = (packed & 0xF).to(torch.int8), (packed >> 4).to(torch.int8)
    values = torch.stack((low, high), dim=-1).flatten(-2)[..., :count]
    return torch.where(values > 7, values - 16, values)
