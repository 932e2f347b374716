"""A payload read as it arrives: each layer rebuilt as soon as its sections are in, and a stated policy for a stream
that stops short (a deadline, a byte budget, a producer that died, a section corrupted in flight).

The policies, per request (as vLLM's ``kv_load_failure_policy``):

- ``"fail"``: anything short of the whole payload raises, naming what arrived and why it stopped.
- ``"accept"``: decode what arrived. A Reuse layer whose refinement (see :mod:`~hf_kvcodecs.scd.progressive`) did
  not arrive decodes its base components; a layer with any base section missing cannot be decoded, and raises
  (a missing section is never filled in).
- ``"recompute"``: as ``"accept"``, and the consumer computes the layers that cannot be decoded itself: its own
  decoder layers ``0 .. m`` over the prompt, ``m`` the deepest such layer (a layer's input needs every layer below
  it). This needs the prompt's ``input_ids``, which are checked against the payload's token hash when its manifest
  arrived. With nothing decodable it is the consumer's own prefill.

What was used is recorded in the cache's ``transfer_report["stream"]``: the bytes received, why reading stopped,
the layers decoded in full, at their base rank, and recomputed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .coding import section_layout
from .knowledge_base import SCDKnowledgeBase
from .manifest import PayloadLimits, PayloadManifest
from .payload import PayloadError, PayloadStream
from .progressive import merge_refinements, refinement_layout
from .rebuild import LayerRebuild

__all__ = ["PARTIAL_POLICIES", "PartialPayloadError", "StreamReport", "read_and_rebuild"]

PARTIAL_POLICIES = ("fail", "accept", "recompute")


class PartialPayloadError(PayloadError):
    """A stream stopped before the consumer had what its partial policy needs; the message says what arrived."""


@dataclass
class StreamReport:
    bytes_received: int = 0
    bytes_declared: int | None = None
    stopped: str | None = None  # None: the whole payload arrived
    layers_full: list[int] = field(default_factory=list)
    layers_at_base_rank: list[int] = field(default_factory=list)
    layers_recomputed: list[int] = field(default_factory=list)
    first_layer_rebuilt_at_bytes: int | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def _check_policy(partial: str) -> None:
    if partial not in PARTIAL_POLICIES:
        raise ValueError(f"partial must be one of {PARTIAL_POLICIES}, got {partial!r}.")


def read_and_rebuild(stream, consumer, kb: SCDKnowledgeBase, *, limits: PayloadLimits, max_bytes: int,
                     vocab_size: int, partial: str = "fail", deadline_s: float | None = None,
                     byte_budget: int | None = None, input_ids: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None, hmac_key: bytes | None = None,
                     ) -> tuple[PayloadManifest | None, LayerRebuild, torch.Tensor, StreamReport]:
    """Read one payload from ``stream`` (a binary file-like object) and rebuild the consumer's layers as their
    sections arrive; apply ``partial`` when it stops short. Returns the manifest (None when even it did not
    arrive), the rebuild (every layer filled), the prompt's attention mask and the report."""
    _check_policy(partial)
    started = time.perf_counter()
    report = StreamReport()

    def stop_reason(error: BaseException) -> str:
        return f"{type(error).__name__}: {str(error)[:300]}"

    try:
        reader = PayloadStream(stream, max_bytes=max_bytes, hmac_key=hmac_key,
                               check=lambda raw, table: PayloadManifest.parse(raw, kb, limits=limits))
    except (TimeoutError, ConnectionError) as error:
        report.stopped = f"before the manifest arrived ({stop_reason(error)})"
        return _without_manifest(consumer, kb, partial, input_ids, attention_mask, report)
    except PayloadError as error:
        if "truncated" not in str(error):
            raise  # a malformed or foreign header or manifest is refused whatever the policy
        report.stopped = f"before the manifest arrived ({stop_reason(error)})"
        return _without_manifest(consumer, kb, partial, input_ids, attention_mask, report)
    manifest = PayloadManifest.parse(reader.manifest, kb, limits=limits)
    report.bytes_declared = reader.total_bytes
    if input_ids is not None:  # the prompt the consumer holds must be the payload's, whatever arrives
        manifest.check_prompt(input_ids, attention_mask, payload_mask=attention_mask if attention_mask is not None
                              else torch.ones(manifest.batch, manifest.tokens, dtype=torch.uint8))
    layers, bases = manifest.layers, manifest.base_layers()
    coded = manifest.coded_tokens
    base_names = {layer.index: [spec.name for spec in section_layout(base, manifest.code_bits, manifest.batch, coded)]
                  for layer, base in zip(layers, bases)} if coded else {}
    refine_names = {layer.index: [spec.name for spec in refinement_layout(layer, base, manifest.code_bits,
                                                                         manifest.batch, coded)]
                    for layer, base in zip(layers, bases)} if coded else {}
    sections: dict[str, torch.Tensor] = {}
    rebuild: LayerRebuild | None = None
    done: set[int] = set()
    sizes = {spec.name: reader.section_bytes(spec) for spec in reader.table}
    iterator = iter(reader)
    for spec in reader.table:
        if deadline_s is not None and time.perf_counter() - started > deadline_s:
            report.stopped = f"deadline of {deadline_s:g} s passed"
            break
        if byte_budget is not None and reader.received + sizes[spec.name] > byte_budget:
            report.stopped = f"byte budget of {byte_budget} bytes reached"
            break
        try:
            name, tensor = next(iterator)
        except (TimeoutError, ConnectionError) as error:
            report.stopped = f"transport stopped in section {spec.name!r} ({stop_reason(error)})"
            break
        except PayloadError as error:
            report.stopped = f"section {spec.name!r} unusable ({stop_reason(error)})"
            break
        if name != "input.attention_mask":  # each section checked as it arrives, beside the prompt's (mask first)
            inputs = {key: sections[key] for key in ("input.attention_mask", "input.exact_token_ids")
                      if key in sections}
            PayloadManifest.parse(reader.manifest, kb, {**inputs, name: tensor}, limits=limits,
                                  vocab_size=vocab_size, partial=True)
        sections[name] = tensor
        if rebuild is None and "input.exact_token_ids" in sections:
            rebuild = LayerRebuild(consumer, kb, manifest.code_bits, sections["input.attention_mask"],
                                   sections["input.exact_token_ids"], any(layer.recomputes for layer in layers))
            if not coded:
                for layer in layers:
                    rebuild.layer(layer, sections)
                    done.add(layer.index)
        index = _layer_of(name)
        if rebuild is not None and index is not None and index not in done and \
                all(key in sections for key in base_names[index] + refine_names[index]):
            rebuild.layer(layers[index], _layer_sections(layers[index], bases[index], sections, manifest.code_bits))
            done.add(index)
            if report.first_layer_rebuilt_at_bytes is None:
                report.first_layer_rebuilt_at_bytes = reader.received
    report.bytes_received = reader.received
    if report.stopped is not None and partial == "fail":
        raise PartialPayloadError(f"The SCD payload stopped after {reader.received} of {reader.total_bytes} bytes "
                                  f"({report.stopped}). Pass partial='accept' to decode what arrived, or "
                                  "partial='recompute' (with the prompt's input_ids) to compute the rest locally.")
    mask = sections.get("input.attention_mask")
    if rebuild is None:  # the prompt's sections did not arrive: nothing from the payload is usable
        return _without_manifest(consumer, kb, partial, input_ids, attention_mask, report, manifest)
    undecodable = []
    for layer, base in zip(layers, bases):
        if layer.index in done or layer.kind == "recomputed":
            continue
        if all(key in sections for key in base_names[layer.index]):
            rebuild.layer(base, {key: sections[key] for key in base_names[layer.index]})
            done.add(layer.index)
            report.layers_at_base_rank.append(layer.index)
        else:
            undecodable.append(layer.index)
    for layer in layers:  # a recomputed layer is written by its block, or cannot be without it
        if layer.kind == "recomputed" and layer.index not in rebuild.states:
            undecodable.append(layer.index)
    undecodable.sort()
    if undecodable and partial != "recompute":
        raise PartialPayloadError(f"The SCD payload stopped after {reader.received} of {reader.total_bytes} bytes "
                                  f"({report.stopped}); layers {undecodable[:8]}{'...' if len(undecodable) > 8 else ''} "
                                  "have sections missing and are not filled in. Pass partial='recompute' (with the "
                                  "prompt's input_ids) to compute them on the consumer.")
    if undecodable:
        if input_ids is None:
            raise PartialPayloadError(f"partial='recompute' needs the prompt's input_ids to compute layers "
                                      f"{undecodable[:8]} the stream did not deliver; pass input_ids=.")
        ids = input_ids if input_ids.ndim == 2 else input_ids[None]
        rebuild.recompute_prefix(ids[:, :manifest.tokens], undecodable[-1])
        report.layers_recomputed = list(range(undecodable[-1] + 1))
    recomputed = set(report.layers_recomputed)
    report.layers_at_base_rank = [index for index in report.layers_at_base_rank if index not in recomputed]
    report.layers_full = sorted(set(rebuild.states) - recomputed - set(report.layers_at_base_rank))
    return manifest, rebuild, mask, report


