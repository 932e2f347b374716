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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .learnable import scale_gradient

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
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


def rtn_parameters(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max round-to-nearest ``(scale, offset)`` per group, in float32 (``offset`` is None when symmetric)."""
    groups = _grouped(weight, group_size)
    levels = 2**bits - 1
    if symmetric:
        return groups.abs().amax(dim=-1) * 2 / levels, None
    low = groups.amin(dim=-1)
    return (groups.amax(dim=-1) - low) / levels, low


def mse_clipped_parameters(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool, *,
                           candidates: int = 80, smallest_ratio: float = 0.2) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per group, the min-max grid shrunk by the clipping ratio that minimises the group's squared rounding error.

    Ratios ``r`` run from 1 down to ``smallest_ratio``; the grid covers ``[r * min, r * max]`` (``[-r * absmax,
    r * absmax]`` when symmetric), as GPTQ's ``mse`` grid search does. At 2-3 bits min-max wastes most levels on the
    few largest weights of a group: clipping them trades a large error on those few for a smaller one on all the
    others. Returns float32 ``(scale, offset)`` like :func:`rtn_parameters`.
    """
    groups = _grouped(weight, group_size)
    levels = 2**bits - 1
    tiny = torch.finfo(torch.float32).tiny
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    if symmetric:
        high = torch.maximum(low.abs(), high.abs())
        low = -high
    best_error = best_scale = best_offset = None
    for ratio in torch.linspace(1.0, smallest_ratio, candidates).tolist():
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
                    offset: torch.Tensor | None = None) -> QuantizedWeight:
    """Quantize a float ``[out_features, in_features]`` weight and pack it.

    By default the grid is min-max RTN per group, and codes are the nearest points of the stored (rounded) grid.
    Pass ``scale`` (and ``offset`` unless symmetric) to quantize on a given grid instead, e.g. one learned by
    quantization-aware training: codes are then taken on that exact grid, which is what training saw, and only the
    grid itself is rounded to ``scale_dtype`` (a flipped code would move a weight by a whole step, a rounded scale
    only by a fraction of it).
    """
    check_bits(bits)
    if weight.ndim != 2:
        raise ValueError(f"quantize_weight expects a 2-D weight, got shape {tuple(weight.shape)}.")
    if not torch.isfinite(weight).all():
        raise ValueError("The weight contains NaN or infinite values; it cannot be quantized.")
    if scale is None:
        stored_scale, stored_offset = storable_parameters(*rtn_parameters(weight, bits, group_size, symmetric), scale_dtype)
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
