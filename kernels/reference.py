"""Readable PyTorch references for the GSRQ kernels; they are also the CPU implementation of the custom ops.

Notation (shared with the Triton kernels):
    B batch, Hq query heads, Hkv KV heads, G = Hq // Hkv query heads per KV head (GQA), Lq queries per head,
    M = G * Lq query rows per KV head (row ``m = g * Lq + l``), N coded tokens, D head_dim,
    S residual stages, K codewords per stage, g group_dim (consecutive transform-domain components per stage).
A coded head vector is ``x = s * (mean + z @ synthesis)`` where ``z`` (``[Dt]``, transform domain) is the sum over
stages of the stage's codeword written into its group's ``g`` components, ``synthesis`` is ``[Dt, D]`` per head and
``s`` the per-vector scale. ``Dt = D`` for per-head codes; joint-head codes (one code per token for all ``Hkv``
heads: codes ``[B, 1, N, S]``, each head reading them through its own synthesis slice) have ``Dt = Hkv * D``.
Keys coded before RoPE are rotated with their own position after reconstruction.
Keys coded conditionally across heads (``ConditionalHeadResidualVQ``, per-head codes ``[B, Hkv, N, S]`` read with
each head's own codebooks ``[Hkv, S, K, g]`` and stage groups ``[Hkv, S]``) are rebuilt from every source head ``j``
up to the target head ``h``: ``k_h = sum_j s_j * (mean[j, h] + z_j @ synthesis[j, h])`` (mean ``[Hkv, Hkv, D]``,
synthesis ``[Hkv, Hkv, D, D]``, zero for ``j > h``); a 4-dimensional key synthesis marks them. They are always coded
before RoPE.
"""

from __future__ import annotations

import math

import torch
from torch.utils.weak import WeakTensorKeyDictionary

DEFAULT_CHUNK_TOKENS = 1024  # coded tokens reconstructed at a time; bounds the transient full-precision memory
# Lookup tables and value histograms cost M * S * K numbers per KV head: right for decoding (M = a few query heads),
# wasteful for a long prefill chunk, where reconstructing a chunk of vectors and multiplying is cheaper.
LOOKUP_MAX_ROWS = 64


