"""The quantizer's view of the KV artifact registry (:mod:`hf_kvcodecs.integrations.kv_artifacts`).

The registry lives below the methods so that each method can register its own entry from its ``__init__``
(``hf_kvcodecs.gsrq.artifact``, ``hf_kvcodecs.scd.artifact``); this module re-exports it for the quantizer and imports
no method. ``GSRQ_CODEBOOKS`` is looked up in the registry when first asked for: ``hf_kvcodecs``' ``__init__`` has
every import of ``hf_kvcodecs.quantization`` import the methods first (and so register them).
"""

from __future__ import annotations

from ..integrations.kv_artifacts import KV_ARTIFACTS, KVArtifact, kv_artifact, register_kv_artifact

# names of registered entries this module still answers for, and the cache implementation each is registered under
_REGISTERED_NAMES = {"GSRQ_CODEBOOKS": "gsrq"}


def __getattr__(name: str) -> KVArtifact:
    implementation = _REGISTERED_NAMES.get(name)
    if implementation is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    artifact = KV_ARTIFACTS.get(implementation)
    if artifact is None:
        raise ImportError(f"No KV artifact is registered for cache_implementation={implementation!r} yet: "
                          f"hf_kvcodecs.{implementation} registers it when imported (importing hf_kvcodecs.quantization does).")
    return artifact


__all__ = ["KV_ARTIFACTS", "KVArtifact", "kv_artifact", "register_kv_artifact"]
