"""GSRQLayer: one decoder layer's keys and values as exact sinks, residual-VQ codes and an exact recent window.

Per layer, tokens live in three append-only regions, in order:
    sinks    the first ``num_sink_tokens`` tokens, exact (attention sinks); in a left-padded batch, as many more
             slots as the longest left padding, so that every row's first real tokens are exact
    codes    uint8 residual-VQ indices + one scale per token and head (8-bit log level, or fp16 with older
             codebooks); a token is encoded once, never again
    window   the most recent ``window_length`` .. ``window_length + flush_interval`` tokens, exact
When the window grows past ``window_length + flush_interval`` tokens, its oldest tokens are encoded and moved to the
codes, once the attention of the call that brought them is done: new tokens are always attended exact. Keys are
coded before RoPE when the codebooks say so: the layer undoes RoPE with the token's own position and re-applies it
after decoding.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..codecs.residual import TransformResidualVQ
from ..integrations.attention import CODE_LAYER_ATTRIBUTE
from ..rope import apply_rope, rotary_cos_sin, undo_rope
from .attention import gsrq_layer_attention, uses_codes
from .config import GSRQCacheConfig
from .ledger import PositionLedger

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
        beam_width: int = GSRQCacheConfig.beam_width,
        gain: str = GSRQCacheConfig.gain,
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
