"""Fast CPU implementation of ``hf_kvcodecs::coded_attention`` for decoding (few query rows per KV head).

Same contract and math as ``coded_attention_reference``; it differs only in how the work is done, to suit a CPU:
* keys coded before RoPE (the default): one compiled call (``decode_attention`` in ``cpu_native.cpp``) does the whole
  attention: it rebuilds each key from ``key_table`` (the per-head codebooks already multiplied by the synthesis
  matrix), rotates it and dots it with the queries, one token at a time, then joins the exact tokens, softmax and
  values; without a compiler, one ``embedding_bag`` per chunk rebuilds the keys and PyTorch ops do the rest;
* keys coded after RoPE: one ``embedding_bag`` over query-codebook lookup tables;
* keys coded conditionally across heads: the compiled loop reads them from ``conditional_key_table`` (head_dim 64 or
  128, at most 16 KV heads); elsewhere the reference rebuilds them chunk by chunk;
* values: a histogram of probability x scale per codeword (compiled loops, or one ``scatter_add_``), multiplied by
  the codebooks once (in the compiled loops too), then by the synthesis matrix.
Larger query blocks (prefill) go to the reference.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import reference
from .cpu_native import native_ops

CHUNK_TOKENS = 2048  # bounds the transient memory (keys reconstructed, histogram sources) whatever the context
CONDITIONAL_HEAD_DIMS = (64, 128)  # what the compiled loop for keys coded conditionally across heads is built for
MAX_CONDITIONAL_HEADS = 16
# The tables the compiled loops rebuild pre-RoPE keys from are read at random, one 64-float row per stage and key, and
# their time is the time those rows take to arrive: 16-bit rows halve the bytes (a head's float32 table is 1 MB, more
# than a 512 KB L2 per core holds). Each float16 row's rounding (relative 2^-11) is far below the keys' quantization
# error. Fixed-point int16 rows (the default) read the same bytes and add 16 lanes per AVX2 register with no widening
# per row, with a rounding error (about 1e-4 of the largest table entry per key) of the same order as float16's.
KEY_TABLE_DTYPES = {"int16": torch.int16, "float16": torch.float16, "float32": torch.float32}
FIXED_POINT_LIMIT = 32767  # int16: the loops add a key's rows in 16-bit lanes


def native_key_table_dtype() -> torch.dtype:
    """The dtype of the key tables the compiled loops read: ``int16`` (a :class:`FixedPointKeyTable`) unless
    ``HF_KVCODECS_KEY_TABLE`` says ``float16`` or ``float32`` (with float32 the loops match the PyTorch reference to
    float32 rounding, at the cost of reading twice the bytes)."""
    name = os.environ.get("HF_KVCODECS_KEY_TABLE", "int16")
    if name not in KEY_TABLE_DTYPES:
        raise ValueError(f"HF_KVCODECS_KEY_TABLE={name!r} is not a key table dtype; use one of "
                         f"{sorted(KEY_TABLE_DTYPES)} (or unset it for int16).")
    return KEY_TABLE_DTYPES[name]


def float_key_table_dtype(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` where a key table must be a tensor (the custom op's arguments): float16 in place of int16."""
    return torch.float16 if dtype == torch.int16 else dtype


