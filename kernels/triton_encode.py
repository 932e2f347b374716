"""Triton kernels: residual-VQ encoding of transform-domain vectors, greedy (nearest codeword per stage) and beam
search (``_residual_encode_beam_kernel``, reference ``residual_encode_beam_reference``).

Greedy: each program encodes ``BLOCK_R`` vectors through all stages. A stage reads its group's running residual,
scores all ``K`` codewords (``r.c - |c|^2 / 2``), keeps the arg-max and writes the updated residual back, so later
stages of the same group see it. Reference: ``residual_encode_reference`` in ``reference.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _residual_encode_kernel(residual_ptr, codes_ptr, codebooks_ptr, groups_ptr, R, S,
                            D: tl.constexpr, K: tl.constexpr, GD: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    words = tl.arange(0, K)
    components = tl.arange(0, GD)
    for stage in range(S):
        group = tl.load(groups_ptr + stage)
        residual_pointers = residual_ptr + rows[:, None] * D + group * GD + components[None, :]
        residual = tl.load(residual_pointers, mask=row_mask[:, None], other=0.0)
        codebook = tl.load(codebooks_ptr + stage * K * GD + words[:, None] * GD + components[None, :])
        half_norms = 0.5 * tl.sum(codebook * codebook, axis=1)
        products = tl.sum(residual[:, None, :] * codebook[None, :, :], axis=2)
        index = tl.argmax(products - half_norms[None, :], axis=1)
        chosen = tl.load(codebooks_ptr + stage * K * GD + index[:, None] * GD + components[None, :], mask=row_mask[:, None], other=0.0)
        tl.store(residual_pointers, residual - chosen, mask=row_mask[:, None])
        tl.store(codes_ptr + rows * S + stage, index.to(tl.uint8), mask=row_mask)


def residual_encode_triton(z: torch.Tensor, codebooks: torch.Tensor, stage_groups: torch.Tensor, block_r: int = 16):
    """Same contract as ``residual_encode_reference``: ``[R, D]`` -> codes ``[R, S]`` uint8."""
    rows, dim = z.shape
    stages, size, group_dim = codebooks.shape
    codes = torch.empty(rows, stages, dtype=torch.uint8, device=z.device)
    if rows == 0 or stages == 0:
        return codes
    residual = z.float().contiguous().clone()
    _residual_encode_kernel[(triton.cdiv(rows, block_r),)](
        residual, codes, codebooks.float().contiguous(), stage_groups.to(torch.int32).contiguous(), rows, stages,
        D=dim, K=size, GD=group_dim, BLOCK_R=block_r,
    )
    return codes


@triton.jit
def _residual_encode_beam_kernel(z_ptr, codes_ptr, codebooks_ptr, order_ptr, opens_ptr, groups_ptr, S,
                                 D: tl.constexpr, K: tl.constexpr, GD: tl.constexpr, SP: tl.constexpr,
                                 BEAMS: tl.constexpr, BP: tl.constexpr):
    """One program per vector. Stages arrive grouped (``order``: stage indices sorted by group, first-appearance
    order kept), so one group's beams live in registers while its stages are searched: ``residual`` ``[BP, GD]``,
    ``error`` ``[BP]`` (+inf for unused beams) and each beam's code path ``[BP, SP]``. After every stage the best beam's
    path is written into the group's columns of the output, so it holds the final choice once the group is done."""
    row = tl.program_id(0)
    beams = tl.arange(0, BP)
    words = tl.arange(0, K)
    components = tl.arange(0, GD)
    columns = tl.arange(0, SP)
    candidates = tl.arange(0, BP * K)
    infinity = float("inf")
    codes = tl.zeros([SP], dtype=tl.int32)
    residual = tl.zeros([BP, GD], dtype=tl.float32)
    error = tl.full([BP], infinity, dtype=tl.float32)
    path = tl.zeros([BP, SP], dtype=tl.int32)
    stage_group = tl.load(groups_ptr + columns, mask=columns < S, other=-1)  # group of every stage (column)
    for step in range(S):
        stage = tl.load(order_ptr + step)
        group = tl.load(groups_ptr + stage)
        # A group's first stage starts from one beam holding the input's components of that group.
        opens_group = tl.load(opens_ptr + step) != 0
        start = tl.load(z_ptr + row * D + group * GD + components)
        residual = tl.where(opens_group, tl.where(beams[:, None] == 0, start[None, :], 0.0), residual)
        error = tl.where(opens_group, tl.where(beams == 0, tl.sum(start * start, axis=0), infinity), error)
        path = tl.where(opens_group, 0, path)
        codebook = tl.load(codebooks_ptr + stage * K * GD + words[:, None] * GD + components[None, :])  # [K, GD]
        products = tl.sum(residual[:, None, :] * codebook[None, :, :], axis=2)  # [BP, K]
        norms = tl.sum(codebook * codebook, axis=1)
        energy = tl.sum(residual * residual, axis=1)
        scores = energy[:, None] - 2.0 * products + norms[None, :]  # |r_b - c_k|^2
        scores = tl.where((error < infinity)[:, None], scores, infinity)
        flat = tl.reshape(scores, [BP * K])
        next_residual = tl.zeros([BP, GD], dtype=tl.float32)
        next_error = tl.full([BP], infinity, dtype=tl.float32)
        next_path = tl.zeros([BP, SP], dtype=tl.int32)
        for slot in tl.static_range(BEAMS):  # the BEAMS smallest candidates, smallest first (ties: lowest index)
            best = tl.argmin(flat, axis=0)
            best_error = tl.min(flat, axis=0)
            flat = tl.where(candidates == best, infinity, flat)
            parent = best // K
            word = best % K
            parent_residual = tl.sum(tl.where(beams[:, None] == parent, residual, 0.0), axis=0)  # [GD]
            parent_path = tl.sum(tl.where(beams[:, None] == parent, path, 0), axis=0)  # [SP]
            chosen = tl.load(codebooks_ptr + stage * K * GD + word * GD + components)
            here = beams == slot
            next_residual = tl.where(here[:, None], (parent_residual - chosen)[None, :], next_residual)
            next_error = tl.where(here, best_error, next_error)
            next_path = tl.where(here[:, None], tl.where(columns == stage, word, parent_path)[None, :], next_path)
        residual, error, path = next_residual, next_error, next_path
        winner = tl.argmin(error, axis=0)
        winner_path = tl.sum(tl.where(beams[:, None] == winner, path, 0), axis=0)
        codes = tl.where(stage_group == group, winner_path, codes)
    tl.store(codes_ptr + row * S + columns, codes.to(tl.uint8), mask=columns < S)


