"""The per-layer SCD math both sides run: code a producer layer's states, and rebuild a consumer layer's keys and
values from those codes. Fitting measures its quality budget through these same functions, so what it measured is
what a payload carries.

Section names per layer ``l``: ``layers.l.key_codes`` / ``.key_scales`` / ``.value_codes`` / ``.value_scales`` for
Reuse, ``layers.l.patch_codes`` / ``.patch_scales`` for Patch, and ``layers.l.patch_rms`` (float16, one per token)
for a recompute Patch, whose codes are of the residual stream's direction ``h / rms(h)``. Codes are int8 (8 bits), two per byte in uint8
(4 bits), float16 (16 bits) or float32 (32 bits, lossless); 16- and 32-bit codes send no scales; scales are one float16 per token.
"""

from __future__ import annotations

import torch

from ..codecs.lowrank import dequantize_codes, pack_int4, quantize_codes, unpack_int4
from ..rope import apply_rope, rotary_cos_sin
from .knowledge_base import LayerPlan, SCDKnowledgeBase
from .model_access import LayerCapture, residual_direction


def _code(codes: torch.Tensor, bits: int, name: str) -> dict[str, torch.Tensor]:
    quantized, scales = quantize_codes(codes, bits)
    if bits >= 16:
        return {f"{name}_codes": quantized}
    if bits == 4:
        quantized = pack_int4(quantized)
    return {f"{name}_codes": quantized, f"{name}_scales": scales}


def _uncode(sections: dict[str, torch.Tensor], name: str, bits: int, rank: int) -> torch.Tensor:
    codes = sections[f"{name}_codes"]
    if bits >= 16:
        return codes.float()
    if bits == 4:
        codes = unpack_int4(codes, rank)
    return dequantize_codes(codes, sections[f"{name}_scales"])


def encode_layer(capture: LayerCapture, plan: LayerPlan, kb: SCDKnowledgeBase, start: int,
                 code_bits: int | None = None) -> dict[str, torch.Tensor]:
    """The sections of one layer for tokens ``start:`` of the capture (float32 math; codes at ``code_bits``)."""
    bits = code_bits or kb.code_bits
    prefix = f"layers.{plan.index}"
    if plan.kind == "reuse":
        keys = kb.keys[plan.index].truncated(plan.key_rank).encode(capture.keys[:, start:].float())
        values = kb.values[plan.index].truncated(plan.value_rank).encode(capture.values[:, start:].float())
        return {**_code(keys, bits, f"{prefix}.key"), **_code(values, bits, f"{prefix}.value")}
    if plan.kind == "recomputed":
        return {}
    if plan.recomputes:
        if capture.residual is None:
            raise ValueError(f"Layer {plan.index} is a recompute Patch layer but its residual stream was not captured.")
        direction, rms = residual_direction(capture.residual[:, start:])
        codes = kb.residuals[plan.index].truncated(plan.patch_rank).encode(direction)
        return {**_code(codes, bits, f"{prefix}.patch"), f"{prefix}.patch_rms": rms.to(rms_dtype(bits))}
    if capture.inputs is None:
        raise ValueError(f"Layer {plan.index} is a Patch layer but its normalized input was not captured.")
    inputs = kb.inputs[plan.index].truncated(plan.patch_rank).encode(capture.inputs[:, start:].float())
    return _code(inputs, bits, f"{prefix}.patch")


def rms_dtype(bits: int) -> torch.dtype:
    """float16 RMS beside quantized or float16 codes; float32 beside lossless float32 codes."""
    return torch.float32 if bits == 32 else torch.float16


def predict_residual(plan: LayerPlan, kb: SCDKnowledgeBase, sections: dict[str, torch.Tensor], bits: int,
                     ) -> torch.Tensor:
    """The consumer's residual stream ``[B, T, d]`` entering a recompute Patch layer, predicted from its sections:
    the decoded direction rescaled to unit RMS (the producer's direction has unit RMS; a low-rank prediction of the
    consumer's is shrunk towards the mean) times the producer's per-token RMS."""
    prefix = f"layers.{plan.index}"
    direction = kb.residuals[plan.index].decode(_uncode(sections, f"{prefix}.patch", bits, plan.patch_rank))
    direction = direction / direction.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
    return direction * sections[f"{prefix}.patch_rms"].float()[..., None]


@torch.no_grad()
def rebuild_layer(consumer_layer, plan: LayerPlan, kb: SCDKnowledgeBase, sections: dict[str, torch.Tensor],
                  bits: int, cos: torch.Tensor, sin: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Consumer keys (post-RoPE) and values ``[B, H_kv, T, d_h]`` of one layer from its sections. ``cos``/``sin``
    ``[B, T, d_h]`` are the consumer's rotary angles at the tokens' positions; ``shape`` is ``(H_kv, d_h)``."""
    prefix = f"layers.{plan.index}"
    heads, head_dim = shape
    if plan.kind == "reuse":
        keys = kb.keys[plan.index].decode(_uncode(sections, f"{prefix}.key", bits, plan.key_rank))
        values = kb.values[plan.index].decode(_uncode(sections, f"{prefix}.value", bits, plan.value_rank))
    else:
        inputs = kb.inputs[plan.index].decode(_uncode(sections, f"{prefix}.patch", bits, plan.patch_rank))
        attention = consumer_layer.self_attn
        weight_dtype = next(attention.k_proj.parameters()).dtype
        inputs = inputs.to(weight_dtype)
        keys, values = attention.k_proj(inputs).float(), attention.v_proj(inputs).float()
    batch, tokens = keys.shape[:2]
    keys = keys.reshape(batch, tokens, heads, head_dim).transpose(1, 2)
    values = values.reshape(batch, tokens, heads, head_dim).transpose(1, 2)
    keys = apply_rope(keys, cos, sin)
    return keys.to(dtype), values.to(dtype)


def consumer_angles(inv_freq: torch.Tensor, attention_scaling: float, positions: torch.Tensor):
    """cos/sin ``[B, T, d_h]`` at integer ``positions`` ``[B, T]``, as the consumer's rotary module computes them."""
    return rotary_cos_sin(positions, inv_freq, attention_scaling)
