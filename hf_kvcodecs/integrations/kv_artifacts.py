"""The registry of the fitted KV artifacts a compressed checkpoint carries, one kind per cache implementation.

A KV method whose cache needs fitted data defines a :class:`KVArtifact` in its own package and registers it from its
``__init__`` (GSRQ's codebooks in ``hf_kvcodecs.gsrq.artifact``, SCD's knowledge base in ``hf_kvcodecs.scd.artifact``),
the way each peft tuner registers itself. The registry holds no entry of its own and imports no method: the quantizer
above the methods looks kinds up here by ``cache_implementation`` and handles each the same way (``KVCodecsConfig``
accepts the implementation and its ``kv_cache_config`` keys, ``from_pretrained`` finds the artifact next to the
weights or on the model's Hub repo at the same commit and checks it against the model, ``save_pretrained`` /
``push_to_hub`` write it into the checkpoint's :attr:`KVArtifact.folder`).

``hf_kvcodecs``' ``__init__`` imports every method before the quantization layer and before transformers can load a
model, so every kind is registered before a checkpoint is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
    """The artifact registered for ``cache_implementation``; a ValueError naming the registered ones otherwise."""
    try:
        return KV_ARTIFACTS[cache_implementation]
    except KeyError:
        raise ValueError(f"kv_cache_implementation must be one of {tuple(KV_ARTIFACTS)} or None, got "
                         f"{cache_implementation!r}.") from None
