"""SQuaT's label-free losses, in chunks so that two models' full-vocabulary logits never sit in memory at once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..codecs.learnable import signed_levels


def _kl_chunk(student_hidden, teacher_hidden, student_head, teacher_head, temperature: float) -> torch.Tensor:
    student = F.log_softmax(student_head(student_hidden).float() / temperature, dim=-1)
    with torch.no_grad():
        teacher = F.log_softmax(teacher_head(teacher_hidden).float() / temperature, dim=-1)
    return (teacher.exp() * (teacher - student)).sum()


def chunked_kl(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, student_head, teacher_head, *,
               temperature: float = 1.0, chunk_tokens: int = 512) -> torch.Tensor:
    """``T^2 * KL(teacher || student)`` per token, averaged over the rows of ``[N, hidden]`` final hidden states.

    Logits are made ``chunk_tokens`` rows at a time under activation checkpointing: backward recomputes a chunk's
    logits instead of keeping them, so memory holds one chunk of logits per model, not ``N`` rows.
    """
    if student_hidden.shape[0] == 0:
        return student_hidden.sum() * 0.0
    total = student_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, student_hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        total = total + checkpoint(_kl_chunk, student_hidden[rows], teacher_hidden[rows], student_head, teacher_head,
                                   temperature, use_reentrant=False)
    return total * temperature**2 / student_hidden.shape[0]


def _nll_chunk(hidden, head, targets) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def chunked_nll(hidden: torch.Tensor, head, targets: torch.Tensor, *, chunk_tokens: int = 512) -> torch.Tensor:
    """Summed next-token negative log-likelihood of ``targets`` ``[N]`` given hidden states ``[N, hidden]``."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        total = total + checkpoint(_nll_chunk, hidden[rows], head, targets[rows], use_reentrant=False)
    return total


def feature_terms(student_quantized: torch.Tensor, teacher_feature: torch.Tensor,
                  teacher_quantized: torch.Tensor | None, mask: torch.Tensor, *, quantized_target: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The feature loss and the floor of its raw-teacher form, over the valid positions of ``mask``.

    The loss is ``MSE(Q_s(f_s), target)`` with ``target = Q_s(f_t)`` (SQuaT, ``quantized_target=True``) or ``f_t``
    (the raw-teacher ablation); the floor is ``E||Q_s(f_t) - f_t||^2``, what no student with this quantizer can get
    below against the raw teacher (``None`` without a student quantizer). Both are divided by the teacher feature's
    energy ``E||f_t||^2``, so that one weight suits every layer.
    """
    valid = mask.bool()
    student, raw = student_quantized[valid].float(), teacher_feature[valid].float()
    energy = raw.square().mean().clamp_min(torch.finfo(torch.float32).tiny)
    floor = None
    if teacher_quantized is not None:
        quantized = teacher_quantized[valid].float()
        floor = (quantized - raw).square().mean().detach() / energy
    if quantized_target and teacher_quantized is None:
        raise ValueError("A student-quantized teacher target needs the student's activation quantizer.")
    target = quantized if quantized_target else raw
    return (student - target).square().mean() / energy, floor


def clip_fraction(values: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """The fraction of ``values`` (``[..., C]``) outside the range ``[-Q_n s, Q_p s]`` of a signed ``bits``-bit grid
    with step ``s`` (one, or one per channel ``C``): the values that quantizer clips."""
    negative, positive = signed_levels(bits)
    scaled = values.detach().float() / step.detach().float()
    if scaled.numel() == 0:
        return scaled.new_zeros(())
    return ((scaled < -negative) | (scaled > positive)).float().mean()
