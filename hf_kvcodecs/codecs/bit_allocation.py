"""Whitened PCA codes at a per-component bit width: bit allocation by reverse water-filling, Gaussian scalar
quantizers, and a mixed-width packing whose truncations are byte prefixes.

**Why.** A PCA code's components have very different variances (the fitted spectrum). One per-token max-abs scale over
all of them at a flat width spends as many bits on a trailing component as on the first one. Rate-distortion theory
for independent Gaussian components (reverse water-filling) gives component ``i`` about
``max(0, ½ log2(σ_i² / θ))`` bits, with the water level ``θ`` set by the budget: every component coded at all then
has the same distortion ``θ``, and components below the water level are not sent.

**Allocation** (:func:`allocate_bits`). Integer widths that minimise the modelled distortion
``Σ_i w_i σ_i² D(b_i)`` under ``Σ_i b_i = budget``, where ``D(b)`` is the exact mean squared error of the chosen
``b``-bit quantizer on a unit Gaussian (:func:`gaussian_distortion`) and ``w_i`` an optional per-component weight
(how much an error in component ``i`` costs downstream: the squared norm of its decoder row). ``D`` is convex in ``b``,
so with every width from 0 to ``max_bits`` allowed and the importances ``w_i σ_i²`` non-increasing, the greedy
allocation by marginal distortion reduction is exactly optimal; otherwise (a subset of widths, or importances out of
order) a dynamic program over (component, bits spent, last width) finds the optimum. Either way the widths are
non-increasing in the component index, which is what keeps every prefix of the components a valid, cheaper code (the
ordered-prefix property truncation relies on). When the importances are non-increasing this costs nothing: swapping
two widths so the larger goes to the more important component never increases the distortion.

**Quantizers.** Component ``i`` is whitened to ``u_i = z_i / (σ_i g)`` (``g``: an optional per-token gain, below)
and coded with a fixed ``b_i``-bit quantizer designed for a unit Gaussian, so no per-token scale is needed:

- ``"lloyd-max"`` (default): the minimum-MSE ``2^b``-level quantizer of a unit Gaussian (Lloyd-Max; nearest-level
  thresholds, centroid levels). Lowest error for the model the allocation assumes; decoding is one table look-up.
- ``"uniform"``: ``2^b`` evenly spaced levels (midrise) at the step that minimises the MSE for a unit Gaussian: the
  same look-up, a grid a fixed-point decoder can compute instead of reading.

The tables are computed once (float64, on the CPU) and rounded to float32, so an encoder and a decoder on different
machines use the same numbers. A component with 0 bits decodes to 0: its mean (codes are centred).

**Gain.** With ``gain=True`` each token also sends one byte: a gain ``g`` on a 1/16-octave grid
(:func:`gain_values`), chosen by the encoder, per token, to minimise that token's squared error (a grid search from
0.7 to 2.8 times the RMS of its whitened components, refined to the grid's step; the decoder only multiplies). It
absorbs per-token energy, and a text louder than the one the spectrum was fitted on (which the fixed quantizers would
clip), at 8 bits per token that the allocation no longer has: ``benchmarks/scd_code_bits.py`` measures when that
pays. Why searched rather than the RMS itself: tokens loud in a few leading components and quiet in the rest have a
small RMS, and dividing by it clips their leading components. Why a byte rather than a float16: the encoder picks
the gain, so the grid only limits its choice (steps of 4 %), and the byte leaves 8 more bits to the components.

**Packing** (:func:`pack` / :func:`unpack`). Each token's integer codes are written as one big-endian bit stream in
component order: ``b_0`` bits of component 0, then ``b_1`` bits of component 1, and so on, padded with zero bits to
a whole byte (:func:`bytes_per_vector` ``= ceil(Σ b_i / 8)``, no other overhead). Component order (rather than
bit-plane order, or one byte-aligned group per width) makes the code of the first ``k`` components exactly the first
``ceil(Σ_{i<k} b_i / 8)`` bytes of the full code with the pad bits of its last byte cleared: :func:`truncate` is a
slice and one mask, for every ``k``, and wastes at most 7 bits where per-width groups would waste up to 7 per group.
Bit-plane order would instead make truncation lower the precision of all components, which is not the cut a rank
truncation wants (and means nothing for Lloyd-Max levels).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

MAX_BITS = 8
QUANTIZERS = ("lloyd-max", "uniform")
_LLOYD_ITERATIONS = 100
_LLOYD_TOLERANCE = 1e-9  # far below float32 rounding of the stored tables
# the dynamic program keeps one int8 choice per (component, width, bits spent): refuse tables beyond this many entries
_DP_MAX_ENTRIES = 1 << 28
# per-token gains: uint8 indices k for 2^((k - 128) / 16), from 2^-8 to about 2^8 in 1/16-octave steps
GAIN_ZERO = 128
GAIN_BYTES = 1
GAIN_STEPS_PER_OCTAVE = 16
_GAIN_COARSE_STEP = 4  # the search's first grid: quarter octaves
_SEARCH_ELEMENTS = 1 << 22  # whitened values searched at a time (bounds the search's temporaries)


# ----------------------------------------------------------------------------------------------- Gaussian quantizers


def _phi(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _interval_moments(thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mass, first and second moments of a unit Gaussian over the cells cut by ``thresholds`` (float64)."""
    inf = torch.tensor([math.inf], dtype=torch.float64)
    edges = torch.cat((-inf, thresholds, inf))
    cdf = torch.special.ndtr(edges)
    # upper tail by symmetry: 1 - ndtr(x) = ndtr(-x) keeps precision far out in the right tail
    upper = torch.special.ndtr(-edges)
    mass = torch.where(edges[:-1] >= 0, upper[:-1] - upper[1:], cdf[1:] - cdf[:-1])
    density = torch.where(torch.isinf(edges), torch.zeros_like(edges), _phi(edges))
    first = density[:-1] - density[1:]  # ∫ x φ(x) dx
    x_density = torch.where(torch.isinf(edges), torch.zeros_like(edges), edges * density)
    second = mass + x_density[:-1] - x_density[1:]  # ∫ x² φ(x) dx
    return mass, first, second


