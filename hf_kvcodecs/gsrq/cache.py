"""GSRQCache: a transformers ``Cache`` whose layers hold residual-VQ codes of the KV history.

Per layer, tokens live in three append-only regions, in order:
    sinks    the first ``num_sink_tokens`` tokens, exact (attention sinks); in a left-padded batch, as many more
             slots as the longest left padding, so that every row's first real tokens are exact
    codes    uint8 residual-VQ indices + one scale per token and head (8-bit log level, or fp16 with older
             codebooks); a token is encoded once, never again
    window   the most recent ``window_length`` .. ``window_length + flush_interval`` tokens, exact
When the window grows past ``window_length + flush_interval`` tokens, its oldest tokens are encoded and moved to the
codes, once the attention of the call that brought them is done: new tokens are always attended exact. Keys are
coded before RoPE when the codebooks say so: the cache undoes RoPE with the token's own position and re-applies it
after decoding. Positions are recorded once per cache (not per layer) in a shared ledger.
"""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..codecs.residual import (
    DEFAULT_BEAM_WIDTH,
    DEFAULT_GAIN,
    TransformResidualVQ,
    check_bit_rate,
    check_encoder_options,
)
from ..integrations.attention import (
    CODE_LAYER_ATTRIBUTE,
    attention_implementation,
    enable_code_attention,
    is_code_attention,
)
from ..rope import apply_rope, model_rope_inv_freq, rotary_cos_sin, shared_rotary_half_table, undo_rope
from .attention import gsrq_layer_attention, uses_codes
from .codebooks import METADATA_FILE, TENSORS_FILE, GSRQCodebooks
from .hub import resolve_codebooks

logger = logging.getLogger(__name__)

DEFAULT_BITS = 2.0
DEFAULT_WINDOW_LENGTH = 32
DEFAULT_FLUSH_INTERVAL = 32
DEFAULT_NUM_SINK_TOKENS = 4
# A left padding longer than this makes every row of the batch keep that many more exact tokens: worth a warning.
LARGE_PADDING_TOKENS = 64
CACHE_CONFIG_KEYS = (
    "codebooks", "codebooks_revision", "codebooks_subfolder", "bits", "key_bits", "value_bits", "window_length",
    "flush_interval", "num_sink_tokens", "attention", "beam_width", "gain", "config", "rope_inv_freq",
)
ATTENTION_CHOICES = ("auto", "codes", "dequantize")
# a model's RoPE frequencies may differ from the calibrated ones by a 16-bit rounding (bf16: 2^-9), not more
ROPE_FREQUENCY_TOLERANCE = 0.01


