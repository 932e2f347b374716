"""Export a model quantized by hf_kvcodecs to a compressed-tensors checkpoint (``quant_method: "compressed-tensors"``,
format ``pack-quantized``, group strategy), which plain transformers and vLLM load without hf_kvcodecs.

How our grids map onto compressed-tensors' integer grids, per group of ``group_size`` inputs:

- Asymmetric (min-max, MSE-clipped, or learned by SQuaT): ours is ``w = code * scale + offset`` with a float
  ``offset``; compressed-tensors' is ``w = (q - zero_point) * scale`` with signed codes ``q = code - 2**(bits-1)``
  and an integer ``zero_point`` in the same signed range. The same scale and codes give our grid exactly when
  ``k = -offset / scale`` is an integer in ``[0, 2**bits - 1]``, up to the rounding of the stored offset
  (``zero_point = k - 2**(bits-1)``). Otherwise no integer zero point reproduces the grid, and the group is
  re-fitted: of our scale with the nearest integer zero point (the whole group shifts by ``|k - round(k)|`` of a
  step, at most half), the least-squares scale for our levels around the zero point rounded down or up, and
  compressed-tensors' own min-max fit of the group's weights (range widened to include 0; the only one that fits a
  group whose weights all share a sign), the grid whose nearest codes have the smallest squared error against our
  dequantized weights is kept. Min-max, MSE-clipped and learned offsets are continuous, so in practice almost every
  group is re-fitted, which moves weights about as much as rounding to the grid did (a quarter of a step on
  average): the returned report says how many groups, and the weight and logits differences. Grids quantized or
  trained with ``zero_point="integer"`` (``KVCodecsConfig``) hold ``offset == -zero * scale`` exactly, so every group
  maps exactly (an integer-zero-point layer with a group that does not is an error) and, when the checkpoint's
  scale dtype holds our scales (float16 scales in a float16 or float32 model, bfloat16 ones in a bfloat16 or
  float32 model), its weights are ours bit for bit: the report's ``exact``.
- Symmetric (including ParetoQ's stretched grid): ours is mid-rise, ``w = (code - (2**bits - 1) / 2) * scale``, with
  levels at odd multiples of ``scale / 2`` and no zero level; compressed-tensors' symmetric grid has a zero level,
  and its asymmetric one would need a zero point of one half. No ``bits``-bit checkpoint holds it exactly, so it is
  refused unless ``widen_symmetric=True``: then it is exported exactly as a symmetric ``bits + 1``-bit grid with
  scale ``scale / 2`` and codes ``2 * code - (2**bits - 1)`` (a W3 stretched student becomes an exact W4 checkpoint).

Widths: compressed-tensors 0.19+ packs any width from 1 to 8 densely into int32 words (``bits`` words per 32 codes).
4 and 8 bits pack as in every release, 1 and 2 bits as since 0.17; 3, 5, 6 and 7 bits need compressed-tensors
>= 0.19 wherever the checkpoint is loaded (0.17-0.18 read them with another layout, without an error). vLLM's
compressed-tensors W*A16 kernels take zero points at 4 and 8 bits.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..codecs.weight_quantization import dequantize_weight, unpack_codes
from .modules import FakeQuantLinear, PackedLinear

logger = logging.getLogger(__name__)

MIN_COMPRESSED_TENSORS = "0.19"
REPORT_FILE = "hf_kvcodecs_export.json"
# Text whose tokens the logits of the two models are compared on (with a tokenizer; token ids 3.. without one).
CHECK_TEXT = "The quick brown fox jumps over the lazy dog. Quantized weights should give the same next token."
KV_CACHE_IMPLEMENTATIONS = ("gsrq", "scd")
# The oldest compressed-tensors that reads each width as this export writes it: 4 and 8 bits since transformers'
# minimum, 1 and 2 bits since pack-quantized took every width up to 8 (32 // bits codes per word, the dense layout
# for these widths); the others since 0.19's dense packing.
LOADS_WITH = {4: ">=0.15", 8: ">=0.15", 1: ">=0.17", 2: ">=0.17"}
ROWS_PER_BLOCK_TIMES_INPUTS = 2**22  # weights mapped at once


@dataclass
class _Mapped:
    """One layer on the compressed-tensors grid: ``weight == (codes - zero_point) * scale`` per group."""

    codes: torch.Tensor  # int8 [out, in], signed
    scale: torch.Tensor  # [out, groups], values of the storage dtype, held in float32
    zero_point: torch.Tensor | None  # int8 [out, groups], signed; None when symmetric
    exact_groups: int
    refit_groups: dict = field(default_factory=dict)


def export_compressed_tensors(model: nn.Module, tokenizer=None, out_dir: str | Path = None, *,
                              widen_symmetric: bool = False, drop_activation_quantization: bool = False,
                              check_logits: bool = True, check_input_ids: torch.Tensor | None = None) -> dict:
    """Write ``model`` (quantized by hf_kvcodecs) to ``out_dir`` as a compressed-tensors ``pack-quantized``
    checkpoint that ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads without hf_kvcodecs (and vLLM serves),
    with ``tokenizer`` if given. ``model`` is left as it was.

    ``model`` holds :class:`PackedLinear` layers (:func:`quantize_model`, or an hf_kvcodecs checkpoint, e.g. a
    SQuaT student written by ``SQuaTTrainer.export``) or :class:`FakeQuantLinear` layers (a student being trained:
    exported on its learned grid, as ``SQuaTTrainer.export`` packs it). Layers hf_kvcodecs kept in floating point
    (the LM head, embeddings) stay dense: compressed-tensors' ``ignore`` list names them. See the module docstring
    for which grids export exactly; ``widen_symmetric`` exports a symmetric (mid-rise, stretched) grid exactly at one
    more bit. Learned activation quantizers have no compressed-tensors counterpart here: they are refused, or left
    out with ``drop_activation_quantization=True`` (the checkpoint then runs with floating-point activations). A
    GSRQ or SCD KV cache, which only hf_kvcodecs runs, is left out.

    Returns the report, also written to ``out_dir/hf_kvcodecs_export.json``: the scheme, how many groups were
    exact and how many re-fitted, the weight difference between the checkpoint's dequantized weights and ours (max,
    mean, RMS, and in units of each group's step) and, with ``check_logits``, the largest logits difference on a
    fixed input (``check_input_ids``, ``[batch, tokens]``; by default a sentence through ``tokenizer``, or token ids
    3 to 34 without one) between the exported weights (dequantized by compressed-tensors in this process) and
    ``model``.
    """
    if out_dir is None:
        raise ValueError("export_compressed_tensors needs out_dir, the folder to write the checkpoint to.")
    check_compressed_tensors()
    from compressed_tensors import __version__ as compressed_tensors_version
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.base import compress_module
    from compressed_tensors.compressors.pack_quantized import unpack_from_int32
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        QuantizationStatus,
        initialize_module_for_quantization,
    )

    layers = _quantized_layers(model)
    bits, group_size, symmetric = _common_scheme(layers)
    zero_points = {getattr(layer, "zero_point", "float") for layer in layers.values()}
    _check_exportable(layers, bits, symmetric, widen_symmetric, drop_activation_quantization)
    out_bits = bits + 1 if symmetric else bits
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=out_bits, type="int", symmetric=symmetric, strategy="group", group_size=group_size))
    storage_dtype = _storage_dtype(model)

    plain = _plain_copy(model, layers)
    errors = _ErrorStats()
    exact_groups, refit_groups = 0, {"nearest_zero_point": 0, "least_squares_scale": 0, "min_max_refit": 0}
    for name, layer in layers.items():
        packed = layer.to_packed() if isinstance(layer, FakeQuantLinear) else layer
        codes = unpack_codes(packed.weight.detach(), bits, packed.in_features).to(torch.int64)
        scale = packed.weight_scale.detach()
        offset = None if packed.weight_offset is None else packed.weight_offset.detach()
        bias = None if packed.bias is None else packed.bias.detach()
        ours = dequantize_weight(packed.weight.detach(), scale, offset, bits, group_size, packed.in_features)
        # in blocks of rows: the mapping works in float64 on several candidate grids at once
        rows = max(1, ROWS_PER_BLOCK_TIMES_INPUTS // packed.in_features)
        blocks = []
        for start in range(0, packed.out_features, rows):
            block = slice(start, start + rows)
            blocks.append(_map_grid(codes[block], scale[block], None if offset is None else offset[block], bits,
                                    group_size, storage_dtype, ours[block]))
            errors.add(_ct_dequantize(blocks[-1], group_size), ours[block], scale[block], group_size)
        mapped = _Mapped(torch.cat([b.codes for b in blocks]), torch.cat([b.scale for b in blocks]),
                         None if offset is None else torch.cat([b.zero_point for b in blocks]),
                         sum(b.exact_groups for b in blocks))
        exact_groups += mapped.exact_groups
        if getattr(layer, "zero_point", "float") == "integer" and mapped.exact_groups != mapped.zero_point.numel():
            raise RuntimeError(
                f"{name} has integer zero points, yet {mapped.zero_point.numel() - mapped.exact_groups} of its groups "
                "have an offset that is not -zero_point * scale: its scales or offsets were changed after it was "
                "quantized. Quantize it again with zero_point='integer'.")
        for b in blocks:
            for key, count in b.refit_groups.items():
                refit_groups[key] += count
        theirs = _ct_dequantize(mapped, group_size)

        linear = nn.Linear(layer.in_features, layer.out_features, bias=bias is not None, dtype=torch.float32,
                           device=theirs.device)
        with torch.no_grad():
            # In float32, (q - zero_point) * scale is exact, so the compressor's round(weight / scale + zero_point)
            # gives back exactly these codes (checked below).
            linear.weight.copy_(theirs)
            if bias is not None:
                linear.bias.copy_(bias.float())
        initialize_module_for_quantization(linear, scheme)
        with torch.no_grad():
            linear.weight_scale.copy_(mapped.scale)
            if mapped.zero_point is not None:
                linear.weight_zero_point.copy_(mapped.zero_point)
        compress_module(linear, "pack-quantized")
        unpacked = unpack_from_int32(linear.weight_packed.data, out_bits, torch.Size(theirs.shape))
        if not torch.equal(unpacked, mapped.codes):
            raise RuntimeError(f"compressed-tensors {compressed_tensors_version} packed other codes than hf_kvcodecs "
                               f"gave it for {name}; this pairing of versions cannot export.")
        _to_dtype(linear, storage_dtype)
        plain.set_submodule(name, linear)

    compressor = ModelCompressor.from_pretrained_model(plain, quantization_format="pack-quantized")
    compressor.quantization_config.quantization_status = QuantizationStatus.COMPRESSED
    dropped_cache = _strip_hf_kvcodecs(plain)
    out_dir = Path(out_dir)
    plain.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
    if not symmetric:
        _dequantize_on_load_in_transformers(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)

    groups = exact_groups + sum(refit_groups.values())
    weight_difference = errors.summary()
    report = {
        "format": "compressed-tensors",
        "compressed_tensors_version": compressed_tensors_version,
        "scheme": {"num_bits": out_bits, "group_size": group_size, "symmetric": symmetric, "strategy": "group",
                   "format": "pack-quantized", "scale_dtype": str(storage_dtype).removeprefix("torch.")},
        "source": {"bits": bits, "symmetric": symmetric, "layers": len(layers),
                   "zero_point": None if symmetric else next(iter(zero_points)) if len(zero_points) == 1 else "mixed"},
        "ignored": list(compressor.quantization_config.ignore or []),
        "groups": groups,
        "exact_groups": exact_groups,
        "refit_groups": refit_groups,
        "exact_grid": exact_groups == groups,
        # the checkpoint dequantizes (in float32) to our weights bit for bit
        "exact": weight_difference["max_abs"] == 0.0,
        "weight_difference": weight_difference,
        "dropped": {"activation_quantization": _has_activation_quantizers(layers),
                    "kv_cache_implementation": dropped_cache},
        "loads_with_compressed_tensors": LOADS_WITH.get(out_bits, f">={MIN_COMPRESSED_TENSORS}"),
        "transformers_dequantize_on_load": not symmetric,
    }
    if "integer" in zero_points and not report["exact"]:
        logger.warning(
            "The integer-zero-point grid maps exactly, but the checkpoint stores scales in the model's dtype (%s), "
            "which does not hold every one of ours: weights move by up to %.3g. Quantize with scale_dtype=%r for a "
            "bit-exact export.", report["scheme"]["scale_dtype"], weight_difference["max_abs"],
            report["scheme"]["scale_dtype"])
    if check_logits:
        report["logits_difference"] = _compare_logits(model, plain, compressor, tokenizer, check_input_ids)
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def _dequantize_on_load_in_transformers(out_dir: Path) -> None:
    """Make transformers load this asymmetric checkpoint through its ``dequantize`` route.

    Its default route builds the empty model with compressed-tensors' compressor on the meta device, which leaves
    ``weight_zero_point`` unpacked (``[out_features, groups]``) while the checkpoint holds it packed
    (``[out_features * bits / 32, groups]``), and the load fails on the size mismatch (transformers 5.24 with
    compressed-tensors 0.18 to 0.20.1). The ``dequantize`` route decompresses each layer from the checkpoint's own
    tensors with the same compressor, into the dense weights the default route would decompress to on the first
    forward pass. ``dequantize`` is a loading option of transformers' ``CompressedTensorsConfig`` read from
    ``config.json``; compressed-tensors and vLLM read only the keys they know, so they are unaffected.
    """
    path = out_dir / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["quantization_config"]["dequantize"] = True
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ---- checks ---------------------------------------------------------------------------------------------------------
def check_compressed_tensors() -> None:
    """Raise an ImportError naming the install command unless a compressed-tensors this export supports is there."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        installed = version("compressed-tensors")
    except PackageNotFoundError:
        installed = None
    if installed is None or Version(installed) < Version(MIN_COMPRESSED_TENSORS):
        found = "is not installed" if installed is None else f"is {installed}"
        raise ImportError(f"Exporting to compressed-tensors needs compressed-tensors>={MIN_COMPRESSED_TENSORS} "
                          f"(it {found}): pip install 'compressed-tensors>={MIN_COMPRESSED_TENSORS}', or pip "
                          "install -e '.[serve]' in the hf_kvcodecs source tree.")