def _mse(thresholds: torch.Tensor, levels: torch.Tensor) -> float:
    mass, first, second = _interval_moments(thresholds)
    return float((second - 2 * levels * first + levels * levels * mass).sum())


def _lloyd_step(levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's map (centroids of the nearest-level cells) and its Jacobian (tridiagonal, built dense: ``2^b <= 256``)."""
    thresholds = 0.5 * (levels[1:] + levels[:-1])
    mass, first, _ = _interval_moments(thresholds)
    centroids = first / mass
    density = _phi(thresholds)
    # d centroid_k / d (lower edge) = φ(a)(c_k - a) / m_k and d centroid_k / d (upper edge) = φ(b)(b - c_k) / m_k;
    # each threshold is the mean of its two neighbouring levels
    lower = density * (centroids[1:] - thresholds) / mass[1:]  # cell k + 1 against threshold k
    upper = density * (thresholds - centroids[:-1]) / mass[:-1]  # cell k against threshold k
    count = levels.numel()
    jacobian = torch.zeros(count, count, dtype=torch.float64)
    index = torch.arange(count - 1)
    jacobian[index, index] += 0.5 * upper
    jacobian[index, index + 1] += 0.5 * upper
    jacobian[index + 1, index] += 0.5 * lower
    jacobian[index + 1, index + 1] += 0.5 * lower
    return centroids, jacobian


def _lloyd_max(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Newton's method on the Lloyd-Max conditions (levels = centroids of their cells), from the asymptotically optimal
    # companded grid (point density ∝ φ^(1/3): quantiles of N(0, 3)); plain Lloyd iterations need tens of thousands
    # of steps at 256 levels. A Newton step that does not lower the MSE falls back to a Lloyd step.
    probabilities = (torch.arange(count, dtype=torch.float64) + 0.5) / count
    levels = math.sqrt(3.0) * torch.special.ndtri(probabilities)
    error = _mse(0.5 * (levels[1:] + levels[:-1]), levels)
    for _ in range(_LLOYD_ITERATIONS):
        centroids, jacobian = _lloyd_step(levels)
        residual = centroids - levels
        if float(residual.abs().max()) < _LLOYD_TOLERANCE:
            break
        step = torch.linalg.solve(torch.eye(count, dtype=torch.float64) - jacobian, residual)
        candidate = levels + step
        candidate = 0.5 * (candidate - candidate.flip(0))  # exact symmetry
        ordered = bool((candidate[1:] > candidate[:-1]).all())
        candidate_error = _mse(0.5 * (candidate[1:] + candidate[:-1]), candidate) if ordered else math.inf
        if candidate_error > error:
            candidate = 0.5 * (centroids - centroids.flip(0))
            candidate_error = _mse(0.5 * (candidate[1:] + candidate[:-1]), candidate)
        levels, error = candidate, candidate_error
    return 0.5 * (levels[1:] + levels[:-1]), levels


def _uniform(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(count, dtype=torch.float64) - (count - 1) / 2

    def grid(step: float) -> tuple[torch.Tensor, torch.Tensor]:
        levels = offsets * step
        return 0.5 * (levels[1:] + levels[:-1]), levels

    def error(step: float) -> float:
        return _mse(*grid(step))

    # golden-section search for the step; the MSE of a uniform quantizer of a Gaussian is unimodal in the step
    low, high = 1e-4, 4.0
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    error_a, error_b = error(a), error(b)
    for _ in range(200):
        if error_a < error_b:
            high, b, error_b = b, a, error_a
            a = high - ratio * (high - low)
            error_a = error(a)
        else:
            low, a, error_a = a, b, error_b
            b = low + ratio * (high - low)
            error_b = error(b)
    return grid(0.5 * (low + high))


@functools.cache
def _quantizer(bits: int, kind: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    if bits == 0:
        return torch.zeros(0), torch.zeros(1), 1.0
    thresholds, levels = (_lloyd_max if kind == "lloyd-max" else _uniform)(2**bits)
    thresholds, levels = thresholds.float(), levels.float()  # the stored tables: what both ends use
    return thresholds, levels, _mse(thresholds.double(), levels.double())


def _check_quantizer(kind: str) -> str:
    if kind not in QUANTIZERS:
        raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {kind!r}.")
    return kind


def _check_width(bits: int) -> int:
    if not 0 <= int(bits) <= MAX_BITS:
        raise ValueError(f"A component's bit width must be between 0 and {MAX_BITS}, got {bits}.")
    return int(bits)


def gaussian_quantizer(bits: int, quantizer: str = "lloyd-max") -> tuple[torch.Tensor, torch.Tensor]:
    """``(thresholds [2^b - 1], levels [2^b])`` (float32) of the ``bits``-bit quantizer of a unit Gaussian: a value
    in ``(thresholds[k-1], thresholds[k]]`` is coded as ``k`` and decoded as ``levels[k]``. 0 bits: one level, 0."""
    thresholds, levels, _ = _quantizer(_check_width(bits), _check_quantizer(quantizer))
    return thresholds.clone(), levels.clone()


def gaussian_distortion(bits: int, quantizer: str = "lloyd-max") -> float:
    """Mean squared error of the ``bits``-bit quantizer on a unit Gaussian (1.0 at 0 bits)."""
    return _quantizer(_check_width(bits), _check_quantizer(quantizer))[2]


def _distortion_table(quantizer: str) -> torch.Tensor:
    return torch.tensor([gaussian_distortion(b, quantizer) for b in range(MAX_BITS + 1)], dtype=torch.float64)


# ------------------------------------------------------------------------------------------------------ allocation


def water_filling_bits(variances: torch.Tensor, total_bits: float) -> torch.Tensor:
    """The continuous reverse water-filling rates ``max(0, ½ log2(σ_i² / θ))`` (float64 ``[r]``) with the water
    level ``θ`` set so they sum to ``total_bits``: the ideal that :func:`allocate_bits` rounds to integers."""
    variances = _check_variances(variances).double()
    positive = variances[variances > 0]
    total_bits = float(total_bits)
    if total_bits <= 0 or positive.numel() == 0:
        return torch.zeros_like(variances)
    log_variances = torch.log2(positive)
    low, high = float(log_variances.min()) - 2 * total_bits, float(log_variances.max())
    for _ in range(200):  # bisection on log2 θ: the total rate decreases in θ
        middle = 0.5 * (low + high)
        if float((0.5 * (log_variances - middle)).clamp_min(0).sum()) > total_bits:
            low = middle
        else:
            high = middle
    log_theta = 0.5 * (low + high)
    rates = torch.zeros_like(variances)
    rates[variances > 0] = (0.5 * (log_variances - log_theta)).clamp_min(0)
    return rates


def allocate_bits(variances: torch.Tensor, total_bits: int, *, max_bits: int = MAX_BITS,
                  allowed: Sequence[int] | None = None, weights: torch.Tensor | None = None,
                  quantizer: str = "lloyd-max") -> torch.Tensor:
    """Integer bit widths ``[r]`` (int64, non-increasing in the component index) for codes whose components have
    ``variances`` ``[r]``, spending ``total_bits`` per vector.

    Minimises ``Σ_i weights_i · variances_i · D(b_i)`` (``D``: :func:`gaussian_distortion` of ``quantizer``) over
    widths in ``allowed`` (default every width from 0 to ``max_bits``) that sum to ``total_bits``, or, where that
    exact sum cannot be reached (a budget above ``r · max_bits``, or an odd budget with even widths only), to the
    largest reachable sum below it. Components given 0 bits are not sent: the rank is truncated there.
    """
    variances = _check_variances(variances).double()
    quantizer = _check_quantizer(quantizer)
    max_bits = _check_width(max_bits)
    widths = sorted({_check_width(b) for b in (allowed if allowed is not None else range(max_bits + 1))})
    widths = [b for b in widths if b <= max_bits]
    if not widths or widths[0] != 0:
        widths = [0, *widths]  # sending nothing is always possible
    importance = variances
    if weights is not None:
        weights = torch.as_tensor(weights, dtype=torch.float64)
        if weights.shape != variances.shape or not torch.isfinite(weights).all() or (weights < 0).any():
            raise ValueError(f"weights must be {tuple(variances.shape)} finite non-negative numbers (one per "
                             f"component), got shape {tuple(weights.shape)}.")
        importance = variances * weights
    if int(total_bits) < 0:
        raise ValueError(f"total_bits must be >= 0, got {total_bits}.")
    rank = variances.numel()
    budget = min(int(total_bits), rank * widths[-1])
    table = _distortion_table(quantizer)
    ordered = bool((importance[1:] <= importance[:-1]).all())
    if ordered and widths == list(range(widths[-1] + 1)):
        bits = _greedy(importance, budget, table, widths[-1])
    else:
        bits = _dynamic_program(importance, budget, table, widths)
    return bits


def _greedy(importance: torch.Tensor, budget: int, table: torch.Tensor, top: int) -> torch.Tensor:
    """Optimal for a convex ``D`` and unit steps: take the ``budget`` largest marginal reductions
    ``importance_i · (D(b) - D(b + 1))``; each component's reductions shrink with ``b`` so it takes a prefix of them."""
    rank = importance.numel()
    if budget == 0 or rank == 0:
        return torch.zeros(rank, dtype=torch.int64)
    steps = table[:top] - table[1:top + 1]  # [top], decreasing (D is convex)
    gains = (importance[:, None] * steps[None, :]).flatten()  # component-major: ties go to the earlier component
    chosen = torch.argsort(-gains, stable=True)[:budget]
    bits = torch.bincount(chosen // top, minlength=rank)
    # ties between equal importances can leave a later component ahead; sorting restores the order at equal cost
    return torch.sort(bits, descending=True).values


def _dynamic_program(importance: torch.Tensor, budget: int, table: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """Minimum distortion over non-increasing widths: state (bits spent, width of the previous component)."""
    rank, count = importance.numel(), len(widths)
    if rank * count * (budget + 1) > _DP_MAX_ENTRIES:
        raise ValueError(f"Allocating {budget} bits over {rank} components with widths {widths} needs a "
                         f"{rank}x{count}x{budget + 1} table; allow every width from 0 to the largest (the exact "
                         "greedy path) or sort the components by importance.")
    inf = torch.tensor(math.inf, dtype=torch.float64)
    # cost[j, s]: least distortion of the components so far, spending s bits, the last one at widths[j]
    cost = torch.full((count, budget + 1), math.inf, dtype=torch.float64)
    cost[count - 1, 0] = 0.0  # before the first component: as if the previous one had the largest width
    choices = torch.zeros(rank, count, budget + 1, dtype=torch.int8)
    width_table = table[torch.tensor(widths)]
    for i in range(rank):
        # best previous state with a width >= widths[j]: a suffix minimum over j
        best, where = cost.flip(0).cummin(0)
        best, where = best.flip(0), (count - 1 - where).flip(0)
        updated = torch.full_like(cost, math.inf)
        for j, width in enumerate(widths):
            if width > budget:
                continue
            updated[j, width:] = best[j, :budget + 1 - width] + importance[i] * width_table[j]
            choices[i, j, width:] = where[j, :budget + 1 - width].to(torch.int8)
        cost = updated
    reachable = torch.isfinite(cost).any(0)
    spent = int(torch.nonzero(reachable).max())
    state = int(torch.argmin(torch.where(torch.isfinite(cost[:, spent]), cost[:, spent], inf)))
    bits = torch.zeros(rank, dtype=torch.int64)
    for i in range(rank - 1, -1, -1):
        bits[i] = widths[state]
        previous = int(choices[i, state, spent])
        spent -= widths[state]
        state = previous
    return bits


# --------------------------------------------------------------------------------------------------------- packing


def _check_variances(variances) -> torch.Tensor:
    variances = torch.as_tensor(variances)
    if variances.ndim != 1 or not torch.isfinite(variances).all() or (variances < 0).any():
        raise ValueError(f"variances must be a 1-D tensor of finite non-negative numbers (one per code component), "
                         f"got shape {tuple(variances.shape)}.")
    return variances


def _check_bits(bits_per_component) -> torch.Tensor:
    bits = torch.as_tensor(bits_per_component)
    if bits.ndim != 1 or bits.is_floating_point() or bits.is_complex():
        raise ValueError(f"bits_per_component must be a 1-D integer tensor (one width per component, as "
                         f"allocate_bits returns), got shape {tuple(bits.shape)} dtype {bits.dtype}.")
    bits = bits.to(torch.int64).cpu()
    if bits.numel() and (int(bits.min()) < 0 or int(bits.max()) > MAX_BITS):
        raise ValueError(f"bits_per_component must hold widths between 0 and {MAX_BITS}, got "
                         f"{int(bits.min())}..{int(bits.max())}.")
    return bits


def bytes_per_vector(bits_per_component, *, gain: bool = False) -> int:
    """Bytes per vector: ``ceil(Σ b_i / 8)`` packed, and one more for the per-token gain when it is sent."""
    return (int(_check_bits(bits_per_component).sum()) + 7) // 8 + (GAIN_BYTES if gain else 0)


def _groups(bits: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]]:
    """Per width ``w > 0``: the components at that width, the stream positions of their bits ``[n_w, w]``, and
    ``(start, stop)`` when those components are contiguous (always, for a non-increasing allocation)."""
    offsets = torch.cumsum(bits, 0) - bits
    groups = {}
    for width in sorted(set(bits.tolist()) - {0}):
        components = torch.nonzero(bits == width).flatten()
        first, last = int(components[0]), int(components[-1])
        span = (first, last + 1) if last - first + 1 == components.numel() else None
        groups[width] = components, offsets[components, None] + torch.arange(width), span
    return groups


def _bit_weights(width: int, device) -> torch.Tensor:
    return (1 << torch.arange(width - 1, -1, -1, device=device)).to(torch.uint8)


def pack(values: torch.Tensor, bits_per_component) -> torch.Tensor:
    """Unsigned integers ``[..., r]`` (component ``i`` in ``[0, 2^b_i)``) as bytes ``[..., ceil(Σ b_i / 8)]``
    (uint8): one big-endian bit stream in component order, zero-padded to a whole byte."""
    bits = _check_bits(bits_per_component)
    if values.shape[-1] != bits.numel():
        raise ValueError(f"values have {values.shape[-1]} components but bits_per_component has {bits.numel()} "
                         "widths; pass one width per component (0 for components that are not sent).")
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"pack takes integer codes (quantizer indices), got dtype {values.dtype}.")
    leading, device = values.shape[:-1], values.device
    nbytes = (int(bits.sum()) + 7) // 8
    stream = torch.zeros(*leading, nbytes * 8, dtype=torch.uint8, device=device)
    for width, (components, positions, span) in _groups(bits).items():
        group = _columns(values, components.to(device), span)
        if group.numel() and (int(group.min()) < 0 or int(group.max()) >= 2**width):
            raise ValueError(f"A {width}-bit component holds a value outside [0, {2**width - 1}]: the codes do not "
                             "match bits_per_component.")
        shifts = torch.arange(width - 1, -1, -1, device=device, dtype=torch.uint8)
        group_bits = ((group.to(torch.uint8)[..., None] >> shifts) & 1).flatten(-2)
        if span is not None:  # contiguous components: their bits are one contiguous run of the stream
            first = int(positions[0, 0])
            stream[..., first:first + group_bits.shape[-1]] = group_bits
        else:
            stream[..., positions.flatten().to(device)] = group_bits
    return (stream.view(*leading, nbytes, 8) * _bit_weights(8, device)).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits_per_component) -> torch.Tensor:
    """Inverse of :func:`pack`: integers ``[..., r]`` (uint8; 0 for components with 0 bits)."""
    bits = _check_bits(bits_per_component)
    nbytes = (int(bits.sum()) + 7) // 8
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8 bytes, got dtype {packed.dtype}.")
    if packed.ndim == 0 or packed.shape[-1] != nbytes:
        raise ValueError(f"packed codes have {packed.shape[-1] if packed.ndim else 0} bytes per vector but these "
                         f"widths (Σ = {int(bits.sum())} bits) take {nbytes}: decode with the bits_per_component "
                         "they were packed with (for a truncated code, the first keep_components widths).")
    leading, device = packed.shape[:-1], packed.device
    shifts = torch.arange(7, -1, -1, device=device, dtype=torch.uint8)
    stream = ((packed[..., None] >> shifts) & 1).flatten(-2)
    values = torch.zeros(*leading, bits.numel(), dtype=torch.uint8, device=device)
    for width, (components, positions, span) in _groups(bits).items():
        if span is not None:
            first = int(positions[0, 0])
            group = stream[..., first:first + positions.numel()]
        else:
            group = stream[..., positions.flatten().to(device)]
        group = (group.view(*leading, *positions.shape) * _bit_weights(width, device)).sum(-1, dtype=torch.uint8)
        if span is not None:
            values[..., span[0]:span[1]] = group
        else:
            values[..., components.to(device)] = group
    return values


def truncate(packed: torch.Tensor, bits_per_component, keep_components: int) -> torch.Tensor:
    """The packed code of the first ``keep_components`` components: the first ``ceil(Σ_{i<k} b_i / 8)`` bytes of
    ``packed``, with the bits of later components in the last byte cleared (exactly what :func:`pack` writes for
    those components alone). Decode it with ``bits_per_component[:keep_components]``."""
    bits = _check_bits(bits_per_component)
    if not 0 <= int(keep_components) <= bits.numel():
        raise ValueError(f"keep_components must be between 0 and {bits.numel()}, got {keep_components}.")
    if packed.ndim == 0 or packed.shape[-1] != bytes_per_vector(bits):
        raise ValueError(f"packed codes have {packed.shape[-1] if packed.ndim else 0} bytes per vector, but "
                         f"bits_per_component packs into {bytes_per_vector(bits)}: pass the widths of the full code.")
    kept = int(bits[:int(keep_components)].sum())
    out = packed[..., :(kept + 7) // 8].clone()
    if kept % 8:
        out[..., -1] &= (0xFF << (8 - kept % 8)) & 0xFF
    return out


# --------------------------------------------------------------------------------------------- encoding and decoding


def gain_values(gain: torch.Tensor) -> torch.Tensor:
    """The per-token gains (float32) that stored gain indices (uint8) stand for: ``2^((k - 128) / 16)``."""
    if gain.dtype != torch.uint8:
        raise ValueError(f"Stored gains are uint8 indices (as encode returns them), got dtype {gain.dtype}.")
    return torch.exp2((gain.float() - GAIN_ZERO) / GAIN_STEPS_PER_OCTAVE)


def _scales(variances, count: int, device, what: str) -> torch.Tensor:
    variances = _check_variances(variances)
    if variances.numel() != count:
        raise ValueError(f"{what} has {count} components but variances has {variances.numel()}: pass the variances "
                         "of exactly the components coded (for a truncated code, the first keep_components).")
    return variances.to(device=device, dtype=torch.float32).sqrt()


def _columns(values: torch.Tensor, components: torch.Tensor, span: tuple[int, int] | None) -> torch.Tensor:
    return values[..., span[0]:span[1]] if span is not None else values[..., components]


class _Lookup:
    """Nearest-level indices of one quantizer without a binary search: a uniform grid of cells, each narrower than a
    third of the smallest gap between thresholds, gives a first guess (the number of thresholds below the cell) that
    one comparison on either side corrects. Exactly what ``torch.bucketize(values, thresholds)`` returns, at a
    fraction of its cost on a CPU."""

    def __init__(self, thresholds: torch.Tensor, levels: torch.Tensor, device):
        self.levels = levels.to(device)
        count = thresholds.numel()
        inf = torch.tensor([math.inf])
        self.padded = torch.cat((-inf, thresholds, inf)).to(device)  # cell k is (padded[k], padded[k + 1]]
        if count <= 1:
            self.origin, self.inverse_step, self.guess = 0.0, 0.0, torch.zeros(1, dtype=torch.int64, device=device)
            return
        step = float((thresholds[1:] - thresholds[:-1]).min()) / 3
        cells = int(math.ceil(float(thresholds[-1] - thresholds[0]) / step)) + 2
        self.origin, self.inverse_step = float(thresholds[0]), 1.0 / step
        edges = self.origin + step * torch.arange(cells, dtype=torch.float64)
        self.guess = torch.searchsorted(thresholds.double(), edges).to(device)

    def indices(self, values: torch.Tensor) -> torch.Tensor:
        cell = ((values - self.origin) * self.inverse_step).clamp_(-1, self.guess.numel()).floor_()
        guess = self.guess[cell.long().clamp_(0, self.guess.numel() - 1)]
        return guess + (values > self.padded[guess + 1]).long() - (values <= self.padded[guess]).long()


class _Tables:
    """The quantizers of every width in an allocation, on one device."""

    def __init__(self, bits: torch.Tensor, quantizer: str, device):
        self.groups = []
        for width, (components, _, span) in _groups(bits).items():
            self.groups.append((components.to(device), span, _Lookup(*gaussian_quantizer(width, quantizer), device)))

    def quantize(self, whitened: torch.Tensor) -> torch.Tensor:
        indices = torch.zeros(whitened.shape, dtype=torch.uint8, device=whitened.device)
        for components, span, lookup in self.groups:
            group = lookup.indices(_columns(whitened, components, span)).to(torch.uint8)
            if span is not None:
                indices[..., span[0]:span[1]] = group
            else:
                indices[..., components] = group
        return indices

    def dequantize(self, indices: torch.Tensor) -> torch.Tensor:
        whitened = torch.zeros(indices.shape, dtype=torch.float32, device=indices.device)
        for components, span, lookup in self.groups:
            group = lookup.levels[_columns(indices, components, span).long()]
            if span is not None:
                whitened[..., span[0]:span[1]] = group
            else:
                whitened[..., components] = group
        return whitened

    def error(self, whitened: torch.Tensor, variances: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        """Per-vector squared error (in code units) of the components that get bits, at per-vector ``gain``."""
        total = torch.zeros(whitened.shape[:-1], dtype=torch.float32, device=whitened.device)
        for components, span, lookup in self.groups:
            group = _columns(whitened, components, span)
            rebuilt = lookup.levels[lookup.indices(group / gain[..., None])] * gain[..., None]
            total += ((group - rebuilt).square() * _columns(variances, components, span)).sum(-1)
        return total


def _search_gain(whitened: torch.Tensor, variances: torch.Tensor, bits: torch.Tensor, tables: _Tables) -> torch.Tensor:
    """Per-vector gain index (int64) that minimises the code-space squared error: a quarter-octave grid from 0.7 to
    2.8 times the RMS of the components sent, then two halvings of the step around the best."""
    sent = (bits > 0).to(whitened.device)
    rms = whitened[..., sent].square().mean(-1).sqrt().clamp_min(2.0 ** -8)
    start = torch.round(torch.log2(rms) * GAIN_STEPS_PER_OCTAVE) + GAIN_ZERO
    best = torch.zeros_like(start)
    best_error = torch.full_like(start, math.inf)

    def trial(index: torch.Tensor) -> None:
        nonlocal best, best_error
        index = index.clamp(0, 255)
        error = tables.error(whitened, variances, torch.exp2((index - GAIN_ZERO) / GAIN_STEPS_PER_OCTAVE))
        better = error < best_error
        best = torch.where(better, index, best)
        best_error = torch.where(better, error, best_error)

    for offset in range(-_GAIN_COARSE_STEP * 2, _GAIN_COARSE_STEP * 6 + 1, _GAIN_COARSE_STEP):
        trial(start + offset)
    step = _GAIN_COARSE_STEP // 2
    while step >= 1:
        centre = best.clone()
        trial(centre - step)
        trial(centre + step)
        step //= 2
    return best.long()


def encode(codes: torch.Tensor, variances: torch.Tensor, bits_per_component, *, gain: bool | torch.Tensor = False,
           quantizer: str = "lloyd-max") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize codes ``[..., r]`` (centred, components with ``variances`` ``[r]``) at ``bits_per_component``:
    ``(packed [..., ceil(Σ b_i / 8)] uint8, gain [...] uint8 or None)``.

    Each component is whitened by its standard deviation and coded with the unit-Gaussian quantizer of its width.
    With ``gain=True`` each token is also divided by its own gain, chosen to minimise its squared error and returned
    as a uint8 index (:func:`gain_values`); a uint8 tensor ``[...]`` instead imposes those gains (a caller's own
    rule)."""
    bits = _check_bits(bits_per_component)
    if codes.shape[-1] != bits.numel():
        raise ValueError(f"codes have {codes.shape[-1]} components but bits_per_component has {bits.numel()} "
                         "widths; allocate one width per component (allocate_bits).")
    if not torch.isfinite(codes).all():
        raise ValueError("codes hold non-finite values; they cannot be quantized.")
    tables = _Tables(bits, _check_quantizer(quantizer), codes.device)
    scales = _scales(variances, bits.numel(), codes.device, "codes")
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    whitened = torch.where(scales > 0, codes.float() / safe, torch.zeros((), device=codes.device))
    token_gain = None
    if isinstance(gain, torch.Tensor):
        if gain.dtype != torch.uint8 or tuple(gain.shape) != tuple(codes.shape[:-1]):
            raise ValueError(f"An imposed gain must be uint8 indices of shape {tuple(codes.shape[:-1])} (one per "
                             f"vector, see gain_values), got {gain.dtype} {tuple(gain.shape)}.")
        token_gain = gain.to(codes.device)
    elif gain:
        rows = whitened.reshape(-1, bits.numel())
        chunk = max(1, _SEARCH_ELEMENTS // max(bits.numel(), 1))  # bounds the search's temporaries
        found = [_search_gain(rows[i:i + chunk], scales.square(), bits, tables) for i in range(0, rows.shape[0], chunk)]
        token_gain = (torch.cat(found) if found else rows.new_zeros(0, dtype=torch.int64)).to(torch.uint8)
        token_gain = token_gain.reshape(codes.shape[:-1])
    if token_gain is not None:
        whitened = whitened / gain_values(token_gain)[..., None]
    return pack(tables.quantize(whitened), bits), token_gain


def decode(packed: torch.Tensor, variances: torch.Tensor, bits_per_component, gain: torch.Tensor | None = None, *,
           quantizer: str = "lloyd-max", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes ``[..., r]`` from :func:`encode`'s bytes (and gain, when it sent one). Components with 0 bits are 0."""
    bits = _check_bits(bits_per_component)
    tables = _Tables(bits, _check_quantizer(quantizer), packed.device)
    indices = unpack(packed, bits)
    scales = _scales(variances, bits.numel(), packed.device, "bits_per_component")
    whitened = tables.dequantize(indices)
    if gain is not None:
        if tuple(gain.shape) != tuple(packed.shape[:-1]):
            raise ValueError(f"gain has shape {tuple(gain.shape)} but the packed codes hold "
                             f"{tuple(packed.shape[:-1])} vectors: pass the gain encode returned with these bytes.")
        whitened = whitened * gain_values(gain)[..., None]
    return (whitened * scales).to(dtype)
