"""Rotary position embedding applied and undone inside a cache, so keys can be coded before RoPE.

Rotation is an orthogonal map per pair of channels, so undoing it with the same angles is exact up to rounding.
The angles come from the model's own rotary module (``inv_freq`` and ``attention_scaling``), recorded at calibration.
"""

from __future__ import annotations

import torch


def find_rotary_parameters(model) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of a model's rotary embedding module; raises if RoPE is length-dependent."""
    text_config = model.config.get_text_config(decoder=True)
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type in ("dynamic",):
        raise ValueError(
            f"rope_type={rope_type!r} changes its frequencies with the sequence length, so keys cannot be stored "
            "before RoPE with fixed angles. Calibrate with key_space='post_rope' for this model."
        )
    if rope.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ValueError("Partial rotary embeddings are not supported for pre-RoPE key storage; use key_space='post_rope'.")
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor) and hasattr(module, "attention_scaling"):
            return inv_freq.detach().float().cpu().clone(), float(module.attention_scaling)
    raise ValueError(
        f"Could not find a rotary embedding module (with `inv_freq` and `attention_scaling`) in {type(model).__name__}; "
        "use key_space='post_rope' for this model."
    )


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float):
    """cos/sin of shape ``[B, T, D]`` for integer ``positions`` ``[B, T]``, matching transformers' rotary modules."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)[None, None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos() * attention_scaling, angles.sin() * attention_scaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``keys`` ``[B, H, T, D]``; ``cos``/``sin`` ``[B, T, D]``."""
    cos, sin = cos[:, None].to(keys.dtype), sin[:, None].to(keys.dtype)
    return keys * cos + _rotate_half(keys) * sin


def undo_rope(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_scaling: float) -> torch.Tensor:
    """Inverse of :func:`apply_rope` (the rotation's transpose, divided by the scaling applied twice)."""
    cos, sin = cos[:, None].to(keys.dtype), sin[:, None].to(keys.dtype)
    return (keys * cos - _rotate_half(keys) * sin) / (attention_scaling**2)