def _quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    if hasattr(model, "peft_config") or hasattr(model, "merge_and_unload"):
        raise ValueError("This model carries peft adapters: merge them into the quantized student first "
                         "(model = model.merge_and_unload()), then export.")
    layers = {name: module for name, module in model.named_modules() if isinstance(module, (PackedLinear, FakeQuantLinear))}
    if not layers:
        raise ValueError("The model has no layer quantized by hf_kvcodecs (PackedLinear or FakeQuantLinear). Quantize "
                         "it first (quantize_model(model, KVCodecsConfig(weight_bits=4, group_size=...)), `hf-kvcodecs "
                         "compress --kv none`, or a SQuaT student), or load such a checkpoint after `import hf_kvcodecs`.")
    return layers


def _common_scheme(layers: dict[str, nn.Module]) -> tuple[int, int, bool]:
    schemes = {(m.bits, m.group_size, m.symmetric) for m in layers.values()}
    if len(schemes) != 1:
        raise ValueError(f"The quantized layers use several grids {sorted(schemes)} (bits, group_size, symmetric); "
                         "this export writes one compressed-tensors scheme: quantize every layer with one config.")
    return schemes.pop()


def _check_exportable(layers, bits: int, symmetric: bool, widen_symmetric: bool, drop_activations: bool) -> None:
    if symmetric and not widen_symmetric:
        raise ValueError(
            f"This model's {bits}-bit grid is symmetric (hf_kvcodecs' mid-rise grid, or the stretched one): its levels "
            "sit at odd multiples of half a step, with no zero level, which no compressed-tensors grid of the same "
            f"width holds. Pass widen_symmetric=True (--widen-symmetric) to export it exactly as a {bits + 1}-bit "
            "symmetric grid, or quantize with symmetric=False for an export at the same width.")
    if symmetric and bits + 1 > 8:
        raise ValueError(f"A symmetric {bits}-bit grid widens to {bits + 1} bits, beyond compressed-tensors' 8; quantize "
                         "with symmetric=False to export 8-bit weights.")
    if _has_activation_quantizers(layers) and not drop_activations:
        raise ValueError(
            "This model quantizes the inputs of its linear layers with learned steps (activation_bits), which the "
            "compressed-tensors export does not carry. Pass drop_activation_quantization=True "
            "(--drop-activation-quantization) to export the weights alone (the checkpoint then runs with floating-point "
            "activations: compare its quality first), or keep the hf_kvcodecs checkpoint for W*A* inference.")


