"""GSRQCacheConfig: every option of the GSRQ cache, its default, its type and its check, in one place.

``GSRQCache(model.config, **options)``, ``generate(..., cache_implementation="gsrq", cache_config=options)`` and the
``kv_cache_config`` a compressed checkpoint carries read their names, defaults and checks from this dataclass. The
options of ``hf-kvcodecs demo`` are a copy (``cli.defaults.GSRQ_CACHE_OPTIONS``, so that ``--help`` imports no torch),
which a test checks against this dataclass field by field.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..codecs.residual import (
    DEFAULT_BEAM_WIDTH,
    DEFAULT_GAIN,
    GAIN_CHOICES,
    MAX_BEAM_WIDTH,
    check_bit_rate,
    check_encoder_options,
)

ATTENTION_CHOICES = ("auto", "codes", "dequantize")


def _option(default, help: str, *, checkpoint: bool = True, locates_codebooks: bool = False, cli: bool = True,
            choices: tuple | None = None, compare: bool = True):
    """A field of :class:`GSRQCacheConfig` and what the rest of the package needs to know about it.

    help: one line for command-line help. checkpoint: a compressed checkpoint's ``kv_cache_config`` may set it (not
    what only makes sense per call or per machine). locates_codebooks: it says where the codebooks are; a per-call
    codebooks location replaces all of a checkpoint's. cli: ``hf-kvcodecs demo`` has an option for it (not what the
    demo finds itself: its codebooks and the model's RoPE frequencies). choices: the values accepted.
    """
    metadata = {"help": help, "checkpoint": checkpoint, "locates_codebooks": locates_codebooks, "cli": cli,
                "choices": choices}
    return field(default=default, metadata=metadata, compare=compare)


@dataclass
class GSRQCacheConfig:
    """The options of a :class:`~hf_kvcodecs.GSRQCache`, checked when built (a ``ValueError`` names the fix).

    Attributes:
        codebooks: a directory written by ``hf-kvcodecs calibrate`` / ``calibrate_gsrq``, the id of a Hub repo
            holding one (``hf-kvcodecs push-codebooks``), or a ``GSRQCodebooks``. The cache requires it: without
            fitted codebooks there is nothing sensible to quantize with, so it raises instead of silently falling
            back to full precision (a compressed checkpoint sets it for you).
        codebooks_revision, codebooks_subfolder: for a Hub repo id, the branch, tag or commit to read and the folder
            inside the repo (``"kv_codebooks"`` reads the codebooks of a model saved by hf_kvcodecs).
        bits: bits per KV element including the per-vector scale (index bits + 8/head_dim, or 16/head_dim with
            fp16-scale codebooks); default 2.0 (``None`` also means 2.0). It must be a rate the codebooks serve
            exactly: the lowest (one residual stage, e.g. 0.25 for keys of head size 64) plus whole stages (0.125
            each there), up to the rate they were calibrated for; another rate (0.3) is refused by the cache with the
            nearest ones, not served at a lower one.
        key_bits, value_bits: per-tensor overrides of ``bits`` (``None``: ``bits``).
        window_length: recent tokens kept exact (plus up to ``flush_interval`` more between flushes).
        flush_interval: how many tokens accumulate beyond the window before they are encoded together (at least 1).
        num_sink_tokens: first tokens kept exact (attention sinks). In a left-padded batch (``generate`` with an
            ``attention_mask``) the count starts at each row's first real token: the sink region grows by the longest
            left padding, whose slots hold pad tokens in the padded rows and real tokens in the others.
        attention: how attention reads the coded history. ``"codes"``: the code-reading attention
            (``hf_kvcodecs::coded_attention``: Triton on CUDA, PyTorch reference on CPU), which never builds a
            full-precision copy; needs the model on a code-reading attention implementation
            (``hf_kvcodecs.enable_code_attention(model)``, done for you by ``generate(cache_implementation="gsrq")``).
            ``"dequantize"``: decode the history and hand it to the model's own attention. ``"auto"`` (default):
            ``"codes"`` when the model config says the model uses a code-reading attention implementation, else
            ``"dequantize"``. The cache's choice is in ``cache.attention_path``.
        beam_width: code paths the encoder keeps per group of stages (default 8: 12-15 % lower KL at 2 bits on the
            default model than 1 = greedy, which encodes, and so prefills, faster; decode speed is the same).
        gain: how each coded vector's scale is chosen once its codes are: ``"norm"`` (default, decoded vectors
            as long as their inputs), ``"least_squares"`` or ``"rms"`` (see ``TransformResidualVQ.encode``).
        rope_inv_freq: the RoPE frequencies the model applies (``hf_kvcodecs.model_rope_inv_freq(model)``), when
            they can differ from those the codebooks were calibrated with: ``model.to(torch.bfloat16)`` also rounds
            the rotary embedding's ``inv_freq`` buffer to bf16, and a cache using the calibrated frequencies would then
            undo RoPE with other angles than the model applied and code keys that are not really pre-RoPE (default
            model in bf16: KL 0.050 instead of 0.042). ``generate(cache_implementation="gsrq")`` passes the model's
            own; default: the calibrated ones.
    """

    codebooks: Any = _option(None, "GSRQ codebooks: a directory, a Hub repo id or a GSRQCodebooks",
                             locates_codebooks=True, cli=False)
    codebooks_revision: str | None = _option(None, "branch, tag or commit of a Hub codebooks repo",
                                             checkpoint=False, locates_codebooks=True, cli=False)
    codebooks_subfolder: str | None = _option(None, "folder of the codebooks inside a Hub repo",
                                              checkpoint=False, locates_codebooks=True, cli=False)
    bits: float = _option(2.0, "bits per KV element, the per-vector scale included")
    key_bits: float | None = _option(None, "bits per key element, overriding the rate of --bits (default: --bits)")
    value_bits: float | None = _option(None, "bits per value element, overriding the rate of --bits "
                                             "(default: --bits)")
    window_length: int = _option(32, "most recent tokens the GSRQ cache keeps exact")
    flush_interval: int = _option(32, "tokens that accumulate beyond the exact window before they are coded "
                                      "together")
    num_sink_tokens: int = _option(4, "first tokens the GSRQ cache keeps exact (attention sinks)")
    attention: str = _option("auto", "how attention reads the coded history: 'codes' reads the codes, "
                                     "'dequantize' decodes them for the model's own attention, 'auto' picks 'codes' "
                                     "when the model runs the code-reading attention", choices=ATTENTION_CHOICES)
    beam_width: int = _option(DEFAULT_BEAM_WIDTH, f"code paths the encoder keeps per group of stages (1: greedy, "
                                                  f"up to {MAX_BEAM_WIDTH})")
    gain: str = _option(DEFAULT_GAIN, "how each coded vector's scale is chosen once its codes are",
                        choices=GAIN_CHOICES)
    # a tensor: compared by identity would make equal configs unequal, compared by value raises
    rope_inv_freq: Any = _option(None, "the RoPE frequencies the model applies", checkpoint=False, cli=False,
                                 compare=False)

    def __post_init__(self):
        if self.bits is None:  # GSRQCache(bits=None) has always meant the default rate
            self.bits = type(self).bits
        self.bits = check_bit_rate("bits", self.bits)
        for name in ("key_bits", "value_bits"):
            if getattr(self, name) is not None:
                setattr(self, name, check_bit_rate(name, getattr(self, name)))
        for name in ("window_length", "flush_interval", "num_sink_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}: give a whole number of "
                                 f"tokens (default {getattr(type(self), name)}).")
        if self.flush_interval < 1:
            raise ValueError("flush_interval must be at least 1: tokens beyond the window are coded every "
                             "flush_interval tokens (default 32).")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {self.attention!r}.")
        check_encoder_options(self.gain, self.beam_width)
        for name in ("codebooks_revision", "codebooks_subfolder"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str) and not hasattr(value, "__fspath__"):
                raise ValueError(f"{name} must be a string (a Hub {name.split('_')[1]}) or None, got {value!r}.")

    # ---- the names, as the rest of the package derives them ---------------------------------------------------
    @classmethod
    def option_names(cls, *, checkpoint: bool | None = None, locates_codebooks: bool | None = None,
                     cli: bool | None = None) -> tuple[str, ...]:
        """The option names, in field order; ``checkpoint`` / ``locates_codebooks`` / ``cli``: only those whose
        field has (True) or lacks (False) that property (see :func:`_option`)."""
        wanted = {"checkpoint": checkpoint, "locates_codebooks": locates_codebooks, "cli": cli}
        return tuple(f.name for f in fields(cls)
                     if all(value is None or f.metadata[key] == value for key, value in wanted.items()))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every option's default, by name."""
        return {f.name: f.default for f in fields(cls)}

    @classmethod
    def metadata(cls, name: str) -> Mapping[str, Any]:
        """The field of ``name``'s help, choices and properties (see :func:`_option`)."""
        return next(f.metadata for f in fields(cls) if f.name == name)

    # ---- dicts ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every option by name (values as held: a codebooks object or a tensor is not copied)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> GSRQCacheConfig:
        """The config of ``options`` (a ``cache_config`` dict); a ``ValueError`` naming the valid keys for a key
        that is not an option, so a misspelt option is not silently ignored."""
        if not isinstance(options, Mapping):
            raise TypeError(f"GSRQ cache options must be a dict, got {type(options).__name__}: e.g. "
                            "{'codebooks': DIR, 'bits': 2}.")
        check_option_names(options)
        return cls(**options)


def check_option_names(options, *, also_valid: tuple[str, ...] = ()) -> None:
    """A ``ValueError`` listing the valid ``cache_config`` keys when ``options`` names one that is not."""
    valid = GSRQCacheConfig.option_names() + tuple(also_valid)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        close = {name: difflib.get_close_matches(name, valid, n=1) for name in unknown}
        hints = [f"{name!r} -> {match[0]!r}" for name, match in close.items() if match]
        raise ValueError(f"Unknown GSRQCache option(s) {unknown}; valid cache_config keys are {list(valid)}"
                         + (f" (did you mean {', '.join(hints)}?)." if hints else "."))
