"""The producer's side: prefill a prompt, code every layer with the knowledge base, and pack one payload.

The payload binds what it was made from: the knowledge base's save id, the producer's and the intended consumer's
weight and adapter hashes, the tokenizer's hash and a hash of the prompt's token ids (with its attention mask), so a
consumer can refuse a payload that is not for it and say which part differs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..codecs.lowrank import pack_int4, unpack_int4
from .coding import encode_layer
from .knowledge_base import CODE_BITS, KnowledgeBaseError, LayerPlan, SCDKnowledgeBase, _read_plan
from .model_access import LayerCapture, model_identity, prefill_with_taps, shapes, token_ids_sha256, tokenizer_sha256
from .payload import iter_payload_chunks, pack_payload, unpack_payload

CODEC_ID = "hf_kvcodecs.scd.reuse_patch"
CODEC_VERSION = 2
READABLE_CODEC_VERSIONS = (1, 2)  # version 1 carried projection-only Patch layers only


class PairMismatchError(ValueError):
    """A model, adapter, tokenizer or prompt is not the one a knowledge base or payload was made for."""


def check_left_padded(attention_mask: torch.Tensor) -> torch.Tensor:
    """The number of left-padding columns per row; refuses a mask with padding anywhere else."""
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be [batch, tokens], got shape {tuple(attention_mask.shape)}.")
    mask = attention_mask.to(torch.long)
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError("attention_mask must hold only 0 and 1.")
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise ValueError("SCD needs left padding (zeros only before a row's tokens), as generate() uses for "
                         "decoder-only models: set tokenizer.padding_side = 'left'.")
    if (mask.sum(1) == 0).any():
        raise ValueError("A row of the batch has no tokens (its attention_mask is all zeros).")
    return (mask == 0).sum(1)


def exact_columns(attention_mask: torch.Tensor, exact_tokens: int) -> int:
    """The leading columns the consumer computes itself: every row's first ``exact_tokens`` real tokens (attention
    sinks, which low-rank codes reconstruct worst), plus the left padding before them. They are causal, so the
    consumer's own states for them are exact."""
    pads = check_left_padded(attention_mask)
    return min(int(pads.max()) + int(exact_tokens), attention_mask.shape[1])


def check_producer(producer, kb: SCDKnowledgeBase) -> dict:
    identity = model_identity(producer)
    expected = kb.producer
    for key, what in (("weights_sha256", "weights"), ("adapter_sha256", "LoRA adapter")):
        if expected.get(key) != identity[key]:
            raise PairMismatchError(
                f"The producer's {what} (sha256 {str(identity[key])[:12]}) differ from those the knowledge base was "
                f"fitted for ({str(expected.get(key))[:12]}, model {expected.get('name')!r}); fit a knowledge base for this "
                "producer with `hf-kvcodecs scd fit`.")
    return identity


@dataclass
class EncodeReport:
    tokens: int
    coded_tokens: int
    payload_bytes: int
    prefill_and_code_seconds: float

    @property
    def bytes_per_token(self) -> float:
        return self.payload_bytes / max(self.tokens, 1)


@torch.inference_mode()
def encode_sections(producer, input_ids: torch.Tensor, kb: SCDKnowledgeBase, *,
                    attention_mask: torch.Tensor | None = None, tokenizer=None, code_bits: int | None = None,
                    ) -> tuple[dict, dict[str, torch.Tensor]]:
    """The manifest and sections of the payload for ``input_ids`` ``[B, T]`` (or ``[T]``)."""
    if input_ids.ndim == 1:
        input_ids = input_ids[None]
    if input_ids.ndim != 2 or input_ids.shape[1] < 1 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be integer token ids [batch, tokens], got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}.")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.reshape(input_ids.shape)
    if tokenizer is not None and kb.tokenizer_sha256 is not None and tokenizer_sha256(tokenizer) != kb.tokenizer_sha256:
        raise PairMismatchError("The producer's tokenizer is not the one the knowledge base was fitted with; the "
                                "token ids would mean different text to the consumer.")
    bits = code_bits or kb.code_bits
    if bits not in CODE_BITS:
        raise ValueError(f"code_bits must be one of {CODE_BITS}, got {bits}.")
    if bits < kb.code_bits:
        raise KnowledgeBaseError(f"This knowledge base's plan was chosen for {kb.code_bits}-bit codes; coding at "
                                 f"{bits} bits would exceed its quality budget. Fit one for {bits}-bit codes.")
    identity = check_producer(producer, kb)
    model_shapes = shapes(producer)
    if model_shapes.layers != kb.num_layers:
        raise KnowledgeBaseError(f"The knowledge base plans {kb.num_layers} layers; the producer has "
                                 f"{model_shapes.layers}.")
    start = exact_columns(mask, kb.exact_tokens)
    sections: dict[str, torch.Tensor] = {
        "input.attention_mask": mask.to(torch.uint8).cpu(),
        "input.exact_token_ids": input_ids[:, :start].to(torch.int64).cpu(),
    }
    layer_sections: dict[int, dict[str, torch.Tensor]] = {}
    plan = kb.plan

    def on_layer(capture: LayerCapture) -> None:
        if start < input_ids.shape[1]:
            layer_sections[capture.index] = {name: tensor.cpu() for name, tensor in
                                             encode_layer(capture, plan[capture.index], kb, start, bits).items()}

    prefill_with_taps(producer, input_ids, mask, on_layer, inputs_of=set(kb.input_layers),
                      residuals_of=set(kb.residual_layers))
    for index in range(kb.num_layers):
        sections.update(layer_sections.get(index, {}))
    manifest = {
        "codec": CODEC_ID, "codec_version": CODEC_VERSION, "knowledge_base": kb.identity(),
        "producer": {"weights_sha256": identity["weights_sha256"], "adapter_sha256": identity["adapter_sha256"]},
        "consumer": {"weights_sha256": kb.consumer.get("weights_sha256"),
                     "adapter_sha256": kb.consumer.get("adapter_sha256")},
        "tokenizer_sha256": kb.tokenizer_sha256, "token_ids_sha256": token_ids_sha256(input_ids, mask),
        "batch": int(input_ids.shape[0]), "tokens": int(input_ids.shape[1]), "exact_columns": int(start),
        "code_bits": int(bits), "layers": [layer.to_dict() for layer in plan],
    }
    return manifest, sections


