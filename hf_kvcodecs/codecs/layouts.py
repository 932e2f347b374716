"""The registry of codec layouts: one :class:`~.base.KVCodec` class per layout name.

Files, configs, command-line options and the cache name a layout by its string; everything that needs the class,
its rules (which kinds it codes, whether it needs keys coded before RoPE, how many heads one code covers) or its
loader asks here. A new layout is a new class added to :data:`LAYOUT_CODECS`.
"""

from __future__ import annotations

from .base import KVCodec
from .conditional import ConditionalHeadResidualVQ, HeadCodebooksResidualVQ
from .given_keys import KeyPredictedValueVQ
from .joint import JointHeadResidualVQ
from .residual import TransformResidualVQ

# in the order options list them
LAYOUT_CODECS: dict[str, type[KVCodec]] = {
    codec.layout: codec
    for codec in (TransformResidualVQ, JointHeadResidualVQ, HeadCodebooksResidualVQ, ConditionalHeadResidualVQ,
                  KeyPredictedValueVQ)
}
KINDS = ("keys", "values")


def layouts_for(kind: str) -> tuple[str, ...]:
    """The layouts that can code ``kind`` ("keys" or "values")."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
    return tuple(name for name, codec in LAYOUT_CODECS.items() if kind in codec.kinds)


def codec_class(layout: str, kind: str | None = None) -> type[KVCodec]:
    """The codec class of ``layout``; with ``kind``, also checked to code that kind."""
    codec = LAYOUT_CODECS.get(layout)
    if codec is None or (kind is not None and kind not in codec.kinds):
        choices = layouts_for(kind) if kind is not None else tuple(LAYOUT_CODECS)
        what = f"{kind[:-1]}_layout" if kind is not None else "layout"
        raise ValueError(f"{what} must be one of {choices}, got {layout!r}.")
    return codec


def heads_per_code(layout: str, kv_heads: int) -> int:
    """How many head vectors one code of ``layout`` covers (its index bits are the budget of all of them)."""
    return codec_class(layout).heads_per_code(kv_heads)
