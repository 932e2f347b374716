"""Linear layers that hold quantized weights: ``PackedLinear`` (inference) and ``FakeQuantLinear`` (QAT)."""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import re

import torch
import torch.nn.functional as F
from torch import nn

from ..codecs.learnable import LSQActivationQuantizer, stretched_symmetric_scale
from ..codecs.weight_quantization import (
    SCALE_DTYPES,
    check_bits,
    check_zero_point,
    dequantize_weight,
    fake_quantize,
    integer_zero_point_grid,
    mse_clipped_parameters,
    packed_width,
    quantize_weight,
    rtn_parameters,
)

logger = logging.getLogger(__name__)
WEIGHT_INITS = ("minmax", "stretched", "mse")


def initial_weight_grid(weight: torch.Tensor, *, bits: int, group_size: int, symmetric: bool, weight_init: str,
                        zero_point: str, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float32 ``(scale, offset)`` a fake-quant layer's grid starts from (``weight_init``, ``zero_point``): the
    one source for :meth:`FakeQuantLinear.reset_quantizer_parameters` and quantization while loading."""
    weight = weight.detach()
    if weight_init == "mse":
        return mse_clipped_parameters(weight, bits, group_size, symmetric, zero_point=zero_point,
                                      scale_dtype=scale_dtype)
    scale, offset = rtn_parameters(weight, bits, group_size, symmetric, zero_point=zero_point, scale_dtype=scale_dtype)
    if weight_init == "stretched":
        scale = stretched_symmetric_scale(weight.float().reshape(weight.shape[0], -1, group_size), bits)
    return scale, offset


def _input_quantizer(activation_bits, in_features, granularity, device, trainable: bool):
    if activation_bits is None:
        return None
    quantizer = LSQActivationQuantizer(activation_bits, in_features, granularity, device=device)
    quantizer.step.requires_grad_(trainable)
    return quantizer


def _copy_input_quantizer(source, target) -> None:
    if source is not None:
        with torch.no_grad():
            target.step.copy_(source.step.detach())
            target.initialized.copy_(source.initialized)


class PackedLinear(nn.Module):
    """A linear layer whose weight is stored as packed low-bit codes (see :mod:`hf_kvcodecs.codecs.weight_quantization`).

    State dict: ``weight`` (int32 packed codes, never the float shape), ``weight_scale``, ``weight_offset`` (only
    when asymmetric; with ``zero_point="integer"``, ``-zero * scale`` exactly, in the same tensor: see
    :mod:`hf_kvcodecs.codecs.weight_quantization`) and ``bias``; with ``activation_bits``, also
    ``input_quantizer.step`` and ``input_quantizer.initialized``: the input is then quantized on that learned grid
    before the matmul, as in training. The forward pass dequantizes the weight to the input's dtype and runs a float
    matmul; inside :func:`dequantized_weight_cache` the dequantized weight is kept between calls instead.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, bits: int, group_size: int,
                 symmetric: bool = False, scale_dtype: torch.dtype = torch.float16, activation_bits: int | None = None,
                 activation_granularity: str = "tensor", zero_point: str = "float", device=None, dtype=None):
        super().__init__()
        check_bits(bits)
        self.zero_point = check_zero_point(zero_point, symmetric)
        if in_features % group_size:
            raise ValueError(f"in_features={in_features} is not a multiple of group_size={group_size}.")
        width = packed_width(in_features, bits)
        if width == in_features:  # only possible for in_features == bits == 8
            raise ValueError(
                f"A {bits}-bit packed row of {in_features} inputs would have the float weight's shape, which a loader "
                "without hf_kvcodecs could not tell apart; keep this layer in floating point (modules_to_not_convert)."
            )
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        groups = in_features // group_size
        self.weight = nn.Parameter(torch.empty(out_features, width, dtype=torch.int32, device=device), requires_grad=False)
        # Scales and offsets are storage metadata, not trainable parameters: buffers (saved in the state dict).
        self.register_buffer("weight_scale", torch.empty(out_features, groups, dtype=scale_dtype, device=device))
        self.register_buffer(
            "weight_offset", None if symmetric else torch.empty(out_features, groups, dtype=scale_dtype, device=device)
        )
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.input_quantizer = _input_quantizer(activation_bits, in_features, activation_granularity, device, False)
        self._cached_weight: torch.Tensor | None = None
        self._cache_enabled = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, bits: int, group_size: int, symmetric: bool = False,
                    scale_dtype: torch.dtype = torch.float16, zero_point: str = "float") -> PackedLinear:
        """Round-to-nearest quantize a float ``nn.Linear``."""
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, bits=bits, group_size=group_size,
                     symmetric=symmetric, scale_dtype=scale_dtype, zero_point=zero_point, device=linear.weight.device,
                     dtype=linear.weight.dtype)
        module.load_quantized(quantize_weight(linear.weight.detach(), bits, group_size, symmetric=symmetric,
                                              scale_dtype=scale_dtype, zero_point=zero_point))
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module

    def load_quantized(self, quantized) -> None:
        with torch.no_grad():
            self.weight.data = quantized.packed.to(self.weight.device)
            self.weight_scale = quantized.scale.to(self.weight.device)
            if not self.symmetric:
                self.weight_offset = quantized.offset.to(self.weight.device)
        self._cached_weight = None

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or (self.bias.dtype if self.bias is not None else torch.float32)
        if self._cache_enabled:
            if self._cached_weight is None or self._cached_weight.dtype != dtype:
                self._cached_weight = self._dequantize(dtype)
            return self._cached_weight
        return self._dequantize(dtype)

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale, self.weight_offset, self.bits, self.group_size,
                                 self.in_features, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quantizer is not None:
            x = self.input_quantizer(x)
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def to_linear(self, dtype: torch.dtype | None = None) -> nn.Linear:
        """A float ``nn.Linear`` computing the same function (for ``model.dequantize()``)."""
        weight = self._dequantize(dtype or torch.float32)
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias.to(weight.dtype))
        return linear

    def extra_repr(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        kind += ", integer zero points" if self.zero_point == "integer" else ""
        activations = "" if self.input_quantizer is None else f", activation_bits={self.input_quantizer.bits}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"bits={self.bits}, group_size={self.group_size}, {kind}{activations}")


class FakeQuantLinear(nn.Linear):
    """``nn.Linear`` whose forward uses its weight fake-quantized on a learnable grid (quantization-aware training).

    The float ``weight`` (same key and shape as ``nn.Linear``) is the trained latent weight. ``weight_scale`` and
    ``weight_offset`` (asymmetric only) are ``nn.Parameter``s ``[out_features, in_features // group_size]``
    initialised from the weight (``weight_init``: ``"minmax"`` RTN; ``"stretched"``, ParetoQ's stretched elastic
    grid, symmetric only: see :func:`~hf_kvcodecs.codecs.learnable.stretched_symmetric_scale`; or ``"mse"``, the
    min-max grid clipped per group to its least squared error, see
    :func:`~hf_kvcodecs.codecs.weight_quantization.mse_clipped_parameters`) and trained with LSQ gradients through
    :func:`~hf_kvcodecs.codecs.weight_quantization.fake_quantize` on the grid rounded to ``scale_dtype``, the one the
    export stores (:meth:`stored_grid`). With ``zero_point="integer"`` the forward pass uses, instead, the nearest
    grid whose offset is ``-zero * scale`` with an integer zero, exact in ``scale_dtype`` (the one the export stores,
    and the one compressed-tensors holds exactly), and ``weight_scale``/``weight_offset`` are its latent float
    parameters: the zero point ``round(-offset / scale)`` and the exact scale are straight-through roundings of them,
    so they receive the same LSQ gradients as a float-offset grid. With ``activation_bits``, the input goes
    through ``input_quantizer`` (a learnable LSQ step, :class:`~hf_kvcodecs.codecs.learnable.LSQActivationQuantizer`)
    first. Subclasses can override :meth:`quantized_weight` to change the quantizer. :meth:`to_packed` exports the
    trained layer to a :class:`PackedLinear` on the learned grids.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, bits: int, group_size: int,
                 symmetric: bool = False, activation_bits: int | None = None, activation_granularity: str = "tensor",
                 weight_init: str = "minmax", scale_dtype: torch.dtype = torch.float16, zero_point: str = "float",
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.zero_point = check_zero_point(zero_point, symmetric)
        if scale_dtype not in SCALE_DTYPES.values():
            raise ValueError(f"scale_dtype must be one of {list(SCALE_DTYPES.values())}, got {scale_dtype!r}.")
        self.scale_dtype = scale_dtype
        if weight_init not in WEIGHT_INITS:
            raise ValueError(f"weight_init must be one of {WEIGHT_INITS}, got {weight_init!r}.")
        if weight_init == "stretched" and not symmetric:
            raise ValueError("weight_init='stretched' initialises a symmetric grid; use symmetric=True with it.")
        self.weight_init = weight_init
        check_bits(bits)
        if in_features % group_size:
            raise ValueError(f"in_features={in_features} is not a multiple of group_size={group_size}.")
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        groups = in_features // group_size
        self.weight_scale = nn.Parameter(torch.empty(out_features, groups, device=device, dtype=dtype))
        self.weight_offset = None if symmetric else nn.Parameter(torch.empty(out_features, groups, device=device, dtype=dtype))
        self.input_quantizer = _input_quantizer(activation_bits, in_features, activation_granularity, device, True)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, bits: int, group_size: int, symmetric: bool = False,
                    activation_bits: int | None = None, activation_granularity: str = "tensor",
                    weight_init: str = "minmax", scale_dtype: torch.dtype = torch.float16,
                    zero_point: str = "float") -> FakeQuantLinear:
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, bits=bits, group_size=group_size,
                     symmetric=symmetric, activation_bits=activation_bits, activation_granularity=activation_granularity,
                     weight_init=weight_init, scale_dtype=scale_dtype, zero_point=zero_point,
                     device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            module.weight.copy_(linear.weight)
            if linear.bias is not None:
                module.bias.copy_(linear.bias)
        module.reset_quantizer_parameters()
        return module

    def reset_quantizer_parameters(self) -> None:
        """(Re)initialise the weight grid from the current weight (``weight_init``, ``zero_point``)."""
        scale, offset = initial_weight_grid(self.weight, bits=self.bits, group_size=self.group_size,
                                            symmetric=self.symmetric, weight_init=self.weight_init,
                                            zero_point=self.zero_point, scale_dtype=self.scale_dtype)
        with torch.no_grad():
            # A zero scale would divide by zero in the forward pass; the smallest normal float is harmless instead.
            self.weight_scale.copy_(scale.clamp_min(torch.finfo(self.weight_scale.dtype).tiny))
            if self.weight_offset is not None:
                self.weight_offset.copy_(offset)

    def stored_grid(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(scale, offset)`` rounded to ``scale_dtype``, as the packed export stores them, with straight-through
        gradients. Training on the stored grid is what makes the export exact: with quantized activations a grid
        rounded only at export moves some layer outputs across an activation step, and the error compounds. With
        ``zero_point="integer"``, the grid of :meth:`integer_grid` instead, with straight-through gradients to the
        latent scale and offset."""
        tiny = torch.finfo(self.scale_dtype).tiny
        scale = self.weight_scale.clamp_min(tiny)
        offset = self.weight_offset
        if self.zero_point == "integer":
            exact_scale, exact_offset = self.integer_grid()
            return (scale + (exact_scale.to(scale.dtype) - scale).detach(),
                    offset + (exact_offset.to(offset.dtype) - offset).detach())
        scale = scale + (scale.to(self.scale_dtype).to(scale.dtype) - scale).detach()
        if offset is not None:
            offset = offset + (offset.to(self.scale_dtype).to(offset.dtype) - offset).detach()
        return scale, offset

    @torch.no_grad()
    def integer_grid(self, scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The integer-zero-point grid nearest to the latent one, exact in ``scale_dtype`` (default: the layer's):
        float32 ``(scale, offset == -zero * scale)``. Of the candidates of
        :func:`~hf_kvcodecs.codecs.weight_quantization.integer_zero_point_grid` for the latent grid's range
        ``[offset, offset + (2**bits - 1) * scale]``, the one with the least rounding error on the current weight; a
        latent grid that is already exact is its own."""
        scale_dtype = scale_dtype or self.scale_dtype
        scale = self.weight_scale.detach().float().clamp_min(torch.finfo(scale_dtype).tiny)
        low = self.weight_offset.detach().float()
        groups = self.weight.detach().float().reshape(self.out_features, -1, self.group_size)
        exact_scale, exact_offset, _ = integer_zero_point_grid(groups, low, low + (2**self.bits - 1) * scale,
                                                               self.bits, scale_dtype)
        return exact_scale, exact_offset

    def quantized_weight(self) -> torch.Tensor:
        return fake_quantize(self.weight, *self.stored_grid(), self.bits, self.group_size)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the matmul consumes: ``x`` on the input quantizer's grid (``x`` itself without one)."""
        return x if self.input_quantizer is None else self.input_quantizer(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.quantize_input(x), self.quantized_weight().to(x.dtype), self.bias)

    def to_packed(self, scale_dtype: torch.dtype | None = None) -> PackedLinear:
        """Export to a ``PackedLinear`` on the learned grid, stored in ``scale_dtype`` (default: the dtype the layer
        trained with, which reproduces its forward pass exactly)."""
        scale_dtype = scale_dtype or self.scale_dtype
        module = PackedLinear(self.in_features, self.out_features, self.bias is not None, bits=self.bits,
                              group_size=self.group_size, symmetric=self.symmetric, scale_dtype=scale_dtype,
                              activation_bits=None if self.input_quantizer is None else self.input_quantizer.bits,
                              activation_granularity="tensor" if self.input_quantizer is None
                              else self.input_quantizer.granularity, zero_point=self.zero_point,
                              device=self.weight.device, dtype=self.weight.dtype)
        _copy_input_quantizer(self.input_quantizer, module.input_quantizer)
        if self.zero_point == "integer":  # in float32, which holds every value of the scale dtypes exactly
            scale, offset = self.integer_grid(scale_dtype)
        else:
            scale, offset = self.stored_grid() if scale_dtype == self.scale_dtype else (self.weight_scale,
                                                                                      self.weight_offset)
        module.load_quantized(quantize_weight(
            self.weight.detach(), self.bits, self.group_size, symmetric=self.symmetric, scale_dtype=scale_dtype,
            scale=scale.detach(), offset=None if offset is None else offset.detach(),
        ))
        if self.bias is not None:
            module.bias.data.copy_(self.bias.detach())
        return module

    def to_linear(self, dtype: torch.dtype | None = None) -> nn.Linear:
        dtype = dtype or self.weight.dtype
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=self.weight.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(self.quantized_weight().to(dtype))
            if self.bias is not None:
                linear.bias.copy_(self.bias.to(dtype))
        return linear

    def extra_repr(self) -> str:
        activations = "" if self.input_quantizer is None else f", activation_bits={self.input_quantizer.bits}"
        zero_point = ", zero_point='integer'" if self.zero_point == "integer" else ""
        return (super().extra_repr() + f", bits={self.bits}, group_size={self.group_size}, symmetric={self.symmetric}"
                + zero_point + activations)


QUANTIZED_LINEAR_TYPES = (PackedLinear, FakeQuantLinear)


def empty_quantized_linear(linear: nn.Linear, config, *, quantize_input: bool = True) -> nn.Module:
    """The quantized module replacing ``linear`` before its weights are loaded (built on the current device, e.g. meta).
    ``quantize_input=False``: no activation quantizer even with ``config.activation_bits`` (a layer outside
    ``config.activation_modules``)."""
    common = dict(bits=config.weight_bits, group_size=config.group_size, symmetric=config.symmetric,
                  zero_point=config.zero_point, activation_bits=config.activation_bits if quantize_input else None,
                  activation_granularity=config.activation_granularity,
                  dtype=linear.weight.dtype, device=linear.weight.device)
    bias = linear.bias is not None
    if config.mode == "fake":
        return FakeQuantLinear(linear.in_features, linear.out_features, bias, weight_init=config.weight_init,
                               scale_dtype=SCALE_DTYPES[config.scale_dtype], **common)
    return PackedLinear(linear.in_features, linear.out_features, bias, scale_dtype=SCALE_DTYPES[config.scale_dtype], **common)


def quantized_from_linear(linear: nn.Linear, config, *, quantize_input: bool = True) -> nn.Module:
    """The quantized module computed from a loaded float ``linear`` (``quantize_input``: as in
    :func:`empty_quantized_linear`)."""
    activation_bits = config.activation_bits if quantize_input else None
    if config.mode == "fake":
        return FakeQuantLinear.from_linear(linear, bits=config.weight_bits, group_size=config.group_size,
                                           symmetric=config.symmetric, activation_bits=activation_bits,
                                           activation_granularity=config.activation_granularity,
                                           weight_init=config.weight_init, zero_point=config.zero_point,
                                           scale_dtype=SCALE_DTYPES[config.scale_dtype])
    if activation_bits is not None:
        raise ValueError("Activation quantization needs a learned step per layer: quantize with mode='fake', train "
                         "(e.g. hf_kvcodecs.training.SQuaTTrainer), then pack_fake_quantized(model).")
    return PackedLinear.from_linear(linear, bits=config.weight_bits, group_size=config.group_size,
                                    symmetric=config.symmetric, scale_dtype=SCALE_DTYPES[config.scale_dtype],
                                    zero_point=config.zero_point)


def linear_layers_to_convert(model: nn.Module, config, modules_to_not_convert) -> list[str]:
    """Names of the ``nn.Linear`` layers to quantize; a clear error if one cannot be quantized with ``config``."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    names = [name for name, module in model.named_modules()
             if type(module) is nn.Linear and should_convert_module(name, modules_to_not_convert)]
    misfits = [f"{name} (in_features={model.get_submodule(name).in_features})" for name in names
               if model.get_submodule(name).in_features % config.group_size]
    if misfits:
        shown = ", ".join(misfits[:5]) + (f" and {len(misfits) - 5} more" if len(misfits) > 5 else "")
        raise ValueError(
            f"group_size={config.group_size} does not divide the in_features of {shown}. Choose a group_size that "
            "divides every layer's in_features, or keep these layers in floating point with "
            "modules_to_not_convert=[...] (their names or a pattern)."
        )
    if config.weight_bits == 8:
        tiny = [name for name in names if model.get_submodule(name).in_features == 8]
        if tiny:
            raise ValueError(f"8-bit layers with in_features=8 cannot be packed distinguishably: {tiny}; add them to modules_to_not_convert.")
    return names


def module_name_matches(name: str, pattern: str) -> bool:
    """Whether ``pattern`` picks the module ``name``: equal to it, a suffix of it at a ``.`` boundary (``"gate_proj"``,
    ``"mlp.up_proj"``, as peft's ``target_modules``), a shell glob matching it (``"model.layers.1*.mlp.*_proj"``),
    or a regular expression matching all of it (``r"model\\.layers\\.(10|11)\\.mlp\\.(gate|up)_proj"``)."""
    if name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern):
        return True
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:  # a glob such as "*.gate_proj" is no regular expression
        return False


def activation_quantized_layers(names: list[str], patterns: list[str] | None) -> set[str]:
    """Which of the converted layers ``names`` get an activation quantizer: all of them (``patterns`` ``None``), or
    those some pattern picks (:func:`module_name_matches`). A pattern that picks none of them is an error that lists
    the converted layers' names: a misspelt pattern would otherwise leave activations silently in floating point."""
    if patterns is None:
        return set(names)
    chosen = set()
    for pattern in patterns:
        matched = {name for name in names if module_name_matches(name, pattern)}
        if not matched:
            suffixes = sorted({name.rsplit(".", 1)[-1] for name in names})
            shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
            raise ValueError(
                f"activation_modules pattern {pattern!r} matches none of the quantized linear layers. Their names: "
                f"{shown or 'none'}; their last parts: {suffixes}. A pattern is a name, a suffix of one (e.g. "
                "'mlp.gate_proj'), a shell glob or a regular expression matching a whole name.")
        chosen |= matched
    return chosen


@contextlib.contextmanager
def dequantized_weight_cache(model: nn.Module):
    """Keep every ``PackedLinear``'s dequantized weight between forward calls inside this block.

    Trades memory (a float copy of each packed weight) for speed in loops of many small forward calls, such as
    token-by-token evaluation or calibration; outputs are bit-identical because the same dequantization runs once
    instead of every call. The copies are released on exit.
    """
    modules = [m for m in model.modules() if isinstance(m, PackedLinear)]
    for module in modules:
        module._cache_enabled = True
    try:
        yield model
    finally:
        for module in modules:
            module._cache_enabled = False
            module._cached_weight = None
