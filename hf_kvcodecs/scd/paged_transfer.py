"""SCD payloads of one prompt's keys and values as a paged-KV server holds them (vLLM's KV connector,
:mod:`hf_kvcodecs.scd.vllm_connector`), without the server.

A paged server hands a connector each layer's keys (after RoPE) and values, per token and KV head. That is enough for
Reuse codes: the producer undoes RoPE at the prompt's positions and codes the pre-RoPE keys and the values with the
knowledge base's encoders; the consumer decodes them with its decoders, applies RoPE at its own positions and writes
them into its paged cache. Both sides run the same per-layer math as :func:`~hf_kvcodecs.scd.encode` and
:meth:`~hf_kvcodecs.scd.SCDTransferCache.from_payload` (:mod:`hf_kvcodecs.scd.coding`), and the payload is the same
checked container, bound to the knowledge base, both models, the tokenizer and the prompt.

What a connector cannot do is run the consumer's layers, so a knowledge base is accepted only when nothing has to be
computed by the consumer: every layer Reuse (no Patch or recomputed layers) and no exact tokens
(:func:`check_paged_knowledge_base`).

Payloads are kept in a directory, one file per prompt, named by the SHA-256 of the prompt's token ids
(:class:`PromptPayloadStore`); a file is read with a size bound and refused unless it parses as a payload of this
knowledge base and this prompt.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..rope import undo_rope
from .coding import consumer_angles, encode_layer, rebuild_layer
from .knowledge_base import KnowledgeBaseError, SCDKnowledgeBase
from .manifest import PairMismatchError, PayloadLimits, PayloadManifest
from .model_access import LayerCapture
from .payload import PayloadError, unpack_payload

PAYLOAD_SUFFIX = ".scd"
_KEY_DOMAIN = b"hf_kvcodecs.scd.prompt_payload\x00"  # a key of another use of the same ids differs

FIT_REUSE_ONLY = ("fit one whose plan is Reuse only and which sends every token: `hf-kvcodecs scd fit ... "
                  "--max-patch-layers 0 --exact-tokens 0`, or full_rank_knowledge_base(..., exact_tokens=0) without "
                  "patch_layers")


def check_paged_knowledge_base(kb: SCDKnowledgeBase) -> None:
    """Refuse a knowledge base a paged-KV connector cannot serve. A connector sees and writes keys and values only:
    it cannot run the consumer's decoder layers, which Patch layers (and the layers a recompute block writes) need,
    nor compute the exact (attention-sink) tokens the consumer is meant to compute itself."""
    kb.identity()  # KnowledgeBaseError: an unsaved knowledge base cannot name its payloads
    computed = [f"{layer.index} ({layer.kind})" for layer in kb.plan if layer.kind != "reuse"]
    if computed:
        raise KnowledgeBaseError(
            f"This knowledge base's layers {', '.join(computed[:6])}{' ...' if len(computed) > 6 else ''} are not "
            "Reuse layers: the consumer rebuilds them by running its own decoder layers, which a KV connector cannot "
            f"do (it only moves keys and values). For vLLM, {FIT_REUSE_ONLY}.")
    if kb.exact_tokens:
        raise KnowledgeBaseError(
            f"This knowledge base leaves the first {kb.exact_tokens} tokens for the consumer to compute itself, which "
            f"a KV connector cannot do (vLLM computes only the tokens after the ones it loads). For vLLM, "
            f"{FIT_REUSE_ONLY}.")


def prompt_key(token_ids: Sequence[int] | torch.Tensor) -> str:
    """The SHA-256 (hex) of a prompt's token ids as int64: the file name its payload is stored under."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).contiguous()
    return hashlib.sha256(_KEY_DOMAIN + ids.numpy().tobytes()).hexdigest()


