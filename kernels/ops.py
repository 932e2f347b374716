"""``torch.library`` custom ops for the GSRQ kernels.

Every op has one definition and several implementations, picked by the dispatcher from the tensors' device:
    default (any device without a kernel)  the readable PyTorch reference in ``reference.py``
    "cpu"                                  ``cpu.py`` for attention (same math, CPU-friendly primitives; its hot loops
                                           compiled from ``cpu_native.cpp`` on first use when a C++ compiler is
                                           available), else reference; the encoder's compiled loop, else reference
    "cuda"                                 the Triton kernels when Triton is installed, else the reference
    fake (Meta)                            output shapes only, for torch.compile / meta tensors
Set ``HF_KVCODECS_KERNELS=reference`` to force the reference everywhere (e.g. to compare or debug), or
``HF_KVCODECS_KERNELS=pytorch`` to keep ``cpu.py`` on PyTorch ops only (no compiled code).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch
from torch import Tensor

from . import reference

LIBRARY = "hf_kvcodecs"
MAX_BEAM_WIDTH = 64  # beyond a few beams the search stops paying (see TransformResidualVQ.encode)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None and os.environ.get("HF_KVCODECS_KERNELS", "auto") != "reference"


def backend_for(device: torch.device) -> str:
    """Which attention implementation the ops use for tensors on ``device``: "triton", "cpu-native" (compiled
    loops, ``cpu_native.cpp``), "cpu" (PyTorch ops, ``cpu.py``) or "reference"."""
    kind = torch.device(device).type
    if os.environ.get("HF_KVCODECS_KERNELS", "auto") == "reference":
        return "reference"
    if kind == "cuda":
        return "triton" if triton_available() else "reference"
    if kind == "cpu":
        from .cpu_native import native_ops

        return "cpu-native" if native_ops() is not None else "cpu"
    return "reference"


@torch.library.custom_op(f"{LIBRARY}::coded_attention", mutates_args=())
def coded_attention(
    query: Tensor,
    key_codes: Tensor,
    key_scales: Tensor,
    value_codes: Tensor,
    value_scales: Tensor,
    key_operands: list[Tensor],
    value_operands: list[Tensor],
    rotary: list[Optional[Tensor]],
    exact: list[Optional[Tensor]],
    scale_levels: list[Optional[Tensor]],
    mask: Optional[Tensor],
    attention_scaling: float,
    scaling: float,
) -> tuple[Tensor, Tensor]:
    """Attention over the coded region: (output ``[B, Hq, Lq, D]`` fp32, log-sum-exp ``[B, Hq, Lq]`` fp32).

    The argument set is the same for every codec layout; what differs between layouts travels inside the lists:
    ``key_operands`` / ``value_operands``: each codec's ``attention_operands()`` (mean, synthesis, codebooks, stage
    groups; values coded given the keys add their predictor as a fifth); ``rotary``: ``[key_table, rotary_cos,
    rotary_sin, positions, inv_freq]``; ``exact``: ``[exact_keys, exact_values, exact_mask]``; ``scale_levels``:
    ``[key_scale_levels, value_scale_levels]`` (each may be None). In the implementations' terms:

    With ``exact_keys``/``exact_values`` (``[B, Hkv, T, D]``, RoPE applied, any float dtype; ``exact_mask``
    ``[B, Lq, T]`` additive or None) the attention spans the coded region and those tokens with one softmax, and the
    output and log-sum-exp are over both: the CPU implementation then needs no separate merge.

    Keys coded conditionally across heads (``ConditionalHeadResidualVQ.attention_operands``: key mean
    ``[Hkv, Hkv, D]``, synthesis ``[Hkv, Hkv, D, D]``, codebooks ``[Hkv, S, K, g]``, stage groups ``[Hkv, S]``; always
    with positions) are read by every implementation (``reference.conditional_dequantize_reference`` is the math).

    With ``key_scale_levels``/``value_scale_levels`` (``[Hkv, 256]`` fp32) the matching scales are the cache's 8-bit
    level indices (uint8) rather than values: the compiled CPU loops look them up per token; the other
    implementations convert them first.

    Values coded given the keys (``value_predictor`` ``[Hkv*D + 1, Hkv*D]`` with the residual code's value operands,
    ``KeyPredictedValueVQ``): the prediction from the coded keys is added from attention-weighted sums of the keys
    (``reference.predicted_value_sums``); the Triton kernel adds it from every source key head's codes
    (``reference.fold_value_prediction``), and so does the compiled CPU loop for per-head or joint keys; for
    conditional keys the compiled CPU loop forms the weighted key sums while it rebuilds the keys
    (``cpu.prerope_decode_attention(value_predictor=...)``). Without the compiled loops, the reference.

    Optional precomputed inputs, used by the implementations they speed up and ignored by the others:
    ``key_table`` (``[Hkv, S'*K, D]``, ``S' >= S``: the codebooks times each head's synthesis matrix,
    ``cpu.folded_key_table``; for conditional keys the flat ``cpu.conditional_key_table``; float32, or float16 where
    the compiled CPU loops read it, ``cpu.native_key_table_dtype()``) and
    ``rotary_cos``/``rotary_sin`` (``[B, N, D]``, scaled, for the coded tokens' positions, in transformers'
    rotate-half layout where both halves of a row are equal: the same for every layer of a step, so the cache
    computes them once).
    """
    return _reference(*positional_arguments(query, key_codes, key_scales, value_codes, value_scales, key_operands,
                                            value_operands, rotary, exact, scale_levels, mask, attention_scaling,
                                            scaling))


_LIST_LENGTHS = {"key_operands": (4,), "value_operands": (4, 5), "rotary": (5,), "exact": (3,), "scale_levels": (2,)}


def positional_arguments(query, key_codes, key_scales, value_codes, value_scales, key_operands, value_operands, rotary,
                         exact, scale_levels, mask, attention_scaling, scaling) -> list:
    """The op's arguments in the order the implementations take them: query, codes and scales, the key and value
    codecs' four operands, key_table, rotary_cos, rotary_sin, positions, inv_freq, attention_scaling, mask, scaling,
    exact_keys, exact_values, exact_mask, key_scale_levels, value_scale_levels, value_predictor."""
    lists = {"key_operands": key_operands, "value_operands": value_operands, "rotary": rotary, "exact": exact,
             "scale_levels": scale_levels}
    for name, items in lists.items():
        if len(items) not in _LIST_LENGTHS[name]:
            raise ValueError(f"coded_attention: {name} holds {len(items)} tensors, expected "
                             f"{' or '.join(map(str, _LIST_LENGTHS[name]))}.")
    predictor = value_operands[4] if len(value_operands) == 5 else None
    return [query, key_codes, key_scales, value_codes, value_scales, *key_operands, *value_operands[:4], *rotary,
            attention_scaling, mask, scaling, *exact, *scale_levels, predictor]


_PRECOMPUTED = slice(13, 16)  # key_table, rotary_cos, rotary_sin
_CODED_ARGUMENTS = 21  # then exact_keys, exact_values, exact_mask, key_scale_levels, value_scale_levels, value_predictor
_OPTIONAL_ARGUMENTS = 6
_KEY_SCALES, _VALUE_SCALES = 2, 4


def _optional(args):
    return (list(args[_CODED_ARGUMENTS:]) + [None] * _OPTIONAL_ARGUMENTS)[:_OPTIONAL_ARGUMENTS]


def _split(args):
    """(the coded region's arguments without the precomputed inputs and with scale values, the exact tokens' (keys,
    values, mask))."""
    arguments = list(args[:_CODED_ARGUMENTS])
    extra = _optional(args)
    for position, levels in ((_KEY_SCALES, extra[3]), (_VALUE_SCALES, extra[4])):
        if levels is not None:
            arguments[position] = reference.scale_values_from_levels(levels, arguments[position])
    del arguments[_PRECOMPUTED]
    return arguments, extra[:3]


def _value_predictor(args):
    return _optional(args)[5]


def _joined(coded_attention_implementation, args):
    coded_args, exact = _split(args)
    coded = coded_attention_implementation(*coded_args)
    return reference.join_exact_attention(coded, args[0], *exact, args[_CODED_ARGUMENTS - 1])


def _reference(*args):
    predictor = _value_predictor(args)
    return _joined(lambda *coded: reference.coded_attention_reference(*coded, value_predictor=predictor), args)


@coded_attention.register_kernel("cpu")
def _coded_attention_cpu(*grouped):
    args = positional_arguments(*grouped)
    if os.environ.get("HF_KVCODECS_KERNELS", "auto") == "reference":
        return _reference(*args)
    from .cpu import coded_attention_cpu

    return coded_attention_cpu(*args)


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@coded_attention.register_kernel("cuda")
def _coded_attention_cuda(*grouped):
    args = positional_arguments(*grouped)
    head_dim = args[0].shape[-1]
    if not triton_available() or head_dim < 32 or not _power_of_two(head_dim):  # shapes the kernel does not tile
        return _reference(*args)
    from .triton_attention import coded_attention_triton

    # The Triton kernel reconstructs in the transform domain (8-dim codewords, one small matmul) and computes the
    # rotation from positions in registers: on a GPU, reading precomputed tables would cost more bandwidth than codes.
    predictor = _value_predictor(args)
    return _joined(lambda *coded: coded_attention_triton(*coded, value_predictor=predictor), args)


@coded_attention.register_fake
def _coded_attention_fake(query, *args):
    batch, heads, length, dim = query.shape
    return (query.new_empty(batch, heads, length, dim, dtype=torch.float32),
            query.new_empty(batch, heads, length, dtype=torch.float32))


@torch.library.custom_op(f"{LIBRARY}::residual_encode", mutates_args=())
def residual_encode(z: Tensor, codebooks: Tensor, stage_groups: Tensor, beam_width: int = 1) -> Tensor:
    """Residual-VQ codes ``[R, S]`` (uint8) of transform-domain vectors ``z`` ``[R, D]``: greedy (``beam_width=1``)
    or beam search over each group's stages (``reference.residual_encode_beam_reference``)."""
    _check_beam_width(beam_width)
    if z.device.type == "cpu":
        from .cpu_native import native_ops

        native = native_ops()
        if native is not None:  # the compiled loop: no [rows, beams * K] score tensors, codewords scored in registers
            return native.residual_encode_beam(z.float().contiguous(), codebooks.float().contiguous(),
                                               stage_groups.long().contiguous(), beam_width)
    if beam_width == 1:
        return reference.residual_encode_reference(z, codebooks, stage_groups)
    return reference.residual_encode_beam_reference(z, codebooks, stage_groups, beam_width)


@residual_encode.register_kernel("cuda")
def _residual_encode_cuda(z, codebooks, stage_groups, beam_width=1):
    _check_beam_width(beam_width)
    if not triton_available() or not (_power_of_two(codebooks.shape[1]) and _power_of_two(codebooks.shape[2])):
        if beam_width == 1:
            return reference.residual_encode_reference(z, codebooks, stage_groups)
        return reference.residual_encode_beam_reference(z, codebooks, stage_groups, beam_width)
    from .triton_encode import residual_encode_beam_triton, residual_encode_triton

    if beam_width == 1:
        return residual_encode_triton(z, codebooks, stage_groups)
    return residual_encode_beam_triton(z, codebooks, stage_groups, beam_width)


@residual_encode.register_fake
def _residual_encode_fake(z, codebooks, stage_groups, beam_width=1):
    return z.new_empty(z.shape[0], codebooks.shape[0], dtype=torch.uint8)


def _check_beam_width(beam_width: int) -> None:
    if not 1 <= beam_width <= MAX_BEAM_WIDTH:
        raise ValueError(f"beam_width must be between 1 (greedy) and {MAX_BEAM_WIDTH}, got {beam_width}.")
