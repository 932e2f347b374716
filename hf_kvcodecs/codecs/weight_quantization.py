"""Weight quantization on per-group grids: round-to-nearest (RTN), MSE-clipped grids, real bit packing and the
straight-through fake quantization that quantization-aware training learns the grids with. Pure tensor math, no
transformers import, in the codec layer so that any method can use it.

Layout of a quantized ``[out_features, in_features]`` weight with ``bits`` bits and groups of ``group_size`` inputs:

- codes are packed row by row into ``int32`` words, ``[out_features, ceil(in_features / 32) * bits]``: exactly
  ``bits`` bits per weight (rows are padded to a multiple of 32 codes). A width that is not a power of two is split
  into power-of-two fields (3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2, 7 = 4 + 2 + 1); each field is packed ``32 / width``
  codes per word and the fields' words are concatenated along the row. Unpacking costs one shift-and-mask pass per
  field, and the packed shape can never equal the float shape (see :func:`packed_width`), so an environment that
  does not know this format fails to load the tensor instead of reading codes as float weights.
- ``scale`` ``[out_features, in_features / group_size]`` and, for asymmetric quantization, ``offset`` (the value of
  code 0) of the same shape, stored in ``scale_dtype``.

Asymmetric:  w ≈ offset + code * scale,                 scale = (max - min) / (2**bits - 1), offset = min
Symmetric:   w ≈ (code - (2**bits - 1) / 2) * scale,     scale = 2 * absmax / (2**bits - 1)
The symmetric grid is mid-rise (no level at exactly 0), which is what makes 1-bit (±scale / 2) possible.

Integer zero points (``zero_point="integer"``, asymmetric only): ``offset = -zero * scale`` with an integer ``zero``
in ``[0, 2**bits - 1]``, so ``w = (code - zero) * scale``: the grid of compressed-tensors, GPTQ and AWQ checkpoints,
which is what makes their export exact. The offset is stored in the same field, and the pair is chosen so that
``scale`` and ``zero * scale`` are both exactly representable in ``scale_dtype`` (see :func:`integer_zero_point_grid`):
then the usual dequantization ``code * scale + offset`` is ``(code - zero) * scale`` exactly, in float32, and a
reader needs nothing new. Such a grid always has a level at 0, so it spans ``[min(w, 0), max(w, 0)]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .learnable import scale_gradient

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
# "float": the offset is any float (min-max: the group's minimum). "integer": offset = -zero * scale, integer zero.
ZERO_POINTS = ("float", "integer")
# Integer zero grids try every zero point up to this many levels away from the ideal one (all of them up to 5 bits).
ZERO_POINT_SEARCH = 16
COVERING_CANDIDATES_PER_CHUNK = 2**21  # groups x candidate zeros searched at once (float64 temporaries of 16 MiB)
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
CODES_PER_BLOCK = 32  # codes of one row are packed in blocks of 32, i.e. ``bits`` int32 words per block


def _fields(bits: int) -> tuple[int, ...]:
    """Power-of-two field widths that add up to ``bits``, widest first (8 stays one field: 4 codes per word)."""
    if bits == 8:
        return (8,)
    return tuple(width for width in (4, 2, 1) if bits & width)


def check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(
            f"weight_bits must be an integer from 1 to 8, got {bits!r}. Use 8 for near-lossless weights, 4 or 3 for "
            "the usual size/quality trade-offs, 2 or 1 only with quantization-aware training."
        )
    return bits


def check_zero_point(zero_point, symmetric: bool) -> str:
    if zero_point not in ZERO_POINTS:
        raise ValueError(f"zero_point must be one of {ZERO_POINTS}, got {zero_point!r}.")
    if zero_point == "integer" and symmetric:
        raise ValueError("zero_point='integer' chooses the offset of an asymmetric grid; a symmetric grid has none. "
                         "Use symmetric=False with it.")
    return zero_point


def packed_width(in_features: int, bits: int) -> int:
    """Number of int32 words per packed row."""
    return -(-in_features // CODES_PER_BLOCK) * bits


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[rows, n]`` (each in ``[0, 2**bits)``) into int32 words ``[rows, packed_width(n, bits)]``."""
    check_bits(bits)
    if codes.ndim != 2:
        raise ValueError(f"pack_codes expects a 2-D tensor of codes, got shape {tuple(codes.shape)}.")
    rows, count = codes.shape
    padded = -(-count // CODES_PER_BLOCK) * CODES_PER_BLOCK
    codes = codes.to(torch.int64)
    if padded != count:
        codes = torch.nn.functional.pad(codes, (0, padded - count))
    words, shift = [], 0
    for width in _fields(bits):
        per_word = 32 // width
        field = ((codes >> shift) & ((1 << width) - 1)).reshape(rows, padded // per_word, per_word)
        positions = torch.arange(per_word, device=codes.device, dtype=torch.int64) * width
        packed = (field << positions).sum(dim=-1)
        # Two's complement: a word with its top bit set is stored as the negative int32 with the same bits.
        words.append(torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32))
        shift += width
    return torch.cat(words, dim=-1)


def unpack_codes(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int32 words ``[rows, packed_width(count, bits)]`` -> int32 codes ``[rows, count]``."""
    check_bits(bits)
    rows = words.shape[0]
    blocks = -(-count // CODES_PER_BLOCK)
    if words.dtype != torch.int32 or words.ndim != 2 or words.shape[1] != blocks * bits:
        raise ValueError(
            f"Packed {bits}-bit codes for {count} inputs must be an int32 tensor [rows, {blocks * bits}], got "
            f"{words.dtype} {tuple(words.shape)}."
        )
    codes, start, shift = None, 0, 0
    for width in _fields(bits):
        per_word = 32 // width
        field_words = words[:, start : start + blocks * width]
        positions = torch.arange(per_word, device=words.device, dtype=torch.int32) * width
        # Arithmetic shifts sign-extend negative words; the mask keeps only this field's bits.
        field = ((field_words.unsqueeze(-1) >> positions) & ((1 << width) - 1)).reshape(rows, blocks * CODES_PER_BLOCK)
        codes = field if codes is None else codes | (field << shift)
        start += blocks * width
        shift += width
    return codes[:, :count]


@dataclass
class QuantizedWeight:
    """A packed weight: what :class:`~hf_kvcodecs.quantization.PackedLinear` stores."""

    packed: torch.Tensor  # int32 [out_features, packed_width(in_features, bits)]
    scale: torch.Tensor  # [out_features, in_features // group_size], scale_dtype
    offset: torch.Tensor | None  # same as scale; None when symmetric
    bits: int
    group_size: int
    in_features: int


def _grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"in_features={in_features} is not a multiple of group_size={group_size}.")
    return weight.float().reshape(out_features, in_features // group_size, group_size)


def rtn_parameters(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool, *, zero_point: str = "float",
                   scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max round-to-nearest ``(scale, offset)`` per group, in float32 (``offset`` is None when symmetric).
    ``zero_point="integer"``: the integer-zero-point grid nearest to min-max's, exact in ``scale_dtype``
    (:func:`integer_zero_point_grid`)."""
    groups = _grouped(weight, group_size)
    levels = 2**bits - 1
    if symmetric:
        return groups.abs().amax(dim=-1) * 2 / levels, None
    low = groups.amin(dim=-1)
    if check_zero_point(zero_point, symmetric) == "integer":
        return integer_zero_point_grid(groups, low, groups.amax(dim=-1), bits, scale_dtype)[:2]
    return (groups.amax(dim=-1) - low) / levels, low


def integer_zero_point_grid(groups: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bits: int,
                            scale_dtype: torch.dtype = torch.float16
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group, an integer-zero-point grid close to the grid spanning ``[low, high]`` (``[out, groups]``), exact in
    ``scale_dtype``; ``groups`` (``[out, groups, group_size]``) are the weights that pick it. Returns float32
    ``(scale, offset, squared_error)``: ``offset == -zero * scale`` with ``zero`` an integer in ``[0, 2**bits - 1]``,
    ``scale`` and ``offset`` both representable in ``scale_dtype``, and the groups' squared rounding error on it.

    Exactness: rounding ``scale`` to float16, then ``-zero * scale`` to float16, is not enough. The product of an
    11-bit significand and a 4-bit zero needs up to 15 bits, so the stored offset would miss ``-zero * scale`` by up
    to half a unit in its last place and ``-offset / scale`` would not be an integer. ``zero * scale`` fits when the
    zero's odd part times the scale's significand (without its trailing zeros) fits in the dtype's significand, so
    every scale here is rounded, down or up, to the nearest scale that qualifies for its zero
    (:func:`_exact_scale`); zeros with a small odd part allow finer scales. The scale also has at most
    ``24 - bits`` significant bits, so that ``code * scale`` and ``(code - zero) * scale`` are exact in float32 (this
    only binds float32 scales).

    Candidates, of which each group keeps the one with the least squared error on its weights:

    - the grid's own step with the zero point rounded to the nearest integer (clamped to ``[0, 2**bits - 1]``), its
      scale rounded down or up to an exact one: the grid shifted by less than half a step, its far end clipped;
    - the smallest exact step that covers ``[min(low, 0), max(high, 0)]`` with some integer zero (every zero up to
      5 bits, otherwise the ``ZERO_POINT_SEARCH`` on either side of the nearest one): nothing clipped, a slightly
      wider step.
    """
    levels = 2**bits - 1
    tiny = float(torch.finfo(scale_dtype).tiny)
    digits = min(_significand_bits(scale_dtype), _significand_bits(torch.float32) - bits)
    low, high = low.double(), high.double()
    step = ((high - low) / levels).clamp_min(tiny)
    nearest = (-low / step).round().clamp(0, levels)
    candidates = [(_exact_scale(step, nearest, scale_dtype, digits, up), nearest) for up in (False, True)]
    candidates.append(_covering_grid(low.clamp(max=0), high.clamp(min=0), levels, scale_dtype, digits))
    best_error = best_scale = best_zero = None
    for scale, zero in candidates:
        error = _grid_error(groups, scale, zero, levels)
        if best_error is None:
            best_error, best_scale, best_zero = error, scale, zero
            continue
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    if not torch.isfinite(best_scale).all():
        raise ValueError(f"A quantization scale does not fit in {str(scale_dtype).removeprefix('torch.')} (the weights "
                         "hold values beyond its range). Use scale_dtype='float32'.")
    return best_scale.float(), (-best_zero * best_scale).float(), best_error


def _covering_grid(low: torch.Tensor, high: torch.Tensor, levels: int, dtype: torch.dtype, digits: int):
    """Per group, the integer zero and the smallest exact step (float64) whose grid covers ``[low, high]``
    (``low <= 0 <= high``); of equal steps, the zero nearest the ideal one. All candidate zeros at once, in chunks of
    groups."""
    shape = low.shape
    low, high = low.reshape(-1, 1), high.reshape(-1, 1)
    tiny = float(torch.finfo(dtype).tiny)
    centre = (-low / ((high - low) / levels).clamp_min(tiny)).round().clamp(0, levels)
    if levels <= 2 * ZERO_POINT_SEARCH:
        offsets, relative = torch.arange(levels + 1, dtype=low.dtype, device=low.device), False
    else:
        offsets = torch.arange(-ZERO_POINT_SEARCH, ZERO_POINT_SEARCH + 1, dtype=low.dtype, device=low.device)
        relative = True
    scales, zeros = [], []
    chunk = max(1, COVERING_CANDIDATES_PER_CHUNK // offsets.numel())
    for start in range(0, low.shape[0], chunk):
        part = slice(start, start + chunk)
        zero = centre[part] + offsets if relative else offsets.expand(centre[part].shape[0], -1)
        inside = (zero >= 0) & (zero <= levels)
        zero = zero.clamp(0, levels)
        # the step that puts level -zero * step at or below low and level (levels - zero) * step at or above high
        below = torch.where(zero > 0, -low[part] / zero.clamp_min(1), torch.where(low[part] < 0, float("inf"), 0.0))
        above = torch.where(zero < levels, high[part] / (levels - zero).clamp_min(1),
                            torch.where(high[part] > 0, float("inf"), 0.0))
        scale = _exact_scale(torch.maximum(below, above).clamp_min(tiny), zero, dtype, digits, True)
        scale = torch.where(inside, scale, float("inf"))
        smallest = scale.amin(dim=-1, keepdim=True)
        distance = torch.where(scale == smallest, (zero - centre[part]).abs(), float("inf"))
        pick = distance.argmin(dim=-1, keepdim=True)
        scales.append(scale.gather(-1, pick))
        zeros.append(zero.gather(-1, pick))
    return torch.cat(scales).reshape(shape), torch.cat(zeros).reshape(shape)


def _significand_bits(dtype: torch.dtype) -> int:
    return round(-math.log2(torch.finfo(dtype).eps)) + 1  # the implicit leading bit included


def _exact_scale(target: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype, digits: int, up: bool) -> torch.Tensor:
    """The nearest float64 scale at or above (``up``) or at or below ``target`` with the scale and ``zero * scale``
    both representable in ``dtype`` and holding at most ``digits`` significant bits (at most the dtype's); ``inf``
    where there is none (beyond the dtype's range, or no positive one below). ``zero`` holds non-negative integers,
    ``target`` positive values."""
    whole = zero.to(torch.int64)
    odd = torch.where(whole > 0, whole // (whole & -whole).clamp_min(1), torch.ones_like(whole))
    odd_bits = torch.floor(torch.log2(odd.double())) + 1
    exponent = torch.frexp(target).exponent.double() - 1  # target in [2**exponent, 2**(exponent + 1))
    result = torch.full_like(target, float("inf"))
    # Multiples of 2**(exponent - digits + 1 + odd_bits) within the binade all qualify; with the quantum half as
    # large, only the smaller ones do, so both are tried and the nearer exact one is kept.
    for extra in (1, 0):
        quantum = torch.exp2(exponent - digits + 1 + odd_bits - extra)
        scale = (torch.ceil if up else torch.floor)(target / quantum) * quantum
        exact = ((scale > 0) & (scale.to(dtype).double() == scale)
                 & ((zero * scale).to(dtype).double() == zero * scale))
        nearer = (scale - target).abs() < (result - target).abs()
        result = torch.where(exact & nearer, scale, result)
    return result


def _grid_error(groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int) -> torch.Tensor:
    """Squared rounding error per group on the grid ``(code - zero) * scale``; ``inf`` where the scale is not finite."""
    scale32, zero32 = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    finite = torch.isfinite(scale)
    safe = torch.where(finite.unsqueeze(-1), scale32, torch.ones_like(scale32))
    codes = torch.round(groups / safe + zero32).clamp_(0, levels)
    error = ((codes - zero32) * safe - groups).square_().sum(dim=-1)
    return torch.where(finite, error, float("inf"))


def mse_clipped_parameters(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool, *,
                           candidates: int = 80, smallest_ratio: float = 0.2, zero_point: str = "float",
                           scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per group, the min-max grid shrunk by the clipping ratio that minimises the group's squared rounding error.

    Ratios ``r`` run from 1 down to ``smallest_ratio``; the grid covers ``[r * min, r * max]`` (``[-r * absmax,
    r * absmax]`` when symmetric), as GPTQ's ``mse`` grid search does. At 2-3 bits min-max wastes most levels on the
    few largest weights of a group: clipping them trades a large error on those few for a smaller one on all the
    others. Returns float32 ``(scale, offset)`` like :func:`rtn_parameters`. ``zero_point="integer"``: each ratio's
    clipped range gets its integer-zero-point grid (:func:`integer_zero_point_grid`), and the error is measured on it.
    """
    integer = check_zero_point(zero_point, symmetric) == "integer"
    groups = _grouped(weight, group_size)
    levels = 2**bits - 1
    tiny = torch.finfo(torch.float32).tiny
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    if symmetric:
        high = torch.maximum(low.abs(), high.abs())
        low = -high
    best_error = best_scale = best_offset = None
    for ratio in torch.linspace(1.0, smallest_ratio, candidates).tolist():
        if integer:
            scale, offset, error = integer_zero_point_grid(groups, low * ratio, high * ratio, bits, scale_dtype)
        else:
            scale = ((high - low) * ratio / levels).clamp_min(tiny)
            offset = low * ratio
            codes = torch.round((groups - offset.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, levels)
            error = (codes * scale.unsqueeze(-1) + offset.unsqueeze(-1) - groups).square_().sum(dim=-1)
        if best_error is None:
            best_error, best_scale, best_offset = error, scale, offset
        else:
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_scale = torch.where(better, scale, best_scale)
            best_offset = torch.where(better, offset, best_offset)
    return best_scale, None if symmetric else best_offset


def codes_for(weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """Nearest codes (int64 ``[out, in]``) of ``weight`` on the grid given by ``scale``/``offset``."""
    groups = _grouped(weight, group_size)
    levels = 2**bits - 1
    scale = scale.float().unsqueeze(-1)
    if offset is None:
        normalized = groups / scale + levels / 2
    else:
        normalized = (groups - offset.float().unsqueeze(-1)) / scale
    return torch.round(normalized).clamp_(0, levels).to(torch.int64).reshape(weight.shape)


def storable_parameters(scale: torch.Tensor, offset: torch.Tensor | None, scale_dtype: torch.dtype):
    """Round ``scale``/``offset`` to their storage dtype; a constant group (scale 0) gets the smallest normal scale so
    that codes stay finite (its weights then all sit on code 0 = offset, or on the grid's centre when symmetric)."""
    finfo = torch.finfo(scale_dtype)
    stored_scale = scale.float().clamp_min(finfo.tiny).to(scale_dtype)
    stored_offset = None if offset is None else offset.float().to(scale_dtype)
    for name, tensor in (("scale", stored_scale), ("offset", stored_offset)):
        if tensor is not None and not torch.isfinite(tensor).all():
            raise ValueError(
                f"A quantization {name} does not fit in {str(scale_dtype).removeprefix('torch.')} (the weights hold "
                "values beyond its range or non-finite values). Use scale_dtype='float32'."
            )
    return stored_scale, stored_offset


def quantize_weight(weight: torch.Tensor, bits: int, group_size: int, *, symmetric: bool = False,
                    scale_dtype: torch.dtype = torch.float16, scale: torch.Tensor | None = None,
                    offset: torch.Tensor | None = None, zero_point: str = "float") -> QuantizedWeight:
    """Quantize a float ``[out_features, in_features]`` weight and pack it.

    By default the grid is min-max RTN per group, and codes are the nearest points of the stored (rounded) grid.
    Pass ``scale`` (and ``offset`` unless symmetric) to quantize on a given grid instead, e.g. one learned by
    quantization-aware training: codes are then taken on that exact grid, which is what training saw, and only the
    grid itself is rounded to ``scale_dtype`` (a flipped code would move a weight by a whole step, a rounded scale
    only by a fraction of it). ``zero_point="integer"`` picks the min-max grid with an integer zero point (exact in
    ``scale_dtype``); a given grid is taken as it is.
    """
    check_bits(bits)
    if weight.ndim != 2:
        raise ValueError(f"quantize_weight expects a 2-D weight, got shape {tuple(weight.shape)}.")
    if not torch.isfinite(weight).all():
        raise ValueError("The weight contains NaN or infinite values; it cannot be quantized.")
    if scale is None:
        grid = rtn_parameters(weight, bits, group_size, symmetric, zero_point=zero_point, scale_dtype=scale_dtype)
        stored_scale, stored_offset = storable_parameters(*grid, scale_dtype)
        codes = codes_for(weight.detach(), stored_scale, stored_offset, bits, group_size)
    else:
        if (offset is None) != symmetric:
            raise ValueError("Pass an offset exactly when quantizing asymmetrically (symmetric=False).")
        scale, offset = scale.detach().float(), None if offset is None else offset.detach().float()
        codes = codes_for(weight.detach(), scale.clamp_min(torch.finfo(torch.float32).tiny), offset, bits, group_size)
        stored_scale, stored_offset = storable_parameters(scale, offset, scale_dtype)
    return QuantizedWeight(pack_codes(codes, bits), stored_scale, stored_offset, bits, group_size, weight.shape[1])


def dequantize_weight(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int,
                      group_size: int, in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float weight ``[out_features, in_features]`` from packed codes (computed in float32, returned in ``dtype``)."""
    codes = unpack_codes(packed, bits, in_features)
    out_features = codes.shape[0]
    groups = codes.reshape(out_features, in_features // group_size, group_size).to(torch.float32)
    if offset is None:
        groups = (groups - (2**bits - 1) / 2) * scale.float().unsqueeze(-1)
    else:
        groups = groups * scale.float().unsqueeze(-1) + offset.float().unsqueeze(-1)
    return groups.reshape(out_features, in_features).to(dtype)


def fake_quantize(weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int,
                  group_size: int) -> torch.Tensor:
    """Quantize-dequantize ``weight`` on the grid ``scale``/``offset`` with a straight-through estimator.

    Rounding passes gradients straight through; clamping does not (weights beyond the grid get no gradient through
    the rounding path). ``scale`` and ``offset`` receive the LSQ gradients, scaled by LSQ's rule
    ``1 / sqrt(group_size * (2**bits - 1))`` so that a step shared by a group does not move faster than its weights.
    """
    out_features, in_features = weight.shape
    levels = 2**bits - 1
    groups = weight.reshape(out_features, in_features // group_size, group_size)
    factor = 1.0 / (group_size * levels) ** 0.5
    scale = scale_gradient(scale, factor).unsqueeze(-1)
    offset = None if offset is None else scale_gradient(offset, factor)
    if offset is None:
        normalized = (groups / scale + levels / 2).clamp(0, levels)
    else:
        offset = offset.unsqueeze(-1)
        normalized = ((groups - offset) / scale).clamp(0, levels)
    rounded = normalized + (torch.round(normalized) - normalized).detach()
    grid = (rounded - levels / 2) * scale if offset is None else rounded * scale + offset
    return grid.reshape(out_features, in_features)
