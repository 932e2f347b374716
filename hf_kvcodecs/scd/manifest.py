"""The SCD payload manifest: one typed, versioned object (:class:`PayloadManifest`), one writer and one validator.

A payload is the container of :mod:`hf_kvcodecs.scd.payload` (header, JSON manifest, raw sections, each followed by
its CRC-32) whose manifest says what the sections are for and whom. The manifest binds the payload to:

- the codec and its version (``codec``, ``codec_version``): a consumer refuses a version it does not read;
- the knowledge base that coded it (``knowledge_base``, its save id: an unsaved knowledge base can neither write nor
  read a payload);
- the producer and the intended consumer (``producer`` / ``consumer``: weights, the adapters the model applies,
  their scaling, and their names for messages; see :func:`~hf_kvcodecs.scd.model_access.model_identity`);
- the tokenizer (``tokenizer_sha256``, always the knowledge base's own, ``null`` for one fitted without a
  tokenizer) and the prompt (``token_ids_sha256``: its token ids and attention mask);
- its sizes (``batch``, ``tokens``, ``exact_columns``: the leading columns the consumer computes itself, always the
  left padding plus the knowledge base's ``exact_tokens``) and its codes (``code_format``, ``code_bits``,
  ``layers``: the layer plan, with each layer's carried ranks and, for whitened codes, the widths of the components
  it carries as ``[width, count]`` runs and whether it sends gains: enough to cut the codes to a shorter prefix
  without the knowledge base, see :func:`~hf_kvcodecs.scd.encode.truncate_payload`).

Everything else follows from those: the section table (every section's name, dtype and shape, in wire order) is
derived from the plan and the sizes, so a producer writes the manifest before its first section exists and then
sends each section as the prefill produces it (:meth:`PayloadManifest.writer`), and a consumer checks the whole table
before it reads a section or allocates anything (:meth:`PayloadManifest.parse`).

The writer is :meth:`PayloadManifest.to_json` (with :meth:`~PayloadManifest.writer` / :meth:`~PayloadManifest.pack`
for the bytes); the validator is :meth:`PayloadManifest.parse`. Each refusal is a :class:`PayloadError` (the payload
is malformed, or over the consumer's limits), a :class:`PairMismatchError` (a well-formed payload for another
knowledge base, model, tokenizer or prompt) or a :class:`KnowledgeBaseError` (the knowledge base cannot check it),
and names what to do about it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .coding import section_layout
from .knowledge_base import (
    CODE_BITS,
    CODE_FORMATS,
    WHITENED_CODE_BITS,
    KnowledgeBaseError,
    LayerPlan,
    SCDKnowledgeBase,
    _read_plan,
    plan_bytes_per_token,
    plan_code_format,
)
from .model_access import token_ids_sha256, tokenizer_sha256
from .payload import CRC_BYTES, HEADER_BYTES, MAX_MANIFEST_BYTES, PayloadError, PayloadWriter, SectionSpec
from .progressive import base_layer, refinement_layout

__all__ = [
    "CODEC_ID", "CODEC_VERSION", "DEFAULT_MAX_BATCH", "DEFAULT_MAX_TOKENS", "READABLE_CODEC_VERSIONS", "ModelBinding",
    "PairMismatchError", "PayloadLimits", "PayloadManifest", "check_left_padded", "check_tokenizer", "exact_columns",
    "identity_mismatch",
]

CODEC_ID = "hf_kvcodecs.scd.reuse_patch"
# 1: projection-only Patch layers; 2: recompute Patch layers; 3: the typed manifest (active adapters and their
# scaling in the identities, a knowledge-base id and tokenizer hash always named, no unknown keys) in payload format 2
# (section CRCs after the sections, so sections stream as they are produced). Whitened codes (per-component widths in
# the layer table, gains instead of scales) add the key code_format, which a reader that predates them refuses as
# unknown; flat payloads leave it out and are what they were.
CODEC_VERSION = 3
READABLE_CODEC_VERSIONS = (3,)

# What one payload may make a consumer do, unless the caller says otherwise: rebuild (and, for the exact columns,
# prefill) at most DEFAULT_MAX_BATCH prompts of at most DEFAULT_MAX_TOKENS tokens each.
DEFAULT_MAX_BATCH = 16
DEFAULT_MAX_TOKENS = 32_768

_MAX_ID_CHARS = 256
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KEYS = ("codec", "codec_version", "knowledge_base", "producer", "consumer", "tokenizer_sha256", "token_ids_sha256",
         "batch", "tokens", "exact_columns", "code_bits", "layers")
# code_format: written for whitened codes only, absent means flat; progressive: written for progressive payloads only
# (the fraction of each Reuse code's components in the base pass, see progressive.py), absent means one pass
_OPTIONAL_KEYS = ("code_format", "progressive")
_CONTAINER_KEYS = ("sections",)  # written and checked by the container (payload.py)


class PairMismatchError(ValueError):
    """A model, adapter, tokenizer or prompt is not the one a knowledge base or payload was made for."""


def _fail(message: str) -> None:
    raise PayloadError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    return "none" if value is None else str(value)[:12]


# ------------------------------------------------------------------------------------------------ prompt geometry


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


# ------------------------------------------------------------------------------------------------------ identities


@dataclass(frozen=True)
class ModelBinding:
    """One side of the pair as a payload names it: hashes of the weights, of the adapters the model applies and of
    their scaling, and the adapters' names (for messages; names are labels, the hashes are what is compared)."""

    weights_sha256: str | None
    adapter_sha256: str | None
    adapter_scaling_sha256: str | None = None
    active_adapters: tuple[str, ...] = ()

    @classmethod
    def from_identity(cls, identity: Mapping) -> ModelBinding:
        """From :func:`~hf_kvcodecs.scd.model_access.model_identity`, or a knowledge base's record of one (which may
        predate the scaling and names)."""
        return cls(identity.get("weights_sha256"), identity.get("adapter_sha256"),
                   identity.get("adapter_scaling_sha256"), tuple(identity.get("active_adapters") or ()))

    def to_json(self) -> dict:
        return {"weights_sha256": self.weights_sha256, "adapter_sha256": self.adapter_sha256,
                "adapter_scaling_sha256": self.adapter_scaling_sha256, "active_adapters": list(self.active_adapters)}

    @classmethod
    def _read(cls, raw: Any, side: str) -> ModelBinding:
        keys = ("weights_sha256", "adapter_sha256", "adapter_scaling_sha256", "active_adapters")
        if not isinstance(raw, dict) or set(raw) != set(keys):
            _fail(f"The payload's {side} must be an object with exactly the keys {list(keys)}, got "
                  f"{sorted(raw) if isinstance(raw, dict) else type(raw).__name__}.")
        for key in keys[:3]:
            value = raw[key]
            if value is not None and not (isinstance(value, str) and 0 < len(value) <= _MAX_ID_CHARS):
                _fail(f"The payload's {side}.{key} must be a hash string or null, got {str(value)[:40]!r}.")
        names = raw["active_adapters"]
        if not isinstance(names, list) or len(names) > 64 or \
                not all(isinstance(name, str) and len(name) <= _MAX_ID_CHARS for name in names):
            _fail(f"The payload's {side}.active_adapters must be a list of adapter names.")
        return cls(raw["weights_sha256"], raw["adapter_sha256"], raw["adapter_scaling_sha256"], tuple(names))

    def difference(self, expected: Mapping) -> str | None:
        """Which part of this binding differs from ``expected`` (a knowledge base's record of one side):
        ``"weights"``, ``"adapter"``, ``"adapter scaling"``, or None. The scaling is compared when ``expected``
        records one (knowledge bases fitted before it was recorded do not)."""
        if self.weights_sha256 != expected.get("weights_sha256"):
            return "weights"
        if self.adapter_sha256 != expected.get("adapter_sha256"):
            return "adapter"
        if "adapter_scaling_sha256" in expected and self.adapter_scaling_sha256 != expected["adapter_scaling_sha256"]:
            return "adapter scaling"
        return None


