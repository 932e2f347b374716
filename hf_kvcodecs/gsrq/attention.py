"""Attention over one GSRQ layer that reads codes: the coded history and the exact tokens (sinks and window) in one
call of the ``hf_kvcodecs::coded_attention`` op (Triton on CUDA, compiled loops or PyTorch on CPU), joined by one
softmax on CPU and by a log-sum-exp merge elsewhere. On CPU with the compiled loops (keys coded before RoPE, eager
mode) the op's own final step, the compiled ``decode_attention``, is called directly. Long query blocks (prefill)
take the dequantize path instead: their tokens were just computed in full precision anyway, and code-reading pays
off per decoded token.
"""

from __future__ import annotations

import math

import torch

from ..codecs.conditional import ConditionalHeadResidualVQ
from ..kernels import (
    LOOKUP_MAX_ROWS,
    DecodeConstants,
    FixedPointKeyTable,
    coded_attention,
    conditional_key_table,
    conditional_native_supports,
    decode_constants,
    decode_with_constants,
    float_key_table_dtype,
    folded_key_table,
    fuses_value_prediction,
    native_key_table_dtype,
    native_ops,
)


def additive_mask(attention_mask, batch: int, query_length: int, kv_length: int, device) -> torch.Tensor | None:
    """``[B, Lq, KV]`` float mask (0 = visible, -inf = hidden) from what transformers passes to attention functions:
    a boolean (True = visible) or additive float mask ``[B, 1, Lq, KV]``, or None (everything visible for one query;
    causal, aligned to the last key, for several)."""
    if attention_mask is None:
        if query_length == 1:
            return None
        query_positions = torch.arange(kv_length - query_length, kv_length, device=device)[:, None]
        hidden = torch.arange(kv_length, device=device)[None, :] > query_positions
        return torch.zeros(query_length, kv_length, device=device).masked_fill_(hidden, -math.inf)[None].expand(batch, -1, -1)
    mask = attention_mask
    if mask.ndim == 4:
        if mask.shape[1] != 1:
            raise ValueError("GSRQ code-reading attention expects one mask for all heads (shape [B, 1, Lq, KV]).")
        mask = mask[:, 0]
    if mask.shape[-1] != kv_length:
        raise ValueError(f"attention mask covers {mask.shape[-1]} keys but the GSRQ layer holds {kv_length}.")
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, device=device).masked_fill_(~mask, -math.inf)
    return mask.float().expand(batch, query_length, kv_length)


def uses_codes(layer, query: torch.Tensor) -> bool:
    """Whether this call reads codes: decode-sized query blocks with a non-empty coded region."""
    group_count = query.shape[1] // layer.key_codec.num_heads
    return layer.is_initialized and layer.key_codes.shape[-2] > 0 and group_count * query.shape[2] <= LOOKUP_MAX_ROWS


def _table_loop_fits(key_codec, head_dim: int) -> bool:
    """Whether the compiled CPU loops can rebuild these keys from a table: conditional keys only in the shapes the
    loop was compiled for (others are rebuilt chunk by chunk by the op's reference)."""
    return not isinstance(key_codec, ConditionalHeadResidualVQ) or conditional_native_supports(head_dim,
                                                                                              key_codec.num_heads)


def _predicted_across_heads(key_codec) -> bool:
    """Whether a key head is rebuilt from other heads' codes too; keys with each head's own codebooks and no
    prediction (``per_head_codebooks``) are read by the compiled loop like keys with shared codebooks."""
    return isinstance(key_codec, ConditionalHeadResidualVQ) and key_codec.predicts_across_heads


def _native_loop(layer, query: torch.Tensor):
    """The compiled CPU library when this layer's attention can be one ``decode_attention`` call, else None."""
    if layer.key_space != "pre_rope" or query.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    key_codec = layer.key_codec
    fits = not _predicted_across_heads(key_codec) or _table_loop_fits(key_codec, query.shape[-1])
    return native_ops() if fits else None


