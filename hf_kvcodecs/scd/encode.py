"""The producer's side: prefill a prompt, code every layer with the knowledge base, and write one payload.

The payload's manifest (:class:`~hf_kvcodecs.scd.manifest.PayloadManifest`) binds what it was made from: the knowledge
base's save id, the producer's and the intended consumer's weight and active-adapter hashes, the tokenizer's hash and
a hash of the prompt's token ids (with its attention mask), so a consumer can refuse a payload that is not for it and
say which part differs. The manifest, with every section's shape, is known before the prefill runs, so
:func:`encode_to` writes it first and then each layer's sections as soon as the prefill has produced them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..codecs import bit_allocation
from ..codecs.lowrank import pack_int4, unpack_int4
from .coding import encode_layer
from .knowledge_base import CODE_BITS, KnowledgeBaseError, LayerPlan, SCDKnowledgeBase
from .manifest import (
    CODEC_ID,
    CODEC_VERSION,
    READABLE_CODEC_VERSIONS,
    PairMismatchError,
    PayloadManifest,
    check_left_padded,
    check_tokenizer,
    exact_columns,
    identity_mismatch,
)
from .model_access import LayerCapture, model_identity, prefill_with_taps, shapes
from .payload import PayloadError, unpack_payload
from .progressive import merge_all, split_refinements

__all__ = [
    "CODEC_ID", "CODEC_VERSION", "READABLE_CODEC_VERSIONS", "EncodeReport", "PairMismatchError", "check_left_padded",
    "check_producer", "encode", "encode_sections", "encode_stream", "encode_to", "encode_with_report",
    "exact_columns", "truncate_payload", "truncate_payload_plan",
]


def check_producer(producer, kb: SCDKnowledgeBase) -> dict:
    identity = model_identity(producer)
    problem = identity_mismatch(identity, kb.producer, "producer")
    if problem is not None:
        raise PairMismatchError(f"{problem}; fit a knowledge base for this producer with `hf-kvcodecs scd fit`.")
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


def _encode(producer, input_ids: torch.Tensor, kb: SCDKnowledgeBase, on_manifest: Callable[[PayloadManifest], None],
            on_section: Callable[[str, torch.Tensor], None], *, attention_mask: torch.Tensor | None = None,
            tokenizer=None, code_bits: int | None = None, progressive: float | None = None) -> PayloadManifest:
    """Check the inputs and the pair, call ``on_manifest`` with the payload's manifest before the prefill, then
    ``on_section(name, cpu_tensor)`` for every section in wire order, each as soon as the prefill has produced it
    and every section before it (a progressive payload's order differs from the layers')."""
    if input_ids.ndim == 1:
        input_ids = input_ids[None]
    if input_ids.ndim != 2 or input_ids.shape[1] < 1 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be integer token ids [batch, tokens], got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}.")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.reshape(input_ids.shape)
    check_tokenizer(tokenizer, kb, "producer")
    bits = code_bits or kb.code_bits
    if bits not in CODE_BITS:
        raise ValueError(f"code_bits must be one of {CODE_BITS}, got {bits}.")
    if bits < kb.code_bits:
        raise KnowledgeBaseError(f"This knowledge base's plan was chosen for {kb.code_bits}-bit codes; coding at "
                                 f"{bits} bits would exceed its quality budget. Fit one for {bits}-bit codes.")
    if kb.code_format == "whitened" and bits < 16 and bits != kb.code_bits:
        raise KnowledgeBaseError(f"This knowledge base codes whitened widths allocated at the bytes of "
                                 f"{kb.code_bits}-bit codes; code at {kb.code_bits} bits, or send floats (16 or 32).")
    kb.identity()  # an unsaved knowledge base is refused before the prefill: a payload must name its save
    identity = check_producer(producer, kb)
    model_shapes = shapes(producer)
    if model_shapes.layers != kb.num_layers:
        raise KnowledgeBaseError(f"The knowledge base plans {kb.num_layers} layers; the producer has "
                                 f"{model_shapes.layers}.")
    manifest = PayloadManifest.for_prompt(kb, identity, input_ids, mask, bits, progressive=progressive)
    start = manifest.exact_columns
    table = manifest.section_table()
    on_manifest(manifest)
    on_section("input.attention_mask", mask.to(torch.uint8).cpu())
    on_section("input.exact_token_ids", input_ids[:, :start].to(torch.int64).cpu())
    plan, bases = manifest.layers, manifest.base_layers()
    owed = [spec.name for spec in table[2:]]  # in wire order: a section goes out once every one before it has
    ready: dict[str, torch.Tensor] = {}
    expected = {spec.name for spec in table}

    def on_layer(capture: LayerCapture) -> None:
        if start >= input_ids.shape[1]:
            return
        produced = encode_layer(capture, kb.plan[capture.index], kb, start, bits)
        if manifest.progressive is not None:
            produced, refined = split_refinements(plan[capture.index], bases[capture.index], produced, bits)
            produced.update(refined)
        unlisted = sorted(set(produced) - expected)
        if unlisted:
            raise PayloadError(f"Layer {capture.index}'s coder produced sections {unlisted} the manifest does not "
                               "list.")
        ready.update((name, tensor.cpu()) for name, tensor in produced.items())
        while owed and owed[0] in ready:
            name = owed.pop(0)
            on_section(name, ready.pop(name))

    # The producer runs only as deep as the plan reads: layers a recompute block covers are the consumer's to run.
    deepest = max(layer.index for layer in kb.plan if layer.kind != "recomputed")
    prefill_with_taps(producer, input_ids, mask, on_layer, inputs_of=set(kb.input_layers),
                      residuals_of=set(kb.residual_layers), stop_after=deepest)
    if owed:
        raise PayloadError(f"The coder produced no section {owed[0]!r}, which the manifest lists.")
    return manifest


@torch.inference_mode()
def encode_to(producer, input_ids: torch.Tensor, kb: SCDKnowledgeBase, write: Callable[[bytes], object],
              **options) -> PayloadManifest:
    """Prefill ``input_ids`` on ``producer`` and write the payload through ``write`` (e.g. ``socket.sendall``) as it
    is produced: the header and manifest before the prefill runs, the prompt's sections, then each layer's sections
    (codes, scales, and a recompute Patch layer's RMS, each followed by its CRC-32) as soon as that layer has run.
    ``b"".join`` of what was written is :func:`encode`'s payload. Returns the manifest. Takes :func:`encode`'s
    options (``hmac_key`` included); every check that can refuse the inputs runs before the first write."""
    writer = None
    hmac_key = options.pop("hmac_key", None)

    def on_manifest(manifest: PayloadManifest) -> None:
        nonlocal writer
        writer = manifest.writer(hmac_key)
        write(writer.head)

    manifest = _encode(producer, input_ids, kb, on_manifest, lambda name, tensor: write(writer.chunk(name, tensor)),
                       **options)
    writer.close()
    return manifest


@torch.inference_mode()
def encode_sections(producer, input_ids: torch.Tensor, kb: SCDKnowledgeBase, **options,
                    ) -> tuple[PayloadManifest, dict[str, torch.Tensor]]:
    """The manifest and sections (CPU tensors, in wire order) of the payload for ``input_ids`` ``[B, T]`` (or
    ``[T]``); ``manifest.pack(sections)`` is :func:`encode`'s payload."""
    sections: dict[str, torch.Tensor] = {}
    manifest = _encode(producer, input_ids, kb, lambda manifest: None, sections.__setitem__, **options)
    return manifest, sections


def encode(producer, input_ids: torch.Tensor, kb: SCDKnowledgeBase, *, attention_mask: torch.Tensor | None = None,
           tokenizer=None, code_bits: int | None = None, progressive: float | None = None,
           hmac_key: bytes | None = None) -> bytes:
    """Prefill ``input_ids`` on ``producer`` and return the SCD payload for the consumer ``kb`` was fitted for.

    ``kb`` must be saved (a payload names its save). Pass ``tokenizer`` to have it checked against the knowledge
    base's (a knowledge base fitted without one refuses the check). The consumer rebuilds its cache with
    :meth:`~hf_kvcodecs.scd.SCDTransferCache.from_payload`; ``len(payload) / input_ids.shape[-1]`` is the bytes per
    token on the wire (see :func:`encode_with_report`).

    ``progressive=f`` (0 < f < 1) orders the payload so that every prefix is useful: the prompt, then each layer's
    Patch sections and the leading ``f`` of its Reuse codes' components, then the remaining components (see
    :mod:`~hf_kvcodecs.scd.progressive`); a consumer reading it as a stream
    (:meth:`~hf_kvcodecs.scd.SCDTransferCache.from_stream`) can stop at a deadline or byte budget and decode what
    arrived. Its bytes are those of the one-pass payload plus one CRC-32 per refinement section.

    ``hmac_key`` (bytes shared with the consumer) signs the payload with HMAC-SHA256 tags, 32 bytes after the
    manifest and after each section: a consumer given the key refuses any payload it did not sign."""
    chunks: list[bytes] = []
    encode_to(producer, input_ids, kb, chunks.append, attention_mask=attention_mask, tokenizer=tokenizer,
              code_bits=code_bits, progressive=progressive, hmac_key=hmac_key)
    return b"".join(chunks)


def encode_with_report(producer, input_ids: torch.Tensor, kb: SCDKnowledgeBase, **options) -> tuple[bytes, EncodeReport]:
    started = time.perf_counter()
    chunks: list[bytes] = []
    manifest = encode_to(producer, input_ids, kb, chunks.append, **options)
    payload = b"".join(chunks)
    report = EncodeReport(manifest.tokens * manifest.batch, manifest.coded_tokens * manifest.batch, len(payload),
                          time.perf_counter() - started)
    return payload, report


def encode_stream(producer, input_ids: torch.Tensor, kb: SCDKnowledgeBase, **options) -> Iterator[bytes]:
    """The payload as chunks (header and manifest, then one chunk per section with its CRC-32, layers in order);
    ``b"".join`` of them is :func:`encode`'s payload. The prefill has run when this returns; to send each chunk as it
    is produced, use :func:`encode_to`."""
    chunks: list[bytes] = []
    encode_to(producer, input_ids, kb, chunks.append, **options)
    return iter(chunks)


def truncate_payload_plan(plan: list[LayerPlan], fraction: float) -> list[LayerPlan]:
    """The plan a progressive payload keeps when only ``fraction`` of each layer's leading components are sent
    (at least one per code)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}.")

    def keep(rank: int) -> int:
        return 0 if rank == 0 else max(1, round(rank * fraction))

    return [LayerPlan(layer.index, layer.kind, keep(layer.key_rank), keep(layer.value_rank), keep(layer.patch_rank),
                      layer.patch_mode, layer.depth,
                      {name: code.prefix(keep(code.rank)) for name, code in layer.widths.items()})
            for layer in plan]


def truncate_payload(payload: bytes, fraction: float) -> bytes:
    """A smaller payload that keeps only the leading ``fraction`` of every code's components: what a sender does to
    fit a bandwidth budget (or what a receiver decodes when the rest has not arrived). PCA codes are ordered, so the
    consumer decodes the prefix with the same knowledge base, least-squares optimally: a documented partial decode,
    whose manifest says which ranks it carries (the consumer accepts any rank from 1 to the knowledge base's).
    Whitened codes are cut to the byte prefix of their first components
    (:func:`~hf_kvcodecs.codecs.bit_allocation.truncate`), and the manifest carries those components' widths."""
    raw, sections = unpack_payload(payload)
    manifest = PayloadManifest.read(raw)
    if manifest.progressive is not None:  # the one-pass payload of the same codes, then cut like any other
        sections = merge_all(manifest.layers, manifest.base_layers(), sections, manifest.code_bits)
        manifest = dataclasses.replace(manifest, progressive=None)
    bits = manifest.code_bits
    new_plan = truncate_payload_plan(list(manifest.layers), fraction)
    for old, new in zip(manifest.layers, new_plan):
        for (name, rank), (_, kept) in zip(old.code_ranks(), new.code_ranks()):
            key = f"layers.{old.index}.{name}_codes"
            if key not in sections:
                continue
            codes = sections[key]
            if name in old.widths and bits < 16:
                sections[key] = bit_allocation.truncate(codes, old.widths[name].bits, kept)
            elif bits == 4:
                sections[key] = pack_int4(unpack_int4(codes, rank)[..., :kept])
            else:
                sections[key] = codes[..., :kept].contiguous()
    return dataclasses.replace(manifest, layers=tuple(new_plan)).pack(sections)
