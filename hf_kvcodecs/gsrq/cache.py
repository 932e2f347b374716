"""GSRQCache: a transformers ``Cache`` whose layers (:class:`~hf_kvcodecs.gsrq.layer.GSRQLayer`) hold residual-VQ
codes of the KV history, and how ``generate(cache_implementation="gsrq")`` builds one.

Its options, their defaults and their checks are :class:`~hf_kvcodecs.gsrq.config.GSRQCacheConfig`'s; the layers'
regions (exact sinks, codes, exact window) are described in :mod:`hf_kvcodecs.gsrq.layer`. Positions are recorded
once per cache (not per layer) in a shared :class:`~hf_kvcodecs.gsrq.ledger.PositionLedger`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import warnings

import torch
from transformers.cache_utils import Cache

from ..integrations.attention import attention_implementation, enable_code_attention, is_code_attention
from ..rope import model_rope_inv_freq, shared_rotary_half_table
from .config import ATTENTION_CHOICES, GSRQCacheConfig, check_option_names
from .layer import GSRQLayer
from .ledger import PositionLedger
from .loading import load_codebooks

logger = logging.getLogger(__name__)

# A left padding longer than this makes every row of the batch keep that many more exact tokens: worth a warning.
LARGE_PADDING_TOKENS = 64
# a model's RoPE frequencies may differ from the calibrated ones by a 16-bit rounding (bf16: 2^-9), not more
ROPE_FREQUENCY_TOLERANCE = 0.01

# Names other modules import from this module; their values are GSRQCacheConfig's.
DEFAULT_BITS = GSRQCacheConfig.bits
DEFAULT_WINDOW_LENGTH = GSRQCacheConfig.window_length
DEFAULT_FLUSH_INTERVAL = GSRQCacheConfig.flush_interval
DEFAULT_NUM_SINK_TOKENS = GSRQCacheConfig.num_sink_tokens
# the keyword arguments GSRQCache takes: the model config and every option
CACHE_CONFIG_KEYS = (*GSRQCacheConfig.option_names(), "config")


class GSRQCache(Cache):
    """A KV cache that stores the history as GSRQ residual-VQ codes.

    Args:
        config: the model config (optional; when given, the codebooks are checked against it and layers are built
            up front).
        codebooks, **options: the options of :class:`~hf_kvcodecs.gsrq.config.GSRQCacheConfig`, which documents
            each with its default (``bits``, ``window_length``, ``attention``, ...). ``codebooks`` is required:
            without fitted codebooks there is nothing sensible to quantize with, so this raises instead of silently
            falling back to full precision. An unknown option or a bad value raises a ``ValueError`` naming the fix.

    Use it as ``model.generate(..., cache_implementation="gsrq", cache_config={"codebooks": DIR, "bits": 2})``
    (after ``import hf_kvcodecs``) or ``model.generate(..., cache=GSRQCache(model.config, codebooks=DIR))``.
    ``GSRQCache.from_cache_config(model.config, GSRQCacheConfig(...))`` builds one from a config object.
    """

    # cache_config keys that locate the codebooks: per-call codebooks replace a compressed checkpoint's whole group
    artifact_options = GSRQCacheConfig.option_names(locates_codebooks=True)

    def __init__(self, config=None, codebooks=None, **options):
        check_option_names(options)
        if codebooks is None:
            raise ValueError(
                "GSRQCache needs fitted codebooks: pass cache_config={'codebooks': DIR} (or GSRQCache(model.config, codebooks=DIR)), "
                "where DIR was written by `hf-kvcodecs calibrate --model <model> --out DIR`. A compressed model saved by "
                "hf_kvcodecs carries its codebooks and sets this for you."
            )
        settings = GSRQCacheConfig(codebooks=codebooks, **options)
        if config is not None and not callable(getattr(config, "get_text_config", None)):
            raise ValueError(f"config must be the model's transformers config (model.config), got {type(config).__name__}.")
        self.beam_width, self.gain = settings.beam_width, settings.gain
        self.codebooks = load_codebooks(codebooks, revision=settings.codebooks_revision,
                                        subfolder=settings.codebooks_subfolder)
        if config is not None:
            self.codebooks.check_fits(config)
        elif settings.rope_inv_freq is None:
            # nothing to check codebooks of another model (layers, RoPE base) against: they would run, coding worse
            warnings.warn("GSRQCache was built without the model's config, so its codebooks are not checked against "
                          "the model; pass GSRQCache(model.config, codebooks=...) (generate(cache_implementation="
                          "'gsrq') does).", UserWarning, stacklevel=2)
        self.bits = settings.bits
        self.key_bits = self.bits if settings.key_bits is None else settings.key_bits
        self.value_bits = self.bits if settings.value_bits is None else settings.value_bits
        key_stages = self.codebooks.stages_for_bits(self.key_bits, "keys")
        value_stages = self.codebooks.stages_for_bits(self.value_bits, "values")
        self.ledger = PositionLedger()
        rope_inv_freq = self._applied_rope_frequencies(settings.rope_inv_freq)
        if self.codebooks.key_space == "pre_rope":
            self.ledger.rotary_table = shared_rotary_half_table(rope_inv_freq, self.codebooks.rope_attention_scaling)
        self.window_length = settings.window_length
        self.flush_interval = settings.flush_interval
        self.num_sink_tokens = settings.num_sink_tokens
        layer_settings = dict(
            ledger=self.ledger,
            key_space=self.codebooks.key_space,
            rope_inv_freq=rope_inv_freq,
            rope_attention_scaling=self.codebooks.rope_attention_scaling,
            window_length=settings.window_length,
            flush_interval=settings.flush_interval,
            num_sink_tokens=settings.num_sink_tokens,
            beam_width=settings.beam_width,
            gain=settings.gain,
        )
        layers = [
            GSRQLayer(k, v, **layer_settings)
            for k, v in zip(self.codebooks.codecs_at("keys", key_stages), self.codebooks.codecs_at("values", value_stages))
        ]
        super().__init__(layers=layers)
        attention = self.attention = settings.attention
        # kept to notice a model switched off the code-reading attention after this cache was built
        self.text_config = None if config is None else config.get_text_config(decoder=True)
        implementation = None if config is None else attention_implementation(config)
        if attention == "auto":
            attention = "codes" if is_code_attention(implementation) else "dequantize"
        elif attention == "codes" and config is not None and not is_code_attention(implementation):
            # the layers would hand the model's own attention placeholders instead of keys and values
            raise ValueError(
                f"attention='codes' needs the model on hf_kvcodecs' code-reading attention, but it uses "
                f"{implementation!r}: call hf_kvcodecs.enable_code_attention(model) first "
                "(generate(cache_implementation='gsrq') does), or use attention='auto'."
            )
        self.attention_path = attention
        for layer in self.layers:
            layer.attention_path = attention
        if self.layers:
            self.layers[-1].is_last_layer = True
        logger.info("GSRQCache attention path: %s", attention)

    @classmethod
    def from_cache_config(cls, config, cache_config: GSRQCacheConfig) -> GSRQCache:
        """The cache of ``cache_config`` for the model whose config is ``config`` (``None``: unchecked)."""
        return cls(config, **cache_config.to_dict())

    @classmethod
    def for_generate(cls, model, **cache_config) -> GSRQCache:
        """The cache ``generate(cache_implementation="gsrq", cache_config=...)`` builds for ``model``: the options
        are read through :class:`GSRQCacheConfig` first (an unknown or bad one raises before the model is touched);
        unless ``attention="dequantize"``, the model is then switched to the code-reading stand-in of its attention;
        the cache gets the model's text config and the RoPE frequencies the model applies (a model cast to bf16
        rounds them), not only the calibrated ones."""
        config = cache_config.pop("config") if "config" in cache_config else model.config.get_text_config(decoder=True)
        options = GSRQCacheConfig.from_dict(cache_config)
        if options.attention != "dequantize":
            enable_code_attention(model)
        if "rope_inv_freq" not in cache_config:
            options.rope_inv_freq = model_rope_inv_freq(model)
        return cls.from_cache_config(config, options)

    def _applied_rope_frequencies(self, given: torch.Tensor | None) -> torch.Tensor | None:
        """The frequencies the layers undo and re-apply RoPE with: ``given`` (checked against the calibrated ones)
        or the calibrated ones."""
        calibrated = self.codebooks.rope_inv_freq
        if given is None or calibrated is None:
            return calibrated
        if not isinstance(given, torch.Tensor) or tuple(given.shape) != tuple(calibrated.shape):
            raise ValueError(f"rope_inv_freq must be a tensor of shape {tuple(calibrated.shape)} (the model's "
                             f"rotary embedding's inv_freq), got {getattr(given, 'shape', type(given).__name__)}.")
        given = given.detach().to(device=calibrated.device, dtype=torch.float32)
        deviation = ((given - calibrated).abs() / calibrated.abs().clamp_min(1e-30)).max().item()
        if not deviation <= ROPE_FREQUENCY_TOLERANCE:
            raise ValueError(
                f"The model's RoPE frequencies differ from the codebooks' by up to {deviation:.2%} (more than a 16-bit "
                f"rounding, {ROPE_FREQUENCY_TOLERANCE:.0%}): these codebooks were calibrated for another RoPE "
                "configuration (rope_theta or rope scaling). Calibrate codebooks for this model."
            )
        return given

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"The model has more layers than the GSRQ codebooks ({len(self.layers)}); they belong to another model."
            )
        if layer_idx == 0:
            if self.attention_path == "codes" and self.text_config is not None:
                implementation = attention_implementation(self.text_config)
                if not is_code_attention(implementation):
                    # the layers would hand its attention placeholders (NaN) instead of keys and values
                    raise RuntimeError(
                        f"This GSRQCache reads codes, but the model now uses attn_implementation={implementation!r}, "
                        "which cannot: switch back with `hf_kvcodecs.enable_code_attention(model)`, or build the "
                        "cache with cache_config={'attention': 'dequantize'} (or 'auto' after the switch)."
                    )
            forward_kwargs = kwargs.get("kwargs") or {}
            held = self.layers[0].region_lengths()
            padding_before = self.ledger.leading_padding
            self.ledger.append(forward_kwargs.get("position_ids"), key_states.shape[0], key_states.shape[-2],
                               key_states.device, only_sinks_held=held["codes"] == held["window"] == 0)
            if self.ledger.leading_padding > max(padding_before, LARGE_PADDING_TOKENS) and self.num_sink_tokens:
                logger.warning(
                    "GSRQCache: this batch is left-padded by up to %d tokens, so every row keeps its first %d tokens "
                    "exact (each row's own first %d real tokens are the attention sinks). Batch prompts of similar "
                    "length to keep the cache compressed.", self.ledger.leading_padding,
                    self.ledger.leading_padding + self.num_sink_tokens, self.num_sink_tokens)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == len(self.layers) - 1 and self.attention_path == "dequantize":
            self.ledger.forget_angles()  # transient: not held between forward passes (code-reading attention
            # still needs them for this layer and releases them itself)
        return keys, values

    def __iter__(self):
        """``(keys, values, None)`` per layer, as ``DynamicCache`` yields them: every held token decoded to full
        precision (a copy made for the caller; ``None`` for a layer not filled yet)."""
        for layer in self.layers:
            keys, values = layer.dequantized_keys_and_values() if layer.is_initialized else (None, None)
            yield keys, values, None

    def __deepcopy__(self, memo):
        """A copy of the held tokens that shares the codebooks and per-layer codecs (with the tables the code-reading
        attention builds on them) with this cache, as a second cache built from the same codebooks does.
        transformers' prefix-caching recipe deep-copies a prompt's cache once per request; copying the model-level
        tables too would cost their tens of MiB per copy on the default model and rebuild them on the copy's first
        step."""
        for shared in self._model_level_state():
            memo.setdefault(id(shared), shared)
        copied = self.__class__.__new__(self.__class__)
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            setattr(copied, name, copy.deepcopy(value, memo))
        return copied

    def _model_level_state(self) -> list:
        state = [self.codebooks, self.text_config, self.ledger.rotary_table]
        for layer in self.layers:
            state += [layer.key_codec, layer.value_codec, layer.rope_inv_freq]
        return [item for item in state if item is not None]

    # The ledger follows every batch/rollback operation the layers get.
    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self.ledger.apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self.ledger.apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self.ledger.apply(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int):
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0:
            self.ledger.apply(lambda t: t[:, : max(t.shape[1] + tokens_to_remove, 0)])

    def reset(self):
        super().reset()
        self.ledger.positions = None
        self.ledger.leading_padding = 0
        self.ledger.forget_angles()

    def bits_per_element(self) -> dict[str, float]:
        """Nominal rate of the coded region (indices + scales), per element, for keys and values."""
        layer = self.layers[0]
        return {"keys": layer.key_codec.bits_per_element(), "values": layer.value_codec.bits_per_element()}


def _constructor_signature() -> inspect.Signature:
    """``GSRQCache(config=None, codebooks=None, *, bits=2.0, ...)``: the options GSRQCache takes through ``**options``,
    with GSRQCacheConfig's defaults, for help() and inspect.signature."""
    hints = {field.name: field.type for field in dataclasses.fields(GSRQCacheConfig)}
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = [inspect.Parameter("self", positional), inspect.Parameter("config", positional, default=None),
                  inspect.Parameter("codebooks", positional, default=None, annotation=hints["codebooks"])]
    parameters += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hints[name])
                   for name, default in GSRQCacheConfig.defaults().items() if name != "codebooks"]
    return inspect.Signature(parameters)


GSRQCache.__init__.__signature__ = _constructor_signature()

__all__ = ["ATTENTION_CHOICES", "CACHE_CONFIG_KEYS", "DEFAULT_BITS", "DEFAULT_FLUSH_INTERVAL", "DEFAULT_NUM_SINK_TOKENS",
           "DEFAULT_WINDOW_LENGTH", "GSRQCache", "GSRQCacheConfig", "GSRQLayer", "PositionLedger", "load_codebooks"]
