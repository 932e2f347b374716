"""SCD: Semantic Cache Distillation. A producer's prefill reaches a (possibly fine-tuned) consumer as compact codes:
low-rank codes of most layers' pre-RoPE keys and values (Reuse) and of the normalized inputs of a few transition
layers (Patch), which the consumer projects with its own weights. The consumer rebuilds an ordinary ``DynamicCache``
(:class:`SCDTransferCache`) and ``generate()`` continues from it.

Offline: :func:`fit_knowledge_base` (``hf-kvcodecs scd fit``). Online: :func:`encode` on the producer,
:meth:`SCDTransferCache.from_payload` on the consumer.
"""

from ..integrations.kv_artifacts import register_kv_artifact
from .artifact import SCD_KNOWLEDGE_BASE
from .cache import SCDTransferCache, check_consumer
from .encode import encode, encode_stream, encode_to, encode_with_report, truncate_payload
from .fit import SCDFitSettings, fit_knowledge_base, full_rank_knowledge_base
from .knowledge_base import KnowledgeBaseError, LayerPlan, SCDKnowledgeBase
from .manifest import CODEC_ID, CODEC_VERSION, PairMismatchError, PayloadLimits, PayloadManifest
from .payload import PayloadError

register_kv_artifact(SCD_KNOWLEDGE_BASE)  # checkpoints carry it: save_pretrained writes it, from_pretrained loads it

__all__ = ["CODEC_ID", "CODEC_VERSION", "KnowledgeBaseError", "LayerPlan", "PairMismatchError", "PayloadError",
           "PayloadLimits", "PayloadManifest", "SCDFitSettings", "SCDKnowledgeBase", "SCDTransferCache",
           "check_consumer", "encode", "encode_stream", "encode_to", "encode_with_report", "fit_knowledge_base",
           "full_rank_knowledge_base", "truncate_payload"]