def encode(producer, input_ids: torch.Tensor, kb: SCDKnowledgeBase, *, attention_mask: torch.Tensor | None = None,
           tokenizer=None, code_bits: int | None = None) -> bytes:
    """Prefill ``input_ids`` on ``producer`` and return the SCD payload for the consumer ``kb`` was fitted for.

    The consumer rebuilds its cache with :meth:`~hf_kvcodecs.scd.SCDTransferCache.from_payload`; ``len(payload) /
    input_ids.shape[-1]`` is the bytes per token on the wire (see :func:`encode_with_report`)."""
    return pack_payload(*encode_sections(producer, input_ids, kb, attention_mask=attention_mask,
                                         tokenizer=tokenizer, code_bits=code_bits))


def encode_with_report(producer, input_ids: torch.Tensor, kb: SCDKnowledgeBase, **options) -> tuple[bytes, EncodeReport]:
    started = time.perf_counter()
    manifest, sections = encode_sections(producer, input_ids, kb, **options)
    payload = pack_payload(manifest, sections)
    report = EncodeReport(manifest["tokens"] * manifest["batch"],
                          (manifest["tokens"] - manifest["exact_columns"]) * manifest["batch"], len(payload),
                          time.perf_counter() - started)
    return payload, report


def encode_stream(producer, input_ids: torch.Tensor, kb: SCDKnowledgeBase, **options) -> Iterator[bytes]:
    """The payload as chunks (header and manifest, then one chunk per section, layers in order), for a sender that
    writes each to a socket as it goes; ``b"".join`` of them is :func:`encode`'s payload."""
    return iter_payload_chunks(*encode_sections(producer, input_ids, kb, **options))


def truncate_payload_plan(plan: list[LayerPlan], fraction: float) -> list[LayerPlan]:
    """The plan a progressive payload keeps when only ``fraction`` of each layer's leading components are sent
    (at least one per code)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}.")

    def keep(rank: int) -> int:
        return 0 if rank == 0 else max(1, round(rank * fraction))

    return [LayerPlan(layer.index, layer.kind, keep(layer.key_rank), keep(layer.value_rank), keep(layer.patch_rank),
                      layer.patch_mode, layer.depth) for layer in plan]


def truncate_payload(payload: bytes, fraction: float) -> bytes:
    """A smaller payload that keeps only the leading ``fraction`` of every code's components: what a sender does to
    fit a bandwidth budget (or what a receiver decodes when the rest has not arrived). PCA codes are ordered, so the
    consumer decodes the prefix with the same knowledge base, least-squares optimally."""
    manifest, sections = unpack_payload(payload)
    manifest.pop("sections")
    bits = manifest["code_bits"]
    old_plan = _read_plan(manifest["layers"])
    new_plan = truncate_payload_plan(old_plan, fraction)
    for old, new in zip(old_plan, new_plan):
        names = (("key", old.key_rank, new.key_rank), ("value", old.value_rank, new.value_rank)) \
            if old.kind == "reuse" else (("patch", old.patch_rank, new.patch_rank),)
        for name, rank, kept in names:
            key = f"layers.{old.index}.{name}_codes"
            if key not in sections:
                continue
            codes = sections[key]
            if bits == 4:
                sections[key] = pack_int4(unpack_int4(codes, rank)[..., :kept])
            else:
                sections[key] = codes[..., :kept].contiguous()
    manifest["layers"] = [layer.to_dict() for layer in new_plan]
    return pack_payload(manifest, sections)