class PositionLedger:
    """Positions ``[B, T]`` (int32) of every token the cache holds, shared by all layers of one cache."""

    def __init__(self):
        self.positions: torch.Tensor | None = None
        self.leading_padding = 0  # the longest left padding of the first call's rows (see _left_padding)
        self._angles = None  # ((start, end), (cos, sin)) shared by the layers during one forward pass
        self._halves = None  # the same for rotary_halves
        self.rotary_table = None  # a RotaryHalfTable, set by GSRQCache where keys are coded before RoPE

    def append(self, position_ids: torch.Tensor | None, batch_size: int, new_tokens: int, device, *,
               only_sinks_held: bool = False) -> None:
        """Record the positions of ``new_tokens`` new tokens. While the layers hold nothing but sinks
        (``only_sinks_held``: no token coded or in the window yet), the left padding is re-read from every position
        recorded, so a prompt prefilled in chunks is measured whole; after that it is fixed, since growing the sink
        region then would put tokens out of order."""
        if position_ids is None:
            start = 0 if self.positions is None else self.positions.shape[1]
            position_ids = torch.arange(start, start + new_tokens, device=device)[None]
        position_ids = position_ids.to(device=device, dtype=torch.int32)
        if position_ids.ndim == 1:
            position_ids = position_ids[None]
        if position_ids.shape[-1] != new_tokens:
            raise ValueError(f"position_ids cover {position_ids.shape[-1]} tokens but {new_tokens} new tokens arrived.")
        position_ids = position_ids.expand(batch_size, new_tokens)
        self.positions = position_ids.clone() if self.positions is None else torch.cat([self.positions, position_ids], dim=1)
        if only_sinks_held:
            self.leading_padding = _left_padding(self.positions)
        self.forget_angles()

    def apply(self, fn) -> None:
        if self.positions is not None:
            self.positions = fn(self.positions)
        self.forget_angles()

    def rotary_angles(self, start: int, end: int, inv_freq: torch.Tensor, attention_scaling: float):
        """cos/sin for the tokens in slots ``[start, end)``; every layer asks for the same range in one forward
        pass, so the result is kept until :meth:`forget_angles` (called once the last layer is done)."""
        return self._kept("_angles", start, end,
                          lambda positions: rotary_cos_sin(positions, inv_freq, attention_scaling))

    def rotary_halves(self, start: int, end: int):
        """:meth:`rotary_angles` as the compiled CPU loops take them: ``[B, T, D/2]`` (one half of each row), from
        the shared :class:`RotaryHalfTable` (views of it where the positions are consecutive)."""
        if self.rotary_table is None:
            raise RuntimeError("GSRQCache has no rotary table: its keys are not coded before RoPE.")
        return self._kept("_halves", start, end, self.rotary_table.halves)

    def _kept(self, slot: str, start: int, end: int, compute):
        """``compute(positions of slots [start, end))``, kept in ``slot`` for the rest of the forward pass."""
        if self.positions is None or self.positions.shape[1] < end:
            raise RuntimeError("GSRQCache position ledger is behind its layers; update layers through "
                               "GSRQCache.update.")
        held = getattr(self, slot)
        if held is None or held[0] != (start, end):
            held = ((start, end), compute(self.positions[:, start:end]))
            setattr(self, slot, held)
        return held[1]

    def forget_angles(self) -> None:
        self._angles = self._halves = None


def _left_padding(positions: torch.Tensor) -> int:
    """The longest left padding over the rows of a first call's ``positions`` ``[B, T]``.

    generate() gives a left-padded row's pad tokens position 0 (or 1, in older transformers) and numbers its real tokens
    0, 1, 2, ...: the real tokens are the row's last run of consecutive positions, and that run holds the row's largest
    position. A row whose last run does not (right padding) or that is one run (no padding) counts as unpadded.
    Conventions this cannot tell apart: pads numbered one below the first real token (e.g. -1) count one pad too
    few; a single real token after pads at position 1, or before right padding, is misread.
    """
    if positions.shape[-1] < 2 or positions.device.type == "meta":  # (meta: refused with a clear error by the layers)
        return 0
    steps = positions[:, 1:] - positions[:, :-1]
    breaks = torch.arange(1, positions.shape[-1], device=positions.device).expand_as(steps) * (steps != 1)
    run_starts = breaks.amax(dim=-1)  # 0 when the whole row is one run
    holds_max = positions[:, -1] == positions.amax(dim=-1)  # (the last run's largest position is its last)
    return int(torch.where(holds_max, run_starts, torch.zeros_like(run_starts)).max())