# ---- encoder -----------------------------------------------------------------------------------------------------
def residual_encode_reference(z: torch.Tensor, codebooks: torch.Tensor, stage_groups: torch.Tensor) -> torch.Tensor:
    """Greedy residual VQ: ``z`` ``[R, D]`` (transform domain) -> codes ``[R, S]`` uint8.

    Stage ``s`` picks the codeword of ``codebooks[s]`` (``[K, g]``) nearest (l2) to the running residual of group
    ``stage_groups[s]`` and subtracts it: argmin ``|r - c|^2`` = argmax ``r.c - |c|^2 / 2`` (ties: lowest index).
    """
    rows, dim = z.shape
    stages, _, group_dim = codebooks.shape
    residual = z.float().clone().reshape(rows, dim // group_dim, group_dim)
    codes = torch.empty(rows, stages, dtype=torch.uint8, device=z.device)
    for stage in range(stages):
        group = int(stage_groups[stage])
        codebook = codebooks[stage].float()
        target = residual[:, group, :]
        index = (target @ codebook.T - 0.5 * (codebook * codebook).sum(-1)[None, :]).argmax(dim=-1)
        residual[:, group, :] = target - codebook[index]
        codes[:, stage] = index.to(torch.uint8)
    return codes


# Beam search scores beam_width x K candidates per vector and stage; rows are taken in chunks so that this stays
# around 64 MB whatever the prompt length.
BEAM_SCORES_PER_CHUNK = 1 << 24


def residual_encode_beam_reference(z: torch.Tensor, codebooks: torch.Tensor, stage_groups: torch.Tensor,
                                   beam_width: int) -> torch.Tensor:
    """Beam-search residual VQ: ``z`` ``[R, D]`` -> codes ``[R, S]`` uint8, same contract as the greedy encoder.

    Greedy encoding commits to the nearest codeword at every stage, though a slightly worse first choice can leave a
    residual that later stages code much better. Groups are coded independently (each stage codes one group's
    residual), so the search runs per group over that group's stages in order: every partial code path of the
    ``beam_width`` kept so far is extended by each of the stage's ``K`` codewords, and the ``beam_width`` extensions
    with the smallest remaining squared error survive. The path with the smallest final error wins. ``beam_width=1``
    gives the greedy encoder's codes (up to exact ties).
    """
    rows, dim = z.shape
    stages, size, group_dim = codebooks.shape
    codes = torch.empty(rows, stages, dtype=torch.uint8, device=z.device)
    if rows == 0 or stages == 0:
        return codes
    group_of_stage = [int(group) for group in stage_groups.tolist()]
    chunk_rows = max(1, BEAM_SCORES_PER_CHUNK // (beam_width * size))
    for start in range(0, rows, chunk_rows):
        block = z[start : start + chunk_rows].float()
        n = block.shape[0]
        for group in dict.fromkeys(group_of_stage):  # first-appearance order
            members = [stage for stage, g in enumerate(group_of_stage) if g == group]
            residual = block[:, None, group * group_dim : (group + 1) * group_dim]  # [n, beams, g]
            parents, words = [], []
            for stage in members:
                codebook = codebooks[stage].float()
                beams = residual.shape[1]
                errors = (  # |r - c|^2 for every beam and codeword: [n, beams * K]
                    residual.pow(2).sum(-1, keepdim=True) - 2 * residual @ codebook.T + codebook.pow(2).sum(-1)
                ).reshape(n, beams * size)
                survivors = errors.topk(min(beam_width, beams * size), dim=1, largest=False).indices
                parent, word = survivors // size, survivors % size
                residual = residual.gather(1, parent[..., None].expand(-1, -1, group_dim)) - codebook[word]
                parents.append(parent)
                words.append(word)
            best = residual.pow(2).sum(-1).argmin(dim=1, keepdim=True)
            for stage, parent, word in zip(reversed(members), reversed(parents), reversed(words)):
                codes[start : start + n, stage] = word.gather(1, best)[:, 0].to(torch.uint8)
                best = parent.gather(1, best)
    return codes


# ---- decode attention over the coded region ------------------------------------------------------------------------
def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float):
    """cos/sin ``[B, N, D]`` for integer positions ``[B, N]`` (transformers' rotate-half convention)."""
    freqs = positions.double()[..., None] * inv_freq.double()[None, None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * attention_scaling).float(), (angles.sin() * attention_scaling).float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin


def _transform_domain(codes: torch.Tensor, codebooks: torch.Tensor, stage_groups: torch.Tensor, dim: int):
    """``z`` ``[..., D]`` for codes ``[..., S]``: each stage's codeword added into its group's components."""
    stages, _, group_dim = codebooks.shape
    z = torch.zeros(*codes.shape[:-1], dim // group_dim, group_dim, dtype=codebooks.dtype, device=codes.device)
    for stage in range(stages):
        z[..., int(stage_groups[stage]), :] += codebooks[stage][codes[..., stage].long()]
    return z.reshape(*codes.shape[:-1], dim)


def dequantize_reference(codes, scales, mean, synthesis, codebooks, stage_groups, dtype=torch.float32):
    """Codes ``[B, H, N, S]`` + scales ``[B, H, N]`` -> vectors ``[B, H, N, D]`` (``x = s * (mean + z @ synthesis)``)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    codes = codes.expand(-1, scales.shape[1], -1, -1)  # joint-head codes: one row shared by every head
    z = _transform_domain(codes, codebooks.to(work), stage_groups, synthesis.shape[1])
    x = mean.to(work)[None, :, None, :] + torch.einsum("bhnd,hde->bhne", z, synthesis.to(work))
    return (x * scales.to(work)[..., None]).to(dtype)


def is_conditional(key_synthesis: torch.Tensor) -> bool:
    """Whether key operands describe keys coded conditionally across heads (synthesis ``[Hkv, Hkv, D, D]``)."""
    return key_synthesis.ndim == 4


# Per synthesis tensor (and its version): whether any block [j, h], j < h, is non-zero. Keys with each head's own
# codebooks and no prediction across heads (the per_head_codebooks layout) have none; the cache passes the same tensor
# at every step, so the device is asked once, not per step.
_CROSS_HEAD_BLOCKS = WeakTensorKeyDictionary()


def has_cross_head_blocks(key_synthesis: torch.Tensor) -> bool:
    """Whether conditional key operands (synthesis ``[Hkv, Hkv, D, D]``) rebuild a head from other heads' codes."""
    # operands built under torch.inference_mode() have no version counter (nor can they change outside it)
    version = None if key_synthesis.is_inference() else key_synthesis._version
    cached = _CROSS_HEAD_BLOCKS.get(key_synthesis)
    if cached is None or cached[0] != version:
        heads = key_synthesis.shape[0]
        later = torch.arange(heads, device=key_synthesis.device)
        cross = (later[:, None] < later[None, :])[..., None, None]  # [j, h] with j < h
        cached = (version, bool((key_synthesis * cross).any()))
        _CROSS_HEAD_BLOCKS[key_synthesis] = cached
    return cached[1]


def conditional_dequantize_reference(codes, scales, mean, synthesis, codebooks, stage_groups, dtype=torch.float32):
    """Keys coded conditionally across heads: codes ``[B, H, N, S]`` + scales ``[B, H, N]`` -> ``[B, H, N, D]``,
    head ``h`` = ``sum_{j <= h} s_j (mean[j, h] + z_j @ synthesis[j, h])`` with ``z_j`` from head ``j``'s codes and
    codebooks (the pairs with ``j > h`` are zero by construction; like the kernels, this never reads them)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    heads = scales.shape[1]
    keys = torch.zeros(*scales.shape, synthesis.shape[-1], dtype=work, device=codes.device)
    cross_head = has_cross_head_blocks(synthesis)
    for source in range(heads):
        targets = slice(source, None if cross_head else source + 1)  # only the head itself without cross blocks
        z = _transform_domain(codes[:, source], codebooks[source].to(work), stage_groups[source], synthesis.shape[-2])
        onward = torch.einsum("bnd,hde->bhne", z, synthesis[source, targets].to(work))
        part = mean[source, targets].to(work)[None, :, None, :] + onward
        keys[:, targets] += part * scales[:, source].to(work)[:, None, :, None]
    return keys.to(dtype)


def check_coded_operands(key_codes, key_synthesis, key_codebooks, value_codes, value_codebooks) -> None:
    """Clear errors for operands whose codebooks do not match the codes (every implementation of the op calls it):
    each code indexes one stage, so codebooks must have exactly as many stages as the codes (a lower rate passes
    its prefix of the stages, as ``codec.truncated(...).attention_operands()`` does)."""
    for kind, codes, codebooks, per_head in (("key", key_codes, key_codebooks, is_conditional(key_synthesis)),
                                             ("value", value_codes, value_codebooks, False)):
        expected = 4 if per_head else 3
        if codebooks.ndim != expected:
            raise ValueError(f"{kind}_codebooks must be {'[Hkv, S, K, g]' if per_head else '[S, K, g]'}, got shape "
                             f"{tuple(codebooks.shape)}.")
        if codebooks.shape[-3] != codes.shape[-1]:
            raise ValueError(f"{kind}_codebooks have {codebooks.shape[-3]} stages but the {kind} codes have "
                             f"{codes.shape[-1]}: pass the codebooks of the rate the codes were made at "
                             "(codec.truncated(stages).attention_operands()).")


def coded_attention_reference(
    query: torch.Tensor,
    key_codes: torch.Tensor,
    key_scales: torch.Tensor,
    value_codes: torch.Tensor,
    value_scales: torch.Tensor,
    key_mean: torch.Tensor,
    key_synthesis: torch.Tensor,
    key_codebooks: torch.Tensor,
    key_stage_groups: torch.Tensor,
    value_mean: torch.Tensor,
    value_synthesis: torch.Tensor,
    value_codebooks: torch.Tensor,
    value_stage_groups: torch.Tensor,
    positions: torch.Tensor | None,
    inv_freq: torch.Tensor | None,
    attention_scaling: float,
    mask: torch.Tensor | None,
    scaling: float,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    value_predictor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` ``[B, Hq, Lq, D]`` over the coded tokens only, reading codes.

    Returns the normalized output ``[B, Hq, Lq, D]`` (float32) and its log-sum-exp ``[B, Hq, Lq]`` so the caller can
    merge it with the exact regions (sinks, window) in one softmax. ``positions`` (``[B, N]``, with ``inv_freq``) are
    given when keys were coded before RoPE; ``mask`` is additive ``[B, Lq, N]`` (0 or -inf) or None (attend to all).

    Keys coded after RoPE are scored with query-codebook lookup tables (``S`` table reads per token and query row);
    keys coded before RoPE are reconstructed ``chunk_tokens`` at a time, rotated and dotted (their rotation depends on
    the key's position, so no position-free table exists). Values are not reconstructed: attention probabilities
    (times the token's scale) are accumulated per codeword into a histogram, which is multiplied by the codebooks once.
    With more than ``LOOKUP_MAX_ROWS`` query rows per KV head (prefill) both sides reconstruct chunks instead.
    Keys coded conditionally across heads (:func:`is_conditional` operands) are reconstructed chunk by chunk as well.

    Values coded given the keys (``value_predictor`` ``[Hkv*D + 1, Hkv*D]``, ``KeyPredictedValueVQ.predictor``; the
    value operands are then its residual code's): a coded token's values are its residual plus
    ``[keys of every head, 1] @ value_predictor``, the keys as coded (before the rotation this function applies).
    That term is linear in the keys, so the attention-weighted sum of every head's keys is formed chunk by chunk and
    multiplied by the predictor once: :func:`predicted_value_sums`.
    """
    check_coded_operands(key_codes, key_synthesis, key_codebooks, value_codes, value_codebooks)
    conditional = is_conditional(key_synthesis)
    if conditional and positions is None:
        raise ValueError("keys coded conditionally across heads are coded before RoPE: pass their positions and "
                         "inv_freq.")
    batch, query_heads, query_length, dim = query.shape
    kv_heads, tokens = key_scales.shape[1], key_codes.shape[2]
    group_count = query_heads // kv_heads
    rows = group_count * query_length
    q = query.float().reshape(batch, kv_heads, rows, dim)
    if tokens == 0:
        return (torch.zeros(batch, query_heads, query_length, dim, device=query.device),
                torch.full((batch, query_heads, query_length), -math.inf, device=query.device))
    key_codes = key_codes.expand(-1, kv_heads, -1, -1)  # joint-head codes ([B, 1, N, S]) serve every head
    value_codes = value_codes.expand(-1, kv_heads, -1, -1)

    lookup = rows <= LOOKUP_MAX_ROWS
    scores = torch.empty(batch, kv_heads, rows, tokens, device=query.device)
    if positions is None and lookup:
        tables = _key_lookup_tables(q, key_mean, key_synthesis, key_codebooks, key_stage_groups)
    for start in range(0, tokens, chunk_tokens):
        end = min(start + chunk_tokens, tokens)
        codes, scales = key_codes[:, :, start:end], key_scales[:, :, start:end].float()
        if positions is None and lookup:
            scores[..., start:end] = _lookup_scores(tables, codes) * scales[:, :, None, :]
        else:
            dequantize = conditional_dequantize_reference if conditional else dequantize_reference
            keys = dequantize(codes, scales, key_mean, key_synthesis, key_codebooks, key_stage_groups)
            if positions is not None:
                cos, sin = rotary_tables(positions[:, start:end], inv_freq, attention_scaling)
                keys = _rotate(keys, cos[:, None], sin[:, None])
            scores[..., start:end] = q @ keys.transpose(-1, -2)
    scores *= scaling
    add_mask(scores, mask, group_count)
    probabilities, lse = softmax_with_lse(scores)  # lse [B, Hkv, M]
    if lookup:
        out = _histogram_values(probabilities, value_codes, value_scales, value_mean, value_synthesis, value_codebooks,
                                value_stage_groups, chunk_tokens)
    else:
        out = torch.zeros(batch, kv_heads, rows, dim, device=query.device)
        for start in range(0, tokens, chunk_tokens):
            end = min(start + chunk_tokens, tokens)
            values = dequantize_reference(value_codes[:, :, start:end], value_scales[:, :, start:end], value_mean,
                                          value_synthesis, value_codebooks, value_stage_groups)
            out += probabilities[..., start:end] @ values
    if value_predictor is not None:
        dequantize = conditional_dequantize_reference if conditional else dequantize_reference
        out += predicted_value_sums(
            probabilities, lambda start, end: dequantize(key_codes[:, :, start:end], key_scales[:, :, start:end].float(),
                                                         key_mean, key_synthesis, key_codebooks, key_stage_groups),
            value_predictor, chunk_tokens)
    return out.reshape(batch, query_heads, query_length, dim), lse.reshape(batch, query_heads, query_length)


def _check_value_predictor(predictor, heads: int, dim: int) -> None:
    if tuple(predictor.shape) != (heads * dim + 1, heads * dim):
        raise ValueError(f"value_predictor must be [Hkv*D + 1, Hkv*D] = [{heads * dim + 1}, {heads * dim}] for "
                         f"{heads} KV heads of {dim}, got shape {tuple(predictor.shape)}.")


def fold_value_prediction(predictor, key_mean, key_synthesis, key_codebooks, key_stage_groups):
    """The value prediction ``[keys of every head, 1] @ predictor`` in terms of the key codes: (codebooks ``[1 or
    Hs, S, K, g]``, stage groups ``[1 or Hs, S]``, mean ``[Hs, H, D]``, synthesis ``[Hs, H, Dt, D]``, bias ``[H, D]``)
    such that value head ``h`` of a coded token gets ``sum_j s_j (mean[j, h] + z_j @ synthesis[j, h]) + bias[h]``,
    ``z_j`` read from source head ``j``'s key codes (joint keys: the shared code) and ``s_j`` its key scale. Key
    operands as ``coded_attention`` takes them (per-head or joint: mean ``[H, D]``; conditional: pairs)."""
    heads, dim = key_mean.shape[0], key_mean.shape[-1]
    _check_value_predictor(predictor, heads, dim)
    predictor = predictor.float()
    blocks = predictor[:-1].reshape(heads, dim, heads, dim).transpose(1, 2)  # blocks[i, h]: key head i -> value head h
    if key_mean.dim() == 2:  # per-head (or joint) keys: key head j = s_j (mean[j] + z_j @ synthesis[j])
        mean = torch.einsum("jd,jhde->jhe", key_mean.float(), blocks)
        synthesis = torch.einsum("jkd,jhde->jhke", key_synthesis.float(), blocks)
        codebooks, stage_groups = key_codebooks[None], key_stage_groups[None]
    else:  # conditional keys: key head i = sum_j s_j (mean[j, i] + z_j @ synthesis[j, i])
        mean = torch.einsum("jid,ihde->jhe", key_mean.float(), blocks)
        synthesis = torch.einsum("jikd,ihde->jhke", key_synthesis.float(), blocks)
        codebooks, stage_groups = key_codebooks, key_stage_groups
    bias = predictor[-1].reshape(heads, dim)
    return tuple(t.contiguous() for t in (codebooks, stage_groups, mean, synthesis, bias))


# The cache passes the same predictor and key operands at every step and layer call; folding them is a
# [Hs, H, Dt, D] product, so it is done once per (predictor, key operands) while they live.
_FOLDED_PREDICTIONS = WeakTensorKeyDictionary()


def cached_fold_value_prediction(value_predictor, key_operands, stage_group_dtype=torch.long):
    """:func:`fold_value_prediction` with float32 contiguous codebooks and stage groups of ``stage_group_dtype`` (the
    compiled CPU loop reads int64, the Triton kernel int32), reused while the same predictor (unmodified) and the same
    key operand tensors come back."""
    cached = _FOLDED_PREDICTIONS.get(value_predictor)
    if (cached is None or cached[1] != value_predictor._version
            or not all(a is b for a, b in zip(cached[0], key_operands))):
        cached = (tuple(key_operands), value_predictor._version, {})
        _FOLDED_PREDICTIONS[value_predictor] = cached
    folded = cached[2].get(stage_group_dtype)
    if folded is None:
        codebooks, groups, *rest = fold_value_prediction(value_predictor, *key_operands)
        folded = cached[2][stage_group_dtype] = (codebooks.float().contiguous(),
                                                 groups.to(stage_group_dtype).contiguous(), *rest)
    return folded


def predicted_value_sums(probabilities, decode_keys, predictor, chunk_tokens=DEFAULT_CHUNK_TOKENS):
    """``sum_n p[b, h, m, n] * ([keys of every head of token n, 1] @ predictor)[h]`` -> ``[B, Hkv, M, D]``: the
    predicted part of values coded given the keys, for probabilities ``[B, Hkv, M, N]`` and ``decode_keys(start,
    end)`` -> the coded keys ``[B, Hkv, end - start, D]``. Linear in the keys: only their weighted sums
    ``[B, Hkv, M, Hkv*D]`` are formed, never a value."""
    batch, kv_heads, rows, tokens = probabilities.shape
    dim = (predictor.shape[0] - 1) // kv_heads
    _check_value_predictor(predictor, kv_heads, dim)
    flat_dim = kv_heads * dim
    key_sums = torch.zeros(batch, kv_heads, rows, flat_dim, device=probabilities.device)
    for start in range(0, tokens, chunk_tokens):
        end = min(start + chunk_tokens, tokens)
        keys = decode_keys(start, end).float()  # [B, Hkv, n, D]: every head's keys of these tokens
        flat = keys.permute(0, 2, 1, 3).reshape(batch, 1, end - start, flat_dim)
        key_sums += probabilities[..., start:end] @ flat
    predictor = predictor.float()
    # value head h reads its own D columns of the prediction
    blocks = predictor[:-1].reshape(flat_dim, kv_heads, dim).permute(1, 0, 2)  # [Hkv, Hkv*D, D]
    bias = predictor[-1].reshape(kv_heads, dim)
    return (torch.einsum("bhmf,hfd->bhmd", key_sums, blocks)
            + probabilities.sum(-1)[..., None] * bias[None, :, None, :])


def _key_lookup_tables(q, mean, synthesis, codebooks, stage_groups):
    """Per query row: the constant ``q . mean`` and the table ``[S*K]`` of ``q . (codeword placed in its group) @ synthesis``."""
    stages, size, group_dim = codebooks.shape
    projected = torch.einsum("bhmd,hed->bhme", q, synthesis.float())  # q @ synthesis^T: scores become z . projected
    grouped = projected.reshape(*projected.shape[:-1], -1, group_dim)[..., stage_groups.long(), :]  # [B,Hkv,M,S,g]
    table = torch.einsum("bhmsg,skg->bhmsk", grouped, codebooks.float()).reshape(*projected.shape[:-1], stages * size)
    constant = torch.einsum("bhmd,hd->bhm", q, mean.float())
    return constant, table


def _lookup_scores(tables, codes):
    constant, table = tables
    batch, kv_heads, tokens, stages = codes.shape
    size = table.shape[-1] // stages
    flat = (codes.long() + torch.arange(stages, device=codes.device) * size).reshape(batch, kv_heads, 1, tokens * stages)
    picked = table.gather(-1, flat.expand(-1, -1, table.shape[2], -1))
    return picked.reshape(batch, kv_heads, -1, tokens, stages).sum(-1) + constant[..., None]


def _histogram_values(probabilities, codes, scales, mean, synthesis, codebooks, stage_groups, chunk_tokens):
    batch, kv_heads, rows, tokens = probabilities.shape
    stages, size, _ = codebooks.shape
    codes = codes.expand(-1, kv_heads, -1, -1)
    weights = probabilities * scales.float()[:, :, None, :]  # p_n * s_n
    histogram = torch.zeros(batch, kv_heads, rows, stages * size, device=probabilities.device)
    stage_offsets = torch.arange(stages, device=codes.device) * size
    for start in range(0, tokens, chunk_tokens):
        end = min(start + chunk_tokens, tokens)
        flat = (codes[:, :, start:end].long() + stage_offsets).reshape(batch, kv_heads, 1, -1)
        source = weights[..., start:end, None].expand(-1, -1, -1, -1, stages).reshape(batch, kv_heads, rows, -1)
        histogram.scatter_add_(-1, flat.expand(-1, -1, rows, -1), source)
    return values_from_histogram(histogram, weights.sum(-1), mean, synthesis, codebooks, stage_groups)


def values_from_histogram(histogram, weight_sum, mean, synthesis, codebooks, stage_groups):
    """Attention output ``[B, Hkv, M, D]`` from the value histogram ``[B, Hkv, M, S*K]`` (sum of ``p_n * s_n`` per
    stage and codeword) and ``weight_sum`` ``[B, Hkv, M]`` (sum of ``p_n * s_n``): the codebooks are read once."""
    batch, kv_heads, rows, _ = histogram.shape
    stages, size, group_dim = codebooks.shape
    dim = synthesis.shape[1]  # transform-domain components
    per_stage = torch.einsum("bhmsk,skg->bhmsg", histogram.reshape(batch, kv_heads, rows, stages, size), codebooks.float())
    z = torch.zeros(batch, kv_heads, rows, dim // group_dim, group_dim, device=histogram.device)
    z.index_add_(3, stage_groups.long(), per_stage)
    return values_from_transform_sums(z.reshape(batch, kv_heads, rows, dim), weight_sum, mean, synthesis)


def values_from_transform_sums(z, weight_sum, mean, synthesis):
    """Attention output ``[B, Hkv, M, D]`` from ``z`` ``[B, Hkv, M, Dt]``, the sum of ``p_n * s_n`` times each token's
    transform-domain vector, and ``weight_sum``: values are ``s_n * (mean + z_n @ synthesis)``, which is linear."""
    return weight_sum[..., None] * mean.float()[None, :, None, :] + torch.einsum("bhmd,hde->bhme", z, synthesis.float())


# ---- merging partial attentions -----------------------------------------------------------------------------------
def softmax_with_lse(scores: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of ``scores`` along ``dim`` and its log-sum-exp (``dim`` removed). A fully masked slice (all -inf)
    gives probabilities 0 and lse -inf, so it drops out of a merge. Written as max / exp / sum rather than
    ``torch.logsumexp`` followed by ``exp(scores - lse)``: half the passes over the scores, which matters on CPU,
    where this runs for every layer of every decode step."""
    weights, total, lse = exp_weights(scores, dim)
    return weights.div_(total), lse


def exp_weights(scores: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unnormalized softmax: ``exp(scores - max)``, the totals along ``dim`` (kept, at least the smallest normal
    float, so dividing by them is safe) and the log-sum-exp (``dim`` removed). For outputs linear in the weights,
    dividing the outputs by the totals saves the pass that normalizes every weight."""
    peak = scores.amax(dim, keepdim=True)
    peak.masked_fill_(peak == -math.inf, 0.0)
    weights = (scores - peak).exp_()
    total = weights.sum(dim, keepdim=True)
    lse = (total.log() + peak).squeeze(dim)
    return weights, total.clamp_min_(torch.finfo(weights.dtype).tiny), lse


def merge_partial_attention(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over several key regions: combine normalized outputs ``[..., D]`` by their log-sum-exps ``[...]``;
    returns the joined (output, log-sum-exp)."""
    weights, lse = softmax_with_lse(torch.stack([lse for _, lse in parts]), dim=0)  # [P, ...]
    return sum(w[..., None] * out for w, (out, _) in zip(weights, parts)), lse


def scale_values_from_levels(levels: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """``levels`` ``[H, L]``, ``stored`` ``[..., H, N]`` level indices -> ``[..., H, N]`` float. A gather, not
    advanced indexing (``levels[heads, stored]``), which is several times slower."""
    return levels.expand(*stored.shape[:-2], -1, -1).gather(-1, stored.long())


def join_exact_attention(coded, query, exact_keys, exact_values, exact_mask, scaling):
    """The coded region's (output, lse) joined with attention over exact keys/values ``[B, Hkv, T, D]`` (the
    cache's sinks and window): what ``coded_attention`` returns when it is given them."""
    if exact_keys is None:
        return coded
    return merge_partial_attention([exact_attention_partial(query, exact_keys, exact_values, exact_mask, scaling), coded])


def add_mask(scores: torch.Tensor, mask: torch.Tensor | None, group_count: int) -> torch.Tensor:
    """Adds an additive mask ``[B, Lq, N]`` to scores ``[B, Hkv, group_count * Lq, N]`` in place: query row
    ``m = g * Lq + l`` (query head ``g`` of the KV head's group, position ``l``) uses mask row ``l``."""
    if mask is not None:
        scores += mask.float().repeat(1, group_count, 1)[:, None]
    return scores


def exact_scores(q, keys, mask, scaling, group_count):
    """Scaled, masked scores of grouped queries ``[B, Hkv, M, D]`` (fp32) against exact keys ``[B, Hkv, T, D]``."""
    return add_mask((q @ keys.float().transpose(-1, -2)).mul_(scaling), mask, group_count)


def exact_attention_partial(query, keys, values, mask, scaling):
    """Attention over exact keys/values ``[B, Hkv, T, D]`` -> (output ``[B, Hq, Lq, D]`` fp32, lse ``[B, Hq, Lq]``)."""
    batch, query_heads, query_length, dim = query.shape
    kv_heads, tokens = keys.shape[1], keys.shape[2]
    group_count = query_heads // kv_heads
    if tokens == 0:
        return (torch.zeros(batch, query_heads, query_length, dim, device=query.device),
                torch.full((batch, query_heads, query_length), -math.inf, device=query.device))
    q = query.float().reshape(batch, kv_heads, group_count * query_length, dim)
    probabilities, lse = softmax_with_lse(exact_scores(q, keys, mask, scaling, group_count))
    out = probabilities @ values.float()
    return out.reshape(batch, query_heads, query_length, dim), lse.reshape(batch, query_heads, query_length)