class FixedPointKeyTable:
    """A folded key table in fixed point, as the compiled pre-RoPE key loop reads it fastest: ``rows`` int16
    ``[H, R, D]`` and ``step`` float32 ``[H, D]``, entry ``(h, r, d)`` standing for ``rows[h, r, d] * step[h, d]``.
    Each head and dimension gets the finest step for which no sum of one row per stage can leave int16: the loops add a
    key's rows in 16-bit integer lanes with no overflow check. Duck-types the parts of a table tensor the PyTorch path
    reads (``shape``, ``dtype``, ``device``, ``float()``). The conditional-keys table is several such tables
    (:meth:`concatenate`): ``rows`` flat, ``step`` one row per slice."""

    def __init__(self, table: torch.Tensor, codebook_size: int):
        heads, table_rows, dim = table.shape
        if table_rows % codebook_size:
            raise ValueError(f"a key table of {table_rows} rows is not whole stages of {codebook_size} codewords")
        stages = table_rows // codebook_size
        if stages >= FIXED_POINT_LIMIT // 2:
            raise ValueError(f"{stages} stages are too many for an int16 key table; use HF_KVCODECS_KEY_TABLE=float16")
        per_stage = table.double().reshape(heads, stages, codebook_size, dim)
        bound = per_stage.abs().amax(dim=2).sum(dim=1)  # the largest |sum of one row per stage|, per head and dim
        # rounding moves each row by at most half a step: keep room for that in the sum of `stages` rows
        step = (bound / (FIXED_POINT_LIMIT - stages)).clamp_min(torch.finfo(torch.float32).tiny).float()
        self.rows = torch.round(per_stage / step.double()[:, None, None, :]).reshape(heads, table_rows, dim)
        self.rows = self.rows.to(torch.int16).contiguous()
        self.step = step.contiguous()  # the step the rows were rounded with, as the loops read it

    dtype = torch.int16

    @classmethod
    def concatenate(cls, parts: list[FixedPointKeyTable]) -> FixedPointKeyTable:
        """One flat table of the parts' slices in order (``rows`` 1-D, ``step`` ``[slices, D]``)."""
        joined = cls.__new__(cls)
        joined.rows = torch.cat([part.rows.reshape(-1) for part in parts])
        joined.step = torch.cat([part.step for part in parts]).contiguous()
        return joined

    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def shape(self) -> torch.Size:
        return self.rows.shape

    def float(self) -> torch.Tensor:
        slices, dim = self.step.shape
        return (self.rows.reshape(slices, -1, dim).float() * self.step[:, None, :]).reshape(self.rows.shape)


