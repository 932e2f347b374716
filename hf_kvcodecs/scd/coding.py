"""The per-layer SCD math both sides run: code a producer layer's states, and rebuild a consumer layer's keys and
values from those codes. Fitting measures its quality budget through these same functions, so what it measured is
what a payload carries.

Section names per layer ``l``: ``layers.l.key_codes`` / ``.key_scales`` / ``.value_codes`` / ``.value_scales`` for
Reuse, ``layers.l.patch_codes`` / ``.patch_scales`` for Patch, and ``layers.l.patch_rms`` (float16, one per token)
for a recompute Patch, whose codes are of the residual stream's direction ``h / rms(h)``. Flat codes are int8
(8 bits), two per byte in uint8 (4 bits), float16 (16 bits) or float32 (32 bits, lossless); 16- and 32-bit codes send
no scales; scales are one float16 per token. Whitened codes (a layer plan with code widths, below 16 bits) are the
packed bytes of :func:`hf_kvcodecs.codecs.bit_allocation.encode` (uint8, ``ceil(Σ bits / 8)`` per token) and, when
the code sends a gain, ``.key_gains`` / ``.value_gains`` / ``.patch_gains`` (uint8, one per token) instead of scales.
:func:`section_layout` is the one table of a layer's sections (names, dtypes, shapes) that the producer writes, the
payload manifest implies and the consumer checks.
"""

from __future__ import annotations

import dataclasses

import torch

from ..codecs import bit_allocation
from ..codecs.lowrank import LowRankMap, dequantize_codes, pack_int4, quantize_codes, unpack_int4
from ..rope import apply_rope, rotary_cos_sin
from .knowledge_base import CodeWidths, LayerPlan, SCDKnowledgeBase, flat_vector_bytes
from .model_access import LayerCapture, residual_direction
from .payload import SectionSpec

FLAT_CODE_DTYPES = {4: torch.uint8, 8: torch.int8, 16: torch.float16, 32: torch.float32}


def whitened_code(plan: LayerPlan, name: str, bits: int) -> CodeWidths | None:
    """The widths ``name``'s code of this layer is sent at, or None for a flat code (no widths, or float codes at 16
    and 32 bits, which either format sends as floats)."""
    return plan.widths.get(name) if bits < 16 else None


def section_layout(plan: LayerPlan, bits: int, batch: int, coded: int) -> list[SectionSpec]:
    """The sections one layer sends for ``batch`` prompts of ``coded`` coded tokens, in wire order: per code (key
    then value, or patch) its codes ``[B, T, width]`` and their scales ``[B, T]`` (flat, below 16 bits) or gains
    ``[B, T]`` (whitened, when sent), then a recompute Patch layer's RMS ``[B, T]``. Flat codes are ``rank`` wide
    (``ceil(rank / 2)`` bytes at 4 bits); whitened ones are ``ceil(Σ bits / 8)`` bytes of the layer's widths."""
    prefix = f"layers.{plan.index}"
    table = []
    for name, rank in plan.code_ranks():
        code = whitened_code(plan, name, bits)
        if code is not None:
            table.append(SectionSpec(f"{prefix}.{name}_codes", torch.uint8, (batch, coded, code.packed_bytes())))
            if code.gain:
                table.append(SectionSpec(f"{prefix}.{name}_gains", torch.uint8, (batch, coded)))
            continue
        width = rank if bits != 4 else (rank + 1) // 2
        table.append(SectionSpec(f"{prefix}.{name}_codes", FLAT_CODE_DTYPES[bits], (batch, coded, width)))
        if bits < 16:
            table.append(SectionSpec(f"{prefix}.{name}_scales", torch.float16, (batch, coded)))
    if plan.recomputes:
        table.append(SectionSpec(f"{prefix}.patch_rms", rms_dtype(bits), (batch, coded)))
    return table


def allocate_code(mapping: LowRankMap, rank: int, bits: int, gain: bool) -> CodeWidths:
    """The whitened code of ``mapping`` that spends what its flat code of ``rank`` components at ``bits`` bits
    spends (the packed codes and the float16 scale, less the gain byte when one is sent), water-filled over all the
    map's components (:func:`~hf_kvcodecs.codecs.bit_allocation.allocate_bits`, variances from the fitted spectrum,
    each component weighted by its decoder row's squared norm: what an error in it costs in the consumer's space).
    The widths come out non-increasing; the components given 0 bits are not sent."""
    budget = 8 * (flat_vector_bytes(rank, bits) - (bit_allocation.GAIN_BYTES if gain else 0))
    weights = mapping.decoder.double().square().sum(1)
    allocated = bit_allocation.allocate_bits(mapping.component_energy.double().clamp_min(0), budget, weights=weights)
    kept = int((allocated > 0).sum())
    return CodeWidths(tuple(int(b) for b in allocated[:kept]), gain)


def code_map(kb: SCDKnowledgeBase, plan: LayerPlan, name: str) -> LowRankMap:
    """The map whose codes ``name`` (``key``, ``value`` or ``patch``) of this layer are."""
    if name == "key":
        return kb.keys[plan.index]
    if name == "value":
        return kb.values[plan.index]
    return kb.patch_map(plan)


