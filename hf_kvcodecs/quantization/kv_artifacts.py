"""The fitted KV artifacts a compressed checkpoint carries, one kind per cache implementation.

A KV method whose cache needs fitted data (GSRQ's codebooks; SCD's knowledge base) registers a :class:`KVArtifact`
under its ``cache_implementation``. The quantizer then handles every kind the same way: ``KVCodecsConfig`` accepts
the implementation and its ``kv_cache_config`` keys, ``from_pretrained`` finds the artifact next to the weights (or
downloads it from the model's Hub repo at the same commit) and checks it against the model (:attr:`KVArtifact.check`),
and ``save_pretrained`` / ``push_to_hub`` write it into the checkpoint's :attr:`KVArtifact.folder`.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..fileio import fsync
from ..gsrq.cache import CACHE_CONFIG_KEYS, GSRQCache, load_codebooks
from ..gsrq.codebooks import METADATA_FILE, TENSORS_FILE, CodebookFileError
from ..gsrq.hub import download_codebooks
from ..scd import knowledge_base as scd_files
from ..scd.cache import check_consumer
from ..scd.encode import PairMismatchError
from ..scd.hub import SAVED_MODEL_FOLDER, download_knowledge_base
from ..scd.knowledge_base import KnowledgeBaseError, SCDKnowledgeBase
from ..scd.model_access import decoder_layers, forget_identity, shapes


@dataclass(frozen=True)
class KVArtifact:
    """How a checkpoint carries the fitted data of one KV cache implementation."""

    cache_implementation: str  # the ``generate(cache_implementation=...)`` name it serves
    description: str  # what error messages call it ("KV codebooks")
    folder: str  # where ``save_pretrained`` writes it, relative to the checkpoint
    location_key: str  # the ``cache_config`` key that names its directory
    files: tuple[str, ...]  # what a complete copy of it holds
    cache_options: tuple[str, ...]  # the ``kv_cache_config`` keys a checkpoint may set, ``location_key`` included
    load: Callable[[Path], Any]  # directory -> artifact object, which has ``save(directory)``
    # (model, artifact, **options) -> None; raises ValueError when they do not work together, at load time
    check: Callable[..., None]
    download: Callable[..., Path]  # (repo_id, revision=None, subfolder=None) -> local directory
    made_with: str  # the command that writes a directory of it, for error messages
    file_error: type[Exception] = FileNotFoundError  # raised when a copy is missing or incomplete
    # (artifact, the directory it was loaded from, target directory) -> None; None: ``artifact.save(target)``
    write: Callable[[Any, Path, Path], None] | None = None

    def is_complete(self, directory: Path) -> bool:
        return all((Path(directory) / name).is_file() for name in self.files)


KV_ARTIFACTS: dict[str, KVArtifact] = {}


def register_kv_artifact(artifact: KVArtifact) -> None:
    """Make ``artifact`` the one carried for its cache implementation (registering the same one again is a no-op)."""
    registered = KV_ARTIFACTS.get(artifact.cache_implementation)
    if registered is not None and registered != artifact:
        raise ValueError(f"A KV artifact for cache_implementation={artifact.cache_implementation!r} is already "
                         "registered; each cache implementation carries one.")
    KV_ARTIFACTS[artifact.cache_implementation] = artifact


def kv_artifact(cache_implementation: str) -> KVArtifact:
    try:
        return KV_ARTIFACTS[cache_implementation]
    except KeyError:
        raise ValueError(f"kv_cache_implementation must be one of {tuple(KV_ARTIFACTS)} or None, got "
                         f"{cache_implementation!r}.") from None


# ---- GSRQ: codebooks ----------------------------------------------------------------------------------------------
def _check_gsrq_codebooks(model, codebooks, **options) -> None:
    # building one cache checks the codebooks against the model config and every option
    GSRQCache(model.config.get_text_config(decoder=True), codebooks=codebooks, **options)


GSRQ_CODEBOOKS = KVArtifact(
    cache_implementation="gsrq",
    description="KV codebooks",
    folder="kv_codebooks",
    location_key="codebooks",
    files=(METADATA_FILE, TENSORS_FILE),
    # generate() supplies the model config; a checkpoint carries its own codebooks, so no Hub revision or subfolder
    cache_options=tuple(key for key in CACHE_CONFIG_KEYS
                        if key not in ("config", "codebooks_revision", "codebooks_subfolder", "rope_inv_freq")),
    load=load_codebooks,
    check=_check_gsrq_codebooks,
    download=download_codebooks,
    made_with="`hf-kvcodecs calibrate --model <model> --out DIR`",
    file_error=CodebookFileError,
)
register_kv_artifact(GSRQ_CODEBOOKS)


# ---- SCD: the consumer's knowledge base ---------------------------------------------------------------------------
def _check_scd_consumer(model, kb: SCDKnowledgeBase) -> None:
    """The consumer the knowledge base was fitted for, with as many layers as it plans.

    An SCD cache cannot be built without a payload, so the check is the one every payload's rebuild starts with.
    """
    decoder_layers(model)  # an architecture SCD cannot rebuild is refused here, not at the first request
    layers = shapes(model).layers
    if layers != kb.num_layers:
        raise PairMismatchError(f"The consumer has {layers} layers; the knowledge base plans {kb.num_layers}: it was "
                                "fitted for another model.")
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
    files=(scd_files.METADATA_FILE, scd_files.TENSORS_FILE),
    # the payload is per request, and expand follows each call's num_beams: neither is a checkpoint default
    cache_options=("knowledge_base",),
    load=SCDKnowledgeBase.load,
    check=_check_scd_consumer,
    download=download_knowledge_base,
    made_with="`hf-kvcodecs scd fit --consumer <model> --out DIR`",
    file_error=KnowledgeBaseError,
    write=_copy_knowledge_base,
)
register_kv_artifact(SCD_KNOWLEDGE_BASE)
