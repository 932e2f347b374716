"""Triton kernel: attention over GSRQ-coded keys and values without a full-precision copy of the history.

Each program takes one (batch, KV head), one block of query rows (the GQA heads sharing that KV head, times the
queries) and one split of the coded tokens. Tokens are processed ``BLOCK_N`` at a time: their 8-dim codewords are
gathered from the (L1/L2-resident) codebooks into a transform-domain tile ``z``. Everything linear stays in that
domain, so the per-head synthesis matrix is applied as rarely as the algebra allows: values accumulate
``p * scale * z`` and are synthesized once per program; keys coded after RoPE are scored against the query multiplied
by the synthesis transpose once; only keys coded before RoPE need ``z @ synthesis`` per token (the rotation depends on
each key's position), done as fp32 `tl.dot` on [BLOCK_N, D] tiles and rotated in registers. Reconstructed vectors never leave
registers. Keys coded conditionally across heads (``CONDITIONAL``) are rebuilt from every source head up to the
program's head, each with its own codes, codebooks, scale and pair synthesis, then rotated as above. Values coded
given the keys (``PREDICTED_VALUES``) add their prediction from every source key head's codes: ``p * s_j * z_j``
per source, times that source's folded prediction matrix for the program's head. Every split writes a normalized partial output and its log-sum-exp; the host merges splits (and the exact
sink/window regions) with one log-sum-exp merge.

Reference: ``coded_attention_reference`` in ``reference.py`` (same arguments, same outputs).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .reference import (
    cached_fold_value_prediction,
    check_coded_operands,
    has_cross_head_blocks,
    is_conditional,
    softmax_with_lse,
)


@triton.jit
def _transform_tile(codes_ptr, codebooks_ptr, groups_ptr, token_offsets, token_mask, S, K: tl.constexpr,
                    GD: tl.constexpr, DT: tl.constexpr, BLOCK_N: tl.constexpr):
    """z ``[BLOCK_N, DT]``: every stage's codeword written into its group's components (codes are [tokens, S])."""
    dims = tl.arange(0, DT)
    z = tl.zeros((BLOCK_N, DT), dtype=tl.float32)
    for stage in range(S):
        code = tl.load(codes_ptr + token_offsets * S + stage, mask=token_mask, other=0).to(tl.int32)
        group = tl.load(groups_ptr + stage)
        within = dims - group * GD
        in_group = (within >= 0) & (within < GD)
        pointers = codebooks_ptr + stage * K * GD + code[:, None] * GD + within[None, :]
        z += tl.load(pointers, mask=token_mask[:, None] & in_group[None, :], other=0.0)
    return z


@triton.jit
def _conditional_keys(codes_ptr, scales_ptr, codebooks_ptr, groups_ptr, mean_ptr, synthesis_ptr, batch, head, tokens,
                      token_mask, N, S, HKV, K: tl.constexpr, GD: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                      BLOCK_N: tl.constexpr, CROSS_HEAD: tl.constexpr):
    """Pre-RoPE keys of ``head`` for a block of tokens, both halves ``[BLOCK_N, HALF]``, scales included:
    ``sum_{j<=head} s_j (mean[j, head] + z_j @ synthesis[j, head])`` (codes ``[B, HKV, N, S]``, codebooks
    ``[HKV, S, K, GD]``, groups ``[HKV, S]``, mean ``[HKV, HKV, D]``, synthesis ``[HKV, HKV, D, D]``); only the term
    ``j = head`` when ``CROSS_HEAD`` is false."""
    halves = tl.arange(0, HALF)
    transform = tl.arange(0, D)
    keys_lo = tl.zeros((BLOCK_N, HALF), dtype=tl.float32)
    keys_hi = tl.zeros((BLOCK_N, HALF), dtype=tl.float32)
    # Each source's [D, D] pair matrix is read again for every block of tokens (from L2: too many to keep in
    # registers), about D*D*4 bytes per source and block against BLOCK_N * S code bytes, plus a [BLOCK_N, D] x [D, D]
    # product per source: gpu_decode.py times this path next to the per-head one (its byte count leaves the pair
    # matrices out).
    # without cross-head blocks (each head's own codebooks, no prediction) only the pair [head, head] is non-zero
    if CROSS_HEAD:
        first = 0
    else:
        first = head
    for source in range(first, head + 1):
        offsets = (batch * HKV + source) * N + tokens
        z = _transform_tile(codes_ptr, codebooks_ptr + source * S * K * GD, groups_ptr + source * S, offsets,
                            token_mask, S, K, GD, D, BLOCK_N)
        pair = source * HKV + head
        matrix = synthesis_ptr + pair * D * D + transform[:, None] * D
        mean_lo = tl.load(mean_ptr + pair * D + halves)
        mean_hi = tl.load(mean_ptr + pair * D + HALF + halves)
        scale = tl.load(scales_ptr + offsets, mask=token_mask, other=0.0).to(tl.float32)[:, None]
        keys_lo += scale * (mean_lo[None, :] + tl.dot(z, tl.load(matrix + halves[None, :]), input_precision="ieee"))
        keys_hi += scale * (mean_hi[None, :] + tl.dot(z, tl.load(matrix + HALF + halves[None, :]),
                                                      input_precision="ieee"))
    return keys_lo, keys_hi


@triton.jit
def _coded_attention_kernel(
    q_ptr, key_codes_ptr, key_scales_ptr, value_codes_ptr, value_scales_ptr,
    key_mean_ptr, key_synthesis_ptr, key_codebooks_ptr, key_groups_ptr,
    value_mean_ptr, value_synthesis_ptr, value_codebooks_ptr, value_groups_ptr,
    positions_ptr, inv_freq_ptr, mask_ptr, out_ptr, lse_ptr,
    prediction_codebooks_ptr, prediction_groups_ptr, prediction_mean_ptr, prediction_synthesis_ptr, prediction_bias_ptr,
    PREDICTION_CODEBOOK_HEADS,
    N, M, LQ, SK, SV, HKV, KEY_CODE_HEADS, VALUE_CODE_HEADS, KEY_DT, VALUE_DT, tokens_per_split, num_splits, scaling,
    attention_scaling, K: tl.constexpr, GD: tl.constexpr, D: tl.constexpr, KEY_DT_BLOCK: tl.constexpr,
    VALUE_DT_BLOCK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROPE: tl.constexpr, HAS_MASK: tl.constexpr,
    CONDITIONAL: tl.constexpr, CROSS_HEAD: tl.constexpr, PREDICTED_VALUES: tl.constexpr,
):
    batch_head = tl.program_id(0)
    split = tl.program_id(1)
    row_block = tl.program_id(2)
    batch = batch_head // HKV
    head = batch_head % HKV

    dims = tl.arange(0, D)
    halves = tl.arange(0, HALF)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    q_rows = q_ptr + (batch_head * M + rows[:, None]) * D
    # synthesis [HKV, DT, D]: DT transform components (D per head, HKV * D joint), padded to a power of two in registers
    key_transform = tl.arange(0, KEY_DT_BLOCK)
    key_transform_mask = key_transform < KEY_DT
    key_matrix = head * KEY_DT * D + key_transform[:, None] * D
    value_transform = tl.arange(0, VALUE_DT_BLOCK)
    value_transform_mask = value_transform < VALUE_DT
    value_matrix = head * VALUE_DT * D + value_transform[:, None] * D

    if ROPE:
        # Keys coded before RoPE are rebuilt per token: mean + z @ synthesis, in two halves so that the rotation
        # (x_lo, x_hi) -> (x_lo cos - x_hi sin, x_hi cos + x_lo sin) needs no permutation of registers.
        q_lo = tl.load(q_rows + halves[None, :], mask=row_mask[:, None], other=0.0)
        q_hi = tl.load(q_rows + HALF + halves[None, :], mask=row_mask[:, None], other=0.0)
        if not CONDITIONAL:  # (conditional keys read a pair of mean and synthesis per source head, in the loop)
            synthesis_lo = tl.load(key_synthesis_ptr + key_matrix + halves[None, :], mask=key_transform_mask[:, None],
                                   other=0.0)
            synthesis_hi = tl.load(key_synthesis_ptr + key_matrix + HALF + halves[None, :],
                                   mask=key_transform_mask[:, None], other=0.0)
            mean_lo = tl.load(key_mean_ptr + head * D + halves)
            mean_hi = tl.load(key_mean_ptr + head * D + HALF + halves)
        inv_freq = tl.load(inv_freq_ptr + halves)
    else:
        # Keys coded after RoPE: q . (mean + z @ synthesis) = q . mean + (q @ synthesis^T) . z, so the synthesis
        # matrix is applied to the query once instead of to every key.
        q = tl.load(q_rows + dims[None, :], mask=row_mask[:, None], other=0.0)
        key_synthesis = tl.load(key_synthesis_ptr + key_matrix + dims[None, :], mask=key_transform_mask[:, None],
                                other=0.0)
        q_transformed = tl.dot(q, tl.trans(key_synthesis), input_precision="ieee")
        q_mean = tl.sum(q * tl.load(key_mean_ptr + head * D + dims)[None, :], axis=1)

    running_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    scaled_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum of p * value scale: weight of the value mean
    accumulator = tl.zeros((BLOCK_M, VALUE_DT_BLOCK), dtype=tl.float32)  # values accumulate in the transform domain
    predicted = tl.zeros((BLOCK_M, D), dtype=tl.float32)  # values coded given the keys: their prediction's share

    start = split * tokens_per_split
    stop = tl.minimum(start + tokens_per_split, N)
    for block_start in range(start, stop, BLOCK_N):
        tokens = block_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < stop
        token_offsets = batch_head * N + tokens
        # joint-head codes have one row per token for all heads
        key_offsets = (batch * KEY_CODE_HEADS + head % KEY_CODE_HEADS) * N + tokens
        value_offsets = (batch * VALUE_CODE_HEADS + head % VALUE_CODE_HEADS) * N + tokens

        if CONDITIONAL:  # scales applied per source head, inside
            keys_lo, keys_hi = _conditional_keys(key_codes_ptr, key_scales_ptr, key_codebooks_ptr, key_groups_ptr,
                                                 key_mean_ptr, key_synthesis_ptr, batch, head, tokens, token_mask, N,
                                                 SK, HKV, K, GD, D, HALF, BLOCK_N, CROSS_HEAD)
            key_scale = tl.full((BLOCK_N,), 1.0, dtype=tl.float32)
        else:
            z = _transform_tile(key_codes_ptr, key_codebooks_ptr, key_groups_ptr, key_offsets, token_mask, SK, K, GD,
                                KEY_DT_BLOCK, BLOCK_N)
            key_scale = tl.load(key_scales_ptr + token_offsets, mask=token_mask, other=0.0).to(tl.float32)
            if ROPE:
                keys_lo = mean_lo[None, :] + tl.dot(z, synthesis_lo, input_precision="ieee")
                keys_hi = mean_hi[None, :] + tl.dot(z, synthesis_hi, input_precision="ieee")
        if ROPE:
            position = tl.load(positions_ptr + batch * N + tokens, mask=token_mask, other=0).to(tl.float32)
            angle = position[:, None] * inv_freq[None, :]
            cos = tl.cos(angle) * attention_scaling
            sin = tl.sin(angle) * attention_scaling
            rotated_lo = keys_lo * cos - keys_hi * sin
            rotated_hi = keys_hi * cos + keys_lo * sin
            scores = tl.dot(q_lo, tl.trans(rotated_lo), input_precision="ieee")
            scores += tl.dot(q_hi, tl.trans(rotated_hi), input_precision="ieee")
        else:
            scores = q_mean[:, None] + tl.dot(q_transformed, tl.trans(z), input_precision="ieee")
        scores = scores * key_scale[None, :] * scaling  # the scale is linear: applied to the scores
        if HAS_MASK:
            mask_pointers = mask_ptr + (batch * LQ + (rows[:, None] % LQ)) * N + tokens[None, :]
            scores += tl.load(mask_pointers, mask=row_mask[:, None] & token_mask[None, :], other=0.0)
        scores = tl.where(token_mask[None, :], scores, float("-inf"))

        block_max = tl.max(scores, axis=1)
        new_max = tl.maximum(running_max, block_max)
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows with nothing visible yet stay at zero
        correction = tl.exp(running_max - safe_max)
        probabilities = tl.exp(scores - safe_max[:, None])
        running_sum = running_sum * correction + tl.sum(probabilities, axis=1)

        zv = _transform_tile(value_codes_ptr, value_codebooks_ptr, value_groups_ptr, value_offsets, token_mask, SV, K,
                             GD, VALUE_DT_BLOCK, BLOCK_N)
        value_scale = tl.load(value_scales_ptr + token_offsets, mask=token_mask, other=0.0).to(tl.float32)
        weighted = probabilities * value_scale[None, :]
        scaled_sum = scaled_sum * correction + tl.sum(weighted, axis=1)
        accumulator = accumulator * correction[:, None] + tl.dot(weighted, zv, input_precision="ieee")
        if PREDICTED_VALUES:
            # sum_j s_j (mean[j, h] + z_j @ synthesis[j, h]) per token, from every source key head's codes (the
            # prediction reads all heads' keys); weighted by p before the synthesis, which is linear
            predicted = predicted * correction[:, None]
            for source in range(0, HKV):
                source_offsets = (batch * KEY_CODE_HEADS + source % KEY_CODE_HEADS) * N + tokens
                codebook_head = source % PREDICTION_CODEBOOK_HEADS
                zk = _transform_tile(key_codes_ptr, prediction_codebooks_ptr + codebook_head * SK * K * GD,
                                     prediction_groups_ptr + codebook_head * SK, source_offsets, token_mask, SK, K,
                                     GD, KEY_DT_BLOCK, BLOCK_N)
                source_scale = tl.load(key_scales_ptr + (batch * HKV + source) * N + tokens, mask=token_mask,
                                       other=0.0).to(tl.float32)
                source_weighted = probabilities * source_scale[None, :]
                pair = source * HKV + head
                pair_synthesis = tl.load(prediction_synthesis_ptr + pair * KEY_DT * D + key_transform[:, None] * D
                                         + dims[None, :], mask=key_transform_mask[:, None], other=0.0)
                pair_mean = tl.load(prediction_mean_ptr + pair * D + dims)
                weighted_codes = tl.dot(source_weighted, zk, input_precision="ieee")
                predicted += tl.sum(source_weighted, axis=1)[:, None] * pair_mean[None, :]
                predicted += tl.dot(weighted_codes, pair_synthesis, input_precision="ieee")
        running_max = new_max

    # sum_n p_n s_n (mean + z_n @ synthesis) = (sum p s) mean + (sum p s z) @ synthesis: one matmul per program
    value_synthesis = tl.load(value_synthesis_ptr + value_matrix + dims[None, :], mask=value_transform_mask[:, None],
                              other=0.0)
    value_mean = tl.load(value_mean_ptr + head * D + dims)
    out = scaled_sum[:, None] * value_mean[None, :] + tl.dot(accumulator, value_synthesis, input_precision="ieee")
    if PREDICTED_VALUES:
        out += predicted + running_sum[:, None] * tl.load(prediction_bias_ptr + head * D + dims)[None, :]
    visible = running_sum > 0
    out = out / tl.where(visible, running_sum, 1.0)[:, None]
    lse = tl.where(visible, running_max + tl.log(tl.where(visible, running_sum, 1.0)), float("-inf"))
    partial = (batch_head * num_splits + split) * M + rows
    tl.store(out_ptr + partial[:, None] * D + dims[None, :], out, mask=row_mask[:, None])
    tl.store(lse_ptr + partial, lse, mask=row_mask)


def _folded_prediction(value_predictor, key_operands):
    return cached_fold_value_prediction(value_predictor, key_operands, stage_group_dtype=torch.int32)


def coded_attention_triton(
    query, key_codes, key_scales, value_codes, value_scales,
    key_mean, key_synthesis, key_codebooks, key_stage_groups,
    value_mean, value_synthesis, value_codebooks, value_stage_groups,
    positions, inv_freq, attention_scaling, mask, scaling,
    block_n: int = 32, tokens_per_split: int | None = None, value_predictor=None,
):
    """Same contract as ``coded_attention_reference``; launches ``_coded_attention_kernel`` then merges the splits.

    Values coded given the keys (``value_predictor``): the prediction is folded into the key codes' terms
    (``reference.fold_value_prediction``) and each program adds it from every source key head's codes."""
    check_coded_operands(key_codes, key_synthesis, key_codebooks, value_codes, value_codebooks)
    batch, query_heads, query_length, dim = query.shape
    kv_heads, tokens = key_scales.shape[1], key_codes.shape[2]
    rows = (query_heads // kv_heads) * query_length
    device = query.device
    if tokens == 0:
        return (torch.zeros(batch, query_heads, query_length, dim, device=device),
                torch.full((batch, query_heads, query_length), -math.inf, device=device))
    if dim & (dim - 1) or dim < 32:  # tl.dot tiles are at least 16 wide, and keys are rebuilt in two halves
        raise ValueError(f"the Triton GSRQ attention needs a power-of-two head_dim >= 32, got {dim}.")
    q = query.float().reshape(batch, kv_heads, rows, dim).contiguous()
    block_m = max(16, triton.next_power_of_2(rows)) if rows <= 64 else 64
    if tokens_per_split is None:  # enough splits to fill the device at batch 1, each a whole number of blocks
        tokens_per_split = max(block_n, triton.cdiv(triton.cdiv(tokens, 64), block_n) * block_n)
    num_splits = triton.cdiv(tokens, tokens_per_split)
    rope = positions is not None
    conditional = is_conditional(key_synthesis)
    if conditional and not rope:
        raise ValueError("keys coded conditionally across heads are coded before RoPE: pass their positions.")
    if rope:
        positions = positions.to(torch.int32).contiguous()
        inv_freq = inv_freq.float().contiguous()
    else:
        positions = inv_freq = torch.zeros(1, device=device)
    mask_tensor = mask.float().contiguous() if mask is not None else torch.zeros(1, device=device)
    if value_predictor is not None:
        if not rope:
            raise ValueError("values coded given the keys are predicted from keys coded before RoPE: pass their "
                             "positions.")
        prediction = _folded_prediction(value_predictor, (key_mean, key_synthesis, key_codebooks, key_stage_groups))
    else:
        prediction = (torch.zeros(1, device=device), torch.zeros(1, dtype=torch.int32, device=device),
                      *(torch.zeros(1, device=device),) * 3)
    prediction_codebook_heads = prediction[0].shape[0] if value_predictor is not None else 1
    out = torch.empty(batch * kv_heads * num_splits * rows, dim, device=device)
    lse = torch.empty(batch * kv_heads * num_splits * rows, device=device)
    grid = (batch * kv_heads, num_splits, triton.cdiv(rows, block_m))
    _coded_attention_kernel[grid](
        q, key_codes.contiguous(), key_scales.contiguous(), value_codes.contiguous(), value_scales.contiguous(),
        key_mean.float().contiguous(), key_synthesis.float().contiguous(),
        key_codebooks.float().contiguous(), key_stage_groups.to(torch.int32).contiguous(),
        value_mean.float().contiguous(), value_synthesis.float().contiguous(), value_codebooks.float().contiguous(),
        value_stage_groups.to(torch.int32).contiguous(),
        positions, inv_freq, mask_tensor, out, lse, *prediction, prediction_codebook_heads,
        tokens, rows, query_length, key_codes.shape[-1], value_codes.shape[-1], kv_heads, key_codes.shape[1],
        value_codes.shape[1], key_synthesis.shape[-2], value_synthesis.shape[1], tokens_per_split, num_splits,
        float(scaling), float(attention_scaling), K=key_codebooks.shape[-2], GD=key_codebooks.shape[-1], D=dim,
        KEY_DT_BLOCK=triton.next_power_of_2(key_synthesis.shape[-2]),
        VALUE_DT_BLOCK=triton.next_power_of_2(value_synthesis.shape[1]), HALF=dim // 2,
        BLOCK_M=block_m, BLOCK_N=block_n, ROPE=rope, HAS_MASK=mask is not None, CONDITIONAL=conditional,
        CROSS_HEAD=conditional and has_cross_head_blocks(key_synthesis), PREDICTED_VALUES=value_predictor is not None,
    )
    out = out.reshape(batch, kv_heads, num_splits, rows, dim)
    lse = lse.reshape(batch, kv_heads, num_splits, rows)
    weights, total = softmax_with_lse(lse, dim=2)  # the splits' partial softmaxes joined into one
    merged = (weights[..., None] * out).sum(dim=2)
    return merged.reshape(batch, query_heads, query_length, dim), total.reshape(batch, query_heads, query_length)