def whiten_plan(plan: list[LayerPlan], kb: SCDKnowledgeBase, bits: int, gain: bool,
                cache: dict | None = None) -> list[LayerPlan]:
    """The whitened plan at the bytes of ``plan``'s flat ``bits``-bit codes: every code's widths from
    :func:`allocate_code` on ``kb``'s maps (of at least the plan's ranks), its rank the number of components that
    get bits. ``cache`` (a dict) keeps allocations across calls on the same maps."""
    whitened = []
    for layer in plan:
        codes = {}
        for name, rank in layer.code_ranks():
            key = (layer.index, layer.kind, layer.patch_mode, name, rank, bits, gain)
            if cache is None or key not in cache:
                code = allocate_code(code_map(kb, layer, name), rank, bits, gain)
                if cache is None:
                    codes[name] = code
                    continue
                cache[key] = code
            codes[name] = cache[key]
        ranks = {f"{name}_rank": code.rank for name, code in codes.items()}
        whitened.append(dataclasses.replace(layer, widths=codes, **ranks))
    return whitened


def _code(codes: torch.Tensor, bits: int, name: str, code: CodeWidths | None,
          mapping: LowRankMap) -> dict[str, torch.Tensor]:
    if code is not None:
        packed, gains = bit_allocation.encode(codes, mapping.component_energy[:code.rank], code.bits, gain=code.gain)
        return {f"{name}_codes": packed, **({f"{name}_gains": gains} if gains is not None else {})}
    quantized, scales = quantize_codes(codes, bits)
    if bits >= 16:
        return {f"{name}_codes": quantized}
    if bits == 4:
        quantized = pack_int4(quantized)
    return {f"{name}_codes": quantized, f"{name}_scales": scales}


def _uncode(sections: dict[str, torch.Tensor], name: str, bits: int, rank: int, code: CodeWidths | None,
            mapping: LowRankMap) -> torch.Tensor:
    codes = sections[f"{name}_codes"]
    if code is not None:
        return bit_allocation.decode(codes, mapping.component_energy[:code.rank], code.bits,
                                     sections.get(f"{name}_gains"))
    if bits >= 16:
        return codes.float()
    if bits == 4:
        codes = unpack_int4(codes, rank)
    return dequantize_codes(codes, sections[f"{name}_scales"])


def encode_layer(capture: LayerCapture, plan: LayerPlan, kb: SCDKnowledgeBase, start: int,
                 code_bits: int | None = None) -> dict[str, torch.Tensor]:
    """The sections of one layer for tokens ``start:`` of the capture (float32 math; codes at ``code_bits``, in the
    plan's widths when it has them and ``code_bits`` is below 16)."""
    bits = code_bits or kb.code_bits
    prefix = f"layers.{plan.index}"
    if plan.kind == "reuse":
        sections = {}
        for name, rank, states in (("key", plan.key_rank, capture.keys), ("value", plan.value_rank, capture.values)):
            mapping = code_map(kb, plan, name)
            codes = mapping.truncated(rank).encode(states[:, start:].float())
            sections.update(_code(codes, bits, f"{prefix}.{name}", whitened_code(plan, name, bits), mapping))
        return sections
    if plan.kind == "recomputed":
        return {}
    mapping = code_map(kb, plan, "patch")
    code = whitened_code(plan, "patch", bits)
    if plan.recomputes:
        if capture.residual is None:
            raise ValueError(f"Layer {plan.index} is a recompute Patch layer but its residual stream was not captured.")
        direction, rms = residual_direction(capture.residual[:, start:])
        codes = mapping.truncated(plan.patch_rank).encode(direction)
        return {**_code(codes, bits, f"{prefix}.patch", code, mapping), f"{prefix}.patch_rms": rms.to(rms_dtype(bits))}
    if capture.inputs is None:
        raise ValueError(f"Layer {plan.index} is a Patch layer but its normalized input was not captured.")
    inputs = mapping.truncated(plan.patch_rank).encode(capture.inputs[:, start:].float())
    return _code(inputs, bits, f"{prefix}.patch", code, mapping)


def rms_dtype(bits: int) -> torch.dtype:
    """float16 RMS beside quantized or float16 codes; float32 beside lossless float32 codes."""
    return torch.float32 if bits == 32 else torch.float16


def predict_residual(plan: LayerPlan, kb: SCDKnowledgeBase, sections: dict[str, torch.Tensor], bits: int,
                     ) -> torch.Tensor:
    """The consumer's residual stream ``[B, T, d]`` entering a recompute Patch layer, predicted from its sections:
    the decoded direction rescaled to unit RMS (the producer's direction has unit RMS; a low-rank prediction of the
    consumer's is shrunk towards the mean) times the producer's per-token RMS."""
    prefix = f"layers.{plan.index}"
    mapping = kb.residuals[plan.index]
    codes = _uncode(sections, f"{prefix}.patch", bits, plan.patch_rank, whitened_code(plan, "patch", bits), mapping)
    direction = mapping.decode(codes)
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
        keys, values = (code_map(kb, plan, name).decode(_uncode(sections, f"{prefix}.{name}", bits, rank,
                                                                whitened_code(plan, name, bits),
                                                                code_map(kb, plan, name)))
                        for name, rank in plan.code_ranks())
    else:
        mapping = kb.inputs[plan.index]
        inputs = mapping.decode(_uncode(sections, f"{prefix}.patch", bits, plan.patch_rank,
                                        whitened_code(plan, "patch", bits), mapping))
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
