"""What SCD needs to know about a model: its decoder layers and their projections, its identity (weights, adapter,
tokenizer), and a prefill that hands over each layer's pre-RoPE keys, values and normalized inputs as it goes.

A peft ``PeftModel`` is looked through: its LoRA-wrapped ``k_proj`` / ``v_proj`` are called as they are, so the
adapted projections are what SCD captures and recomputes with, and its identity is the base weights plus the
adapter's own hash.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models import model_fingerprint


class SCDModelError(ValueError):
    pass


def unwrapped(model) -> torch.nn.Module:
    """The transformers model inside a peft ``PeftModel`` (with its adapters injected), or ``model`` itself."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) and hasattr(model, "peft_config") else model


def text_config(model):
    return unwrapped(model).config.get_text_config(decoder=True)


def decoder_layers(model) -> torch.nn.ModuleList:
    inner = unwrapped(model)
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else getattr(inner, "model", inner)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise SCDModelError(f"{type(inner).__name__} has no decoder layer list (model.model.layers); SCD supports "
                            "decoder-only transformers with Llama-style layers.")
    layer = layers[0]
    attention = getattr(layer, "self_attn", None)
    missing = [name for name in ("k_proj", "v_proj") if not hasattr(attention, name)]
    if attention is None or missing or not hasattr(layer, "input_layernorm"):
        raise SCDModelError(f"{type(layer).__name__} lacks self_attn.k_proj / v_proj / input_layernorm; SCD needs "
                            "Llama-style layers (Llama, Mistral, Qwen2, SmolLM).")
    if hasattr(attention, "k_norm") or hasattr(attention, "q_norm"):
        raise SCDModelError(f"{type(layer).__name__} normalizes keys after k_proj (k_norm); SCD does not handle "
                            "QK-norm architectures yet.")
    layer_types = getattr(text_config(model), "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        raise SCDModelError("This model has sliding-window or other non-full-attention layers; SCD rebuilds "
                            "full-attention caches only.")
    return layers


@dataclass(frozen=True)
class Shapes:
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def shapes(model) -> Shapes:
    fingerprint = model_fingerprint(unwrapped(model).config)
    return Shapes(fingerprint["num_hidden_layers"], fingerprint["num_key_value_heads"], fingerprint["head_dim"],
                  fingerprint["hidden_size"])


_IDENTITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_identity(model) -> dict:
    """``{"weights_sha256", "adapter_sha256", "fingerprint"}``: SHA-256 of the base weights (adapter parameters
    excluded, names as in the plain model) and of the adapter's parameters (None without one).

    Hashed once per model object (about a second for a 135M model); a model whose weights are changed in place
    afterwards keeps its first identity, so call :func:`forget_identity` after training it.
    """
    known = _IDENTITIES.get(model)
    if known is not None:
        return known
    base, adapter = hashlib.sha256(), hashlib.sha256()
    has_adapter = False
    for name, tensor in sorted(unwrapped(model).state_dict().items()):
        target = base
        if "lora_" in name:
            target, has_adapter = adapter, True
        clean = name.replace(".base_layer", "")
        data = tensor.detach().cpu().contiguous()
        target.update(f"{clean}|{data.dtype}|{tuple(data.shape)}".encode())
        target.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    identity = {"weights_sha256": base.hexdigest(), "adapter_sha256": adapter.hexdigest() if has_adapter else None,
                "fingerprint": model_fingerprint(unwrapped(model).config)}
    _IDENTITIES[model] = identity
    return identity


def forget_identity(model) -> None:
    _IDENTITIES.pop(model, None)


def tokenizer_sha256(tokenizer) -> str | None:
    """SHA-256 of a tokenizer's vocabulary and special tokens (None when no tokenizer is given)."""
    if tokenizer is None:
        return None
    vocabulary = sorted(tokenizer.get_vocab().items())
    special = sorted((str(key), str(value)) for key, value in getattr(tokenizer, "special_tokens_map", {}).items())
    return hashlib.sha256(json.dumps([vocabulary, special]).encode()).hexdigest()


