"""Progressive SCD payloads: every prefix of the wire is a payload the consumer can decode.

A progressive payload sends, after the prompt's sections, a *base* pass over every layer (each Reuse code's leading
``ceil(fraction * rank)`` components with its scale or gain, and every Patch section whole, since a recompute block
needs its whole code), then a *refinement* pass: the remaining components of each Reuse code, layer by layer, as
sections named ``layers.l.key_refine`` / ``layers.l.value_refine``. PCA codes are ordered and their components
uncorrelated, so a Reuse layer whose refinement has not arrived decodes its base components alone with the same
knowledge base (the other components at their mean: the least-squares decode of that prefix), and one whose
refinement arrived decodes the whole code exactly as a plain payload would.

The split is fixed by the manifest (its ``progressive`` fraction and layer table), so the consumer knows every
section's shape before any arrives and never has to guess what a missing section would have held.
"""

from __future__ import annotations

import dataclasses

import torch

from ..codecs import bit_allocation
from ..codecs.lowrank import pack_int4, unpack_int4
from .coding import FLAT_CODE_DTYPES, whitened_code
from .knowledge_base import LayerPlan
from .payload import SectionSpec

__all__ = ["REFINE_SUFFIX", "base_layer", "merge_all", "merge_refinements", "refinement_layout", "split_refinements"]

REFINE_SUFFIX = "_refine"


def _base_rank(rank: int, fraction: float) -> int:
    """The rule :func:`~hf_kvcodecs.scd.encode.truncate_payload` cuts by, so a base pass is that payload's codes."""
    return 0 if rank == 0 else min(rank, max(1, round(rank * fraction)))


def base_layer(layer: LayerPlan, fraction: float) -> LayerPlan:
    """The plan of ``layer``'s base pass: a Reuse layer's codes cut to their leading components (whitened widths cut
    to the same prefix); Patch and recomputed layers unchanged."""
    if layer.kind != "reuse":
        return layer
    key, value = _base_rank(layer.key_rank, fraction), _base_rank(layer.value_rank, fraction)
    widths = {name: code.prefix({"key": key, "value": value}[name]) for name, code in layer.widths.items()}
    return dataclasses.replace(layer, key_rank=key, value_rank=value, widths=widths)


def _refined_codes(full: LayerPlan, base: LayerPlan) -> list[tuple[str, int, int]]:
    """``(name, base rank, full rank)`` of each code of a layer that has components past its base pass."""
    return [(name, kept, rank) for (name, rank), (_, kept) in zip(full.code_ranks(), base.code_ranks())
            if kept < rank]


def refinement_layout(full: LayerPlan, base: LayerPlan, bits: int, batch: int, coded: int) -> list[SectionSpec]:
    """The refinement sections of one layer (none when its base pass is the whole code), in wire order."""
    table = []
    for name, kept, rank in _refined_codes(full, base):
        code = whitened_code(full, name, bits)
        if code is not None:
            width = (sum(code.bits[kept:]) + 7) // 8
            table.append(SectionSpec(f"layers.{full.index}.{name}{REFINE_SUFFIX}", torch.uint8, (batch, coded, width)))
        else:
            width = rank - kept if bits != 4 else (rank - kept + 1) // 2
            table.append(SectionSpec(f"layers.{full.index}.{name}{REFINE_SUFFIX}", FLAT_CODE_DTYPES[bits],
                                     (batch, coded, width)))
    return table


def split_refinements(full: LayerPlan, base: LayerPlan, sections: dict[str, torch.Tensor], bits: int,
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A layer's sections coded at its full plan, as its base-pass sections (named and shaped as
    :func:`~hf_kvcodecs.scd.coding.section_layout` lists them for ``base``) and its refinement sections."""
    base_sections, refinements = dict(sections), {}
    for name, kept, rank in _refined_codes(full, base):
        key = f"layers.{full.index}.{name}_codes"
        codes = sections[key]
        code = whitened_code(full, name, bits)
        if code is not None:
            indices = bit_allocation.unpack(codes, code.bits)
            base_sections[key] = bit_allocation.pack(indices[..., :kept].contiguous(), code.bits[:kept])
            tail = bit_allocation.pack(indices[..., kept:].contiguous(), code.bits[kept:])
        elif bits == 4:
            values = unpack_int4(codes, rank)
            base_sections[key], tail = pack_int4(values[..., :kept]), pack_int4(values[..., kept:])
        else:
            base_sections[key], tail = codes[..., :kept].contiguous(), codes[..., kept:].contiguous()
        refinements[f"layers.{full.index}.{name}{REFINE_SUFFIX}"] = tail
    return base_sections, refinements


def merge_refinements(full: LayerPlan, base: LayerPlan, sections: dict[str, torch.Tensor], bits: int,
                      ) -> dict[str, torch.Tensor]:
    """A layer's base and refinement sections (all present) as the sections of its full plan."""
    merged = {name: tensor for name, tensor in sections.items() if not name.endswith(REFINE_SUFFIX)}
    for name, kept, rank in _refined_codes(full, base):
        key = f"layers.{full.index}.{name}_codes"
        head, tail = sections[key], sections[f"layers.{full.index}.{name}{REFINE_SUFFIX}"]
        code = whitened_code(full, name, bits)
        if code is not None:
            indices = torch.cat((bit_allocation.unpack(head, code.bits[:kept]),
                                 bit_allocation.unpack(tail, code.bits[kept:])), -1)
            merged[key] = bit_allocation.pack(indices, code.bits)
        elif bits == 4:
            merged[key] = pack_int4(torch.cat((unpack_int4(head, kept), unpack_int4(tail, rank - kept)), -1))
        else:
            merged[key] = torch.cat((head, tail), -1)
    return merged


def merge_all(layers, bases, sections: dict[str, torch.Tensor], bits: int) -> dict[str, torch.Tensor]:
    """Every layer's sections of a complete progressive payload as those of the one-pass payload of its plan."""
    merged = {name: tensor for name, tensor in sections.items() if not name.startswith("layers.")}
    for full, base in zip(layers, bases):
        prefix = f"layers.{full.index}."
        merged.update(merge_refinements(full, base, {name: tensor for name, tensor in sections.items()
                                                     if name.startswith(prefix)}, bits))
    return merged