def folded_key_table(synthesis: torch.Tensor, codebooks: torch.Tensor, stage_groups: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor | FixedPointKeyTable:
    """``[H, S*K, D]``: row ``s*K + k`` of head ``h`` is codeword ``k`` of stage ``s``, placed in its group, times
    ``synthesis[h]`` (``[Dt, D]``), computed in float32 and stored in ``dtype`` (``torch.int16``: a
    :class:`FixedPointKeyTable`); a key is then ``scale * (mean + sum of S rows)``."""
    stages, size, group_dim = codebooks.shape
    heads, transform_dim, dim = synthesis.shape
    rows = synthesis.reshape(heads, transform_dim // group_dim, group_dim, dim)[:, stage_groups.long()]  # [H, S, g, D]
    table = torch.einsum("skg,hsgd->hskd", codebooks.float(), rows.float()).reshape(heads, stages * size, dim)
    if dtype == torch.int16:
        return FixedPointKeyTable(table, size)
    return table.to(dtype).contiguous()


def conditional_key_table(synthesis: torch.Tensor, codebooks: torch.Tensor, stage_groups: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor | FixedPointKeyTable:
    """The flat table the compiled loop reads keys coded conditionally across heads from (operands as
    ``ConditionalHeadResidualVQ.attention_operands``: synthesis ``[H, H, D, D]``, codebooks ``[H, S, K, g]``, groups
    ``[H, S]``): slices ``(j, h)`` for ``j = 0..H-1``, ``h = j..H-1`` one after another, each ``[S*K, D]``, row
    ``s*K + k`` codeword ``k`` of head ``j``'s stage ``s`` placed in its group times ``synthesis[j, h]`` (its part of
    head ``h``). One slice per (source, target) pair lets the loop read one slice at a time (see ``cpu_native.cpp``)."""
    heads = synthesis.shape[0]
    blocks = [folded_key_table(synthesis[source, source:], codebooks[source], stage_groups[source], dtype)
              for source in range(heads)]
    if dtype == torch.int16:  # a step per slice (j, h)
        return FixedPointKeyTable.concatenate(blocks)
    return torch.cat([block.reshape(-1) for block in blocks]).contiguous()


def conditional_native_supports(dim: int, heads: int) -> bool:
    return dim in CONDITIONAL_HEAD_DIMS and heads <= MAX_CONDITIONAL_HEADS


def fuses_value_prediction(conditional: bool, key_code_heads: int, dim: int, heads: int) -> bool:
    """Whether the compiled loop forms the sums that values coded given the keys need while it rebuilds the keys
    (it then takes the predictor itself) rather than from a histogram of the key codes per key head: conditional
    keys always; keys per head with a code per head and a head_dim the conditional loop reads (forming the key sums
    there costs less than a histogram of every key head's codes)."""
    return conditional or (key_code_heads == heads and conditional_native_supports(dim, heads))


def coded_attention_cpu(
    query, key_codes, key_scales, value_codes, value_scales,
    key_mean, key_synthesis, key_codebooks, key_stage_groups,
    value_mean, value_synthesis, value_codebooks, value_stage_groups,
    key_table, rotary_cos, rotary_sin, positions, inv_freq, attention_scaling, mask, scaling,
    exact_keys=None, exact_values=None, exact_mask=None, key_scale_levels=None, value_scale_levels=None,
    value_predictor=None,
):
    reference.check_coded_operands(key_codes, key_synthesis, key_codebooks, value_codes, value_codebooks)
    batch, query_heads, query_length, dim = query.shape
    kv_heads, tokens, key_stages = key_scales.shape[1], key_codes.shape[2], key_codes.shape[3]
    rows = (query_heads // kv_heads) * query_length
    native = native_ops()
    conditional = reference.is_conditional(key_synthesis)
    use_reference = rows > reference.LOOKUP_MAX_ROWS or tokens == 0 or (
        conditional and (native is None or positions is None or not conditional_native_supports(dim, kv_heads))) or (
        value_predictor is not None and (native is None or positions is None))  # values given the keys: compiled only
    # 8-bit scales stay level indices only where the compiled loops look them up (pre-RoPE keys; values)
    if key_scale_levels is not None and (use_reference or native is None or positions is None):
        key_scales, key_scale_levels = reference.scale_values_from_levels(key_scale_levels, key_scales), None
    if value_scale_levels is not None and (use_reference or native is None):
        value_scales, value_scale_levels = reference.scale_values_from_levels(value_scale_levels, value_scales), None
    if use_reference:
        coded = reference.coded_attention_reference(
            query, key_codes, key_scales, value_codes, value_scales, key_mean, key_synthesis, key_codebooks,
            key_stage_groups, value_mean, value_synthesis, value_codebooks, value_stage_groups, positions, inv_freq,
            attention_scaling, mask, scaling, value_predictor=value_predictor,
        )
        return reference.join_exact_attention(coded, query, exact_keys, exact_values, exact_mask, scaling)
    size = key_codebooks.shape[-2]
    if positions is not None and native is not None:
        fold = conditional_key_table if conditional else folded_key_table
        if key_table is None:
            key_table = fold(key_synthesis, key_codebooks, key_stage_groups, native_key_table_dtype())
        if rotary_cos is None:
            rotary_cos, rotary_sin = reference.rotary_tables(positions, inv_freq, attention_scaling)
        prediction, fused = None, fuses_value_prediction(conditional, key_codes.shape[1], dim, kv_heads)
        if value_predictor is not None and not fused:  # the loop takes the predictor itself where it fuses it
            prediction = (key_codes.expand(-1, kv_heads, -1, -1), key_scales, key_scale_levels,
                          *reference.cached_fold_value_prediction(
                              value_predictor, (key_mean, key_synthesis, key_codebooks, key_stage_groups)))
        return prerope_decode_attention(
            native, query, key_codes, key_scales, key_scale_levels, key_table,
            key_mean.reshape(kv_heads, -1) if conditional else key_mean, rotary_cos, rotary_sin, size,
            value_codes, value_scales, value_scale_levels, value_codebooks, value_stage_groups, value_mean,
            value_synthesis, mask, scaling, exact_keys, exact_values, exact_mask, conditional_keys=conditional,
            value_prediction=prediction, value_predictor=value_predictor if fused else None,
        )
    q = query.float().reshape(batch, kv_heads, rows, dim)
    if key_scale_levels is None:
        key_scales = key_scales.float()
    if positions is None:
        key_codes = key_codes.expand(-1, kv_heads, -1, -1)  # joint-head codes serve every head
        # Lookup tables: entry (b, h, s*K + k, m) = q[b, h, m] . (codeword k of stage s) @ synthesis[h]
        constant, table = reference._key_lookup_tables(q, key_mean, key_synthesis, key_codebooks, key_stage_groups)
        table = table.transpose(-1, -2).reshape(batch * kv_heads * key_stages * size, rows)
        index = _flat_index(key_codes, key_stages * size, size)
        scores = F.embedding_bag(index.reshape(-1, key_stages), table, mode="sum").reshape(batch, kv_heads, tokens, rows)
        scores = (scores + constant[:, :, None, :]) * key_scales[..., None]
        scores = scores.transpose(-1, -2).contiguous()  # rows contiguous, as the compiled value loops read them
    else:
        if key_table is None:
            key_table = folded_key_table(key_synthesis, key_codebooks, key_stage_groups)
        table_rows = key_table.shape[1]  # may hold more stages than these codes use (lower rates are prefixes)
        stage_offsets = torch.arange(key_stages, device=key_codes.device) * size
        head_offsets = (torch.arange(kv_heads, device=key_codes.device) * table_rows)[None, :, None, None]
        flat_table = key_table.float().reshape(-1, dim)  # given in the compiled loops' dtype when they exist
        mean = key_mean.float()[None, :, None, :]
        scores = torch.empty(batch, kv_heads, rows, tokens, device=query.device)
        for start in range(0, tokens, CHUNK_TOKENS):  # at most CHUNK_TOKENS keys per head exist at once
            end = min(start + CHUNK_TOKENS, tokens)
            index = key_codes[:, :, start:end].long() + stage_offsets + head_offsets
            keys = F.embedding_bag(index.reshape(-1, key_stages), flat_table, mode="sum")
            keys = keys.reshape(batch, kv_heads, end - start, dim).add_(mean)
            if rotary_cos is None:
                cos, sin = reference.rotary_tables(positions[:, start:end], inv_freq, attention_scaling)
            else:
                cos, sin = rotary_cos[:, start:end], rotary_sin[:, start:end]
            keys = _rotate_in_place(keys, cos[:, None], sin[:, None])
            # the rotation is linear, so the per-token scale can be applied to the scores afterwards
            torch.mul(q @ keys.transpose(-1, -2), key_scales[:, :, None, start:end], out=scores[..., start:end])
    scores *= scaling
    group_count = rows // query_length
    reference.add_mask(scores, mask, group_count)
    exact = exact_keys is not None and exact_keys.shape[-2] > 0
    if exact:  # the exact tokens' scores join the coded ones: one softmax, no merge afterwards
        scores = torch.cat([scores, reference.exact_scores(q, exact_keys, exact_mask, scaling, group_count)], dim=-1)
    # Softmax left unnormalized: the value sums are linear in the weights, so dividing the few outputs by the
    # total replaces dividing every weight (one pass fewer over [rows, tokens]).
    weights, total, lse = reference.exp_weights(scores)
    if native is not None:
        if value_scale_levels is None:
            value_scales = value_scales.float()
        z, weight_sum = native.value_transform_sums(weights, value_codes.contiguous(), value_scales.contiguous(),
                                                    value_scale_levels, value_codebooks.float().contiguous(),
                                                    value_stage_groups.long().contiguous(), value_synthesis.shape[1])
        out = reference.values_from_transform_sums(z, weight_sum, value_mean, value_synthesis)
    else:
        out = reference._histogram_values(weights[..., :tokens], value_codes, value_scales, value_mean,
                                          value_synthesis, value_codebooks, value_stage_groups, chunk_tokens=CHUNK_TOKENS)
    if exact:
        out += weights[..., tokens:] @ exact_values.float()
    out /= total
    return out.reshape(batch, query_heads, query_length, dim), lse.reshape(batch, query_heads, query_length)


def prerope_decode_attention(
    native, query, key_codes, key_scales, key_scale_levels, key_table, key_mean, rotary_cos, rotary_sin, codebook_size,
    value_codes, value_scales, value_scale_levels, value_codebooks, value_stage_groups, value_mean, value_synthesis,
    mask, scaling, exact_keys, exact_values, exact_mask, conditional_keys: bool = False, value_prediction=None,
    value_predictor=None,
):
    """Decode attention over keys coded before RoPE in one compiled call (``decode_attention`` in ``cpu_native.cpp``:
    key loop, exact tokens, masks, one softmax, value sums and synthesis) -> (output ``[B, Hq, Lq, D]``, lse), fp32.

    ``native`` is :func:`.cpu_native.native_ops`; arguments as ``coded_attention`` takes them, with the folded
    ``key_table`` (a tensor or a :class:`FixedPointKeyTable`) and the coded tokens' ``rotary_cos``/``rotary_sin``
    given, ``[B, N, D]`` or just their first halves ``[B, N, D/2]`` (what the loops read). The CPU kernel of
    ``hf_kvcodecs::coded_attention`` ends here; the GSRQ cache's attention on CPU calls
    :func:`decode_with_constants` directly, without the Python custom op's dispatch (a per-layer, per-step cost
    that grows with this many arguments).

    ``conditional_keys``: the keys are coded head by head, each conditionally on the heads before it; ``key_table``
    is then :func:`conditional_key_table`'s flat table and ``key_mean`` ``[H, H*D]`` (row ``j``: source head ``j``'s
    mean pairs ``[H, D]`` flattened).

    ``value_prediction``: values coded given the keys (the value operands are then the residual code's), as
    ``(key codes [B, Hs, N, S], key scales [B, Hs, N], their levels [Hs, 256] or None, key codebooks [1 or Hs, S, K,
    g], stage groups [1 or Hs, S], mean [Hs, H, D], synthesis [Hs, H, Dt, D], bias [H, D])``: value head ``h`` of a
    coded token gains ``sum_j s_j (mean[j, h] + z_j @ synthesis[j, h]) + bias[h]`` (see
    ``KeyPredictedValueVQ.attention_operands``).

    ``value_predictor``: the same given as the predictor itself (``[Hkv*D + 1, Hkv*D]``), for conditional keys and
    keys per head where :func:`fuses_value_prediction`: the key loop then forms the attention-weighted sums of the
    keys it rebuilds, tile by tile, and the prediction is those sums times the predictor, with no histogram of the
    key codes (``ConditionalKeySums`` in ``cpu_native.cpp``)."""
    prediction_codes = prediction_scales = None
    if value_prediction is not None:
        prediction_codes, prediction_scales, *value_prediction = value_prediction
    constants = decode_constants(key_scale_levels, key_table, key_mean, codebook_size, value_scale_levels,
                                 value_codebooks, value_stage_groups, value_mean, value_synthesis,
                                 conditional_keys=conditional_keys, value_prediction=value_prediction,
                                 value_predictor=value_predictor)
    return decode_with_constants(native, constants, query, key_codes, key_scales, value_codes, value_scales,
                                 rotary_cos, rotary_sin, mask, scaling, exact_keys, exact_values, exact_mask,
                                 prediction_codes, prediction_scales)


class DecodeConstants(NamedTuple):
    """The operands of ``decode_attention`` that depend only on a layer's codecs, in the form the compiled call reads
    (see :func:`decode_constants`). A GSRQ layer builds them once and passes them at every step: converting and
    checking them per call would be a large part of the Python around each layer's call."""

    key_scale_levels: torch.Tensor | None
    key_table: torch.Tensor
    key_table_step: torch.Tensor | None
    key_mean: torch.Tensor
    codebook_size: int
    value_scale_levels: torch.Tensor | None
    value_codebooks: torch.Tensor
    value_stage_groups: torch.Tensor
    value_mean: torch.Tensor
    value_synthesis: torch.Tensor
    conditional_keys: bool
    prediction: tuple | None  # levels, codebooks, stage groups, mean, synthesis, bias
    value_predictor: torch.Tensor | None


def decode_constants(key_scale_levels, key_table, key_mean, codebook_size, value_scale_levels, value_codebooks,
                     value_stage_groups, value_mean, value_synthesis, *, conditional_keys: bool = False,
                     value_prediction=None, value_predictor=None) -> DecodeConstants:
    """:class:`DecodeConstants` from :func:`prerope_decode_attention`'s arguments of the same names
    (``value_prediction`` without its first two items, the key codes and scales)."""
    fixed_point = isinstance(key_table, FixedPointKeyTable)
    prediction = None
    if value_prediction is not None:
        levels, codebooks, stage_groups, mean, synthesis, bias = value_prediction
        prediction = (levels, codebooks.float().contiguous(), stage_groups.long().contiguous(),
                      mean.float().contiguous(), synthesis.float().contiguous(), bias.float().contiguous())
    return DecodeConstants(
        key_scale_levels, key_table.rows if fixed_point else _loop_table(key_table),
        key_table.step if fixed_point else None, key_mean.float().contiguous(), int(codebook_size),
        value_scale_levels, value_codebooks.float().contiguous(), value_stage_groups.long().contiguous(),
        # kept as given (a codec's synthesis may be a transposed view of its basis), made contiguous per call: a
        # copy held here would be another per-model table, and copying costs far less than the call it serves
        value_mean.float().contiguous(), value_synthesis.float(), bool(conditional_keys), prediction,
        None if value_predictor is None else value_predictor.float().contiguous())


def decode_with_constants(native, constants: DecodeConstants, query, key_codes, key_scales, value_codes,
                          value_scales, rotary_cos, rotary_sin, mask, scaling, exact_keys, exact_values, exact_mask,
                          prediction_codes=None, prediction_scales=None):
    """:func:`prerope_decode_attention` with the per-layer operands given as :class:`DecodeConstants`;
    ``prediction_codes``/``prediction_scales``: the key codes and scales the value prediction reads, where
    ``constants.prediction`` is set."""
    batch, query_heads, query_length, dim = query.shape
    kv_heads = key_scales.shape[1]  # scales are per head even where codes are shared by the heads
    rows = (query_heads // kv_heads) * query_length
    q = query.float().reshape(batch, kv_heads, rows, dim).contiguous()
    if constants.key_scale_levels is None:
        key_scales = key_scales.float()
    if constants.value_scale_levels is None:
        value_scales = value_scales.float()
    if rotary_cos.shape[-1] == dim:  # the loops read one half of each row (both halves hold the same angles)
        rotary_cos, rotary_sin = rotary_cos[..., :dim // 2], rotary_sin[..., :dim // 2]
    prediction = (None,) * 8
    if constants.prediction is not None:
        levels, *tables = constants.prediction
        prediction = (prediction_codes.contiguous(),
                      (prediction_scales if levels is not None else prediction_scales.float()).contiguous(), levels,
                      *tables)
    no_tokens = None if exact_keys is not None else q.new_empty(batch, kv_heads, 0, dim)
    extra = {} if constants.value_predictor is None else {"value_predictor": constants.value_predictor}
    if constants.key_table_step is not None:
        extra["key_table_step"] = constants.key_table_step
    out, lse = native.decode_attention(
        q, key_codes.contiguous(), key_scales.contiguous(), constants.key_scale_levels, constants.key_table,
        constants.key_mean, rotary_cos.float().contiguous(), rotary_sin.float().contiguous(),
        constants.codebook_size, value_codes.contiguous(), value_scales.contiguous(), constants.value_scale_levels,
        constants.value_codebooks, constants.value_stage_groups, constants.value_mean,
        constants.value_synthesis.contiguous(),
        _per_batch_row(mask, batch, query_length),
        no_tokens if exact_keys is None else exact_keys.float().contiguous(),
        no_tokens if exact_values is None else exact_values.float().contiguous(),
        None if exact_keys is None else _per_batch_row(exact_mask, batch, query_length),
        query_length, float(scaling), constants.conditional_keys, *prediction, **extra,
    )
    return out.reshape(batch, query_heads, query_length, dim), lse.reshape(batch, query_heads, query_length)


def _loop_table(key_table: torch.Tensor) -> torch.Tensor:
    """The key table as the compiled loops read it: contiguous float16 or float32 (other dtypes widened)."""
    if key_table.dtype not in (torch.float16, torch.float32):
        key_table = key_table.float()
    return key_table.contiguous()


def _per_batch_row(mask, batch: int, query_length: int):
    """An additive mask as the compiled op reads it: contiguous fp32 ``[B, Lq, N]`` (a mask may broadcast over B)."""
    return None if mask is None else mask.float().expand(batch, query_length, -1).contiguous()


def _rotate_in_place(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``keys * cos + rotate_half(keys) * sin``, overwriting ``keys``. Same result as the reference's rotation; it
    allocates one temporary instead of four, which matters on CPU: multi-megabyte temporaries are page-faulted in
    afresh whenever the allocator hands them back to the OS, which can take longer than the arithmetic."""
    half = keys.shape[-1] // 2
    rotated = keys.roll(half, dims=-1)  # (x_hi, x_lo)
    rotated[..., :half].neg_()  # rotate_half(x) = (-x_hi, x_lo)
    return keys.mul_(cos).add_(rotated.mul_(sin))


def _flat_index(codes: torch.Tensor, per_table: int, size: int) -> torch.Tensor:
    """Row of each code in a table stacked as [B, Hkv, S*K]: ((b * Hkv + h) * S + s) * K + code."""
    batch, heads, _, stages = codes.shape
    offsets = (torch.arange(batch * heads, device=codes.device) * per_table).reshape(batch, heads, 1, 1)
    return codes.long() + torch.arange(stages, device=codes.device) * size + offsets