def token_ids_sha256(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> str:
    digest = hashlib.sha256(input_ids.detach().cpu().to(torch.int64).contiguous().numpy().tobytes())
    if attention_mask is not None:
        digest.update(attention_mask.detach().cpu().to(torch.uint8).contiguous().numpy().tobytes())
    return digest.hexdigest()


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position as ``generate()`` assigns it: counted over real tokens only (left padding shifts it)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


@dataclass
class LayerCapture:
    """One layer's states from a prefill: pre-RoPE keys and values ``[B, T, H_kv * d_h]`` and, where asked for, the
    normalized layer input ``[B, T, d]`` (the output of ``input_layernorm``) and the residual stream entering the
    layer ``[B, T, d]``."""

    index: int
    keys: torch.Tensor
    values: torch.Tensor
    inputs: torch.Tensor | None
    residual: torch.Tensor | None = None


def residual_direction(residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h / rms(h), rms(h))`` per token of a residual stream ``[..., d]`` (float32): what a recompute Patch codes
    and the one scalar per token that restores the stream from it."""
    residual = residual.float()
    rms = residual.pow(2).mean(-1).sqrt().clamp_min(1e-6)
    return residual / rms[..., None], rms


@torch.inference_mode()
def prefill_with_taps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      on_layer: Callable[[LayerCapture], None], *, inputs_of: set[int] | frozenset = frozenset(),
                      all_inputs: bool = False, residuals_of: set[int] | frozenset = frozenset(),
                      all_residuals: bool = False) -> None:
    """Run ``model`` over the prompt once and call ``on_layer`` for each layer as soon as its states exist (so a
    caller can encode and send layer ``l`` while layers after it still run). Nothing is kept afterwards; no logits
    beyond the last position are computed."""
    layers = decoder_layers(model)
    pending: dict[int, dict] = {}
    handles = []

    def tap(index: int, kind: str):
        def hook(module, args, output):
            state = pending.setdefault(index, {})
            state[kind] = output.detach()
            if "keys" in state and "values" in state:
                del pending[index]
                on_layer(LayerCapture(index, state["keys"], state["values"], state.get("inputs"), state.get("residual")))
        return hook

    def tap_residual(index: int):
        def hook(module, args, kwargs):
            pending.setdefault(index, {})["residual"] = (args[0] if args else kwargs["hidden_states"]).detach()
        return hook

    try:
        for index, layer in enumerate(layers):
            if all_inputs or index in inputs_of:
                handles.append(layer.input_layernorm.register_forward_hook(tap(index, "inputs")))
            if all_residuals or index in residuals_of:
                handles.append(layer.register_forward_pre_hook(tap_residual(index), with_kwargs=True))
            handles.append(layer.self_attn.k_proj.register_forward_hook(tap(index, "keys")))
            handles.append(layer.self_attn.v_proj.register_forward_hook(tap(index, "values")))
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        model(input_ids=input_ids, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False,
              logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    if pending:
        raise SCDModelError(f"Layers {sorted(pending)} ran without both k_proj and v_proj; the model's attention does "
                            "not call its projections as SCD expects.")


@torch.inference_mode()
def run_decoder_block(model, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                      cache, first: int, depth: int) -> None:
    """Run ``model``'s own decoder layers ``first .. first + depth - 1`` over ``hidden`` ``[B, N, d]``, the residual
    stream of the prompt's last ``N`` tokens entering layer ``first``, so they write those tokens' keys and values
    into ``cache`` after the ones it already holds for every layer (the same earlier tokens in each).
    ``attention_mask`` ``[B, T]`` covers all ``T`` tokens, cached and new; ``position_ids`` ``[B, N]`` are the new
    tokens' positions. A peft model's adapted projections run as they are."""
    from transformers.masking_utils import create_causal_mask

    inner = unwrapped(model)
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else getattr(inner, "model", inner)
    layers = decoder_layers(model)
    if not 0 <= first < first + depth <= len(layers):
        raise ValueError(f"Layers {first}..{first + depth - 1} do not exist: the model has {len(layers)}.")
    weight = next(inner.parameters())
    hidden = hidden.to(device=weight.device, dtype=weight.dtype)
    position_ids = position_ids.to(weight.device)
    mask = create_causal_mask(config=decoder.config, inputs_embeds=hidden, attention_mask=attention_mask.to(weight.device),
                              cache=cache, position_ids=position_ids)
    position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)
    for layer in layers[first:first + depth]:
        hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True,
                       position_embeddings=position_embeddings)
        if isinstance(hidden, tuple):  # decoder layers that also return attention weights
            hidden = hidden[0]
