"""Rotary position embedding applied and undone inside a cache, so keys can be coded before RoPE.

Rotation is an orthogonal map per pair of channels, so undoing it with the same angles is exact up to rounding.
The angles come from the model's own rotary module (``inv_freq`` and ``attention_scaling``), recorded at calibration.
"""

from __future__ import annotations

import weakref

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


class RotaryHalfTable:
    """cos/sin of every position up to the largest asked for, one half of each row (``[P, D/2]``: in the rotate-half
    convention both halves of a row are equal), computed as :func:`rotary_cos_sin` computes them.

    The code-reading attention on CPU rotates every coded key at every decode step and needs the coded tokens'
    cos/sin each time: computing them afresh allocates and fills two [B, N, D] tensors per step, a cost that grows
    with the context; consecutive positions are a slice of this table instead. One table per model's rotary
    parameters is shared by every cache built for them (:func:`shared_rotary_half_table`), so it is a per-model cost
    (256 bytes per position for head_dim 64) that memory reports count as shared.
    """

    GROWTH = 1024  # positions added at a time (the table is recomputed whole when it grows)

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        self.inv_freq, self.attention_scaling = inv_freq.detach().float().clone(), float(attention_scaling)
        self.cos = self.sin = None  # [P, D/2]

    def halves(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B, T, D/2]`` (contiguous fp32) for integer ``positions`` ``[B, T]``: a view of the table for one
        row of consecutive positions, a gathered copy otherwise."""
        batch, tokens = positions.shape
        if tokens == 0 or int(positions.min()) < 0:  # (negative positions: some padding conventions)
            cos, sin = rotary_cos_sin(positions, self.inv_freq, self.attention_scaling)
            half = cos.shape[-1] // 2
            return cos[..., :half].contiguous(), sin[..., :half].contiguous()
        first, last = int(positions[:, 0].min()), int(positions.max())
        self._cover(last + 1, positions.device)
        consecutive = batch == 1 and last - first == tokens - 1 and bool(
            (positions[0, 1:] - positions[0, :-1] == 1).all())
        if consecutive:
            return self.cos[None, first:last + 1], self.sin[None, first:last + 1]
        index = positions.reshape(-1).long()
        return (self.cos.index_select(0, index).reshape(batch, tokens, -1),
                self.sin.index_select(0, index).reshape(batch, tokens, -1))

    def _cover(self, needed: int, device) -> None:
        if self.cos is not None and self.cos.shape[0] >= needed and self.cos.device == torch.device(device):
            return
        rows = -(-needed // self.GROWTH) * self.GROWTH
        cos, sin = rotary_cos_sin(torch.arange(rows, device=device)[None], self.inv_freq, self.attention_scaling)
        half = cos.shape[-1] // 2
        self.cos, self.sin = cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()


_HALF_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared_rotary_half_table(inv_freq: torch.Tensor, attention_scaling: float) -> RotaryHalfTable:
    """The :class:`RotaryHalfTable` for these rotary parameters, shared while any cache holds it."""
    key = (tuple(inv_freq.detach().float().cpu().tolist()), float(attention_scaling))
    table = _HALF_TABLES.get(key)
    if table is None:
        table = _HALF_TABLES[key] = RotaryHalfTable(inv_freq, attention_scaling)
    return table


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


def model_rope_inv_freq(model) -> torch.Tensor | None:
    """The RoPE frequencies ``model`` applies: its rotary embedding's ``inv_freq`` buffer as float32 (rounded to bf16
    if the model was cast with ``.to(torch.bfloat16)``), or None for a model without one."""
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor) and "rotary" in type(module).__name__.lower():
            return inv_freq.detach().float().cpu().clone()
    return None
