"""Triton kernel: greedy residual-VQ encoding (nearest codeword per stage) of transform-domain vectors.

Each program encodes ``BLOCK_R`` vectors through all stages. A stage reads its group's running residual, scores all
``K`` codewords (``r.c - |c|^2 / 2``), keeps the arg-max and writes the updated residual back, so later stages of the
same group see it. Reference: ``residual_encode_reference`` in ``reference.py``.
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
