"""Knowledge bases that code the producer identically: shared PCA encoders and the fingerprint that proves it.

With PCA codes (``SCDFitSettings.encoder="pca"``) a knowledge base's encoders are fitted on the producer's states
only; the consumer is in the decoders. So the knowledge base of a second consumer can keep the first one's encoders
exactly (``SCDFitSettings(encoders_from=DIR)``, ``hf-kvcodecs scd fit --encoders-from DIR``) and fit only its own
decoders, and then one stored set of producer codes serves both consumers (:mod:`hf_kvcodecs.scd.code_store`).

What is shared: the producer-side layout (which layers send key/value codes and which send Patch codes, in which
Patch mode and depth) and every map's producer half (``input_mean``, ``encoder``, ``component_energy``: the
whitened quantizers scale by the energy). What stays per consumer: the decoders, the ranks each plan sends (at most
the shared maps' ranks), the code widths, the code bits and the exact tokens.

:func:`encoder_fingerprint` hashes that producer side (and the producer's identity): two knowledge bases with the
same fingerprint turn the same prompt into the same codes, component for component.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..codecs.lowrank import CrossMoments, LowRankMap
from .knowledge_base import KnowledgeBaseError, LayerPlan, SCDKnowledgeBase
from .manifest import PairMismatchError, identity_mismatch

__all__ = ["PRODUCER_TENSORS", "EncoderSharingError", "encoder_fingerprint", "load_encoder_source",
           "producer_fingerprint", "shared_decoder_map", "shared_layout", "source_maps"]

PRODUCER_TENSORS = ("input_mean", "encoder", "component_energy")  # a LowRankMap's producer half
_FINGERPRINT_VERSION = "hf_kvcodecs.scd.encoder_fingerprint/1"


class EncoderSharingError(PairMismatchError):
    """Encoders cannot be shared: another producer, consumer-specific encoders, or another producer-side layout."""


def producer_fingerprint(identity: dict) -> str:
    """sha256 of the producer's binding (weights, applied adapters and their scaling), as a knowledge base records
    it; names are labels and are left out."""
    binding = {key: identity.get(key) for key in ("weights_sha256", "adapter_sha256", "adapter_scaling_sha256")}
    return hashlib.sha256(json.dumps(binding, sort_keys=True).encode()).hexdigest()


def _producer_maps(kb: SCDKnowledgeBase, layer: LayerPlan) -> list[tuple[str, LowRankMap]]:
    if layer.kind == "reuse":
        return [("keys", kb.keys[layer.index]), ("values", kb.values[layer.index])]
    if layer.kind == "patch":
        return [("residuals" if layer.recomputes else "inputs", kb.patch_map(layer))]
    return []


def encoder_fingerprint(kb: SCDKnowledgeBase) -> str:
    """sha256 of everything that decides the codes a producer sends with ``kb``: the producer's identity, the
    producer-side layout (every layer's kind, Patch mode and depth) and the producer half of every map (dtype, shape
    and bytes of its input mean, encoder and component energies). Ranks sent, widths, bits and decoders are the
    consumer's and are left out."""
    digest = hashlib.sha256(_FINGERPRINT_VERSION.encode())
    layout = [[layer.index, layer.kind, layer.patch_mode, layer.depth] for layer in kb.plan]
    digest.update(json.dumps({"producer": producer_fingerprint(kb.producer), "layout": layout}).encode())
    for layer in kb.plan:
        for kind, mapping in _producer_maps(kb, layer):
            for name in PRODUCER_TENSORS:
                tensor = getattr(mapping, name).detach().cpu().contiguous()
                digest.update(f"layers.{layer.index}.{kind}.{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
                # the bytes of the tensor as stored (little-endian on every machine this runs on)
                digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def load_encoder_source(directory: str | Path, producer_identity: dict, *, encoder: str,
                        patch_mode: str) -> SCDKnowledgeBase:
    """The knowledge base whose encoders a new fit keeps, checked: saved, fitted with PCA codes, for this producer,
    in the same Patch mode as the new fit."""
    source = SCDKnowledgeBase.load(directory)
    problem = identity_mismatch(producer_identity, source.producer, "producer")
    if problem is not None:
        raise EncoderSharingError(f"Encoders are shared between knowledge bases of one producer only: {problem}. "
                                  f"Fit this knowledge base without --encoders-from, or pass the producer of "
                                  f"{directory}.")
    source_encoder = (source.fitting.get("settings") or {}).get("encoder", "pca")
    if encoder != "pca" or source_encoder != "pca":
        raise EncoderSharingError(f"Shared encoders must be PCA codes of the producer's states (encoder='pca'); this "
                                  f"fit asks for {encoder!r} and {directory} was fitted with {source_encoder!r}, "
                                  "whose codes are fitted to one consumer.")
    modes = {layer.patch_mode for layer in source.plan if layer.kind == "patch"}
    if modes and modes != {patch_mode}:
        raise EncoderSharingError(f"{directory} sends {sorted(modes)[0]} Patch codes; fit with "
                                  f"patch_mode={sorted(modes)[0]!r} (--patch-mode) to share its encoders.")
    return source


def shared_layout(source: SCDKnowledgeBase) -> dict[int, int]:
    """The source's Patch layers (first layer -> depth): a fit sharing its encoders sends Patch codes there and
    nowhere else, so the producer codes the same states for both consumers."""
    return {layer.index: layer.depth for layer in source.plan if layer.kind == "patch"}


def shared_decoder_map(source: LowRankMap, moments: CrossMoments, *, ridge: float) -> LowRankMap:
    """A map that keeps ``source``'s producer half exactly and decodes its codes to this pair's targets: per
    component the ridge least-squares decoder from the codes' moments on this fit's text (``ridge`` relative to the
    mean input variance, as :func:`~hf_kvcodecs.codecs.lowrank.fit_pca_map`). Each component is decoded on its own
    (the codes are uncorrelated on the text the encoder was fitted on), so every prefix of the code still decodes
    with the first rows; on that same text this is the decoder a fresh PCA fit would give."""
    if moments.input_dim != source.encoder.shape[0] or moments.output_dim != source.decoder.shape[1]:
        raise KnowledgeBaseError(f"The shared encoder codes {source.encoder.shape[0]}-wide states into "
                                 f"{source.decoder.shape[1]}-wide targets; this pair's are {moments.input_dim} and "
                                 f"{moments.output_dim} wide.")
    encoder = source.encoder.double()
    covariance = moments.covariance_aa()
    code_variance = torch.einsum("ir,ij,jr->r", encoder, covariance, encoder)
    absolute_ridge = float(ridge) * float(torch.linalg.eigvalsh(covariance).clamp_min(0).mean())
    decoder = (encoder.T @ moments.covariance_ab()) / (code_variance + absolute_ridge).clamp_min(1e-300)[:, None]
    # the intercept: the codes are centred on the source's mean, not this text's
    code_mean = (moments.mean_a - source.input_mean.double()) @ encoder
    output_mean = moments.mean_b - code_mean @ decoder
    return LowRankMap(source.input_mean, source.encoder, decoder.float(), output_mean.float(),
                      source.component_energy)


def source_maps(source: SCDKnowledgeBase) -> dict[str, dict[int, LowRankMap]]:
    """The source's maps by kind (``keys``, ``values``, ``residuals``, ``inputs``) and layer."""
    return {"keys": source.keys, "values": source.values, "residuals": source.residuals, "inputs": source.inputs}
