"""``KVCodecsConfig``: the quantization config transformers stores in ``config.json`` as ``quantization_config``."""

from __future__ import annotations

import os
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from ..codecs.learnable import ACTIVATION_GRANULARITIES, check_activation_bits
from ..codecs.weight_quantization import SCALE_DTYPES, ZERO_POINTS, check_bits
from .kv_artifacts import GSRQ_CODEBOOKS, KV_ARTIFACTS, kv_artifact
from .modules import WEIGHT_INITS

QUANT_METHOD = "hf_kvcodecs"
# Bumped whenever a checkpoint written by this version cannot be read correctly by an older hf_kvcodecs. A
# checkpoint is written with the lowest version that reads it: 2 only when it quantizes activations.
FORMAT_VERSION = 2
ACTIVATION_FORMAT_VERSION = 2
MODES = ("packed", "fake")
# Where save_pretrained writes the KV codebooks, relative to the checkpoint folder.
KV_CODEBOOKS_FOLDER = GSRQ_CODEBOOKS.folder
MIN_GROUP_SIZE, MAX_GROUP_SIZE = 8, 8192


class KVCodecsConfig(QuantizationConfigMixin):
    """Quantization config of hf_kvcodecs: low-bit weights and a compressed KV cache, saved with the model.

    Pass it to ``from_pretrained(..., quantization_config=KVCodecsConfig(...))`` to quantize while loading, or to
    :func:`hf_kvcodecs.quantization.quantize_model` for a model already in memory. A saved checkpoint carries it in
    ``config.json``; with ``hf_kvcodecs`` installed and imported, ``from_pretrained`` restores everything.

    Args:
        weight_bits (`int` or `None`, defaults to 4):
            Bits per weight of the converted ``nn.Linear`` layers, 1 to 8. ``None`` leaves the weights in floating
            point and only sets up the KV cache.
        group_size (`int`, defaults to 64):
            Consecutive inputs of a row that share one scale (and offset): a power of two from 8 to 8192. Every
            converted layer's ``in_features`` must be a multiple of it.
        symmetric (`bool`, defaults to `False`):
            Symmetric grid (one scale per group) instead of min-max (scale and offset per group).
        zero_point (`str`, defaults to `"float"`):
            The offset of an asymmetric grid: ``"float"``, any value (min-max: the group's minimum), or
            ``"integer"``, ``-zero * scale`` with an integer zero point, chosen so that the stored scale and offset
            hold it exactly. Integer zero points are compressed-tensors' (GPTQ's, AWQ's) grid, so such a model
            exports to compressed-tensors exactly (``export_compressed_tensors``); they cost a little accuracy (the
            grid always has a level at 0, and its scale is rounded to one whose multiples the offset can hold).
            Packed tensors are laid out as with float offsets. Fake-quant layers learn the scale and the zero point
            through straight-through roundings.
        activation_bits (`int` or `None`, defaults to `None`):
            Bits of the inputs of the converted layers (2 to 8), fake-quantized on a learned LSQ step before each
            matmul, in training and at inference. ``None`` (or 16) keeps activations in floating point. Needs
            ``mode="fake"`` to learn the steps (``pack_fake_quantized`` keeps them).
        activation_granularity (`str`, defaults to `"tensor"`):
            One activation step per layer (``"tensor"``) or per input channel (``"channel"``).
        activation_modules (`list[str]`, *optional*):
            Which converted layers get their input quantized with ``activation_bits``; the others keep floating-point
            inputs. Each entry is a module name, a suffix of one at a ``.`` boundary (``"mlp.gate_proj"``, as peft's
            ``target_modules``), a shell glob (``"model.layers.2[23].mlp.up_proj"``) or a regular expression matching
            a whole name. A pattern that matches no converted layer is an error listing their names. ``None``: every
            converted layer (the default).
        weight_init (`str`, defaults to `"minmax"`):
            How fake-quant weight grids start: ``"minmax"`` RTN, or ``"stretched"`` (ParetoQ's stretched elastic
            grid, with ``symmetric=True``: levels at the centres of equal bins of ``[-absmax, absmax]``, at 2 bits
            ``{-3/4, -1/4, 1/4, 3/4} * absmax``, no zero level), or ``"mse"`` (per group, the min-max grid clipped
            to the ratio with the least squared rounding error; symmetric or not).
        mode (`str`, defaults to `"packed"`):
            ``"packed"``: int32-packed codes plus scales, the inference format (``PackedLinear``). ``"fake"``:
            float weights quantized on the fly with a straight-through estimator and learnable scales
            (``FakeQuantLinear``), for quantization-aware training; ``Trainer`` accepts such a model.
        modules_to_not_convert (`list[str]`, *optional*):
            Module names (prefixes, suffixes or regular expressions) kept in floating point. ``None`` keeps
            transformers' default: the output embedding and weights tied to it.
        scale_dtype (`str`, defaults to `"float16"`):
            Storage dtype of packed scales and offsets: ``"float16"``, ``"bfloat16"`` or ``"float32"``.
        kv_cache_implementation (`str`, *optional*):
            ``"gsrq"`` makes ``generate()`` use :class:`~hf_kvcodecs.GSRQCache` by default; ``"scd"`` makes it
            rebuild the cache from the SCD payload given per call (``cache_config={"payload": ...}``).
        kv_cache_config (`dict`, *optional*):
            For ``"gsrq"``: options of that cache (``bits``, ``window_length``, ...), and ``codebooks``: a directory
            written by ``hf-kvcodecs calibrate``. In a saved checkpoint it is ``"kv_codebooks"``, relative to the
            checkpoint. For ``"scd"``: ``knowledge_base``, a directory written by ``hf-kvcodecs scd fit`` for this
            model as the consumer (``"scd_knowledge_base"`` in a saved checkpoint).
        format_version (`int`):
            Checkpoint format version; set by hf_kvcodecs, not by users.
    """

    def __init__(
        self,
        weight_bits: int | None = 4,
        group_size: int = 64,
        symmetric: bool = False,
        mode: str = "packed",
        zero_point: str = "float",
        modules_to_not_convert: list[str] | None = None,
        scale_dtype: str = "float16",
        activation_bits: int | None = None,
        activation_granularity: str = "tensor",
        activation_modules: list[str] | None = None,
        weight_init: str = "minmax",
        kv_cache_implementation: str | None = None,
        kv_cache_config: dict[str, Any] | None = None,
        format_version: int = FORMAT_VERSION,
        **kwargs,
    ):
        quant_method = kwargs.pop("quant_method", QUANT_METHOD)
        if quant_method != QUANT_METHOD:
            raise ValueError(f"KVCodecsConfig has quant_method={QUANT_METHOD!r}, got {quant_method!r}.")
        if kwargs:
            raise ValueError(
                f"Unknown KVCodecsConfig option(s) {sorted(kwargs)}. Valid options: weight_bits, group_size, symmetric, "
                "mode, modules_to_not_convert, scale_dtype, activation_bits, activation_granularity, activation_modules, "
                "weight_init, zero_point, kv_cache_implementation, kv_cache_config. If they come from a checkpoint's "
                "config.json, it was written by a newer hf_kvcodecs: `pip install -U hf-kvcodecs`."
            )
        self.quant_method = QUANT_METHOD
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.symmetric = symmetric
        self.mode = mode
        self.modules_to_not_convert = None if modules_to_not_convert is None else list(modules_to_not_convert)
        self.scale_dtype = scale_dtype
        self.activation_bits = None if activation_bits == 16 else activation_bits
        self.activation_granularity = activation_granularity
        self.activation_modules = ([activation_modules] if isinstance(activation_modules, str)
                                   else None if activation_modules is None else list(activation_modules))
        self.weight_init = weight_init
        self.zero_point = zero_point
        self.kv_cache_implementation = kv_cache_implementation
        self.kv_cache_config = None if kv_cache_config is None else dict(kv_cache_config)
        self.format_version = format_version
        self.post_init()

    def post_init(self):
        """Check every field and say how to fix a bad one."""
        if not isinstance(self.format_version, int) or self.format_version > FORMAT_VERSION:
            raise ValueError(
                f"This checkpoint uses hf_kvcodecs format version {self.format_version!r}; this hf_kvcodecs reads "
                f"versions up to {FORMAT_VERSION}. Upgrade it: `pip install -U hf-kvcodecs`."
            )
        if self.weight_bits is not None:
            check_bits(self.weight_bits)
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or not (
            MIN_GROUP_SIZE <= self.group_size <= MAX_GROUP_SIZE and self.group_size & (self.group_size - 1) == 0
        ):
            raise ValueError(
                f"group_size must be a power of two from {MIN_GROUP_SIZE} to {MAX_GROUP_SIZE}, got {self.group_size!r}. "
                "It must also divide the in_features of every converted layer (64 or 32 suit most models)."
            )
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric must be True or False, got {self.symmetric!r}.")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}.")
        if self.weight_bits is None and self.mode != "packed":
            raise ValueError("mode='fake' trains quantized weights, so it needs weight_bits (1 to 8), not None.")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {tuple(SCALE_DTYPES)}, got {self.scale_dtype!r}.")
        if self.activation_bits is not None:
            check_activation_bits(self.activation_bits)
            if not self.quantizes_weights:
                raise ValueError("activation_bits quantizes the inputs of the converted linear layers, so it needs "
                                 "weight_bits (1 to 8).")
        if self.activation_granularity not in ACTIVATION_GRANULARITIES:
            raise ValueError(f"activation_granularity must be one of {ACTIVATION_GRANULARITIES}, got "
                             f"{self.activation_granularity!r}.")
        if self.activation_modules is not None:
            if self.activation_bits is None:
                raise ValueError("activation_modules chooses the layers whose inputs activation_bits quantizes; set "
                                 "activation_bits (2 to 8) too, or leave activation_modules=None.")
            if not self.activation_modules or not all(isinstance(m, str) and m for m in self.activation_modules):
                raise ValueError("activation_modules must be a non-empty list of module names or patterns (strings), "
                                 f"got {self.activation_modules!r}; None quantizes every converted layer's input.")
        if self.weight_init not in WEIGHT_INITS:
            raise ValueError(f"weight_init must be one of {WEIGHT_INITS}, got {self.weight_init!r}.")
        if self.weight_init == "stretched" and not self.symmetric:
            raise ValueError("weight_init='stretched' is ParetoQ's symmetric grid without a zero level; set "
                             "symmetric=True with it.")
        if self.zero_point not in ZERO_POINTS:
            raise ValueError(f"zero_point must be one of {ZERO_POINTS}, got {self.zero_point!r}.")
        if self.zero_point == "integer" and (self.symmetric or not self.quantizes_weights):
            raise ValueError("zero_point='integer' chooses the offset of an asymmetric weight grid: it needs "
                             "weight_bits and symmetric=False.")
        if self.modules_to_not_convert is not None and not all(isinstance(m, str) for m in self.modules_to_not_convert):
            raise ValueError("modules_to_not_convert must be a list of module names (strings).")
        self._check_kv_cache()

    def _check_kv_cache(self):
        if self.kv_cache_implementation is None:
            if self.kv_cache_config:
                raise ValueError("kv_cache_config was given without kv_cache_implementation; set kv_cache_implementation "
                                 f"to one of {tuple(KV_ARTIFACTS)}.")
            return
        kind = kv_artifact(self.kv_cache_implementation)
        options = self.kv_cache_config or {}
        unknown = sorted(set(options) - set(kind.cache_options))
        if unknown:
            raise ValueError(f"Unknown kv_cache_config option(s) {unknown}; valid options: {list(kind.cache_options)}.")
        location = options.get(kind.location_key)
        if not isinstance(location, (str, os.PathLike)):
            raise ValueError(
                f"kv_cache_implementation={kind.cache_implementation!r} needs kv_cache_config="
                f"{{{kind.location_key!r}: DIR}}, where DIR was written by {kind.made_with} (a path, so that the "
                "config can be saved as JSON)."
            )
        self.kv_cache_config = {**options, kind.location_key: os.fspath(location)}

    @property
    def quantizes_weights(self) -> bool:
        return self.weight_bits is not None

    def to_dict(self) -> dict[str, Any]:
        # Options at their defaults are left out, so a checkpoint that does not use them stays readable by the
        # versions before them.
        optional = {name: value for name, value, default in (
            ("activation_bits", self.activation_bits, None),
            ("activation_granularity", self.activation_granularity, "tensor"),
            ("activation_modules", None if self.activation_modules is None else list(self.activation_modules), None),
            ("weight_init", self.weight_init, "minmax"),
            ("zero_point", self.zero_point, "float")) if value != default}
        return {
            "quant_method": self.quant_method,
            "format_version": ACTIVATION_FORMAT_VERSION if self.activation_bits is not None else 1,
            "weight_bits": self.weight_bits,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "mode": self.mode,
            "modules_to_not_convert": None if self.modules_to_not_convert is None else list(self.modules_to_not_convert),
            "scale_dtype": self.scale_dtype,
            **optional,
            "kv_cache_implementation": self.kv_cache_implementation,
            "kv_cache_config": None if self.kv_cache_config is None else dict(self.kv_cache_config),
        }

    def __eq__(self, other):
        return isinstance(other, KVCodecsConfig) and self.to_dict() == other.to_dict()

    __hash__ = None  # mutable, like the other quantization configs
