"""Per-vector scales of the codecs: fp16, or the uint8 index of one of 256 log-uniform levels in a per-head range
fitted at calibration."""

from __future__ import annotations

import torch

from ..kernels import scale_values_from_levels

FP16_SCALE_BITS = 16
LOG_SCALE_BITS = 8


def quantize_scales(rms: torch.Tensor, log_scale_range: torch.Tensor | None,
                    levels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored scales, their values) for per-vector RMS ``[H, N]``: fp16, or with ``log_scale_range`` (``[H, 2]``)
    the uint8 index of the nearest of 256 log-uniform levels (clamped to the range). ``levels``: that range's
    :func:`scale_levels` when the caller keeps them (a codec's :func:`cached_scale_levels`), else computed here."""
    if log_scale_range is None:
        stored = rms.to(torch.float16)
        return stored, stored.float()
    low, high = log_scale_range[:, :1].to(rms.device), log_scale_range[:, 1:].to(rms.device)
    position = (torch.log2(rms.float()) - low) / (high - low) * (2**LOG_SCALE_BITS - 1)
    stored = position.round_().clamp_(0, 2**LOG_SCALE_BITS - 1).to(torch.uint8)
    if levels is None:
        return stored, dequantize_scales(stored, log_scale_range)
    return stored, scale_values_from_levels(levels.to(stored.device), stored)


def dequantize_scales(stored: torch.Tensor, log_scale_range: torch.Tensor | None) -> torch.Tensor:
    """Values of stored scales ``[..., H, N]`` (fp16 ones are returned as they are)."""
    if stored.dtype != torch.uint8:
        return stored
    if log_scale_range is None:
        raise ValueError("8-bit scales need the codec's log_scale_range.")
    return scale_values_from_levels(scale_levels(log_scale_range.to(stored.device)), stored)


def scale_levels(log_scale_range: torch.Tensor) -> torch.Tensor:
    """``[H, 256]`` values of the 8-bit scale levels from ``[H, 2]`` log2 (low, high) ranges."""
    low, high = log_scale_range[:, :1].float(), log_scale_range[:, 1:].float()
    steps = torch.arange(2**LOG_SCALE_BITS, device=log_scale_range.device, dtype=torch.float32) / (2**LOG_SCALE_BITS - 1)
    return torch.exp2(low + (high - low) * steps)


def cached_scale_levels(codec, device) -> torch.Tensor | None:
    """A codec's ``[H, 256]`` scale levels on ``device``, kept on the codec (they are needed at every decode step;
    prefixes share the levels of the codec they were cut from); None when its scales are fp16."""
    source = codec._table_source or codec
    if source._levels is not None and source._levels.device == torch.device(device):
        return source._levels  # (before log_scale_range: a conditional codec builds that property by concatenation)
    if codec.log_scale_range is None:
        return None
    if source._levels is None or source._levels.device != torch.device(device):
        source._levels = scale_levels(source.log_scale_range.to(device))
    return source._levels


def stored_scale_values(codec, stored: torch.Tensor) -> torch.Tensor:
    """Stored scales ``[..., H, N]`` of ``codec`` (either codec class) as numbers."""
    levels = cached_scale_levels(codec, stored.device) if stored.dtype == torch.uint8 else None
    return dequantize_scales(stored, codec.log_scale_range) if levels is None else scale_values_from_levels(levels, stored)