_NAN_ELEMENTS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _nan_element(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One NaN ``[1, 1, 1, 1]`` per dtype and device, which every layer's placeholders view (one allocation per
    process instead of two per layer and decode step; not held by any cache)."""
    key = (dtype, torch.device(device))
    if key not in _NAN_ELEMENTS:
        with torch.inference_mode(False):  # a normal tensor: views of it also serve passes outside inference mode
            _NAN_ELEMENTS[key] = torch.full((1, 1, 1, 1), float("nan"), dtype=dtype, device=device)
    return _NAN_ELEMENTS[key]


def _check_finite(states: torch.Tensor, name: str) -> None:
    """Codes for NaN or infinite vectors would index real codewords: finite garbage the model could not notice."""
    finite = torch.isfinite(states)
    if not bool(finite.all()):
        raise ValueError(
            f"GSRQCache cannot code non-finite {name}: {int(finite.numel() - finite.sum())} of {finite.numel()} "
            f"elements about to be coded are NaN or infinite. The model's activations overflowed (common in float16): "
            "run the model in bfloat16 or float32."
        )


class GSRQLayer(CacheLayerMixin):
    """One decoder layer's GSRQ-coded keys and values."""

    is_croppable = True
    is_sliding = False

    def __init__(
        self,
        key_codec: TransformResidualVQ,
        value_codec: TransformResidualVQ,
        *,
        ledger: PositionLedger,
        key_space: str,
        rope_inv_freq: torch.Tensor | None,
        rope_attention_scaling: float,
        window_length: int,
        flush_interval: int,
        num_sink_tokens: int,
        beam_width: int = DEFAULT_BEAM_WIDTH,
        gain: str = DEFAULT_GAIN,
    ):
        super().__init__()
        self.beam_width, self.gain = beam_width, gain
        self.key_codec, self.value_codec = key_codec, value_codec
        self.ledger = ledger
        self.key_space = key_space
        self.rope_inv_freq, self.rope_attention_scaling = rope_inv_freq, rope_attention_scaling
        self.window_length, self.flush_interval, self.num_sink_tokens = window_length, flush_interval, num_sink_tokens
        self.attention_path = "dequantize"  # or "codes": set by GSRQCache
        self.last_attention = None  # in code-reading mode, how the last call attended: "codes" or "dequantize"
        self.is_last_layer = False  # the last layer's attention releases the step's rotary tables (set by GSRQCache)
        self._awaiting_attention = False
        self._clear()

    def mark_attended(self) -> None:
        """Called by the code-reading attention function when it has consumed this layer's state."""
        self._awaiting_attention = False

    def finish_attention(self) -> None:
        """Called after this layer's code-reading attention: the tokens it attended exact beyond the window are
        encoded now, and the last layer releases the step's rotary tables."""
        self._flush_overflow()
        if self.is_last_layer:
            self.ledger.forget_angles()

    def code_attention(self, query, attention_mask, scaling: float, attend_decoded, *, output_attentions=False):
        """The code-reading attention function's call for this layer (``integrations.attention``): decode-sized
        query blocks read the codes; prefill-sized blocks, calls that want attention weights and calls that need
        gradients attend over the decoded tokens with the model's own attention (the op returns no weights and has
        no autograd formula, and a prefill's tokens were just computed in full precision anyway)."""
        self.mark_attended()
        try:
            if not uses_codes(self, query) or output_attentions or (torch.is_grad_enabled() and query.requires_grad):
                self.last_attention = "dequantize"
                return attend_decoded(*self.dequantized_keys_and_values())
            self.last_attention = "codes"
            output = gsrq_layer_attention(self, query, attention_mask, scaling)
            return output.transpose(1, 2).contiguous(), None
        finally:
            self.finish_attention()

    def dequantized_keys_and_values(self):
        """Every held token, decoded, in order (the dequantize path's keys and values)."""
        return self._full_keys_and_values()

    def _clear(self):
        self.sink_keys = self.sink_values = None
        self.key_codes = self.key_scales = self.value_codes = self.value_scales = None
        self.window_keys = self.window_values = None

    # ---- CacheLayerMixin surface ----------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.device.type == "meta":
            raise ValueError("GSRQCache codes real key and value vectors: a model on the 'meta' device has none. Load "
                             "the weights (e.g. model.to_empty(...) and load a state dict) before generating.")
        self.device, self.dtype = key_states.device, key_states.dtype
        if key_states.shape[1] != self.key_codec.num_heads or key_states.shape[-1] != self.key_codec.head_dim:
            raise ValueError(
                f"GSRQ codebooks expect {self.key_codec.num_heads} KV heads of size {self.key_codec.head_dim}, but the "
                f"model produced keys of shape {tuple(key_states.shape)}. The codebooks belong to another model: "
                "calibrate for this one with `hf-kvcodecs calibrate`."
            )
        if key_states.device != self.key_codec.mean.device:
            self.key_codec = self.key_codec.to(key_states.device)
            self.value_codec = self.value_codec.to(key_states.device)
        batch, heads, _, dim = key_states.shape
        empty = lambda d, dt: torch.zeros(batch, heads, 0, *d, dtype=dt, device=self.device)  # noqa: E731
        self.sink_keys, self.sink_values = empty((dim,), self.dtype), empty((dim,), self.dtype)
        self.window_keys, self.window_values = empty((dim,), self.dtype), empty((dim,), self.dtype)
        # codes: [B, code_heads, T, S]; code_heads is 1 for joint-head codecs (one code per token for all heads)
        code_rows = lambda codec: torch.zeros(batch, codec.code_heads, 0, codec.num_stages, dtype=torch.uint8,  # noqa: E731
                                              device=self.device)
        self.key_codes, self.value_codes = code_rows(self.key_codec), code_rows(self.value_codec)
        self.key_scales = empty((), self.key_codec.scale_dtype)
        self.value_scales = empty((), self.value_codec.scale_dtype)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.dtype != self.dtype:
            raise ValueError(f"GSRQCache was filled with {self.dtype} states and now received {key_states.dtype}.")
        # a left-padded batch keeps its pad tokens (masked out) in extra slots, so each row's first real tokens are exact
        sink_slots = self.num_sink_tokens + self.ledger.leading_padding if self.num_sink_tokens else 0
        free_sinks = sink_slots - self.sink_keys.shape[-2]
        if free_sinks > 0:
            self.sink_keys = torch.cat([self.sink_keys, key_states[..., :free_sinks, :]], dim=-2)
            self.sink_values = torch.cat([self.sink_values, value_states[..., :free_sinks, :]], dim=-2)
            key_states, value_states = key_states[..., free_sinks:, :], value_states[..., free_sinks:, :]
        self.window_keys = torch.cat([self.window_keys, key_states], dim=-2)
        self.window_values = torch.cat([self.window_values, value_states], dim=-2)
        # The tokens of this call are attended exact and encoded only afterwards (as transformers' QuantizedCache
        # and KIVI do): encoding them first would make a long prefill attend to its own coding error, and the
        # error would compound through the layers into every key and value stored above (3x the relative MSE
        # by layer 17 on the default model).
        if self.attention_path == "codes":
            return self._code_placeholders(key_states)  # the attention function calls finish_attention
        keys, values = self._full_keys_and_values()
        self._flush_overflow()
        return keys, values

    def _flush_overflow(self) -> None:
        if self.is_initialized and self.window_keys.shape[-2] > self.window_length + self.flush_interval:
            self._flush(self.window_keys.shape[-2] - self.window_length)

    def _code_placeholders(self, key_states):
        """Full-length NaN views (no memory) that carry this layer to the code-reading attention function.

        Any other attention function would turn them into NaNs rather than silently attend to the wrong tensors, and
        the next update raises if the previous placeholders were not consumed by the code-reading function.
        """
        if self._awaiting_attention:
            raise RuntimeError(
                "GSRQCache is in code-reading mode (attention='codes') but the model's attention function did not read "
                "the codes. Call `hf_kvcodecs.enable_code_attention(model)` before generating, or use "
                "cache_config={'attention': 'auto'} (or 'dequantize')."
            )
        self._awaiting_attention = True
        batch, heads, _, dim = key_states.shape
        shape = (batch, heads, self.get_seq_length(), dim)
        nan = _nan_element(self.dtype, self.device)
        keys, values = nan.expand(shape), nan.expand(shape)
        setattr(keys, CODE_LAYER_ATTRIBUTE, self)
        return keys, values

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.sink_keys.shape[-2] + self.key_codes.shape[-2] + self.window_keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # ---- coding ---------------------------------------------------------------------------------------------
    def _flush(self, count: int) -> None:
        keys, values = self.window_keys[..., :count, :], self.window_values[..., :count, :]
        _check_finite(keys, "keys")  # before anything changes: the cache stays as it was
        _check_finite(values, "values")
        # Copies, not views: a view would keep the whole pre-flush window (full precision) alive.
        self.window_keys = self.window_keys[..., count:, :].clone()
        self.window_values = self.window_values[..., count:, :].clone()
        if self.key_space == "pre_rope":
            start = self.sink_keys.shape[-2] + self.key_codes.shape[-2]
            # Not through the ledger's per-step memo: that holds the coded region's angles for the attention of
            # the other layers, which this range would evict.
            cos, sin = rotary_cos_sin(self.ledger.positions[:, start : start + count], self.rope_inv_freq,
                                      self.rope_attention_scaling)
            keys = undo_rope(keys.float(), cos, sin, self.rope_attention_scaling)
        key_codes, key_scales = self._encode(self.key_codec, keys)
        # values coded given the keys are predicted from the keys as the decoder will see them
        decoded_keys = self._decode(self.key_codec, key_codes, key_scales) if self._values_need_keys else None
        value_codes, value_scales = self._encode(self.value_codec, values, decoded_keys)
        self.key_codes = torch.cat([self.key_codes, key_codes], dim=-2)
        self.key_scales = torch.cat([self.key_scales, key_scales], dim=-1)
        self.value_codes = torch.cat([self.value_codes, value_codes], dim=-2)
        self.value_scales = torch.cat([self.value_scales, value_scales], dim=-1)

    def _cos_sin(self, start: int, end: int):
        return self.ledger.rotary_angles(start, end, self.rope_inv_freq, self.rope_attention_scaling)

    def _cos_sin_halves(self, start: int, end: int):
        return self.ledger.rotary_halves(start, end)

    @property
    def _values_need_keys(self) -> bool:
        return self.value_codec.needs_keys

    @staticmethod
    def _heads_first(states: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [H, B*T, D]
        batch, heads, tokens, dim = states.shape
        # (detached: codes are integers, no gradient reaches them through the encoder)
        return states.detach().float().permute(1, 0, 2, 3).reshape(heads, batch * tokens, dim)

    def _encode(self, codec: TransformResidualVQ, states: torch.Tensor, decoded_keys: torch.Tensor | None = None):
        batch, heads, tokens, dim = states.shape
        flat = self._heads_first(states)
        if decoded_keys is None:
            codes, scales = codec.encode(flat, gain=self.gain, beam_width=self.beam_width)
        else:
            codes, scales = codec.encode(flat, self._heads_first(decoded_keys), gain=self.gain,
                                         beam_width=self.beam_width)
        codes = codes.reshape(codes.shape[0], batch, tokens, -1).permute(1, 0, 2, 3).contiguous()
        scales = scales.reshape(heads, batch, tokens).permute(1, 0, 2).contiguous()
        return codes, scales

    @classmethod
    def _decode(cls, codec: TransformResidualVQ, codes: torch.Tensor, scales: torch.Tensor,
                decoded_keys: torch.Tensor | None = None) -> torch.Tensor:
        batch, code_heads, tokens, stages = codes.shape
        heads = scales.shape[1]
        flat_codes = codes.permute(1, 0, 2, 3).reshape(code_heads, batch * tokens, stages)
        flat_scales = scales.permute(1, 0, 2).reshape(heads, batch * tokens)
        if decoded_keys is None:
            decoded = codec.decode(flat_codes, flat_scales)
        else:
            decoded = codec.decode(flat_codes, flat_scales, cls._heads_first(decoded_keys))
        return decoded.reshape(heads, batch, tokens, codec.head_dim).permute(1, 0, 2, 3)

    def _coded_keys(self) -> torch.Tensor:
        """The coded tokens' keys decoded in the space they were coded in (before RoPE when the codebooks say so)."""
        return self._decode(self.key_codec, self.key_codes, self.key_scales)

    def _with_rope(self, keys: torch.Tensor) -> torch.Tensor:
        if self.key_space == "pre_rope" and keys.shape[-2]:
            start = self.sink_keys.shape[-2]
            keys = apply_rope(keys, *self._cos_sin(start, start + keys.shape[-2]))
        return keys.to(self.dtype)

    def dequantized_keys(self) -> torch.Tensor:
        return self._with_rope(self._coded_keys())

    def dequantized_values(self, coded_keys: torch.Tensor | None = None) -> torch.Tensor:
        """``coded_keys``: :meth:`_coded_keys` when already decoded (values coded given the keys need them)."""
        if self._values_need_keys and coded_keys is None:
            coded_keys = self._coded_keys()
        return self._decode(self.value_codec, self.value_codes, self.value_scales,
                            coded_keys if self._values_need_keys else None).to(self.dtype)

    def _full_keys_and_values(self):
        coded_keys = self._coded_keys()
        keys = torch.cat([self.sink_keys, self._with_rope(coded_keys), self.window_keys], dim=-2)
        values = torch.cat([self.sink_values, self.dequantized_values(coded_keys), self.window_values], dim=-2)
        return keys, values

    # ---- batch / rollback operations --------------------------------------------------------------------------
    _TOKEN_TENSORS = ("sink_keys", "sink_values", "key_codes", "value_codes", "window_keys", "window_values")
    _SCALE_TENSORS = ("key_scales", "value_scales")

    def _apply_batchwise(self, fn) -> None:
        if self.is_initialized:
            for name in self._TOKEN_TENSORS + self._SCALE_TENSORS:
                setattr(self, name, fn(getattr(self, name)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply_batchwise(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply_batchwise(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply_batchwise(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (codes are per token, so this is exact in every region)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop expects a negative number of tokens to remove, got {tokens_to_remove}.")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = max(self.get_seq_length() + tokens_to_remove, 0)
        sinks, codes = self.sink_keys.shape[-2], self.key_codes.shape[-2]
        keep_sinks = min(keep, sinks)
        keep_codes = min(max(keep - sinks, 0), codes)
        keep_window = max(keep - sinks - codes, 0)
        self.sink_keys, self.sink_values = self.sink_keys[..., :keep_sinks, :], self.sink_values[..., :keep_sinks, :]
        self.key_codes, self.value_codes = self.key_codes[..., :keep_codes, :], self.value_codes[..., :keep_codes, :]
        self.key_scales, self.value_scales = self.key_scales[..., :keep_codes], self.value_scales[..., :keep_codes]
        self.window_keys = self.window_keys[..., :keep_window, :].clone()  # release the cropped tokens' memory
        self.window_values = self.window_values[..., :keep_window, :].clone()

    def reset(self) -> None:
        self._awaiting_attention = False
        self._clear()
        self.is_initialized = False

    def offload(self) -> None:
        self._apply_batchwise(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized and self.key_codes.device != self.device:
            self._apply_batchwise(lambda t: t.to(self.device, non_blocking=True))

    # ---- introspection --------------------------------------------------------------------------------------
    def region_lengths(self) -> dict[str, int]:
        if not self.is_initialized:
            return {"sinks": 0, "codes": 0, "window": 0}
        return {"sinks": self.sink_keys.shape[-2], "codes": self.key_codes.shape[-2], "window": self.window_keys.shape[-2]}


_CODEBOOK_MEMO: dict[tuple[str, float], GSRQCodebooks] = {}


def load_codebooks(source, *, revision: str | None = None, subfolder: str | None = None) -> GSRQCodebooks:
    """A ``GSRQCodebooks`` object, a directory path or a Hub repo id (memoized on the local path and its
    modification time; a Hub download is a local path in the Hub cache, one per commit)."""
    if isinstance(source, GSRQCodebooks):
        if revision is not None or subfolder is not None:
            raise ValueError("codebooks_revision / codebooks_subfolder only apply to a Hub repo id or a directory, "
                             "not to a GSRQCodebooks object.")
        return source
    if isinstance(source, (str, Path)):
        path = resolve_codebooks(source, revision=revision, subfolder=subfolder).resolve()
        # a directory without the files gets GSRQCodebooks.load's error, which says how to create them
        stamp = max(((path / f).stat().st_mtime for f in (METADATA_FILE, TENSORS_FILE) if (path / f).exists()),
                    default=0.0)
        key = (str(path), stamp)
        if key not in _CODEBOOK_MEMO:
            # loaded as normal tensors even inside torch.inference_mode(): the memo outlives the block, and inference
            # tensors would break a later forward pass that records gradients
            with torch.inference_mode(False):
                _CODEBOOK_MEMO[key] = GSRQCodebooks.load(path)
        return _CODEBOOK_MEMO[key]
    raise TypeError(f"codebooks must be a GSRQCodebooks object, a directory path or a Hub repo id, got "
                    f"{type(source).__name__}.")


class GSRQCache(Cache):
    """A KV cache that stores the history as GSRQ residual-VQ codes.

    Args:
        config: the model config (optional; when given, the codebooks are checked against it and layers are built
            up front).
        codebooks: a directory written by ``hf-kvcodecs calibrate`` / ``calibrate_gsrq``, the id of a Hub repo
            holding one (``hf-kvcodecs push-codebooks``), or a ``GSRQCodebooks``. Required: without fitted codebooks
            there is nothing sensible to quantize with, so this raises instead of silently falling back to full
            precision.
        codebooks_revision, codebooks_subfolder: for a Hub repo id, the branch, tag or commit to read and the folder
            inside the repo (``"kv_codebooks"`` reads the codebooks of a model saved by hf_kvcodecs).
        bits: bits per KV element including the per-vector scale (index bits + 8/head_dim, or 16/head_dim with
            fp16-scale codebooks); default 2.0. It must be a rate the codebooks serve exactly: the lowest (one
            residual stage, e.g. 0.25 for keys of head size 64) plus whole stages (0.125 each there), up to the rate
            they were calibrated for; another rate (0.3) is refused with the nearest ones, not served at a lower one.
        key_bits, value_bits: per-tensor overrides of ``bits``.
        window_length: recent tokens kept exact (plus up to ``flush_interval`` more between flushes).
        flush_interval: how many tokens accumulate beyond the window before they are encoded together.
        num_sink_tokens: first tokens kept exact (attention sinks). In a left-padded batch (``generate`` with an
            ``attention_mask``) the count starts at each row's first real token: the sink region grows by the longest
            left padding, whose slots hold pad tokens in the padded rows and real tokens in the others.
        attention: how attention reads the coded history. ``"codes"``: the code-reading attention
            (``hf_kvcodecs::coded_attention``: Triton on CUDA, PyTorch reference on CPU), which never builds a
            full-precision copy; needs the model on a code-reading attention implementation
            (``hf_kvcodecs.enable_code_attention(model)``, done for you by ``generate(cache_implementation="gsrq")``).
            ``"dequantize"``: decode the history and hand it to the model's own attention. ``"auto"`` (default):
            ``"codes"`` when ``config`` says the model uses a code-reading attention implementation, else
            ``"dequantize"``. The choice is in ``cache.attention_path``.
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

    Use it as ``model.generate(..., cache_implementation="gsrq", cache_config={"codebooks": DIR, "bits": 2})``
    (after ``import hf_kvcodecs``) or ``model.generate(..., cache=GSRQCache(model.config, codebooks=DIR))``.
    """

    # cache_config keys that locate the codebooks: per-call codebooks replace a compressed checkpoint's whole group
    artifact_options = ("codebooks", "codebooks_revision", "codebooks_subfolder")

    def __init__(self, config=None, codebooks=None, bits: float | None = None, key_bits: float | None = None,
                 value_bits: float | None = None, window_length: int = DEFAULT_WINDOW_LENGTH,
                 flush_interval: int = DEFAULT_FLUSH_INTERVAL, num_sink_tokens: int = DEFAULT_NUM_SINK_TOKENS,
                 attention: str = "auto", beam_width: int = DEFAULT_BEAM_WIDTH, gain: str = DEFAULT_GAIN,
                 codebooks_revision: str | None = None, codebooks_subfolder: str | None = None,
                 rope_inv_freq: torch.Tensor | None = None, **unknown):
        if unknown:
            raise ValueError(
                f"Unknown GSRQCache option(s) {sorted(unknown)}; valid cache_config keys are {list(CACHE_CONFIG_KEYS)}."
            )
        if codebooks is None:
            raise ValueError(
                "GSRQCache needs fitted codebooks: pass cache_config={'codebooks': DIR} (or GSRQCache(model.config, codebooks=DIR)), "
                "where DIR was written by `hf-kvcodecs calibrate --model <model> --out DIR`. A compressed model saved by "
                "hf_kvcodecs carries its codebooks and sets this for you."
            )
        for name, value in (("window_length", window_length), ("flush_interval", flush_interval), ("num_sink_tokens", num_sink_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")
        if config is not None and not callable(getattr(config, "get_text_config", None)):
            raise ValueError(f"config must be the model's transformers config (model.config), got {type(config).__name__}.")
        if flush_interval < 1:
            raise ValueError("flush_interval must be at least 1.")
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}.")
        check_encoder_options(gain, beam_width)
        self.beam_width, self.gain = beam_width, gain
        self.codebooks = load_codebooks(codebooks, revision=codebooks_revision, subfolder=codebooks_subfolder)
        if config is not None:
            self.codebooks.check_fits(config)
        elif rope_inv_freq is None:
            # nothing to check codebooks of another model (layers, RoPE base) against: they would run, coding worse
            warnings.warn("GSRQCache was built without the model's config, so its codebooks are not checked against "
                          "the model; pass GSRQCache(model.config, codebooks=...) (generate(cache_implementation="
                          "'gsrq') does).", UserWarning, stacklevel=2)
        self.bits = DEFAULT_BITS if bits is None else check_bit_rate("bits", bits)
        self.key_bits = self.bits if key_bits is None else check_bit_rate("key_bits", key_bits)
        self.value_bits = self.bits if value_bits is None else check_bit_rate("value_bits", value_bits)
        key_stages = self.codebooks.stages_for_bits(self.key_bits, "keys")
        value_stages = self.codebooks.stages_for_bits(self.value_bits, "values")
        self.ledger = PositionLedger()
        rope_inv_freq = self._applied_rope_frequencies(rope_inv_freq)
        if self.codebooks.key_space == "pre_rope":
            self.ledger.rotary_table = shared_rotary_half_table(rope_inv_freq, self.codebooks.rope_attention_scaling)
        self.window_length, self.flush_interval, self.num_sink_tokens = window_length, flush_interval, num_sink_tokens
        layer_settings = dict(
            ledger=self.ledger,
            key_space=self.codebooks.key_space,
            rope_inv_freq=rope_inv_freq,
            rope_attention_scaling=self.codebooks.rope_attention_scaling,
            window_length=window_length,
            flush_interval=flush_interval,
            num_sink_tokens=num_sink_tokens,
            beam_width=beam_width,
            gain=gain,
        )
        layers = [
            GSRQLayer(k, v, **layer_settings)
            for k, v in zip(self.codebooks.codecs_at("keys", key_stages), self.codebooks.codecs_at("values", value_stages))
        ]
        super().__init__(layers=layers)
        self.attention = attention
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
    def for_generate(cls, model, **cache_config) -> GSRQCache:
        """The cache ``generate(cache_implementation="gsrq", cache_config=...)`` builds for ``model``: unless
        ``attention="dequantize"``, the model is first switched to the code-reading stand-in of its attention; the
        cache gets the model's text config and the RoPE frequencies the model applies (a model cast to bf16 rounds
        them), not only the calibrated ones."""
        if cache_config.get("attention", "auto") != "dequantize":
            enable_code_attention(model)
        cache_config.setdefault("config", model.config.get_text_config(decoder=True))
        cache_config.setdefault("rope_inv_freq", model_rope_inv_freq(model))
        return cls(**cache_config)

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
        """A copy of the held tokens that shares the codebooks and per-layer codecs (with the decode tables built on
        them) with this cache, as a second cache built from the same codebooks does. transformers' prefix-caching
        recipe deep-copies a prompt's cache once per request; copying the model-level tables too would cost their
        100+ MiB per copy on the default model and rebuild them on the copy's first step."""
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