def gsrq_layer_attention(layer, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
    """``query`` ``[B, Hq, Lq, D]`` (RoPE applied) -> output ``[B, Hq, Lq, D]`` in the query's dtype.

    Only for calls where :func:`uses_codes` holds; others go through the model's own attention on
    ``layer.dequantized_keys_and_values()``.
    """
    batch, _, query_length, dim = query.shape
    sinks, codes, window = layer.sink_keys.shape[-2], layer.key_codes.shape[-2], layer.window_keys.shape[-2]
    mask = additive_mask(attention_mask, batch, query_length, sinks + codes + window, query.device)
    exact_keys = torch.cat([layer.sink_keys, layer.window_keys], dim=-2)
    exact_values = torch.cat([layer.sink_values, layer.window_values], dim=-2)
    exact_mask = coded_mask = None
    if mask is not None:
        exact_mask = torch.cat([mask[..., :sinks], mask[..., sinks + codes:]], dim=-1)
        coded_mask = mask[..., sinks:sinks + codes]
    key_codec, value_codec = layer.key_codec, layer.value_codec
    conditional = isinstance(key_codec, ConditionalHeadResidualVQ)  # always coded before RoPE
    pre_rope = layer.key_space == "pre_rope"
    on_cpu = query.device.type == "cpu"
    key_scales, key_levels = _scales_and_levels(key_codec, layer.key_scales, query.device)
    value_scales, value_levels = _scales_and_levels(value_codec, layer.value_scales, query.device)
    native = _native_loop(layer, query)
    if native is not None:
        # what the CPU kernel of hf_kvcodecs::coded_attention ends in, without the custom op's Python dispatch
        constants = _layer_decode_constants(layer, key_levels, value_levels)
        prediction_codes = None
        if constants.prediction is not None:  # values coded given the keys: a histogram of the key codes per head
            prediction_codes = layer.key_codes.expand(-1, key_scales.shape[1], -1, -1)
        out, _ = decode_with_constants(
            native, constants, query, layer.key_codes, key_scales, layer.value_codes, value_scales,
            *layer._cos_sin_halves(sinks, sinks + codes),  # shared by all layers
            coded_mask, scaling, exact_keys, exact_values, exact_mask, prediction_codes, key_scales,
        )
        return out.to(query.dtype)
    # CPU kernels rebuild pre-RoPE keys from the table (under torch.compile too); for conditional keys only the
    # compiled loop does, elsewhere the op's reference reads the operands
    wants_table = (pre_rope and on_cpu and _table_loop_fits(key_codec, dim)
                   and (not conditional or native_ops() is not None))
    # the op's arguments are tensors: a float table where the compiled loop would read fixed point
    table_dtype = float_key_table_dtype(native_key_table_dtype()) if native_ops() is not None else torch.float32
    key_table = _cpu_key_table(key_codec, table_dtype)[0] if wants_table else None
    values_given_keys = value_codec.needs_keys  # the op adds the prediction from the key codes
    rotary = layer._cos_sin(sinks, sinks + codes) if pre_rope and on_cpu else (None, None)  # shared by all layers
    value_operands = (list(value_codec.residual_attention_operands()) + [value_codec.predictor] if values_given_keys
                      else list(value_codec.attention_operands()))
    out, _ = coded_attention(
        query, layer.key_codes, key_scales, layer.value_codes, value_scales,
        list(key_codec.attention_operands()), value_operands,
        [key_table, *rotary,
         layer.ledger.positions[:, sinks:sinks + codes] if pre_rope else None,
         layer.rope_inv_freq.to(query.device) if pre_rope else None],
        [exact_keys, exact_values, exact_mask], [key_levels, value_levels],
        coded_mask, float(layer.rope_attention_scaling), float(scaling),
    )
    return out.to(query.dtype)


# Attribute of a layer's key codec that holds its DecodeConstants, per value codec it was paired with: on the codec,
# every cache built from the same codebooks (and a deep copy of one) shares them, and a walk of a cache's objects
# (bench.memory) reaches every tensor they hold.
_DECODE_CONSTANTS = "_decode_constants"


def held_decode_constants(layer) -> DecodeConstants | None:
    """The :class:`DecodeConstants` the layer's code-reading steps read, or None before its first such step (they
    are built lazily, per layer)."""
    held = layer.key_codec.__dict__.get(_DECODE_CONSTANTS, {}).get(id(layer.value_codec))
    return None if held is None else held[1]


def _layer_decode_constants(layer, key_levels, value_levels) -> DecodeConstants:
    """The layer's :class:`DecodeConstants`, built on its first decode step and again only if its codecs, the key
    table dtype or the scales' form change."""
    key_codec, value_codec = layer.key_codec, layer.value_codec
    table_dtype = native_key_table_dtype()
    source = (value_codec, table_dtype, key_levels, value_levels)
    # keyed by the value codec's id: the entry holds that codec, so its id cannot be reused while the entry lives
    by_value_codec = key_codec.__dict__.setdefault(_DECODE_CONSTANTS, {})
    held = by_value_codec.get(id(value_codec))
    if held is not None and all(a is b for a, b in zip(held[0], source)):
        return held[1]
    conditional = _predicted_across_heads(key_codec)
    key_table, key_mean = _cpu_key_table(key_codec, table_dtype, per_head=not conditional)
    prediction = predictor = None
    if value_codec.needs_keys:  # values coded given the keys: residual + prediction
        value_mean, value_synthesis, value_codebooks, value_stage_groups = value_codec.residual_attention_operands()
        if fuses_value_prediction(conditional, key_codec.code_heads, key_codec.head_dim, key_codec.num_heads):
            predictor = value_codec.predictor  # the key loop forms the weighted key sums the predictor needs
        else:  # a histogram of the key codes per key head
            prediction = (key_levels, *value_codec.attention_prediction(key_codec))
    else:
        value_mean, value_synthesis, value_codebooks, value_stage_groups = value_codec.attention_operands()
    constants = decode_constants(
        key_levels, key_table, key_mean, key_codec.codebook_size,
        value_levels, value_codebooks, value_stage_groups, value_mean, value_synthesis, conditional_keys=conditional,
        value_prediction=prediction, value_predictor=predictor)
    by_value_codec[id(value_codec)] = (source, constants)
    return constants


def _cpu_key_table(key_codec, dtype: torch.dtype, per_head: bool = False):
    """(the table the CPU loops rebuild keys from, in ``dtype``, the key mean they take with it). ``per_head``: keys
    with each head's own codebooks as a per-head table (the compiled loop's fast path) rather than as the
    ``coded_attention`` op takes their operands (pairs of heads, the off-diagonal ones zero)."""
    if isinstance(key_codec, ConditionalHeadResidualVQ):
        if per_head:
            return per_head_key_table(key_codec, dtype)
        return conditional_key_table_of(key_codec, dtype)
    return shared_key_table(key_codec, dtype), key_codec.attention_operands()[0]


def shared_key_table(key_codec, dtype: torch.dtype = torch.float32):
    """``[H, S'*K, D]`` codebooks times each head's synthesis matrix (``S' >= num_stages``: shared with the higher-rate
    codec this one is a prefix of), in ``dtype`` (``torch.int16``: a :class:`~hf_kvcodecs.kernels.FixedPointKeyTable`),
    for keys coded per head or jointly with codebooks shared by the heads. Built once per dtype asked last."""
    def build(source):
        _, synthesis, codebooks, stage_groups = source.attention_operands()
        return folded_key_table(synthesis, codebooks, stage_groups, dtype)

    return key_codec.derived("cpu_key_table", (key_codec.mean.device, dtype), build)


def conditional_key_table_of(key_codec, dtype: torch.dtype = torch.float32) -> tuple:
    """(table in ``dtype``, mean ``[H, H*D]`` float32) as the compiled CPU attention reads keys coded conditionally
    across heads: ``kernels.conditional_key_table`` of the full-rate codec's operands (lower rates read a prefix of
    every slice)."""
    def build(source):
        mean, synthesis, codebooks, stage_groups = source.build_attention_operands()  # the table replaces them
        return (conditional_key_table(synthesis, codebooks, stage_groups, dtype),
                mean.reshape(source.num_heads, -1).contiguous())

    return key_codec.derived("cpu_conditional_key_table", (key_codec.predictors.device, dtype), build)


def per_head_key_table(key_codec, dtype: torch.dtype = torch.float32) -> tuple:
    """Heads coded independently only: (``[H, S'*K, D]`` table, mean ``[H, D]``), each head's own codebooks times its
    synthesis matrix, as the compiled CPU loop reads per-head keys (the form of :func:`shared_key_table`); ``S'`` is
    the full-rate codec's stages (lower rates read a prefix). Built once per dtype asked last."""
    if key_codec.predicts_across_heads:
        raise ValueError("Keys predicted across heads are read from conditional_key_table_of(), not a per-head table.")

    def build(source):
        table = torch.cat([folded_key_table(codec.attention_operands()[1], codec.codebooks, codec.stage_groups)
                           for codec in source.head_codecs])
        table = FixedPointKeyTable(table, source.codebook_size) if dtype == torch.int16 else table.to(dtype)
        return table, source.mean.contiguous()

    return key_codec.derived("cpu_per_head_key_table", (key_codec.predictors.device, dtype), build)


def _scales_and_levels(codec, stored: torch.Tensor, device):
    """(scales as the op takes them, their level table or None): 8-bit scales go as level indices with the table,
    which the compiled CPU loops read per token instead of a per-step lookup of every scale."""
    levels = codec.scale_level_table(device) if stored.dtype == torch.uint8 else None
    return (stored, levels) if levels is not None else (codec.scale_values(stored), None)
