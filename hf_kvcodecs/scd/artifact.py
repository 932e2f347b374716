"""SCD's knowledge base as the KV artifact a consumer's checkpoint carries (``kv_cache_implementation="scd"``).

Registered from ``hf_kvcodecs.scd``'s ``__init__``; the registry and what the quantizer does with an entry are in
:mod:`hf_kvcodecs.integrations.kv_artifacts`.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from ..fileio import fsync
from ..integrations.kv_artifacts import KVArtifact
from .hub import SAVED_MODEL_FOLDER, download_knowledge_base
from .knowledge_base import METADATA_FILE, TENSORS_FILE, KnowledgeBaseError, SCDKnowledgeBase
from .manifest import PairMismatchError
from .model_access import decoder_layers, forget_identity, shapes


def _check_scd_consumer(model, kb: SCDKnowledgeBase) -> None:
    """The consumer the knowledge base was fitted for, with as many layers as it plans.

    An SCD cache cannot be built without a payload, so the check is the one every payload's rebuild starts with.
    """
    decoder_layers(model)  # an architecture SCD cannot rebuild is refused here, not at the first request
    layers = shapes(model).layers
    if layers != kb.num_layers:
        raise PairMismatchError(f"The consumer has {layers} layers; the knowledge base plans {kb.num_layers}: it was "
                                "fitted for another model.")
    from .cache import check_consumer  # the consumer's cache loads transformers, which this module does not need

    try:
        check_consumer(model, kb)
    finally:
        # The weights hash is memoized per model object, but from_pretrained can still load an adapter into this
        # model after the quantizer ran, and a stale hash would let payloads for the bare model through.
        forget_identity(model)


def _copy_knowledge_base(kb: SCDKnowledgeBase, source: Path, target: Path) -> None:
    """Copy the files ``kb`` was loaded from instead of saving it again: payloads name the save id of the knowledge
    base they were coded with, and a new save gets a new id, which every producer's payload would then fail."""
    source, target = Path(source).resolve(), Path(target)
    if target.resolve() == source:
        return  # saved into the checkpoint it was loaded from
    on_disk = SCDKnowledgeBase.load(source).save_id
    if on_disk != kb.save_id:
        raise KnowledgeBaseError(f"{source} no longer holds the SCD knowledge base this model loaded (save "
                                 f"{kb.save_id}, now {on_disk}): it was replaced after loading. Load the model again "
                                 "to use the new one.")
    target.mkdir(parents=True, exist_ok=True)
    staged = {name: target / f".{name}.{uuid.uuid4().hex}.partial" for name in SCD_KNOWLEDGE_BASE.files}
    try:  # staged, flushed, then moved: an interrupted save never leaves a half-written file under the real name
        for name, path in staged.items():
            shutil.copyfile(source / name, path)
            fsync(path)
        for name, path in staged.items():
            os.replace(path, target / name)
        fsync(target)
    finally:
        for path in staged.values():
            path.unlink(missing_ok=True)


SCD_KNOWLEDGE_BASE = KVArtifact(
    cache_implementation="scd",
    description="SCD knowledge base",
    folder=SAVED_MODEL_FOLDER,
    location_key="knowledge_base",
    files=(METADATA_FILE, TENSORS_FILE),
    # the payload is per request, and expand follows each call's num_beams: neither is a checkpoint default
    cache_options=("knowledge_base",),
    load=SCDKnowledgeBase.load,
    check=_check_scd_consumer,
    download=download_knowledge_base,
    made_with="`hf-kvcodecs scd fit --consumer <model> --out DIR`",
    file_error=KnowledgeBaseError,
    write=_copy_knowledge_base,
)
