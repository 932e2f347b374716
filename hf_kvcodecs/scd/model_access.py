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
_REMEMBERED_STATES = 4  # identities kept per model (e.g. two adapters switched back and forth)
_SAMPLES_PER_TENSOR = 16
_SAMPLE_INDEX: dict[tuple[int, torch.device], torch.Tensor] = {}


def _tuner_layers(inner: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """peft's adapter-carrying modules (LoRA layers, ``modules_to_save`` wrappers) by their qualified name."""
    return {name: module for name, module in inner.named_modules()
            if isinstance(getattr(module, "adapter_layer_names", None), tuple) and hasattr(module, "active_adapters")}


def _live_adapters(module: torch.nn.Module) -> tuple[str, ...]:
    """The adapters a tuner layer applies in its forward: none while disabled, and none that are merged into the
    base weights already (those are part of the weights)."""
    if getattr(module, "disable_adapters", False):
        return ()
    active = module.active_adapters
    active = [active] if isinstance(active, str) else list(active or ())
    merged = set(getattr(module, "merged_adapters", None) or ())
    return tuple(name for name in active if name not in merged)


def _split_state(inner: torch.nn.Module) -> tuple[dict, dict, dict[str, torch.nn.Module], dict[str, tuple[str, ...]]]:
    """The model's state split into base tensors and the tensors of the adapters its forward applies (those of adapters
    loaded but not applied, being inactive, disabled or merged, are left out of both); the tuner layers, and each
    one's live adapters."""
    tuners = _tuner_layers(inner)
    live = {name: _live_adapters(module) for name, module in tuners.items()}
    owners = {f"{name}.{layer}" if name else layer: name for name, module in tuners.items()
              for layer in module.adapter_layer_names}
    base, active = {}, {}
    for key, tensor in inner.state_dict(keep_vars=True).items():
        parts = key.split(".")
        owner = next((i for i in range(1, len(parts) - 1) if ".".join(parts[:i]) in owners), None) if owners else None
        if owner is None:
            base[key] = tensor
        elif parts[owner] in live[owners[".".join(parts[:owner])]]:
            active[key] = tensor
    return base, active, tuners, live


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor (created under torch.inference_mode) has no version counter
        return -1


def _fingerprint(tensors: dict[str, torch.Tensor]) -> tuple:
    """A cheap stand-in for the tensors' contents: each one's storage, version counter (bumped by every in-place
    change autograd sees: optimizer steps, ``copy_``, ``load_state_dict``), dtype and shape, and the values of a few
    elements spread over it (which catch most changes made through ``.data``, which leaves the counter alone)."""
    facts, samples = [], []
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        facts.append((name, tensor.device.type, tensor.data_ptr() if tensor.device.type != "meta" else 0,
                      _version(tensor), tensor.dtype, tuple(tensor.shape)))
        if tensor.numel() and tensor.device.type != "meta":
            flat = tensor.reshape(-1)
            key = (flat.numel(), flat.device)
            if key not in _SAMPLE_INDEX:
                count = min(_SAMPLES_PER_TENSOR, flat.numel())
                if len(_SAMPLE_INDEX) > 4096:
                    _SAMPLE_INDEX.clear()
                _SAMPLE_INDEX[key] = (torch.arange(count, dtype=torch.int64) * (flat.numel() - 1)
                                      // max(count - 1, 1)).to(flat.device)
            samples.append(flat[_SAMPLE_INDEX[key]].to(torch.float64))
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for sample in samples:
        by_device.setdefault(sample.device, []).append(sample)
    values = b"".join(torch.cat(group).cpu().numpy().tobytes() for group in by_device.values())
    return tuple(facts), values


def _sha256(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        clean = name.replace(".base_layer", "")
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{clean}|{data.dtype}|{tuple(data.shape)}".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def _scaling_sha256(tuners: dict[str, torch.nn.Module], live: dict[str, tuple[str, ...]]) -> str | None:
    """SHA-256 of each live adapter's per-layer scaling (LoRA's ``lora_alpha / r``, or what ``set_scale`` made it):
    not a tensor, so not in the adapter's weight hash, but it changes what the adapter does."""
    entries = []
    for name, adapters in sorted(live.items()):
        scaling = getattr(tuners[name], "scaling", None)
        for adapter in adapters:
            value = scaling.get(adapter) if isinstance(scaling, dict) else None
            entries.append([name, adapter, repr(value)])
    if not entries:
        return None
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def model_identity(model) -> dict:
    """What a model is, for binding knowledge bases and payloads to it: ``{"weights_sha256", "adapter_sha256",
    "adapter_scaling_sha256", "active_adapters", "fingerprint"}``.

    ``weights_sha256`` covers the base weights (adapter parameters excluded, names as in the plain model; an adapter
    merged into the weights in place is part of them); ``adapter_sha256`` the parameters of the adapters the model's
    forward applies *now*: the active ones (``set_adapter``), none while adapters are disabled (``disable_adapter()``)
    or merged. So switching or disabling an adapter changes the identity, and a model whose adapters are all off has
    its base model's identity. Loaded adapters that are not applied count in neither. ``adapter_scaling_sha256``
    covers those adapters' scaling, ``active_adapters`` names them (None and [] without one).

    Hashing costs about a second for a 135M model, so an identity is remembered per model object and state: each
    call takes a cheap fingerprint (every tensor's storage, version counter and a few sampled values, and the adapter
    state) and hashes again when it changed, so training, ``load_state_dict``, ``copy_`` and adapter switches are seen.
    An in-place change made through ``.data`` that misses every sampled element is not; call :func:`forget_identity`
    after such an edit.
    """
    inner = unwrapped(model)
    base, active, tuners, live = _split_state(inner)
    state = (tuple(sorted(live.items())), _fingerprint(base), _fingerprint(active), _scaling_sha256(tuners, live))
    remembered = _IDENTITIES.setdefault(model, {})
    if state in remembered:
        return remembered[state]
    names = sorted({adapter for adapters in live.values() for adapter in adapters})
    identity = {"weights_sha256": _sha256(base), "adapter_sha256": _sha256(active) if active else None,
                "adapter_scaling_sha256": state[3] if active else None, "active_adapters": names,
                "fingerprint": model_fingerprint(inner.config)}
    if len(remembered) >= _REMEMBERED_STATES:
        remembered.pop(next(iter(remembered)))
    remembered[state] = identity
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


class _LastLayerTapped(Exception):
    """Raised from a hook to end a forward whose remaining layers nobody reads."""


@torch.inference_mode()
def prefill_with_taps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      on_layer: Callable[[LayerCapture], None], *, inputs_of: set[int] | frozenset = frozenset(),
                      all_inputs: bool = False, residuals_of: set[int] | frozenset = frozenset(),
                      all_residuals: bool = False, stop_after: int | None = None) -> None:
    """Run ``model`` over the prompt once and call ``on_layer`` for each layer as soon as its states exist (so a
    caller can encode and send layer ``l`` while layers after it still run). Nothing is kept afterwards; no logits
    beyond the last position are computed. ``stop_after``: the forward stops once layer ``stop_after``'s states
    were handed over (layers after it are neither run nor passed to ``on_layer``)."""
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
                if index == stop_after:
                    raise _LastLayerTapped
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
    except _LastLayerTapped:
        pass
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
