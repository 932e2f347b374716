"""Codebook learners: l2 k-means (the VQLLM-style baseline) and Gain-Shape K-means (GSKM), both optionally weighted.

All learners return a plain ``[K, d]`` codebook that is used with the same l2 nearest-codeword encoder, so GSKM is a
drop-in replacement for k-means: same indices, same bits, same decoder.

GSKM writes each codeword as ``g_j * u_j`` with ``||u_j|| = 1``. Its shape is estimated from the *unit directions* of
the cluster members (so a few large-norm members cannot steer it, and the shrinkage of Euclidean averaging does not
blur the direction), and its gain is the weighted least-squares gain for that shape, which keeps the l2 distortion at
least as low as the k-means centroid's would be for the same direction (see shared/docs/algorithms.md §2.3-2.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_EPS = 1e-12
# Rows scored against a codebook at once: a [rows, K] score block of 1 MB at K = 256 stays in L2 for the argmax; a
# block of tens of MB would be written to and read back from memory.
_CHUNK_ROWS = 1024
# Rows whose outer products the principal-shape M-step accumulates at once: 256 rows of 64-dim outer products are 4 MB;
# materializing all of them (N x d^2 floats, 2 GB for 131K 64-dim rows) made that step ~25x slower. The rows are added
# in the same order either way, so the moments are bit-identical.
_OUTER_CHUNK_ROWS = 256
# How k-means++ draws its seeds (recorded with the codebooks as "kmeans_seeding"). 2: one uniform per seed against the
# cumulative D^2 weights; 1: torch.multinomial, which draws an exponential variate for every point per seed, a large
# share of a calibration's time. Same distribution, other draws: revision 2 gives other codebooks for the same seed
# than revision 1, of the same quality.
KMEANS_SEEDING_REVISION = 2


@dataclass(frozen=True)
class LearnerSpec:
    """How a codebook is learned. ``kind`` is "l2" or "gskm"; the other fields are GSKM variants."""

    kind: str
    assignment: str = "l2"  # GSKM training assignment: "l2" against g_j u_j, or "cosine" against u_j
    shape: str = "unit_mean"  # "unit_mean": normalized mean of member directions; "principal": top eigenvector
    spherical_init: bool = True  # k-means++ seeding on unit directions (GSKM) instead of on raw vectors


# The learner calibration uses unless told otherwise: plain l2 k-means. In the codec ablation
# (benchmarks/results/codec_ablation.md) the best GSKM variant, the principal-direction shape, is within 0.5 % of l2
# in relative MSE, but in `bench kv` (benchmarks/results/results.md, two calibration seeds each) l2 codebooks give
# lower teacher-forced KL at 2 bits, with the norm-restoring gain and with the RMS scale, and equal KL at 1 bit.
DEFAULT_LEARNER = "l2"
# The best GSKM variant of the ablation: the one benchmarks compare with l2.
BEST_GSKM_LEARNER = "gskm-principal"

# Named learners the CLI, the cache config and the ablation refer to.
CODEBOOK_LEARNERS: dict[str, LearnerSpec] = {
    "l2": LearnerSpec("l2", spherical_init=False),
    "gskm": LearnerSpec("gskm"),
    "gskm-cosine": LearnerSpec("gskm", assignment="cosine"),
    "gskm-principal": LearnerSpec("gskm", shape="principal"),
}


def nearest_codeword(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the l2-nearest codeword for every row of ``x`` (``[N, d]`` against ``[K, d]``), as int64 ``[N]``."""
    half_sq_norms = 0.5 * (codebook * codebook).sum(dim=1)
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    for start in range(0, x.shape[0], _CHUNK_ROWS):
        block = x[start : start + _CHUNK_ROWS]
        # argmin ||x - c||^2 == argmax <x, c> - ||c||^2 / 2: one GEMM instead of materializing differences.
        out[start : start + _CHUNK_ROWS] = (block @ codebook.T - half_sq_norms).argmax(dim=1)
    return out