def _layer_sections(full, base, sections: dict[str, torch.Tensor], bits: int) -> dict[str, torch.Tensor]:
    own = {name: tensor for name, tensor in sections.items() if name.startswith(f"layers.{full.index}.")}
    return merge_refinements(full, base, own, bits) if full != base else own


def _without_manifest(consumer, kb: SCDKnowledgeBase, partial: str, input_ids, attention_mask, report: StreamReport,
                      manifest: PayloadManifest | None = None):
    """Nothing from the payload can be used: the consumer's own prefill of ``input_ids`` under ``recompute``."""
    if partial != "recompute":
        raise PartialPayloadError(f"The SCD payload stopped {report.stopped or 'early'}, before its prompt's sections "
                                  "arrived: nothing can be decoded. Pass partial='recompute' with the prompt's "
                                  "input_ids to prefill locally instead.")
    if input_ids is None:
        raise PartialPayloadError("partial='recompute' needs the prompt's input_ids to prefill locally; pass "
                                  "input_ids=.")
    ids = input_ids if input_ids.ndim == 2 else input_ids[None]
    tokens = manifest.tokens if manifest is not None else ids.shape[1]
    ids = ids[:, :tokens]
    mask = (attention_mask if attention_mask is not None else torch.ones_like(ids))
    mask = (mask if mask.ndim == 2 else mask[None])[:, :tokens].to(torch.uint8)
    rebuild = LayerRebuild(consumer, kb, kb.code_bits, mask, ids[:, :0], False)
    layers = kb.num_layers
    rebuild.recompute_prefix(ids, layers - 1)
    report.layers_recomputed = list(range(layers))
    return manifest, rebuild, mask, report
