"""What attention reads from a cache, compared with full precision: relative squared error of keys and values.

Caches store their history in different layouts (quanto's packed tensors, GSRQ's codes), so the keys and values are
taken where every cache has to hand them over: at the model's attention function. A stand-in attention
implementation, registered through transformers' public ``AttentionInterface``, records what each layer attends over
and then calls the model's own implementation, so the forward pass is unchanged. A GSRQ layer on the code-reading
path hands over placeholders instead; for it the recorded tensors are the layer's decoded history, which is what the
code-reading attention computes with (the two paths are tested equal).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..integrations.attention import (
    CODE_LAYER_ATTRIBUTE,
    FORWARDING_IMPLEMENTATIONS,
    attention_implementation,
    is_code_attention,
    original_attention,
)

CAPTURE_IMPLEMENTATION = "hf_kvcodecs_capture"


@contextmanager
def recorded_attention_inputs(model):
    """Within the block, each attention call of ``model`` stores ``{layer_idx: (keys, values)}`` (float32 copies,
    ``[B, H_kv, T, D]``, the last call per layer wins) in the yielded dict."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = attention_implementation(model.config)
    if (original not in ALL_ATTENTION_FUNCTIONS and original != "eager") or original not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"Cannot record the attention inputs of implementation {original!r}.")
    records: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        layer = getattr(key, CODE_LAYER_ATTRIBUTE, None)
        keys, values = layer.dequantized_keys_and_values() if layer is not None else (key, value)
        records[module.layer_idx] = (keys.detach().float().clone(), values.detach().float().clone())
        return original_attention(original, module)(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CAPTURE_IMPLEMENTATION, recording_attention)
    AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS[original])
    forwards_codes = is_code_attention(original)
    if forwards_codes:  # caches reading codes keep doing so through the recorder
        FORWARDING_IMPLEMENTATIONS.add(CAPTURE_IMPLEMENTATION)
    model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
    try:
        yield records
    finally:
        model.set_attn_implementation(original)
        FORWARDING_IMPLEMENTATIONS.discard(CAPTURE_IMPLEMENTATION)


def relative_errors(records: dict, reference: dict) -> dict[str, float]:
    """Mean over layers of ``|x - x_ref|^2 / |x_ref|^2`` for keys and values (post-RoPE keys, all tokens held)."""
    if set(records) != set(reference):
        raise ValueError(f"Recorded layers {sorted(records)} differ from the reference's {sorted(reference)}.")
    errors = {"keys": [], "values": []}
    for layer, (keys, values) in records.items():
        reference_keys, reference_values = reference[layer]
        if keys.shape != reference_keys.shape:
            raise ValueError(
                f"Layer {layer}: attention read {tuple(keys.shape)} keys, the reference {tuple(reference_keys.shape)}."
            )
        for name, got, expected in (("keys", keys, reference_keys), ("values", values, reference_values)):
            errors[name].append(float((got - expected).pow(2).sum() / expected.pow(2).sum().clamp_min(1e-30)))
    return {name: sum(values) / len(values) for name, values in errors.items()}
