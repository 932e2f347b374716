"""Learnable-step quantizers for quantization-aware training: pure tensor math on torch, reusable by any method.

- :func:`round_ste` rounds with a straight-through gradient; :func:`scale_gradient` multiplies a tensor's gradient
  without changing its value (LSQ's step-gradient scaling, Esser et al. 2020: ``g = 1 / sqrt(N * Q_p)`` for a step
  shared by ``N`` elements on a grid whose largest positive code is ``Q_p``).
- :func:`lsq_quantize`: the LSQ quantizer ``s * clamp(round(x / s), -Q_n, Q_p)`` (a signed integer grid with a zero
  level), gradients to ``x`` inside the clamp range and LSQ's gradient to ``s``.
- :class:`LSQActivationQuantizer`: that quantizer as a module with one step per tensor or per channel of its input,
  initialised from data on its first training forward pass (the step minimising the mean squared quantization error
  of that batch) and averaged over processes when ``torch.distributed`` is running.
- Initialisation rules of weight grids (:func:`stretched_symmetric_scale`): ParetoQ's stretched elastic grid.
"""

from __future__ import annotations

import torch
from torch import nn

ACTIVATION_GRANULARITIES = ("tensor", "channel")
MIN_ACTIVATION_BITS, MAX_ACTIVATION_BITS = 2, 8


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` forward, identity backward."""
    return x + (torch.round(x) - x).detach()


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` forward; its gradient multiplied by ``factor`` backward."""
    return x * factor + (x - x * factor).detach()


def signed_levels(bits: int) -> tuple[int, int]:
    """``(Q_n, Q_p)`` of a signed ``bits``-bit integer grid: codes ``-Q_n .. Q_p``."""
    return 2 ** (bits - 1), 2 ** (bits - 1) - 1


def lsq_quantize(x: torch.Tensor, step: torch.Tensor, bits: int, *, gradient_factor: float | None = None) -> torch.Tensor:
    """Fake-quantize ``x`` on the signed grid ``step * {-Q_n, ..., Q_p}`` (``step`` broadcasts against ``x``).

    ``gradient_factor`` scales the step's gradient (LSQ: ``1 / sqrt(elements per step * Q_p)``); ``None`` uses that
    rule with the number of elements of ``x`` each step value covers.
    """
    negative, positive = signed_levels(bits)
    if gradient_factor is None:
        gradient_factor = 1.0 / (max(x.numel() // max(step.numel(), 1), 1) * positive) ** 0.5
    step = scale_gradient(step, gradient_factor)
    return round_ste(torch.clamp(x / step, -negative, positive)) * step


def mse_optimal_step(x: torch.Tensor, bits: int, dim: tuple[int, ...] | None, candidates: int = 64) -> torch.Tensor:
    """Per-slice step minimising ``E (Q(x) - x)^2`` over clipping ratios of the slice's absolute maximum.

    ``dim`` are the dimensions reduced into one step (``None``: the whole tensor). A search over ``candidates``
    clipping ratios from 1/candidates to 1; a slice of zeros gets the smallest normal step.
    """
    x = x.detach().float()
    negative, positive = signed_levels(bits)
    absmax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    absmax = absmax.clamp_min(torch.finfo(torch.float32).tiny)
    best_error, best_step = None, None
    for ratio in torch.linspace(1.0 / candidates, 1.0, candidates).tolist():
        step = absmax * ratio / positive
        error = (torch.round(torch.clamp(x / step, -negative, positive)) * step - x).square()
        error = error.mean() if dim is None else error.mean(dim=dim, keepdim=True)
        if best_error is None:
            best_error, best_step = error, step
        else:
            better = error < best_error
            best_error, best_step = torch.where(better, error, best_error), torch.where(better, step, best_step)
    return best_step


def stretched_symmetric_scale(weight_groups: torch.Tensor, bits: int) -> torch.Tensor:
    """ParetoQ's stretched elastic initialisation of a mid-rise symmetric grid, per group (last dimension).

    The grid ``(code - (2**bits - 1) / 2) * scale`` has no zero level; with ``scale = 2 * absmax / 2**bits`` its
    ``2**bits`` levels are the centres of equal bins splitting ``[-absmax, absmax]`` (at 2 bits the levels are
    ``{-3/4, -1/4, 1/4, 3/4} * absmax``), where min-max initialisation (``scale = 2 * absmax / (2**bits - 1)``) puts
    the outermost levels on ``±absmax``.
    """
    return weight_groups.abs().amax(dim=-1) * 2 / 2**bits


def check_activation_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_ACTIVATION_BITS <= bits <= MAX_ACTIVATION_BITS:
        raise ValueError(f"activation_bits must be an integer from {MIN_ACTIVATION_BITS} to {MAX_ACTIVATION_BITS} "
                         f"(or None for floating-point activations), got {bits!r}.")
    return bits


class LSQActivationQuantizer(nn.Module):
    """Fake-quantizes the input of a linear layer with a learnable LSQ step: per tensor (one step) or per channel
    (one step per input feature, the last dimension).

    State: ``step`` (an ``nn.Parameter``) and ``initialized``. Until initialised, the first forward pass in training
    mode sets the step to the MSE-optimal one for that batch (the mean over processes under ``torch.distributed``);
    a forward pass in eval mode before that is an error, because an uninitialised step would quantize silently wrong.
    """

    def __init__(self, bits: int, features: int, granularity: str = "tensor", *, device=None, dtype=None):
        super().__init__()
        check_activation_bits(bits)
        if granularity not in ACTIVATION_GRANULARITIES:
            raise ValueError(f"activation granularity must be one of {ACTIVATION_GRANULARITIES}, got {granularity!r}.")
        self.bits, self.features, self.granularity = bits, features, granularity
        shape = (features,) if granularity == "channel" else (1,)
        self.step = nn.Parameter(torch.ones(shape, device=device, dtype=dtype or torch.float32))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.uint8, device=device))

    @property
    def is_initialized(self) -> bool:
        return bool(self.initialized.item())

    @torch.no_grad()
    def initialize(self, x: torch.Tensor) -> None:
        """Set the step from a batch of inputs (MSE-optimal clipping), averaged over processes."""
        if x.shape[-1] != self.features:
            raise ValueError(f"The activation quantizer expects inputs with {self.features} features in the last "
                             f"dimension, got shape {tuple(x.shape)}.")
        dims = tuple(range(x.ndim - 1)) if self.granularity == "channel" else None
        step = mse_optimal_step(x, self.bits, dims).reshape(self.step.shape)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(step)
            step /= torch.distributed.get_world_size()
        self.step.copy_(step.to(self.step.dtype))
        self.initialized.fill_(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_initialized:
            if not self.training:
                raise RuntimeError("This activation quantizer has no step yet: run one training forward pass (or "
                                   "call initialize(inputs)) before evaluating, or load a checkpoint that has one.")
            self.initialize(x)
        return lsq_quantize(x, self.step.to(x.dtype), self.bits)

    def quantize_detached(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` on this quantizer's current grid, no gradient to the step (for a target such as a teacher's
        feature: SQuaT's student-quantized teacher feature)."""
        negative, positive = signed_levels(self.bits)
        step = self.step.detach().to(x.dtype)
        return torch.round(torch.clamp(x / step, -negative, positive)) * step

    def extra_repr(self) -> str:
        return f"bits={self.bits}, features={self.features}, granularity={self.granularity}"
