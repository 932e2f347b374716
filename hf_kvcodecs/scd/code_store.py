"""A store of producer-side SCD codes, written once per prompt and served to every consumer that shares the encoders.

With PCA codes a knowledge base's encoders see the producer only, and knowledge bases fitted with shared encoders
(:mod:`~hf_kvcodecs.scd.encoder_sharing`) turn a prompt into the same codes component for component. So the codes of
one prefill can be kept once and cut, per consumer, into that consumer's ordinary payload: storage grows with the
documents, not with documents times consumers.

:meth:`SCDCodeStore.put` prefills a prompt on the producer and stores, per layer, the codes of every map at the
largest rank any registered knowledge base sends (a Patch layer's codes with the residual stream's per-token RMS),
for every column of the prompt (the exact columns differ per knowledge base). :meth:`SCDCodeStore.payload_for`
cuts that entry to one knowledge base's plan, re-quantizes the codes at its widths or bits, and writes the manifest
with :class:`~hf_kvcodecs.scd.manifest.PayloadManifest`: the payload ``SCDTransferCache.from_payload`` reads, with
nothing store-specific in it.

Stored precision (``precision``):

- ``"widths"`` (the default; whitened knowledge bases): each code component at the largest width any registered
  knowledge base gives it, with the same unit-Gaussian quantizers and component energies the payload uses. A
  consumer whose width is the stored one gets exactly the codes a fresh encode sends; a narrower one re-quantizes a
  finely quantized value (measured in benchmarks/scd_code_store.py). An entry holds about the bytes of the widest
  registered payload, not their sum.
- ``"float16"``: the codes as float16, for any plan and format (flat codes, 16-bit payloads), at 2 bytes per
  component.
- ``"float32"``: exact codes (for checks).

An entry is keyed by the prompt's token-id hash (with its attention mask), the producer's fingerprint and the
encoder fingerprint, and it names all three inside; a read checks them, the tokenizer, every tensor's name, dtype and
shape against the entry's description and a sha256 of their bytes, and refuses what does not match. Entries are safetensors bytes (no pickle)
whose JSON description sits in the safetensors metadata; reads are bounded (``max_entry_bytes``) before they
allocate.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ..codecs import bit_allocation
from ..codecs.lowrank import pack_int4, quantize_codes
from .coding import code_map, rms_dtype, whitened_code
from .encode import check_producer
from .encoder_sharing import EncoderSharingError, encoder_fingerprint, producer_fingerprint
from .knowledge_base import CODE_BITS, KnowledgeBaseError, LayerPlan, SCDKnowledgeBase
from .manifest import PairMismatchError, PayloadManifest, exact_columns
from .model_access import LayerCapture, prefill_with_taps, residual_direction, token_ids_sha256
from .store_backends import DirectoryBackend, StoreBackend, StoreError

__all__ = ["ENTRY_FORMAT", "PRECISIONS", "SCDCodeStore", "StoreError", "StoredCode"]

ENTRY_FORMAT = "hf_kvcodecs.scd_code_store_entry"
ENTRY_VERSION = 1
PRECISIONS = ("widths", "float16", "float32")
_METADATA_KEY = "entry"
_MAX_DESCRIPTION_BYTES = 1 << 20
DEFAULT_MAX_ENTRY_BYTES = 1 << 32
_FLOAT_DTYPES = {"float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class StoredCode:
    """One stored code: layer, name (``key``, ``value`` or ``patch``), rank, and its widths (``widths`` precision)."""

    layer: int
    name: str
    rank: int
    bits: tuple[int, ...] = ()

    @property
    def section(self) -> str:
        return f"layers.{self.layer}.{self.name}_codes"

    def to_json(self) -> dict:
        return {"layer": self.layer, "name": self.name, "rank": self.rank, "bits": list(self.bits)}


def _union_codes(kbs: Sequence[SCDKnowledgeBase], precision: str) -> list[StoredCode]:
    """Per layer and code, the largest rank any knowledge base sends and (``widths``) each component's largest width."""
    codes = []
    for layers in zip(*(kb.plan for kb in kbs)):
        for position, (name, _) in enumerate(layers[0].code_ranks()):
            ranks = [layer.code_ranks()[position][1] for layer in layers]
            rank = max(ranks)
            bits: tuple[int, ...] = ()
            if precision == "widths":
                widths = [layer.widths[name].bits for layer in layers]
                bits = tuple(max((w[j] for w in widths if j < len(w)), default=0) for j in range(rank))
            codes.append(StoredCode(layers[0].index, name, rank, bits))
    return codes