def _has_activation_quantizers(layers) -> bool:
    return any(getattr(m, "input_quantizer", None) is not None for m in layers.values())


# ---- our grid -------------------------------------------------------------------------------------------------------
def _storage_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the checkpoint's scales: the model's, which is what transformers and vLLM give the scale
    parameters they load them into."""
    dtype = getattr(model, "dtype", None)
    return dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32


def _stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` rounded to ``dtype`` (positive, at least its smallest normal), held in float64."""
    return tensor.double().clamp_min(torch.finfo(dtype).tiny).to(dtype).double()


def _map_grid(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int, group_size: int,
              storage_dtype: torch.dtype, ours: torch.Tensor) -> _Mapped:
    out_features, in_features = codes.shape
    groups = in_features // group_size
    codes = codes.reshape(out_features, groups, group_size)
    if offset is None:  # mid-rise symmetric, widened: (code - L/2) * s == (2 * code - L) * (s / 2)
        levels = 2**bits - 1
        half = _stored(scale.double() / 2, storage_dtype)
        return _Mapped((2 * codes - levels).reshape(out_features, in_features).to(torch.int8), half.float(), None,
                       out_features * groups)

    levels = 2**bits - 1
    half_range = 2 ** (bits - 1)
    target = ours.double().reshape(out_features, groups, group_size)
    kept = codes.double()
    ratio = -offset.double() / scale.double()  # k: the (fractional) code whose level is 0
    nearest = ratio.round()
    # The offset is stored rounded to its dtype, to within half a unit in its last place: an integer k shows up
    # within that rounding of an integer.
    tolerance = 0.5 * torch.finfo(offset.dtype).eps * nearest.abs() + 1e-9
    exact = ((ratio - nearest).abs() <= tolerance) & (nearest >= 0) & (nearest <= levels)

    candidates = {}
    # our scale, the nearest integer zero point in range: the group shifts by |k - round(k)| steps at most
    candidates["nearest_zero_point"] = (scale.double(), nearest.clamp(0, levels))
    # the zero point rounded down or up, and the scale fitting our levels best by least squares around it
    for name, zero in (("least_squares_floor", ratio.floor()), ("least_squares_ceil", ratio.ceil())):
        zero = zero.clamp(0, levels)
        centred = kept - zero[..., None]
        fit = (centred * (kept - ratio[..., None])).sum(-1) / centred.square().sum(-1)
        candidates[name] = (torch.where(torch.isfinite(fit) & (fit > 0), scale.double() * fit, scale.double()), zero)
    # compressed-tensors' own min-max observer on our dequantized weights, range widened to include 0 (the only
    # one that fits a group whose weights all share a sign)
    low, high = target.amin(-1).clamp(max=0), target.amax(-1).clamp(min=0)
    minmax_scale = _stored((high - low) / levels, storage_dtype)
    candidates["min_max_refit"] = (minmax_scale, (-low / minmax_scale).round().clamp(0, levels))

    best_error = best_codes = best_scale = best_zero = best_index = None
    for index, (candidate_scale, zero) in enumerate(candidates.values()):
        candidate_scale = _stored(candidate_scale, storage_dtype)
        candidate_codes = (target / candidate_scale[..., None] + zero[..., None]).round().clamp(0, levels)
        error = ((candidate_codes - zero[..., None]) * candidate_scale[..., None] - target).square().sum(-1)
        if index == 0:
            # an exact group keeps its codes and this grid: no re-fit replaces it
            candidate_codes = torch.where(exact[..., None], kept, candidate_codes)
            error = torch.where(exact, torch.zeros_like(error), error)
            best_error, best_codes, best_scale, best_zero = error, candidate_codes, candidate_scale, zero
            best_index = torch.zeros_like(nearest, dtype=torch.long)
            continue
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_codes = torch.where(better[..., None], candidate_codes, best_codes)
        best_scale = torch.where(better, candidate_scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
        best_index = torch.where(better, index, best_index)
    refit = {name: int(((best_index == index) & ~exact).sum()) for index, name in enumerate(candidates)}
    refit["least_squares_scale"] = refit.pop("least_squares_floor") + refit.pop("least_squares_ceil")
    return _Mapped(
        codes=(best_codes - half_range).reshape(out_features, in_features).to(torch.int8),
        scale=best_scale.float(),
        zero_point=(best_zero - half_range).to(torch.int8),
        exact_groups=int(exact.sum()),
        refit_groups=refit,
    )


def _ct_dequantize(mapped: _Mapped, group_size: int) -> torch.Tensor:
    """What compressed-tensors dequantizes to, in float32: ``(q - zero_point) * scale`` per group."""
    out_features, in_features = mapped.codes.shape
    q = mapped.codes.float().reshape(out_features, in_features // group_size, group_size)
    if mapped.zero_point is not None:
        q = q - mapped.zero_point.float()[..., None]
    return (q * mapped.scale[..., None]).reshape(out_features, in_features)


class _ErrorStats:
    def __init__(self):
        self.count = 0
        self.abs_sum = self.square_sum = self.reference_square_sum = self.steps_sum = 0.0
        self.max_abs = self.max_steps = 0.0

    def add(self, theirs: torch.Tensor, ours: torch.Tensor, scale: torch.Tensor, group_size: int) -> None:
        difference = (theirs.double() - ours.double()).abs()
        steps = difference.reshape(*scale.shape, group_size) / scale.double()[..., None]
        self.count += difference.numel()
        self.abs_sum += float(difference.sum())
        self.square_sum += float(difference.square().sum())
        self.reference_square_sum += float(ours.double().square().sum())
        self.steps_sum += float(steps.sum())
        self.max_abs = max(self.max_abs, float(difference.max()))
        self.max_steps = max(self.max_steps, float(steps.max()))

    def summary(self) -> dict:
        return {"max_abs": self.max_abs, "mean_abs": self.abs_sum / self.count,
                "rms": (self.square_sum / self.count) ** 0.5,
                "relative_rms": (self.square_sum / max(self.reference_square_sum, 1e-300)) ** 0.5,
                "max_in_steps": self.max_steps, "mean_in_steps": self.steps_sum / self.count,
                "weights": self.count}


# ---- the dense model around the exported layers ---------------------------------------------------------------------
def _plain_copy(model: nn.Module, layers: dict[str, nn.Module]) -> nn.Module:
    """A copy of ``model``'s module tree that shares every tensor and quantized layer with it (they are replaced in
    the copy, never modified) and leaves the hf_kvcodecs quantizer and its KV artifact behind."""
    memo = {id(tensor): tensor for tensor in [*model.parameters(), *model.buffers()]}
    memo.update({id(module): module for module in layers.values()})
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        memo[id(quantizer)] = None
    return copy.deepcopy(model, memo)


def _to_dtype(linear: nn.Linear, dtype: torch.dtype) -> None:
    for name in ("weight_scale", "bias"):
        tensor = getattr(linear, name, None)
        if tensor is not None:
            tensor.data = tensor.data.to(dtype)


def _strip_hf_kvcodecs(plain: nn.Module) -> str | None:
    """Make the copy a plain transformers model: no hf_kvcodecs quantization config or quantizer, no save extension,
    no GSRQ/SCD default cache. Returns the cache implementation left out, if any."""
    for attribute in ("hf_quantizer", "is_quantized", "quantization_method", "save_pretrained"):
        if attribute in plain.__dict__:
            delattr(plain, attribute)
    if getattr(plain.config, "quantization_config", None) is not None:
        del plain.config.quantization_config
    generation_config = getattr(plain, "generation_config", None)
    dropped = None
    if generation_config is not None and generation_config.cache_implementation in KV_CACHE_IMPLEMENTATIONS:
        dropped = generation_config.cache_implementation
        generation_config.cache_implementation = None
        generation_config.cache_config = None
    return dropped


@torch.no_grad()
def _compare_logits(model: nn.Module, plain: nn.Module, compressor, tokenizer, ids: torch.Tensor | None) -> dict:
    """Largest and mean absolute logits difference on a fixed input between ``model`` and the exported weights as
    compressed-tensors dequantizes them (the copy, decompressed in place after it was saved)."""
    if ids is None and tokenizer is not None:
        ids = torch.tensor([tokenizer(CHECK_TEXT)["input_ids"]])
    elif ids is None:
        ids = (torch.arange(3, 35) % model.config.vocab_size)[None]
    compressor.decompress_model(plain)
    training = model.training
    model.eval()
    plain.eval()
    try:
        device = next(model.parameters()).device
        ours = model(input_ids=ids.to(device), use_cache=False).logits.float()
        theirs = plain(input_ids=ids.to(device), use_cache=False).logits.float()
    finally:
        model.train(training)
    difference = (theirs - ours).abs()
    return {"tokens": ids.numel(), "max_abs": float(difference.max()), "mean_abs": float(difference.mean()),
            "reference_max_abs_logit": float(ours.abs().max()),
            "same_argmax_fraction": float((theirs.argmax(-1) == ours.argmax(-1)).float().mean())}
