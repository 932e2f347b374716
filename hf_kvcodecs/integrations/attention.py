"""Code-reading attention as a transformers attention implementation, for any cache layer that holds codes.

transformers looks the attention function up by name (``config._attn_implementation``) on every forward pass, and
builds the mask with the function registered under the same name. We register, through the public
``AttentionInterface`` / ``AttentionMaskInterface``, one name per implementation we can stand in for:
``"kvcodecs_sdpa"`` and ``"kvcodecs_eager"`` (and their earlier names ``"gsrq_sdpa"`` / ``"gsrq_eager"``). A cache
layer in code-reading mode returns placeholder keys that carry the layer (:data:`CODE_LAYER_ATTRIBUTE`); the
dispatcher hands such a call to the layer's :meth:`CodeReadingLayer.code_attention` and every other call to the
original function unchanged, so switching a model to them is behaviour-preserving. The dispatcher knows no method:
a method plugs in by implementing that one method on its cache layers.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

CODE_ATTENTION_PREFIX = "kvcodecs_"
# registered as well, so that code which switched a model to them by name keeps working
LEGACY_CODE_ATTENTION_PREFIX = "gsrq_"
WRAPPED_IMPLEMENTATIONS = ("sdpa", "eager")
CODE_LAYER_ATTRIBUTE = "_kvcodecs_code_layer"  # set on the placeholder key tensor a code-reading cache layer returns


class CodeReadingLayer(Protocol):
    """What the dispatcher needs of a cache layer in code-reading mode."""

    def code_attention(self, query: torch.Tensor, attention_mask, scaling: float,
                       attend_decoded: Callable[[torch.Tensor, torch.Tensor], tuple], *,
                       output_attentions: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of ``query`` ``[B, Hq, Lq, D]`` over the layer's tokens, as transformers' attention functions
        return it (output ``[B, Lq, Hq, D]``, weights or None). ``attend_decoded(keys, values)`` runs the model's own
        attention on decoded keys and values, for calls the layer does not serve from codes."""

    def dequantized_keys_and_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every held token's key and value, decoded, in order (what the code-reading attention computes with)."""


def code_attention_name(implementation: str | None) -> str | None:
    """The registered code-reading name standing in for ``implementation`` (None if we cannot stand in for it)."""
    if implementation in WRAPPED_IMPLEMENTATIONS:
        return CODE_ATTENTION_PREFIX + implementation
    if is_code_attention(implementation) and implementation not in FORWARDING_IMPLEMENTATIONS:
        return implementation
    return None


# Other registered names whose function hands code-reading layers on to a code-reading one (e.g. bench.fidelity's
# recorder).
FORWARDING_IMPLEMENTATIONS: set[str] = set()


def is_code_attention(implementation: str | None) -> bool:
    if implementation in FORWARDING_IMPLEMENTATIONS:
        return True
    return implementation is not None and any(
        implementation.startswith(prefix) and implementation.removeprefix(prefix) in WRAPPED_IMPLEMENTATIONS
        for prefix in (CODE_ATTENTION_PREFIX, LEGACY_CODE_ATTENTION_PREFIX))


def attention_implementation(config) -> str | None:
    """The attention implementation a model config selects (transformers keeps it in a private attribute)."""
    return getattr(config.get_text_config(decoder=True), "_attn_implementation", None)


def _make_attention(original_name: str):
    def code_reading_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                               **kwargs):
        layer = getattr(key, CODE_LAYER_ATTRIBUTE, None)
        if layer is None:
            return original_attention(original_name, module)(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        if dropout:
            raise ValueError("Code-reading attention is for inference; put the model in eval() mode.")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5

        def attend_decoded(keys, values):
            return original_attention(original_name, module)(
                module, query, keys, values, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )

        return layer.code_attention(query, attention_mask, scaling, attend_decoded,
                                    output_attentions=bool(kwargs.get("output_attentions")))

    code_reading_attention.__name__ = f"kvcodecs_{original_name}_attention"
    return code_reading_attention


def original_attention(name: str, module):
    if name == "eager":  # every model file defines its own eager function (the default of its interface lookup)
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise TypeError(f"{type(module).__name__} has no eager_attention_forward; use attn_implementation='sdpa'.")
        return eager
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def register_code_attention() -> None:
    """Register ``kvcodecs_sdpa`` / ``kvcodecs_eager`` and their earlier ``gsrq_`` names (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for original in WRAPPED_IMPLEMENTATIONS:
        function = _make_attention(original)
        for prefix in (CODE_ATTENTION_PREFIX, LEGACY_CODE_ATTENTION_PREFIX):
            AttentionInterface.register(prefix + original, function)
            AttentionMaskInterface.register(prefix + original, ALL_MASK_ATTENTION_FUNCTIONS[original])


def enable_code_attention(model) -> bool:
    """Switch ``model`` to the code-reading stand-in of its attention implementation.

    Returns True when the model now uses code-reading attention for caches that hold codes (other caches are
    unaffected), False when its implementation (e.g. flash attention) has no stand-in; such caches then attend over
    decoded keys and values.
    """
    register_code_attention()
    current = attention_implementation(model.config)
    name = code_attention_name(current)
    if name is None:
        logger.info("attention implementation %r has no code-reading stand-in; caches that hold codes decode them.", current)
        return False
    if name != current:
        model.set_attn_implementation(name)
        logger.info("switched attention from %r to %r (reads cache codes; other caches unchanged).", current, name)
    return True