def _kmeans_plus_plus(points: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` seeds drawn from ``points`` by k-means++: each next seed with probability proportional to its squared
    distance to the nearest seed so far."""
    n = points.shape[0]
    first = torch.randint(n, (1,), generator=generator).item()
    centers = torch.empty(k, points.shape[1], dtype=points.dtype)
    centers[0] = points[first]
    closest = ((points - points[first]) ** 2).sum(dim=1)
    draws = torch.rand(k, generator=generator, dtype=torch.float64)
    for i in range(1, k):
        cumulative = closest.double().cumsum(0)
        total = float(cumulative[-1])
        if total > 0:
            # the first point whose cumulative weight exceeds the draw: points of weight 0 (already seeds) never are
            index = min(int(torch.searchsorted(cumulative, draws[i] * total, right=True)), n - 1)
        else:  # every point already coincides with a seed (fewer distinct points than codewords)
            index = int(float(draws[i]) * n) % n
        centers[i] = points[index]
        torch.minimum(closest, ((points - points[index]) ** 2).sum(dim=1), out=closest)
    return centers


def _weighted_sums(assign: torch.Tensor, values: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.zeros((k,) + values.shape[1:], dtype=values.dtype, device=values.device)
    return out.index_add_(0, assign, values)


def fit_codebook(
    x: torch.Tensor,
    codebook_size: int,
    *,
    learner: str | LearnerSpec = DEFAULT_LEARNER,
    weights: torch.Tensor | None = None,
    n_iter: int = 15,
    seed: int = 0,
    init_sample: int = 8192,
    tol: float = 0.0,
    history: list[float] | None = None,
) -> torch.Tensor:
    """Learn a ``[codebook_size, d]`` codebook for the rows of ``x`` (``[N, d]``, float32).

    ``weights`` (``[N]``, non-negative) make the objective ``sum_i w_i ||x_i - c(x_i)||^2``; with the per-token
    scales squared this is the error in the original (de-normalized) space.

    ``history``, when given, receives the weighted mean l2 distortion ``sum_i w_i ||x_i - c_a(i)||^2 / sum_i w_i`` of
    every iteration's training assignment (the codebook entering that iteration). ``tol > 0`` stops after the
    iteration whose distortion changed by less than ``tol`` (relative) from the previous one; ``n_iter`` stays the cap.
    With the defaults (``tol=0``, no history) no distortion is computed and exactly ``n_iter`` iterations run.
    """
    spec = CODEBOOK_LEARNERS[learner] if isinstance(learner, str) else learner
    if x.ndim != 2:
        raise ValueError(f"fit_codebook expects a 2-D [N, d] tensor, got shape {tuple(x.shape)}.")
    x = x.float()
    n = x.shape[0]
    if n == 0:
        raise ValueError("fit_codebook got no samples.")
    w = torch.ones(n, device=x.device) if weights is None else weights.float().clamp_min(0)
    generator = torch.Generator(device="cpu").manual_seed(seed)

    norms = x.norm(dim=1)
    directions = x / norms.clamp_min(_EPS)[:, None]
    seed_rows = torch.randperm(n, generator=generator)[: min(n, init_sample)]
    seed_space = directions if spec.spherical_init else x
    k_init = min(codebook_size, n)
    init = _kmeans_plus_plus(seed_space[seed_rows.to(x.device)].cpu(), k_init, generator).to(x.device)
    if k_init < codebook_size:  # fewer samples than codewords: repeat seeds (duplicates end up as empty clusters)
        init = init[torch.arange(codebook_size) % k_init]

    if spec.kind == "l2":
        codebook = init.clone()
    elif spec.kind == "gskm":
        shapes = init / init.norm(dim=1, keepdim=True).clamp_min(_EPS)
        # Every codeword starts at the mean sample norm; the first M-step replaces it with its least-squares gain.
        gains = torch.full((codebook_size,), float((w * norms).sum() / w.sum().clamp_min(_EPS)), device=x.device)
        codebook = gains[:, None] * shapes
    else:
        raise ValueError(f"Unknown learner kind {spec.kind!r}; choose one of {sorted(CODEBOOK_LEARNERS)}.")

    track = tol > 0 or history is not None
    previous_distortion = None
    for _ in range(n_iter):
        if spec.kind == "gskm" and spec.assignment == "cosine":
            assign = nearest_codeword(directions, codebook / codebook.norm(dim=1, keepdim=True).clamp_min(_EPS))
        else:
            assign = nearest_codeword(x, codebook)
        converged = False
        if track:
            distortion = float((w * ((x - codebook[assign]) ** 2).sum(dim=1)).sum() / w.sum().clamp_min(_EPS))
            if history is not None:
                history.append(distortion)
            if previous_distortion is not None and tol > 0:
                converged = abs(previous_distortion - distortion) <= tol * max(abs(previous_distortion), _EPS)
            previous_distortion = distortion
        mass = _weighted_sums(assign, w, codebook_size)
        if spec.kind == "l2":
            sums = _weighted_sums(assign, w[:, None] * x, codebook_size)
            updated = sums / mass.clamp_min(_EPS)[:, None]
        else:
            if spec.shape == "principal":
                shapes = _principal_shapes(x, w, assign, codebook_size, codebook)
            else:
                shape_sums = _weighted_sums(assign, w[:, None] * directions, codebook_size)
                shapes = shape_sums / shape_sums.norm(dim=1, keepdim=True).clamp_min(_EPS)
            projections = (x * shapes[assign]).sum(dim=1)
            gains = (_weighted_sums(assign, w * projections, codebook_size) / mass.clamp_min(_EPS)).clamp_min(0)
            updated = gains[:, None] * shapes
        empty = mass <= 0
        updated[empty] = codebook[empty]
        codebook = updated
        if empty.any():
            codebook = _reseed_empty(x, w, codebook, empty)
        if converged:
            break
    return codebook


def _principal_shapes(x, w, assign, k, previous):
    """Top eigenvector of each cluster's weighted second-moment matrix, sign-aligned with the cluster mean."""
    d = x.shape[1]
    moments = torch.zeros(k, d * d, dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[0], _OUTER_CHUNK_ROWS):
        rows, row_weights = x[start : start + _OUTER_CHUNK_ROWS], w[start : start + _OUTER_CHUNK_ROWS]
        outer = (row_weights[:, None, None] * rows[:, :, None] * rows[:, None, :]).reshape(-1, d * d)
        moments.index_add_(0, assign[start : start + _OUTER_CHUNK_ROWS], outer)
    moments = moments.reshape(k, d, d)
    # Unit trace first (same eigenvectors): LAPACK's eigh returns NaNs for tiny matrices (~1e-16 entries, as a late
    # residual stage produces); a cluster whose moments still give non-finite vectors keeps its previous direction.
    trace = moments.diagonal(dim1=1, dim2=2).sum(-1)
    _, vectors = torch.linalg.eigh(moments / trace.clamp_min(1e-30)[:, None, None])
    top = vectors[:, :, -1]
    usable = torch.isfinite(top).all(dim=1) & (trace > 0)
    means = _weighted_sums(assign, w[:, None] * x, k)
    sign = torch.sign((top * means).sum(dim=1))
    sign[sign == 0] = 1
    top = top * sign[:, None]
    counts = torch.bincount(assign, minlength=k)
    prev_dirs = previous / previous.norm(dim=1, keepdim=True).clamp_min(_EPS)
    return torch.where(((counts > 0) & usable)[:, None], top.nan_to_num(0.0), prev_dirs)


def _reseed_empty(x, w, codebook, empty):
    """Move each empty codeword onto one of the samples that are currently worst served."""
    assign = nearest_codeword(x, codebook)
    errors = w * ((x - codebook[assign]) ** 2).sum(dim=1)
    count = int(empty.sum())
    worst = torch.topk(errors, min(count, x.shape[0]), largest=True).indices
    codebook = codebook.clone()
    codebook[empty] = x[worst[torch.arange(count, device=worst.device) % worst.numel()]]  # fewer samples: repeat
    return codebook