def _adapter_words(binding: ModelBinding) -> str:
    if binding.adapter_sha256 is None:
        return "no adapter applied"
    names = f"active {list(binding.active_adapters)}, " if binding.active_adapters else ""
    return f"{names}sha256 {_short(binding.adapter_sha256)}"


def identity_mismatch(identity: Mapping, expected: Mapping, side: str) -> str | None:
    """Why a model whose :func:`~hf_kvcodecs.scd.model_access.model_identity` is ``identity`` is not the ``side``
    (``"producer"`` / ``"consumer"``) a knowledge base recorded as ``expected``; None when it is that model."""
    who = "The producer" if side == "producer" else f"This {side}"
    got, want = ModelBinding.from_identity(identity), ModelBinding.from_identity(expected)
    difference = got.difference(expected)
    if difference is None:
        return None
    name = f", model {expected.get('name')!r}" if expected.get("name") else ""
    if difference == "weights":
        return (f"{who}'s weights (sha256 {_short(got.weights_sha256)}) differ from those the knowledge base was "
                f"fitted for ({_short(want.weights_sha256)}{name})")
    if difference == "adapter":
        return (f"{who}'s LoRA adapter ({_adapter_words(got)}) is not the one the knowledge base was fitted for "
                f"({_adapter_words(want)}{name}): if the {side} holds that adapter, activate it (set_adapter(...); "
                "outside a disable_adapter() block; not merged in place)")
    return (f"{who}'s LoRA adapter is the one the knowledge base was fitted for, but at another scaling "
            f"({_adapter_words(got)}; lora_alpha / r or set_scale differ{name})")


