"""TurboQuantCache: a transformers ``Cache`` holding calibration-free TurboQuant-style codes of the KV history.

The residual-window pattern of transformers' ``QuantizedCache``: the most recent ``residual_length`` tokens of each
layer stay in full precision, older ones are stored as codes (:mod:`hf_kvcodecs.codecs.turboquant`: random rotation
per KV head, per-vector float16 norm, Gaussian Lloyd-Max codes) and dequantized for attention at every step. Unlike
``QuantizedCache``, which re-quantizes the whole dequantized history each time its window fills, a token is coded
once, when it leaves the window: the codes are per vector, so appending is exact and no error compounds. Every forward
call attends its own new tokens at full precision.

Optional protection of the first and last layers: ``protected_layers=n`` keeps the first ``n`` and the last ``n``
layers as plain full-precision ``DynamicLayer`` s.

    >>> cache = TurboQuantCache(model.config, bits=3, residual_length=128)
    >>> model.generate(**inputs, cache=cache, max_new_tokens=64)
"""

from __future__ import annotations

import warnings

import torch
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs

from ..codecs.turboquant import TurboQuantCodec, TurboQuantCodes, TurboQuantRotations, check_bits
from ..models import model_fingerprint

DEFAULT_BITS = 4
DEFAULT_RESIDUAL_LENGTH = 128  # as transformers' QuantizedCache


class TurboQuantLayer(DynamicLayer):
    """One layer: ``keys`` / ``values`` hold the full-precision window, ``coded_keys`` / ``coded_values`` the codes of
    every older token (``None`` until one leaves the window)."""

    is_croppable = False

    def __init__(self, codec: TurboQuantCodec, rotations: TurboQuantRotations, layer_idx: int, residual_length: int):
        super().__init__()
        self.codec, self.rotations = codec, rotations
        self.layer_idx, self.residual_length = layer_idx, residual_length
        self.cumulative_length = 0
        self.coded_keys: TurboQuantCodes | None = None
        self.coded_values: TurboQuantCodes | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        window_keys = torch.cat([self.keys, key_states], dim=-2)
        window_values = torch.cat([self.values, value_states], dim=-2)
        if self.coded_keys is None:
            keys, values = window_keys, window_values
        else:
            rotation = self.rotations.layer(self.layer_idx, key_states.device)
            keys = torch.cat([self.codec.decode(self.coded_keys, rotation, key_states.dtype), window_keys], dim=-2)
            values = torch.cat([self.codec.decode(self.coded_values, rotation, value_states.dtype), window_values],
                               dim=-2)
        overflow = window_keys.shape[-2] - self.residual_length
        if overflow > 0:
            rotation = self.rotations.layer(self.layer_idx, key_states.device)
            self.coded_keys = self._append(self.coded_keys, self.codec.encode(window_keys[..., :overflow, :], rotation))
            self.coded_values = self._append(self.coded_values,
                                             self.codec.encode(window_values[..., :overflow, :], rotation))
            # copies: a view would keep the whole concatenated window alive
            window_keys = window_keys[..., overflow:, :].clone()
            window_values = window_values[..., overflow:, :].clone()
        self.keys, self.values = window_keys, window_values
        return keys, values

    @staticmethod
    def _append(held: TurboQuantCodes | None, new: TurboQuantCodes) -> TurboQuantCodes:
        if held is None:
            return new
        return TurboQuantCodes(torch.cat([held.codes, new.codes], dim=-2), torch.cat([held.norms, new.norms], dim=-1))

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.coded_keys = self.coded_values = None

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("TurboQuantCache cannot crop its coded history; use a DynamicCache for assisted decoding.")

    def _apply_batchwise(self, fn) -> None:
        if self.is_initialized and self.keys.numel():
            self.keys, self.values = fn(self.keys), fn(self.values)
        for name in ("coded_keys", "coded_values"):
            coded = getattr(self, name)
            if coded is not None:
                setattr(self, name, TurboQuantCodes(fn(coded.codes), fn(coded.norms)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply_batchwise(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply_batchwise(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply_batchwise(lambda tensor: tensor[indices, ...])


class TurboQuantCache(Cache):
    """KV cache coded TurboQuant-style (random rotation + Gaussian Lloyd-Max scalar codes), with no calibration.

    Args:
        config: the model's config (a decoder with full attention in every layer).
        bits: bits per rotated coordinate: 1, 2, 3 or 4, or 1.5, 2.5, 3.5 (half the coordinates at one bit more).
            Each coded vector also holds a 16-bit norm: 4 bits on 128-dim heads hold 4.125 bits per element.
        residual_length: how many of the most recent tokens each layer keeps at full precision.
        protected_layers: the first and the last ``protected_layers`` layers are kept at full precision.
        seed: seed of the rotations (default 0); not with ``rotations``, which carry their own.
        rotations: a :class:`TurboQuantRotations` shared with other caches of the same model, so that its tables are
            held once; by default the cache builds its own, which then count as memory it holds.
    """

    def __init__(self, config, bits: float = DEFAULT_BITS, residual_length: int = DEFAULT_RESIDUAL_LENGTH,
                 protected_layers: int = 0, seed: int | None = None, rotations: TurboQuantRotations | None = None):
        bits = check_bits(bits)
        for name, value in (("residual_length", residual_length), ("protected_layers", protected_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r}: pass a non-negative integer number of "
                                 f"{'tokens' if name == 'residual_length' else 'layers'} (0 for none).")
        text_config = config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(text_config)
        other = sorted(set(layer_types) - {"full_attention"})
        if other:
            raise ValueError(f"TurboQuantCache supports models whose every layer has full attention; this one also "
                             f"has {other} layers. Use a DynamicCache for it.")
        shape = model_fingerprint(config)
        heads, dim, num_layers = shape["num_key_value_heads"], shape["head_dim"], shape["num_hidden_layers"]
        if rotations is None:
            rotations = TurboQuantRotations(heads, dim, 0 if seed is None else seed)
        elif seed is not None and seed != rotations.seed:
            raise ValueError(f"seed={seed} differs from the given rotations' seed {rotations.seed}: pass one of them.")
        elif (rotations.heads, rotations.dim) != (heads, dim):
            raise ValueError(f"the given rotations are for {rotations.heads} heads of {rotations.dim} dims; this model "
                             f"has {heads} KV heads of {dim} dims.")
        if 2 * protected_layers >= num_layers:
            # warnings, not logging: a factory that makes one cache per sequence would repeat the message endlessly
            warnings.warn(f"protected_layers={protected_layers} keeps all {num_layers} layers at full precision: "
                          "nothing is coded.", stacklevel=2)
        codec = TurboQuantCodec(bits, dim)
        self.bits, self.residual_length, self.protected_layers = bits, residual_length, protected_layers
        self.rotations = rotations
        super().__init__(layers=[
            DynamicLayer() if self.is_protected(index, num_layers) else
            TurboQuantLayer(codec, rotations, index, residual_length)
            for index in range(num_layers)
        ])

    def is_protected(self, layer_idx: int, num_layers: int | None = None) -> bool:
        """Whether layer ``layer_idx`` is kept at full precision."""
        num_layers = len(self.layers) if num_layers is None else num_layers
        return layer_idx < self.protected_layers or layer_idx >= num_layers - self.protected_layers
