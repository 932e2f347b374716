"""What every KV codec layout offers, so that a layout is one class and the cache, the file format and the attention
glue never dispatch on its name.

A layout says how one layer's keys or values are cut into codes: one code per head vector with codebooks shared by
the heads (``per_head``), one code per token for all its heads (``joint_heads``), each head with its own codebooks
(``per_head_codebooks``), each head predicted from the heads decoded before it (``conditional_heads``), or values
predicted from the same token's decoded keys (``given_keys``). Each is a :class:`KVCodec` subclass; the registry of
them is :mod:`.layouts`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import ClassVar

import torch

from .scales import FP16_SCALE_BITS, LOG_SCALE_BITS, cached_scale_levels, stored_scale_values


class KVCodec(abc.ABC):
    """Base of the codec layouts: their class-level facts and the sizes that follow from a few per-instance ones.

    A subclass provides ``num_heads``, ``head_dim``, ``num_stages``, ``group_dim``, ``codebook_bits`` and
    ``log_scale_range`` (``[H, 2]`` log2 range of 8-bit scales, or None for fp16 scales), and the methods
    ``encode`` / ``decode`` / ``reconstruct`` (codes ``[code_heads, N, S]`` uint8, stored scales ``[H, N]``),
    ``truncated(num_stages)`` (the same codec at a lower rate), ``to(device, dtype)``, ``attention_operands()`` (what
    the ``hf_kvcodecs::coded_attention`` op reads), ``state_dict(prefix)`` / ``from_state_dict(...)`` and
    ``consistency_problems(...)``.
    """

    layout: ClassVar[str]  # the name files, configs and options use
    kinds: ClassVar[tuple[str, ...]] = ("keys", "values")  # what it can code
    joint_code: ClassVar[bool] = False  # one code per token covers all its heads (their index bits are shared)
    needs_pre_rope_keys: ClassVar[bool] = False  # only for keys coded before RoPE (and values beside them)
    pre_rope_reason: ClassVar[str] = ""  # why, for the error that refuses it with keys coded after RoPE
    supports_metric: ClassVar[bool] = False  # can be fitted under a per-head error metric (``metric=[H, D, D]``)
    needs_keys: ClassVar[bool] = False  # encode / decode also take the same tokens' decoded pre-RoPE keys

    @staticmethod
    @abc.abstractmethod
    def fit(samples: torch.Tensor, **settings) -> KVCodec:
        """Fit this layout on one layer's calibration samples ``[H, N, D]`` (``max_stages``, ``seed``, the codebook
        settings; ``decoded_keys`` where :attr:`needs_keys`)."""

    @classmethod
    def heads_per_code(cls, kv_heads: int) -> int:
        """How many head vectors one code covers (its index bits are the budget of all of them)."""
        return kv_heads if cls.joint_code else 1

    @property
    def code_heads(self) -> int:
        """Rows of codes per token."""
        return 1 if self.joint_code else self.num_heads

    @property
    def codebook_size(self) -> int:
        return 2 ** self.codebook_bits

    @property
    def scale_bits(self) -> int:
        return FP16_SCALE_BITS if self.log_scale_range is None else LOG_SCALE_BITS

    @property
    def scale_dtype(self) -> torch.dtype:
        """How the cache stores a scale: fp16, or the uint8 index of a log-uniform level."""
        return torch.float16 if self.log_scale_range is None else torch.uint8

    def code_bits_per_vector(self) -> float:
        """Index bits per head vector (a joint code's indices spread over the token's heads)."""
        return self.code_heads * self.num_stages * self.codebook_bits / self.num_heads

    def bits_per_element(self) -> float:
        """Index bits plus the per-head scales, per KV element."""
        code_bits = self.code_heads * self.num_stages * self.codebook_bits
        return (code_bits + self.num_heads * self.scale_bits) / (self.num_heads * self.head_dim)

    def derived(self, name: str, key, build: Callable[[KVCodec], object]):
        """A table derived from this codec's operands by someone else (e.g. the CPU attention's key tables): built
        by ``build(source)`` from the full-rate codec this one was truncated from (or itself), kept on that codec and
        shared by every rate cut from it, and rebuilt when asked for with another ``key`` (e.g. dtype or device)."""
        source = getattr(self, "_table_source", None) or self
        held = source.__dict__.setdefault("_derived", {})
        entry = held.get(name)
        if entry is None or entry[0] != key:
            entry = held[name] = (key, build(source))
        return entry[1]

    def scale_values(self, stored: torch.Tensor) -> torch.Tensor:
        """Scales as numbers from how they are stored (``[..., H, N]``): fp16 as is, 8-bit indices via their level."""
        return stored_scale_values(self, stored)

    def scale_level_table(self, device) -> torch.Tensor | None:
        """``[H, 256]`` values of the 8-bit scale levels on ``device`` (None for fp16 scales); built once."""
        return cached_scale_levels(self, device)
