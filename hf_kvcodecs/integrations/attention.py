"""Code-reading attention as a transformers attention implementation.

transformers looks the attention function up by name (``config._attn_implementation``) on every forward pass, and
builds the mask with the function registered under the same name. We register, through the public
``AttentionInterface`` / ``AttentionMaskInterface``, one name per implementation we can stand in for:
``"gsrq_sdpa"`` and ``"gsrq_eager"``. For a layer of a ``GSRQCache`` in code-reading mode they attend over the codes;
for anything else they call the original function unchanged, so switching a model to them is behaviour-preserving.
"""

from __future__ import annotations

import logging
import sys

import torch

logger = logging.getLogger(__name__)

CODE_ATTENTION_PREFIX = "gsrq_"
WRAPPED_IMPLEMENTATIONS = ("sdpa", "eager")
CODE_LAYER_ATTRIBUTE = "_gsrq_code_layer"  # set on the placeholder key tensor a code-reading GSRQ layer returns


def code_attention_name(implementation: str | None) -> str | None:
    """The registered code-reading name standing in for ``implementation`` (None if we cannot stand in for it)."""
    if implementation in WRAPPED_IMPLEMENTATIONS:
        return CODE_ATTENTION_PREFIX + implementation
    if implementation in tuple(CODE_ATTENTION_PREFIX + name for name in WRAPPED_IMPLEMENTATIONS):
        return implementation
    return None


# Other registered names whose function hands GSRQ layers on to a code-reading one (e.g. bench.fidelity's recorder).
FORWARDING_IMPLEMENTATIONS: set[str] = set()


def is_code_attention(implementation: str | None) -> bool:
    if implementation in FORWARDING_IMPLEMENTATIONS:
        return True
    return implementation is not None and implementation.startswith(CODE_ATTENTION_PREFIX) and (
        implementation.removeprefix(CODE_ATTENTION_PREFIX) in WRAPPED_IMPLEMENTATIONS
    )


def _make_attention(original_name: str):
    def gsrq_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        layer = getattr(key, CODE_LAYER_ATTRIBUTE, None)
        if layer is None:
            return original_attention(original_name, module)(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        from ..cache.attention import gsrq_layer_attention, uses_codes

        if dropout:
            raise ValueError("GSRQ code-reading attention is for inference; put the model in eval() mode.")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        layer.mark_attended()
        try:
            # The model's own attention on decoded states for prefill-sized blocks, and wherever the code-reading op
            # cannot serve the call: it returns no attention weights (output_attentions) and has no autograd formula.
            if (not uses_codes(layer, query) or kwargs.get("output_attentions")
                    or (torch.is_grad_enabled() and query.requires_grad)):
                layer.last_attention = "dequantize"
                keys, values = layer.dequantized_keys_and_values()
                return original_attention(original_name, module)(
                    module, query, keys, values, attention_mask, dropout=dropout, scaling=scaling, **kwargs
                )
            layer.last_attention = "codes"
            output = gsrq_layer_attention(layer, query, attention_mask, scaling)
            return output.transpose(1, 2).contiguous(), None
        finally:
            layer.finish_attention()

    gsrq_attention.__name__ = f"gsrq_{original_name}_attention"
    return gsrq_attention


def original_attention(name: str, module):
    if name == "eager":  # every model file defines its own eager function (the default of its interface lookup)
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise TypeError(f"{type(module).__name__} has no eager_attention_forward; use attn_implementation='sdpa'.")
        return eager
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def register_code_attention() -> None:
    """Register ``gsrq_sdpa`` / ``gsrq_eager`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for original in WRAPPED_IMPLEMENTATIONS:
        name = CODE_ATTENTION_PREFIX + original
        AttentionInterface.register(name, _make_attention(original))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])


def enable_code_attention(model) -> bool:
    """Switch ``model`` to the code-reading stand-in of its attention implementation.

    Returns True when the model now uses code-reading attention for GSRQ caches (other caches are unaffected), False
    when its implementation (e.g. flash attention) has no stand-in; GSRQ caches then use the dequantize path.
    """
    register_code_attention()
    config = model.config.get_text_config(decoder=True)
    current = config._attn_implementation
    name = code_attention_name(current)
    if name is None:
        logger.info("GSRQ: attention implementation %r has no code-reading stand-in; using the dequantize path.", current)
        return False
    if name != current:
        model.set_attn_implementation(name)
        logger.info("GSRQ: switched attention from %r to %r (reads GSRQ codes; other caches unchanged).", current, name)
    return True
