"""SCD: Semantic Cache Distillation. A producer's prefill reaches a (possibly fine-tuned) consumer as compact codes:
low-rank codes of most layers' pre-RoPE keys and values (Reuse) and of the normalized inputs of a few transition
layers (Patch), which the consumer projects with its own weights. The consumer rebuilds an ordinary ``DynamicCache``
(:class:`SCDTransferCache`) and ``generate()`` continues from it.

Offline: :func:`fit_knowledge_base` (``hf-kvcodecs scd fit``). Online: :func:`encode` on the producer,
:meth:`SCDTransferCache.from_payload` (or ``from_stream``, as the bytes arrive) on the consumer.
"""

import importlib
from typing import TYPE_CHECKING

from ..integrations.kv_artifacts import register_kv_artifact
from .artifact import SCD_KNOWLEDGE_BASE

# imported here, not on first use: importing the submodule ``encode`` binds that name on this package to the module,
# which a lazy name would never replace (the producer's side loads no transformers either)
from .encode import encode, encode_stream, encode_to, encode_with_report, truncate_payload

if TYPE_CHECKING:
    from .cache import SCDTransferCache, check_consumer
    from .fit import SCDFitSettings, fit_knowledge_base, full_rank_knowledge_base
    from .knowledge_base import KnowledgeBaseError, LayerPlan, SCDKnowledgeBase
    from .manifest import CODEC_ID, CODEC_VERSION, PairMismatchError, PayloadLimits, PayloadManifest
    from .payload import PayloadError
    from .stream import PartialPayloadError

register_kv_artifact(SCD_KNOWLEDGE_BASE)  # checkpoints carry it: save_pretrained writes it, from_pretrained loads it

# public name -> the module defining it, imported on first use: the consumer's cache and the fit load transformers,
# which a process that runs another engine's model code (vLLM, through hf_kvcodecs.scd.vllm_connector) leaves alone
_LAZY = {
    "SCDTransferCache": "cache", "check_consumer": "cache",
    "SCDFitSettings": "fit", "fit_knowledge_base": "fit", "full_rank_knowledge_base": "fit",
    "KnowledgeBaseError": "knowledge_base", "LayerPlan": "knowledge_base", "SCDKnowledgeBase": "knowledge_base",
    "CODEC_ID": "manifest", "CODEC_VERSION": "manifest", "PairMismatchError": "manifest", "PayloadLimits": "manifest",
    "PayloadManifest": "manifest",
    "PayloadError": "payload", "PartialPayloadError": "stream",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["CODEC_ID", "CODEC_VERSION", "KnowledgeBaseError", "LayerPlan", "PairMismatchError", "PartialPayloadError",
           "PayloadError", "PayloadLimits", "PayloadManifest", "SCDFitSettings", "SCDKnowledgeBase",
           "SCDTransferCache", "check_consumer", "encode", "encode_stream", "encode_to", "encode_with_report",
           "fit_knowledge_base", "full_rank_knowledge_base", "truncate_payload"]