def _producer_states(capture: LayerCapture, layer: LayerPlan, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The states ``name``'s code of this layer codes (all columns, float32), and a recompute Patch layer's RMS."""
    if name == "key":
        return capture.keys.float(), None
    if name == "value":
        return capture.values.float(), None
    if layer.recomputes:
        if capture.residual is None:
            raise ValueError(f"Layer {layer.index}'s residual stream was not captured.")
        return residual_direction(capture.residual)
    if capture.inputs is None:
        raise ValueError(f"Layer {layer.index}'s normalized input was not captured.")
    return capture.inputs.float(), None


def _quantize_for(codes: torch.Tensor, layer: LayerPlan, name: str, bits: int, kb: SCDKnowledgeBase,
                  ) -> dict[str, torch.Tensor]:
    """One code's payload sections at ``kb``'s widths or ``bits`` (what the producer's coder writes)."""
    prefix = f"layers.{layer.index}.{name}"
    widths = whitened_code(layer, name, bits)
    if widths is not None:
        energy = code_map(kb, layer, name).component_energy[:widths.rank]
        packed, gains = bit_allocation.encode(codes, energy, widths.bits, gain=widths.gain)
        return {f"{prefix}_codes": packed, **({f"{prefix}_gains": gains} if gains is not None else {})}
    quantized, scales = quantize_codes(codes, bits)
    if bits >= 16:
        return {f"{prefix}_codes": quantized}
    return {f"{prefix}_codes": pack_int4(quantized) if bits == 4 else quantized, f"{prefix}_scales": scales}


class SCDCodeStore:
    """Producer codes by (prompt, producer, encoders), served as each consumer's payload.

    ``backend``: a :class:`~hf_kvcodecs.scd.store_backends.StoreBackend`, or a directory (a
    :class:`~hf_kvcodecs.scd.store_backends.DirectoryBackend`). ``precision``: how codes are stored (see the module
    docstring). ``max_entry_bytes`` bounds every read."""

    def __init__(self, backend: StoreBackend | str, *, precision: str = "widths",
                 max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}.")
        self.backend = DirectoryBackend(backend) if not isinstance(backend, StoreBackend) else backend
        self.precision = precision
        self.max_entry_bytes = int(max_entry_bytes)

    # ---- keys -------------------------------------------------------------------------------------------------
    @staticmethod
    def _prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        ids = input_ids[None] if input_ids.ndim == 1 else input_ids
        if ids.ndim != 2 or ids.shape[1] < 1 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be integer token ids [batch, tokens], got {ids.dtype} "
                             f"{tuple(ids.shape)}.")
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.reshape(ids.shape)
        return ids, mask

    @staticmethod
    def key_for(kb: SCDKnowledgeBase, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> str:
        """The entry key of a prompt for the encoders of ``kb``: token-id hash, producer and encoder fingerprints."""
        ids, mask = SCDCodeStore._prompt(input_ids, attention_mask)
        return (f"{token_ids_sha256(ids, mask)}.{producer_fingerprint(kb.producer)}."
                f"{encoder_fingerprint(kb)}")

    # ---- the producer's side ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def put(self, producer, input_ids: torch.Tensor, kbs: SCDKnowledgeBase | Sequence[SCDKnowledgeBase], *,
            attention_mask: torch.Tensor | None = None, overwrite: bool = False) -> str:
        """Prefill ``input_ids`` on ``producer`` once and store its codes for every knowledge base in ``kbs`` (which
        must share one encoder fingerprint and tokenizer). An entry already stored is kept (``overwrite=True``
        replaces it, e.g. to register a knowledge base that sends more). Returns the entry's key."""
        kbs = [kbs] if isinstance(kbs, SCDKnowledgeBase) else list(kbs)
        if not kbs:
            raise ValueError("put needs at least one knowledge base: the consumers the codes are stored for.")
        fingerprints = {encoder_fingerprint(kb) for kb in kbs}
        if len(fingerprints) > 1:
            raise EncoderSharingError(f"The knowledge bases code the producer differently ({len(fingerprints)} "
                                      "encoder fingerprints); one entry serves knowledge bases that share encoders. "
                                      "Fit the others with --encoders-from (SCDFitSettings(encoders_from=...)).")
        if len({kb.tokenizer_sha256 for kb in kbs}) > 1:
            raise PairMismatchError("The knowledge bases were fitted with different tokenizers; the stored token ids "
                                    "would mean different text to their consumers.")
        if self.precision == "widths" and any(kb.code_format != "whitened" for kb in kbs):
            raise StoreError("precision='widths' stores whitened codes at the registered widths; a knowledge base "
                             "here sends flat codes. Use SCDCodeStore(..., precision='float16').")
        ids, mask = self._prompt(input_ids, attention_mask)
        exact_columns(mask, 0)  # refuses a mask that is not left-padded 0/1
        key = self.key_for(kbs[0], ids, mask)
        if not overwrite and self.backend.exists(key):
            return key
        check_producer(producer, kbs[0])
        kb = kbs[0]
        codes = _union_codes(kbs, self.precision)
        by_layer: dict[int, list[StoredCode]] = {}
        for code in codes:
            by_layer.setdefault(code.layer, []).append(code)
        tensors: dict[str, torch.Tensor] = {"input.attention_mask": mask.to(torch.uint8).cpu().contiguous()}
        rms_layers: list[int] = []

        def on_layer(capture: LayerCapture) -> None:
            layer = kb.plan[capture.index]
            for code in by_layer.get(capture.index, []):
                states, rms = _producer_states(capture, layer, code.name)
                mapping = code_map(kb, layer, code.name)
                values = mapping.truncated(code.rank).encode(states)
                tensors[code.section] = self._pack(values, code, mapping.component_energy[:code.rank])
                if rms is not None:
                    tensors[f"layers.{capture.index}.patch_rms"] = rms.float().cpu().contiguous()
                    rms_layers.append(capture.index)

        prefill_with_taps(producer, ids, mask, on_layer, inputs_of=set(kb.input_layers),
                          residuals_of=set(kb.residual_layers))
        token_hash, producer_hash, encoder_hash = key.split(".")
        description = {"format": ENTRY_FORMAT, "format_version": ENTRY_VERSION, "key": key,
                       "token_ids_sha256": token_hash, "producer_fingerprint": producer_hash,
                       "encoder_fingerprint": encoder_hash, "tokenizer_sha256": kb.tokenizer_sha256,
                       "batch": int(ids.shape[0]), "tokens": int(ids.shape[1]), "precision": self.precision,
                       "codes": [code.to_json() for code in codes], "rms_layers": sorted(rms_layers),
                       "tensors_sha256": _tensors_sha256(tensors)}
        self.backend.put(key, save_safetensors(tensors, metadata={_METADATA_KEY: json.dumps(description)}))
        return key

    def _pack(self, values: torch.Tensor, code: StoredCode, energy: torch.Tensor) -> torch.Tensor:
        if self.precision == "widths":
            return bit_allocation.encode(values, energy, code.bits)[0].cpu().contiguous()
        return values.to(_FLOAT_DTYPES[self.precision]).cpu().contiguous()

    # ---- reading an entry -------------------------------------------------------------------------------------
    def read_entry(self, key: str) -> tuple[dict, dict[str, torch.Tensor]]:
        """An entry's description and tensors, checked against each other and against ``key``."""
        data = self.backend.get(key, self.max_entry_bytes)
        if data is None:
            raise StoreError(f"The store holds no entry {key[:24]}...; put the prompt first (store.put(producer, "
                             "input_ids, knowledge_bases)).")
        description = _entry_description(data, key)
        try:
            tensors = load_safetensors(data)
        except (SafetensorError, ValueError) as error:
            raise StoreError(f"Store entry {key[:24]}... is not readable safetensors ({error}).") from None
        _check_entry_tensors(description, tensors, key)
        return description, tensors

    # ---- the consumer's side ----------------------------------------------------------------------------------
    def sections_for(self, kb: SCDKnowledgeBase, input_ids: torch.Tensor, *,
                     attention_mask: torch.Tensor | None = None, code_bits: int | None = None,
                     ) -> tuple[PayloadManifest, dict[str, torch.Tensor]]:
        """The manifest and sections of ``kb``'s payload for the prompt, cut from the stored codes."""
        ids, mask = self._prompt(input_ids, attention_mask)
        bits = code_bits or kb.code_bits
        if bits not in CODE_BITS or bits < kb.code_bits:
            raise KnowledgeBaseError(f"code_bits must be one of {CODE_BITS} and at least the knowledge base's "
                                     f"{kb.code_bits}, got {bits}.")
        if kb.code_format == "whitened" and bits < 16 and bits != kb.code_bits:
            raise KnowledgeBaseError(f"This knowledge base codes whitened widths at the bytes of {kb.code_bits}-bit "
                                     "codes; serve at that width, or at 16 or 32 bits.")
        key = self.key_for(kb, ids, mask)
        description, stored = self.read_entry(key)
        if description["tokenizer_sha256"] != kb.tokenizer_sha256:
            raise PairMismatchError("The stored codes were put for knowledge bases of another tokenizer than this "
                                    "one's; the token ids would mean different text.")
        manifest = PayloadManifest.for_prompt(kb, kb.producer, ids, mask, bits)
        start = manifest.exact_columns
        sections = {"input.attention_mask": mask.to(torch.uint8).cpu(),
                    "input.exact_token_ids": ids[:, :start].to(torch.int64).cpu()}
        codes = {(code["layer"], code["name"]): StoredCode(code["layer"], code["name"], code["rank"],
                                                           tuple(code["bits"])) for code in description["codes"]}
        for layer in manifest.layers:
            if start >= manifest.tokens:
                break
            for name, rank in layer.code_ranks():
                code = codes.get((layer.index, name))
                if code is None or code.rank < rank:
                    have = "none" if code is None else f"rank {code.rank}"
                    raise StoreError(f"The entry stores layer {layer.index}'s {name} code at {have}; this knowledge "
                                     f"base sends rank {rank}. Put the prompt again with this knowledge base among "
                                     "the registered ones (overwrite=True).")
                if code.bits:
                    _check_widths(code, whitened_code(layer, name, bits), layer.index)
                values = self._unpack(stored[code.section][:, start:], code, kb, layer)[..., :rank]
                sections.update(_quantize_for(values, layer, name, bits, kb))
            if layer.recomputes:
                sections[f"layers.{layer.index}.patch_rms"] = \
                    stored[f"layers.{layer.index}.patch_rms"][:, start:].to(rms_dtype(bits))
        return manifest, sections

    def _unpack(self, stored: torch.Tensor, code: StoredCode, kb: SCDKnowledgeBase, layer: LayerPlan) -> torch.Tensor:
        if code.bits:
            energy = code_map(kb, layer, code.name).component_energy[:code.rank]
            return bit_allocation.decode(stored, energy, code.bits)
        return stored.float()

    def payload_for(self, kb: SCDKnowledgeBase, input_ids: torch.Tensor, *,
                    attention_mask: torch.Tensor | None = None, code_bits: int | None = None) -> bytes:
        """``kb``'s SCD payload for the prompt (as :func:`~hf_kvcodecs.scd.encode.encode` writes one), from the
        stored codes: no prefill. Refuses a knowledge base whose encoder fingerprint has no entry for the prompt."""
        manifest, sections = self.sections_for(kb, input_ids, attention_mask=attention_mask, code_bits=code_bits)
        return manifest.pack(sections)

    # ---- accounting -------------------------------------------------------------------------------------------
    def entry_bytes(self, key: str) -> int | None:
        return self.backend.size(key)

    def total_bytes(self) -> int:
        return self.backend.total_bytes()

    def delete(self, key: str) -> bool:
        return self.backend.delete(key)


def _check_widths(code: StoredCode, wanted, layer: int) -> None:
    """An entry of quantized codes serves whitened payloads no wider than it stores: re-quantizing a coarse value at
    a finer width would send bytes that carry nothing more."""
    if wanted is None:
        raise StoreError(f"The entry stores quantized codes (precision 'widths'), which serve whitened payloads below "
                         f"16 bits only; this payload sends layer {layer}'s {code.name} code as flat or float codes. "
                         "Store the prompt with precision='float16'.")
    wider = [j for j, width in enumerate(wanted.bits) if width > code.bits[j]]
    if wider:
        raise StoreError(f"The entry stores layer {layer}'s {code.name} code component {wider[0]} at "
                         f"{code.bits[wider[0]]} bits; this knowledge base sends it at {wanted.bits[wider[0]]}. Put the "
                         "prompt again with this knowledge base among the registered ones (overwrite=True).")


def _entry_description(data: bytes, key: str) -> dict:
    """The JSON description in a safetensors header's metadata, read without trusting its sizes."""
    if len(data) < 8:
        raise StoreError(f"Store entry {key[:24]}... is truncated ({len(data)} bytes).")
    (header_bytes,) = struct.unpack("<Q", data[:8])
    if header_bytes > min(len(data) - 8, _MAX_DESCRIPTION_BYTES + (1 << 16)):
        raise StoreError(f"Store entry {key[:24]}... declares a {header_bytes}-byte header: corrupt or not an entry.")
    try:
        header = json.loads(data[8:8 + header_bytes])
        description = json.loads(header["__metadata__"][_METADATA_KEY])
    except (ValueError, KeyError, TypeError):
        raise StoreError(f"Store entry {key[:24]}... has no readable description: corrupt or not an entry.") from None
    if not isinstance(description, dict) or description.get("format") != ENTRY_FORMAT or \
            description.get("format_version") != ENTRY_VERSION:
        raise StoreError(f"Store entry {key[:24]}... is not a version-{ENTRY_VERSION} SCD code store entry.")
    fields = ("key", "token_ids_sha256", "producer_fingerprint", "encoder_fingerprint", "tokenizer_sha256", "batch",
              "tokens", "precision", "codes", "rms_layers", "tensors_sha256")
    unknown = sorted(set(description) - {"format", "format_version", *fields})
    missing = [name for name in fields if name not in description]
    if unknown or missing:
        raise StoreError(f"Store entry {key[:24]}... has an unexpected description (missing {missing}, unknown "
                         f"{unknown[:5]}).")
    named = ".".join(str(description[name]) for name in ("token_ids_sha256", "producer_fingerprint",
                                                          "encoder_fingerprint"))
    if description["key"] != key or named != key:
        raise StoreError(f"Store entry {key[:24]}... names another prompt, producer or encoders "
                         f"({str(description['key'])[:24]}...); it was copied or written under the wrong key. Delete "
                         "it and put the prompt again.")
    return description


def _check_entry_tensors(description: dict, tensors: dict[str, torch.Tensor], key: str) -> None:
    """Every tensor is the one the description implies (name, dtype, shape), finite, and nothing else is there."""
    def fail(message: str) -> None:
        raise StoreError(f"Store entry {key[:24]}... is inconsistent: {message}. Delete it and put the prompt again.")

    batch, tokens, precision = description["batch"], description["tokens"], description["precision"]
    if not all(type(v) is int and v >= 1 for v in (batch, tokens)) or precision not in PRECISIONS:
        fail("its sizes or precision are invalid")
    if not isinstance(description["codes"], list) or not isinstance(description["rms_layers"], list):
        fail("its code list is invalid")
    expected = {"input.attention_mask": (torch.uint8, (batch, tokens))}
    for entry in description["codes"]:
        if not isinstance(entry, dict) or set(entry) != {"layer", "name", "rank", "bits"} or \
                entry["name"] not in ("key", "value", "patch") or type(entry["layer"]) is not int or \
                type(entry["rank"]) is not int or entry["rank"] < 1 or not isinstance(entry["bits"], list):
            fail("a code's description is invalid")
        code = StoredCode(entry["layer"], entry["name"], entry["rank"], tuple(entry["bits"]))
        if precision == "widths":
            if len(code.bits) != code.rank or any(type(b) is not int or not 1 <= b <= bit_allocation.MAX_BITS
                                                  for b in code.bits):
                fail(f"{code.section} needs one width of 1..{bit_allocation.MAX_BITS} bits per component")
            expected[code.section] = (torch.uint8, (batch, tokens, (sum(code.bits) + 7) // 8))
        else:
            if code.bits:
                fail(f"{code.section} names widths but the entry stores {precision} codes")
            expected[code.section] = (_FLOAT_DTYPES[precision], (batch, tokens, code.rank))
    for layer in description["rms_layers"]:
        if type(layer) is not int:
            fail("an RMS layer is not an integer")
        expected[f"layers.{layer}.patch_rms"] = (torch.float32, (batch, tokens))
    if set(tensors) != set(expected):
        fail(f"it holds tensors {sorted(set(tensors) - set(expected))[:3]} and lacks "
             f"{sorted(set(expected) - set(tensors))[:3]}")
    for name, (dtype, shape) in expected.items():
        tensor = tensors[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            fail(f"{name} is {tensor.dtype} {tuple(tensor.shape)}, its description implies {dtype} {shape}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            fail(f"{name} holds non-finite values")
    if _tensors_sha256(tensors) != description["tensors_sha256"]:
        fail("its tensors' bytes are not the ones it was written with (the sha256 differs)")


def _tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order: a changed byte anywhere is caught."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
