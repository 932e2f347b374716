"""SCD knowledge bases on the Hugging Face Hub: fetch the two files of one from a repo, or from a folder of it such as
the ``scd_knowledge_base/`` folder of a consumer saved by hf_kvcodecs.

A knowledge base is fitted once per (producer, consumer) pair and every machine that runs the consumer needs it.
Downloads go through ``huggingface_hub``'s cache, so they work offline once fetched (``HF_HUB_OFFLINE=1``) and a
commit hash pins them.
"""

from __future__ import annotations

from pathlib import Path

from ..hub import HubArtifactKind, download_artifact
from .knowledge_base import METADATA_FILE, TENSORS_FILE, KnowledgeBaseError

KNOWLEDGE_BASE_FILES = (METADATA_FILE, TENSORS_FILE)
# Where a consumer saved by hf_kvcodecs keeps its knowledge base, relative to the checkpoint (named here so the hint
# below and the quantizer that writes the folder cannot drift apart).
SAVED_MODEL_FOLDER = "scd_knowledge_base"
_SAVED_MODEL_HINT = (f" If the repo holds a consumer saved by hf_kvcodecs, its knowledge base is in its "
                     f"{SAVED_MODEL_FOLDER}/ folder: pass subfolder={SAVED_MODEL_FOLDER!r}.")


KNOWLEDGE_BASE_ON_THE_HUB = HubArtifactKind(
    name="SCD knowledge base", files=KNOWLEDGE_BASE_FILES, error=KnowledgeBaseError,
    made_by="`hf-kvcodecs scd fit --out DIR`", saved_model_hint=_SAVED_MODEL_HINT)


def download_knowledge_base(repo_id: str, *, revision: str | None = None, subfolder: str | None = None,
                            token: str | bool | None = None, cache_dir: str | Path | None = None,
                            local_files_only: bool = False) -> Path:
    """The local directory holding the knowledge base files of Hub repo ``repo_id`` (downloaded into the Hub cache)."""
    return download_artifact(KNOWLEDGE_BASE_ON_THE_HUB, repo_id, revision=revision, subfolder=subfolder, token=token,
                             cache_dir=cache_dir, local_files_only=local_files_only)