class PromptPayloadStore:
    """A directory of SCD payloads, one file per prompt named by :func:`prompt_key`, written whole (to a temporary
    name, then renamed) so a reader never sees half a payload. Reads are bounded by ``max_bytes``."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def path(self, token_ids: Sequence[int] | torch.Tensor) -> Path:
        return self.directory / f"{prompt_key(token_ids)}{PAYLOAD_SUFFIX}"

    def contains(self, token_ids: Sequence[int] | torch.Tensor) -> bool:
        return self.path(token_ids).is_file()

    def write(self, token_ids: Sequence[int] | torch.Tensor, payload: bytes) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(token_ids)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_bytes(payload)
        os.replace(partial, path)
        return path

    def read(self, token_ids: Sequence[int] | torch.Tensor, max_bytes: int) -> bytes | None:
        """The stored payload of this prompt, None when there is none; ``PayloadError`` for a file over
        ``max_bytes`` (refused before it is read)."""
        path = self.path(token_ids)
        try:
            handle = path.open("rb")
        except FileNotFoundError:
            return None
        with handle:
            size = os.fstat(handle.fileno()).st_size
            if size > max_bytes:
                raise PayloadError(f"{path} is {size} bytes, over the {max_bytes}-byte limit of a payload this "
                                   "knowledge base writes for the server's longest prompt.")
            data = handle.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise PayloadError(f"{path} grew past the {max_bytes}-byte limit while it was read.")
        return data


def _angles(inv_freq: torch.Tensor, attention_scaling: float, tokens: int):
    return consumer_angles(inv_freq, attention_scaling, torch.arange(tokens)[None])


@torch.inference_mode()
def encode_prompt_kv(kb: SCDKnowledgeBase, producer_identity: Mapping, token_ids: Sequence[int] | torch.Tensor,
                     layers: Sequence[tuple[torch.Tensor, torch.Tensor]], inv_freq: torch.Tensor,
                     attention_scaling: float) -> bytes:
    """The SCD payload of one prompt from the producer's paged keys and values: ``layers[l]`` is layer ``l``'s
    ``(keys, values)``, each ``[T, H_kv, d_h]``, keys after RoPE at positions ``0 .. T - 1`` with the producer's
    ``inv_freq`` / ``attention_scaling``. ``producer_identity`` is ``model_identity`` of the producer, checked
    against ``kb`` by the caller (:func:`~hf_kvcodecs.scd.encode.check_producer`). Codes at ``kb.code_bits``."""
    check_paged_knowledge_base(kb)
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(1, -1)
    tokens = ids.shape[1]
    if len(layers) != kb.num_layers:
        raise KnowledgeBaseError(f"The knowledge base plans {kb.num_layers} layers; the producer sent {len(layers)}.")
    mask = torch.ones_like(ids, dtype=torch.uint8)
    manifest = PayloadManifest.for_prompt(kb, producer_identity, ids, mask, kb.code_bits)
    cos, sin = _angles(inv_freq, attention_scaling, tokens)
    sections = {"input.attention_mask": mask, "input.exact_token_ids": ids[:, :0]}
    for plan, (keys, values) in zip(kb.plan, layers):
        if keys.shape[0] != tokens or values.shape[0] != tokens:
            raise ValueError(f"Layer {plan.index}'s keys {tuple(keys.shape)} / values {tuple(values.shape)} do not "
                             f"cover the prompt's {tokens} tokens.")
        pre_rope = undo_rope(keys.float().transpose(0, 1)[None], cos, sin, attention_scaling)  # [1, H, T, d]
        capture = LayerCapture(plan.index, pre_rope.transpose(1, 2).reshape(1, tokens, -1),
                               values.float().reshape(1, tokens, -1), None)
        sections.update(encode_layer(capture, plan, kb, 0, kb.code_bits))
    return manifest.pack(sections)


def payload_limits(max_tokens: int) -> PayloadLimits:
    """One prompt of at most ``max_tokens`` tokens: what a connector asks of a payload (a request's prompt)."""
    return PayloadLimits(max_batch=1, max_tokens=max_tokens)


def read_prompt_payload(payload: bytes, kb: SCDKnowledgeBase, token_ids: Sequence[int] | torch.Tensor, *,
                        max_tokens: int) -> tuple[PayloadManifest, dict[str, torch.Tensor]]:
    """Unpack and check a payload for this knowledge base and exactly this prompt: the container (CRCs, bounded
    sizes), the manifest against ``kb`` (its save, both models, the tokenizer, the plan), then the prompt's token-id
    hash. Raises ``PayloadError`` / ``PairMismatchError`` / ``KnowledgeBaseError`` naming what differs."""
    check_paged_knowledge_base(kb)
    limits = payload_limits(max_tokens)
    raw, sections = unpack_payload(payload, max_bytes=limits.max_payload_bytes(kb),
                                   check=lambda raw, table: PayloadManifest.parse(raw, kb, limits=limits))
    manifest = PayloadManifest.parse(raw, kb, sections, limits=limits)
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(1, -1)
    if manifest.tokens != ids.shape[1]:
        raise PairMismatchError(f"The payload covers {manifest.tokens} tokens; the prompt asks for {ids.shape[1]}.")
    manifest.check_prompt(ids, None, payload_mask=sections["input.attention_mask"].long())
    if manifest.exact_columns:
        raise PairMismatchError(f"The payload leaves {manifest.exact_columns} columns for the consumer to compute, "
                                "which a KV connector cannot do.")
    return manifest, sections


@torch.inference_mode()
def decode_prompt_kv(payload: bytes, kb: SCDKnowledgeBase, token_ids: Sequence[int] | torch.Tensor,
                     inv_freq: torch.Tensor, attention_scaling: float, kv_heads: int, head_dim: int,
                     dtype: torch.dtype, *, max_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The consumer's keys (after RoPE at positions ``0 .. T - 1``, its own ``inv_freq`` / ``attention_scaling``)
    and values, ``[T, H_kv, d_h]`` per layer, from a payload checked by :func:`read_prompt_payload`."""
    manifest, sections = read_prompt_payload(payload, kb, token_ids, max_tokens=max_tokens)
    cos, sin = _angles(inv_freq, attention_scaling, manifest.tokens)
    layers = []
    for plan in manifest.layers:
        prefix = f"layers.{plan.index}."
        layer_sections = {name: tensor for name, tensor in sections.items() if name.startswith(prefix)}
        keys, values = rebuild_layer(None, plan, kb, layer_sections, manifest.code_bits, cos, sin,
                                     (kv_heads, head_dim), dtype)
        layers.append((keys[0].transpose(0, 1), values[0].transpose(0, 1)))
    return layers
