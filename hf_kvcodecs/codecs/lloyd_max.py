"""Lloyd-Max scalar quantizers for a standard Gaussian, designed numerically once per bit width and kept.

A Lloyd-Max quantizer minimises the mean squared error of a scalar source; for ``X ~ N(0, 1)`` its two optimality
conditions have closed forms: each cell boundary is the midpoint of its two neighbouring levels, and each level is the
conditional mean of its cell, ``E[X | a < X <= b] = (phi(a) - phi(b)) / (Phi(b) - Phi(a))``. Lloyd's iteration
alternates the two until the levels stop moving. The density is symmetric, so only the positive half is iterated (its
cells' masses come from ``erfc``, which keeps full precision in the tail where ``1 - Phi`` would cancel).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from statistics import NormalDist

GAUSSIAN_QUANTIZER_BITS = (1, 2, 3, 4)
# Lloyd's iteration converges linearly; this tolerance leaves the levels exact to float64 rounding for all widths.
_TOLERANCE = 1e-14
_MAX_ITERATIONS = 200_000
_SQRT2 = math.sqrt(2.0)
_SQRT2PI = math.sqrt(2.0 * math.pi)


@dataclass(frozen=True)
class ScalarQuantizer:
    """The ``2**bits`` levels (increasing) of a quantizer, its ``2**bits - 1`` cell boundaries, and its mean squared
    error on the source it was designed for."""

    bits: int
    levels: tuple[float, ...]
    thresholds: tuple[float, ...]
    mse: float


def _density(x: float) -> float:
    return 0.0 if math.isinf(x) else math.exp(-0.5 * x * x) / _SQRT2PI


def _upper_tail(x: float) -> float:
    """P(X > x) for X ~ N(0, 1), accurate far into the tail."""
    return 0.5 * math.erfc(x / _SQRT2)


def gaussian_cell_mean(low: float, high: float) -> float:
    """E[X | low < X <= high] for X ~ N(0, 1) and 0 <= low < high (high may be inf)."""
    return (_density(low) - _density(high)) / (_upper_tail(low) - _upper_tail(high))


def gaussian_lloyd_max(bits: int) -> ScalarQuantizer:
    """The Lloyd-Max quantizer of ``bits`` bits (1 to 4) for a standard Gaussian, computed on first use."""
    if isinstance(bits, bool) or bits not in GAUSSIAN_QUANTIZER_BITS:
        raise ValueError(f"bits={bits!r}: Gaussian Lloyd-Max quantizers are designed for {GAUSSIAN_QUANTIZER_BITS} bits.")
    return _design(int(bits))


@functools.cache
def _design(bits: int) -> ScalarQuantizer:
    half = 2 ** (bits - 1)  # levels on the positive side; the negative side mirrors them
    # start from the medians of equal-mass cells, already close to optimal
    levels = [NormalDist().inv_cdf(0.5 + (index + 0.5) / (2 * half)) for index in range(half)]
    for _ in range(_MAX_ITERATIONS):
        bounds = [0.0] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        updated = [gaussian_cell_mean(bounds[i], bounds[i + 1]) for i in range(half)]
        moved = max(abs(a - b) for a, b in zip(updated, levels))
        levels = updated
        if moved < _TOLERANCE:
            break
    else:
        raise RuntimeError(f"Lloyd's iteration for {bits} bits did not converge.")
    bounds = [0.0] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
    # At the centroid condition E[X Q(X)] = E[Q(X)^2], so the error is E[X^2] - E[Q(X)^2] = 1 - sum p_i c_i^2.
    kept_energy = 2 * sum((_upper_tail(bounds[i]) - _upper_tail(bounds[i + 1])) * levels[i] ** 2 for i in range(half))
    positive_thresholds = bounds[1:-1]
    return ScalarQuantizer(
        bits=bits,
        levels=tuple([-level for level in reversed(levels)] + levels),
        thresholds=tuple([-t for t in reversed(positive_thresholds)] + [0.0] + positive_thresholds),
        mse=1.0 - kept_energy,
    )