def check_tokenizer(tokenizer, kb: SCDKnowledgeBase, side: str) -> None:
    """Refuse a ``tokenizer`` that is not the knowledge base's; a knowledge base fitted without one cannot check it."""
    if tokenizer is None:
        return
    if kb.tokenizer_sha256 is None:
        raise KnowledgeBaseError(
            f"This knowledge base was fitted without a tokenizer (its tokenizer_sha256 is null), so it cannot check "
            f"that the {side}'s tokenizer gives token ids the same meaning; fit it with its tokenizer "
            "(`hf-kvcodecs scd fit` passes it; fit_knowledge_base(..., tokenizer=...)), or pass tokenizer=None to go "
            "without the check.")
    if tokenizer_sha256(tokenizer) != kb.tokenizer_sha256:
        raise PairMismatchError(f"The {side}'s tokenizer is not the one the knowledge base was fitted with; the "
                                f"token ids would mean different text on the two sides. Use the knowledge base's "
                                "tokenizer, or fit a knowledge base with this one.")


# ----------------------------------------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class PayloadLimits:
    """What one payload may ask of a consumer, checked before anything is allocated: at most ``max_batch`` prompts
    of at most ``max_tokens`` tokens each. The consumer's work and memory (the cache, and the prefill of the exact
    columns) grow with ``batch * tokens``, and a payload's bytes need not: a few bytes per token can ask for a long
    rebuild. The default byte limit of a payload follows from these (:meth:`max_payload_bytes`)."""

    max_batch: int = DEFAULT_MAX_BATCH
    max_tokens: int = DEFAULT_MAX_TOKENS

    def __post_init__(self):
        for name in ("max_batch", "max_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")

    def max_payload_bytes(self, kb: SCDKnowledgeBase) -> int:
        """The largest payload ``kb`` can write within these limits: the header and the largest manifest, then for
        every token its mask byte, an exact token id and the codes at 32 bits (the widest), and every CRC."""
        per_token = 1 + 8 + math.ceil(plan_bytes_per_token(kb.plan, 32))
        sections = 2 + 7 * kb.num_layers  # a progressive payload adds up to two refinement sections per layer
        return HEADER_BYTES + MAX_MANIFEST_BYTES + self.max_batch * self.max_tokens * per_token + CRC_BYTES * sections


# --------------------------------------------------------------------------------------------------------- manifest


def check_progressive(fraction: Any) -> None:
    """``None`` (one pass) or the base pass's fraction of each Reuse code, a float strictly between 0 and 1."""
    if fraction is None:
        return
    if not isinstance(fraction, float) or not 0.0 < fraction < 1.0:
        raise ValueError(f"progressive fraction must be a float strictly between 0 and 1 (or None for a one-pass "
                         f"payload), got {str(fraction)[:40]}")


def _describe(layer: LayerPlan) -> str:
    if layer.kind == "reuse":
        return f"'reuse' (key rank {layer.key_rank}, value rank {layer.value_rank})"
    if layer.kind == "recomputed":
        return "'recomputed'"
    return f"a {layer.patch_mode} Patch layer of depth {layer.depth} (rank {layer.patch_rank})"