def residual_encode_beam_triton(z: torch.Tensor, codebooks: torch.Tensor, stage_groups: torch.Tensor,
                                beam_width: int) -> torch.Tensor:
    """Same contract as ``residual_encode_beam_reference``: ``[R, D]`` -> codes ``[R, S]`` uint8."""
    rows, dim = z.shape
    stages, size, group_dim = codebooks.shape
    codes = torch.empty(rows, stages, dtype=torch.uint8, device=z.device)
    if rows == 0 or stages == 0:
        return codes
    groups = stage_groups.to(torch.int32)
    group_of = [int(g) for g in stage_groups.tolist()]
    first_seen = {g: i for i, g in reversed(list(enumerate(group_of)))}
    order = sorted(range(stages), key=lambda s: (first_seen[group_of[s]], s))  # stages grouped, each group in order
    opens = [i == 0 or group_of[order[i]] != group_of[order[i - 1]] for i in range(stages)]
    _residual_encode_beam_kernel[(rows,)](
        z.float().contiguous(), codes, codebooks.float().contiguous(),
        torch.tensor(order, dtype=torch.int32, device=z.device), torch.tensor(opens, dtype=torch.int32, device=z.device),
        groups.contiguous(), stages,
        D=dim, K=size, GD=group_dim, SP=triton.next_power_of_2(stages), BEAMS=beam_width,
        BP=triton.next_power_of_2(beam_width),
    )
    return codes