@dataclass(frozen=True)
class PayloadManifest:
    """The manifest of one SCD payload (see the module docstring for what each field binds).

    Build it with :meth:`for_prompt` (the producer), write it with :meth:`to_json` / :meth:`writer` / :meth:`pack`,
    read and validate one with :meth:`parse` (the consumer) or, without a knowledge base, :meth:`read`.
    """

    knowledge_base: str
    producer: ModelBinding
    consumer: ModelBinding
    tokenizer_sha256: str | None
    token_ids_sha256: str
    batch: int
    tokens: int
    exact_columns: int
    code_bits: int
    layers: tuple[LayerPlan, ...]
    codec: str = CODEC_ID
    codec_version: int = CODEC_VERSION
    progressive: float | None = None  # the base pass's fraction of each Reuse code, or None for one pass

    @property
    def code_format(self) -> str:
        """``whitened`` when the layer table carries code widths (always below 16 bits), else ``flat``."""
        return plan_code_format(self.layers)

    # ---- built by the producer --------------------------------------------------------------------------------
    @classmethod
    def for_prompt(cls, kb: SCDKnowledgeBase, producer_identity: Mapping, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, code_bits: int, progressive: float | None = None,
                   ) -> PayloadManifest:
        """The manifest of ``kb``'s payload for a prompt ``[B, T]`` (left-padded ``attention_mask``), coded by a
        producer whose identity was checked against ``kb``. Refuses an unsaved knowledge base (a payload must name
        the save that decodes it). A whitened knowledge base's plan travels with its widths, except at 16 and 32
        bits, where codes are floats in either format. ``progressive`` (a float in (0, 1)) orders the sections in a
        base pass and a refinement pass (see :mod:`~hf_kvcodecs.scd.progressive`)."""
        check_progressive(progressive)
        layers = tuple(kb.plan) if code_bits < 16 else tuple(dataclasses.replace(layer, widths={})
                                                                for layer in kb.plan)
        return cls(kb.identity(), ModelBinding.from_identity(producer_identity),
                   ModelBinding.from_identity(kb.consumer), kb.tokenizer_sha256,
                   token_ids_sha256(input_ids, attention_mask), int(input_ids.shape[0]), int(input_ids.shape[1]),
                   exact_columns(attention_mask, kb.exact_tokens), int(code_bits), layers,
                   progressive=progressive)

    @property
    def coded_tokens(self) -> int:
        """Columns per row sent as codes (after the exact columns)."""
        return self.tokens - self.exact_columns

    def section_table(self) -> list[SectionSpec]:
        """Every section the payload carries, in wire order: the attention mask ``[B, T]`` (uint8), the exact
        columns' token ids ``[B, E]`` (int64), then, if any column is coded, each layer's sections in layer order as
        :func:`~hf_kvcodecs.scd.coding.section_layout` lists them (codes, their scales or gains, a recompute Patch
        layer's RMS). A progressive payload sends every Patch layer's sections, then each Reuse layer's base pass
        from the deepest layer to the first, then the refinements in that order."""
        batch, coded = self.batch, self.coded_tokens
        table = [SectionSpec("input.attention_mask", torch.uint8, (batch, self.tokens)),
                 SectionSpec("input.exact_token_ids", torch.int64, (batch, self.exact_columns))]
        if coded == 0:
            return table
        if self.progressive is None:
            for layer in self.layers:
                table.extend(section_layout(layer, self.code_bits, batch, coded))
            return table
        # Patch sections first: a recompute block can run as soon as they are in, and a cut after them leaves only
        # Reuse layers to decode at a lower rank or, deepest first, the shallowest to recompute (the cheapest).
        bases = self.base_layers()
        order = [layer for layer in bases if layer.kind == "patch"] + \
            [layer for layer in reversed(bases) if layer.kind == "reuse"]
        for base in order:
            table.extend(section_layout(base, self.code_bits, batch, coded))
        for base in order:
            table.extend(refinement_layout(self.layers[base.index], base, self.code_bits, batch, coded))
        return table

    def base_layers(self) -> tuple[LayerPlan, ...]:
        """Each layer's plan in a progressive payload's base pass (the full plan for a one-pass payload)."""
        if self.progressive is None:
            return self.layers
        return tuple(base_layer(layer, self.progressive) for layer in self.layers)

    # ---- the writer -------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        """The manifest's JSON object (the container adds ``"sections"``, the table, when it writes it)."""
        return {"codec": self.codec, "codec_version": self.codec_version, "knowledge_base": self.knowledge_base,
                "producer": self.producer.to_json(), "consumer": self.consumer.to_json(),
                "tokenizer_sha256": self.tokenizer_sha256, "token_ids_sha256": self.token_ids_sha256,
                "batch": self.batch, "tokens": self.tokens, "exact_columns": self.exact_columns,
                **({"code_format": self.code_format} if self.code_format != "flat" else {}),
                **({"progressive": self.progressive} if self.progressive is not None else {}),
                "code_bits": self.code_bits, "layers": [layer.to_dict() for layer in self.layers]}

    def writer(self, hmac_key: bytes | None = None) -> PayloadWriter:
        """A writer whose ``head`` (header and manifest) can be sent before any section exists; then
        ``chunk(name, tensor)`` per section of :meth:`section_table`, in order. ``hmac_key`` signs it (see
        :mod:`~hf_kvcodecs.scd.payload`)."""
        return PayloadWriter(self.to_json(), self.section_table(), hmac_key=hmac_key)

    def pack(self, sections: Mapping[str, torch.Tensor], hmac_key: bytes | None = None) -> bytes:
        """The whole payload, with ``sections`` written in table order (each must be there, and nothing else)."""
        writer = self.writer(hmac_key)
        extra = sorted(set(sections) - {spec.name for spec in writer.table})
        if extra:
            _fail(f"Sections {extra[:5]} are not in this manifest's section table.")
        missing = [spec.name for spec in writer.table if spec.name not in sections]
        if missing:
            _fail(f"Sections {missing[:5]} of this manifest's section table were not produced.")
        chunks = [writer.head, *(writer.chunk(spec.name, sections[spec.name]) for spec in writer.table)]
        writer.close()
        return b"".join(chunks)

    # ---- the validator ----------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, raw: Any, kb: SCDKnowledgeBase, sections: Mapping[str, torch.Tensor] | None = None, *,
              limits: PayloadLimits | None = None, vocab_size: int | None = None,
              partial: bool = False) -> PayloadManifest:
        """Validate a payload's manifest (as :func:`~hf_kvcodecs.scd.payload.unpack_payload` returns it) for a
        consumer holding ``kb``, and return it typed.

        Checks, in order: the codec and its version; the keys (none missing, none unknown), every value's type
        and range and the layer table's structure; then, against ``kb``: that it is saved and is the one named,
        the producer's and consumer's identities, the tokenizer, ``limits`` (batch and tokens), the exact columns
        against ``kb.exact_tokens``, the code bits and every layer's kind, mode, depth and ranks; then the section
        table the container read (names, dtypes and shapes must be exactly those the plan and sizes imply). With ``sections``
        (the tensors) it then checks their contents: dtypes and shapes, finite floats, a 0/1 left-padded mask whose
        padding plus ``kb.exact_tokens`` is exactly the exact columns, and exact token ids inside ``vocab_size``.

        Without ``sections`` nothing here allocates more than the manifest's own size, so a consumer runs it before
        it reads any section (``unpack_payload(..., check=...)``). ``partial=True`` (a stream cut short) checks the
        sections that arrived, which must include the prompt's, and lets the others be missing.
        """
        manifest = cls._read_fields(raw)
        manifest._check_against(kb, limits or PayloadLimits())
        if "sections" in raw:
            manifest._check_table(raw["sections"])
        if sections is not None:
            manifest._check_sections(sections, kb, vocab_size, partial)
        return manifest

    @classmethod
    def read(cls, raw: Any) -> PayloadManifest:
        """The manifest's structure only, no knowledge base needed (its fields, and the section table it implies
        against the one the container read): what :meth:`parse` checks without the knowledge base."""
        manifest = cls._read_fields(raw)
        if "sections" in raw:
            manifest._check_table(raw["sections"])
        return manifest

    @classmethod
    def _read_fields(cls, raw: Any) -> PayloadManifest:
        if not isinstance(raw, dict):
            _fail(f"The payload's manifest must be a JSON object, not a {type(raw).__name__}.")
        if raw.get("codec") != CODEC_ID:
            _fail(f"This payload's codec is {str(raw.get('codec'))[:80]!r}, not SCD's {CODEC_ID!r}.")
        version = raw.get("codec_version")
        if not _is_int(version) or version not in READABLE_CODEC_VERSIONS:
            _fail(f"SCD codec version {str(version)[:20]} is not supported (this hf_kvcodecs reads "
                  f"{', '.join(map(str, READABLE_CODEC_VERSIONS))}); upgrade hf_kvcodecs on the consumer or re-encode "
                  "on the producer with this version.")
        missing = [key for key in _KEYS if key not in raw]
        unknown = sorted(key for key in raw if key not in _KEYS + _OPTIONAL_KEYS + _CONTAINER_KEYS)
        if missing or unknown:
            _fail(f"The payload's manifest must have exactly the keys of codec version {CODEC_VERSION}; missing "
                  f"{missing}, unknown {[str(key)[:40] for key in unknown[:5]]}.")
        knowledge_base = raw["knowledge_base"]
        if not (isinstance(knowledge_base, str) and 0 < len(knowledge_base) <= _MAX_ID_CHARS):
            _fail(f"The payload names no knowledge base (knowledge_base is {str(knowledge_base)[:40]!r}); a payload "
                  "must name the saved knowledge base that coded it. Re-encode with a saved knowledge base.")
        producer = ModelBinding._read(raw["producer"], "producer")
        consumer = ModelBinding._read(raw["consumer"], "consumer")
        tokenizer = raw["tokenizer_sha256"]
        if tokenizer is not None and not (isinstance(tokenizer, str) and 0 < len(tokenizer) <= _MAX_ID_CHARS):
            _fail(f"The payload's tokenizer_sha256 must be a hash string or null, got {str(tokenizer)[:40]!r}.")
        token_ids = raw["token_ids_sha256"]
        if not (isinstance(token_ids, str) and _SHA256.fullmatch(token_ids)):
            _fail(f"The payload's token_ids_sha256 must be a SHA-256 hex digest, got {str(token_ids)[:80]!r}.")
        for key in ("batch", "tokens", "exact_columns", "code_bits"):
            if not _is_int(raw[key]) or raw[key] < 0:
                _fail(f"The payload's {key} must be a non-negative integer, got {str(raw[key])[:40]}.")
        batch, tokens, exact, bits = raw["batch"], raw["tokens"], raw["exact_columns"], raw["code_bits"]
        if not (batch >= 1 and tokens >= 1 and exact <= tokens):
            _fail(f"Inconsistent payload sizes: batch {batch}, tokens {tokens}, exact columns {exact}.")
        if bits not in CODE_BITS:
            _fail(f"The payload's codes are {bits}-bit; SCD codes are {', '.join(map(str, CODE_BITS))}-bit.")
        layers = raw["layers"]
        if isinstance(layers, list):
            for position, entry in enumerate(layers):
                index = entry.get("index") if isinstance(entry, dict) else None
                if index != position:
                    _fail(f"The payload's layer table lists layer index {str(index)[:20]} at position {position}; "
                          "it must list layers 0..L-1 in order.")
        try:
            plan = _read_plan(layers)
        except ValueError as error:
            _fail(f"The payload's layer table is malformed: {str(error)[:300]}.")
        code_format = raw.get("code_format", "flat")
        if code_format not in CODE_FORMATS:
            _fail(f"The payload's code_format must be one of {list(CODE_FORMATS)}, got {str(code_format)[:40]!r}.")
        if code_format != plan_code_format(plan):
            _fail(f"The payload's code_format is {code_format!r} but its layer table "
                  f"{'carries' if plan_code_format(plan) == 'whitened' else 'carries no'} code widths.")
        if code_format == "whitened" and bits not in WHITENED_CODE_BITS:
            _fail(f"The payload's whitened codes are marked {bits}-bit; whitened codes spend the bytes of "
                  f"{' or '.join(map(str, WHITENED_CODE_BITS))}-bit flat codes (floats are sent flat).")
        progressive = raw.get("progressive")
        try:
            check_progressive(progressive)
        except ValueError as error:
            _fail(f"The payload's {error}")
        return cls(knowledge_base, producer, consumer, tokenizer, token_ids, batch, tokens, exact, bits, tuple(plan),
                   raw["codec"], version, progressive)

    def _check_table(self, entries: Any) -> None:
        """The container's section table must be exactly the one this manifest implies."""
        expected = [spec.entry() for spec in self.section_table()]
        if entries == expected:
            return
        if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
            _fail("The payload's section table is not a list of section entries.")
        names = [entry.get("name") for entry in entries]
        wanted = [entry["name"] for entry in expected]
        missing = [name for name in wanted if name not in names]
        unexpected = [str(name)[:80] for name in names if name not in wanted]
        if missing or unexpected:
            _fail(f"The payload's sections do not match its manifest (missing: {missing[:5]}, unexpected: "
                  f"{unexpected[:5]}).")
        for got, want in zip(entries, expected):
            if got != want:
                _fail(f"Section {got.get('name')!r} is {got.get('dtype')} {got.get('shape')} at position "
                      f"{names.index(got.get('name'))}; the manifest implies {want['dtype']} {want['shape']} there "
                      f"(position {wanted.index(want['name'])}).")

    def _check_against(self, kb: SCDKnowledgeBase, limits: PayloadLimits) -> None:
        save_id = kb.identity()  # KnowledgeBaseError for an unsaved knowledge base: it cannot tell its payloads apart
        if self.knowledge_base != save_id:
            raise PairMismatchError(f"The payload was coded with knowledge base {self.knowledge_base!r}; this one is "
                                    f"{save_id!r}. Use the knowledge base the producer used.")
        for side in ("producer", "consumer"):
            binding, recorded = getattr(self, side), getattr(kb, side)
            difference = binding.difference(recorded)
            if difference is not None:
                field = {"weights": "weights_sha256", "adapter": "adapter_sha256",
                         "adapter scaling": "adapter_scaling_sha256"}[difference]
                what = "LoRA adapter" if difference == "adapter" else difference
                raise PairMismatchError(f"The payload names a {side} whose {what} differ from the knowledge base's "
                                        f"({_short(getattr(binding, field))} != {_short(recorded.get(field))}).")
        if self.tokenizer_sha256 != kb.tokenizer_sha256:
            raise PairMismatchError("The payload was tokenized with another tokenizer than the knowledge base's.")
        if self.batch > limits.max_batch:
            _fail(f"The payload holds a batch of {self.batch} prompts; this consumer accepts at most "
                  f"max_batch={limits.max_batch}. Send smaller batches, or raise the limit (from_payload(..., "
                  "max_batch=N), or cache_config={..., 'max_batch': N}).")
        if self.tokens > limits.max_tokens:
            _fail(f"The payload covers {self.tokens} tokens per prompt; this consumer accepts at most "
                  f"max_tokens={limits.max_tokens}. Send a shorter prompt, or raise the limit (from_payload(..., "
                  "max_tokens=N), or cache_config={..., 'max_tokens': N}).")
        least = min(kb.exact_tokens, self.tokens)
        if self.exact_columns < least:
            _fail(f"The payload marks {self.exact_columns} leading columns exact; this knowledge base computes at least "
                  f"its {kb.exact_tokens} exact tokens itself. Re-encode with this knowledge base.")
        if self.code_bits < kb.code_bits:
            _fail(f"The payload's codes are {self.code_bits}-bit; this knowledge base decodes {kb.code_bits}-bit codes "
                  "or finer.")
        if self.code_bits < 16 and self.code_format != kb.code_format:
            _fail(f"The payload's codes are {self.code_format}; this knowledge base codes {kb.code_format} "
                  "(below 16 bits a payload uses the knowledge base's code format). Re-encode with this knowledge "
                  "base.")
        if self.code_format == "whitened" and self.code_bits != kb.code_bits:
            _fail(f"The payload's whitened codes are marked {self.code_bits}-bit; this knowledge base's widths spend "
                  f"the bytes of {kb.code_bits}-bit codes.")
        if len(self.layers) != kb.num_layers:
            _fail(f"The payload has {len(self.layers)} layers; the knowledge base {kb.num_layers}.")
        for carried, fitted in zip(self.layers, kb.plan):
            if carried.index != fitted.index:
                _fail(f"The payload's layer table lists layer {carried.index} where the knowledge base has layer "
                      f"{fitted.index}.")
            if (carried.kind, carried.patch_mode, carried.depth) != (fitted.kind, fitted.patch_mode, fitted.depth):
                _fail(f"Layer {carried.index} is {_describe(carried)} in the payload but {_describe(fitted)} in the "
                      "knowledge base.")
            if carried.kind == "recomputed":
                continue
            ranks = ((carried.key_rank, fitted.key_rank, "key"), (carried.value_rank, fitted.value_rank, "value")) \
                if carried.kind == "reuse" else ((carried.patch_rank, fitted.patch_rank, "patch"),)
            for rank, limit, name in ranks:
                if not (1 <= rank <= limit or rank == 0 == limit):
                    _fail(f"Layer {carried.index} carries {name} rank {rank}; the knowledge base decodes 1..{limit}.")
                if name in carried.widths and carried.widths[name] != fitted.widths[name].prefix(rank):
                    _fail(f"Layer {carried.index}'s {name} code widths (gain {carried.widths[name].gain}, "
                          f"{carried.widths[name].runs()[:4]}...) are not the first {rank} of the knowledge base's "
                          f"(gain {fitted.widths[name].gain}, {fitted.widths[name].prefix(rank).runs()[:4]}...).")

    def _check_sections(self, sections: Mapping[str, torch.Tensor], kb: SCDKnowledgeBase,
                        vocab_size: int | None, partial: bool = False) -> None:
        table = self.section_table()
        missing = sorted({spec.name for spec in table} - set(sections))
        if partial:  # a stream cut short: the sections that arrived must still be the table's, the prompt's included
            missing = [name for name in missing if name.startswith("input.")]
            table = [spec for spec in table if spec.name in sections]
        unexpected = sorted(set(sections) - {spec.name for spec in self.section_table()})
        if missing or unexpected:
            _fail(f"The payload's sections do not match its manifest (missing: {missing[:5]}, unexpected: "
                  f"{unexpected[:5]}).")
        for spec in table:
            tensor = sections[spec.name]
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                _fail(f"Section {spec.name!r} is {getattr(tensor, 'dtype', type(tensor).__name__)} "
                      f"{tuple(getattr(tensor, 'shape', ()))}; the manifest implies {spec.dtype} {spec.shape}.")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                _fail(f"Section {spec.name!r} holds non-finite values.")
        mask = sections["input.attention_mask"]
        if not bool(((mask == 0) | (mask == 1)).all()):
            _fail("The payload's attention mask must hold only 0 and 1.")
        try:
            expected = exact_columns(mask, kb.exact_tokens)
        except ValueError as error:
            raise PayloadError(f"The payload's attention mask is invalid: {error}") from None
        if self.exact_columns != expected:
            _fail(f"The payload marks {self.exact_columns} leading columns exact; with its left padding this knowledge "
                  f"base's are {expected} (the padding plus its {kb.exact_tokens} exact tokens, which the consumer "
                  "computes itself). Re-encode with this knowledge base.")
        ids = sections["input.exact_token_ids"]
        if ids.numel() and vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            _fail(f"The payload's exact token ids run from {int(ids.min())} to {int(ids.max())}, outside the "
                  f"consumer's vocabulary of {vocab_size} ids: it was tokenized for another model, or is corrupt.")

    # ---- the prompt -------------------------------------------------------------------------------------------
    def check_prompt(self, input_ids: Any, attention_mask: torch.Tensor | None, *, payload_mask: torch.Tensor,
                     new_tokens: int = 0, what: str = "input_ids") -> None:
        """Refuse a prompt whose first ``tokens`` columns (token ids and attention mask; the payload's own mask when
        ``attention_mask`` is None) are not the ones the payload was encoded for, or that has fewer than
        ``new_tokens`` columns after them."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim not in (1, 2) or input_ids.is_floating_point():
            raise PairMismatchError(f"{what} must be integer token ids [batch, tokens] to check the SCD payload "
                                    f"against, got {type(input_ids).__name__} {tuple(getattr(input_ids, 'shape', ()))}.")
        ids = input_ids if input_ids.ndim == 2 else input_ids[None]
        if ids.shape[0] != self.batch or ids.shape[1] < self.tokens + new_tokens:
            after = f" followed by at least {new_tokens} token(s) it does not cover" if new_tokens else ""
            raise PairMismatchError(f"The payload covers a prompt of {(self.batch, self.tokens)} tokens; {what} has "
                                    f"shape {tuple(ids.shape)}, where it must be that prompt{after}.")
        mask = payload_mask
        if attention_mask is not None:
            given = attention_mask if attention_mask.ndim == 2 else attention_mask[None]
            if given.shape[0] != self.batch or given.shape[1] < self.tokens:
                raise PairMismatchError(f"The payload covers a prompt of {(self.batch, self.tokens)} tokens; the "
                                        f"attention mask has shape {tuple(given.shape)}.")
            mask = given[:, :self.tokens]
        if token_ids_sha256(ids[:, :self.tokens], mask) != self.token_ids_sha256:
            raise PairMismatchError(f"The payload was encoded for another prompt (its token-id hash differs from "
                                    f"{what}' first {self.tokens} tokens and attention mask). Send the payload of this "
                                    "prompt, or give the prompt the payload was encoded for.")
