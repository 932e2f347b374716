"""The fitted KV artifacts a compressed checkpoint carries, one kind per cache implementation.

A KV method whose cache needs fitted data (GSRQ's codebooks; SCD's knowledge base) registers a :class:`KVArtifact`
under its ``cache_implementation``. The quantizer then handles every kind the same way: ``KVCodecsConfig`` accepts
the implementation and its ``kv_cache_config`` keys, ``from_pretrained`` finds the artifact next to the weights (or
downloads it from the model's Hub repo at the same commit) and checks it against the model by building one cache,
and ``save_pretrained`` / ``push_to_hub`` write it into the checkpoint's :attr:`KVArtifact.folder`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..gsrq.cache import CACHE_CONFIG_KEYS, GSRQCache, load_codebooks
from ..gsrq.codebooks import METADATA_FILE, TENSORS_FILE, CodebookFileError
from ..gsrq.hub import download_codebooks


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
    build_cache: Callable[..., Any]  # (text config, artifact, **options) -> a cache; raises ValueError on a misfit
    download: Callable[..., Path]  # (repo_id, revision=None, subfolder=None) -> local directory
    file_error: type[Exception] = FileNotFoundError  # raised when a copy is missing or incomplete

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


def _build_gsrq_cache(text_config, codebooks, **options):
    return GSRQCache(text_config, codebooks=codebooks, **options)


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
    build_cache=_build_gsrq_cache,
    download=download_codebooks,
    file_error=CodebookFileError,
)
register_kv_artifact(GSRQ_CODEBOOKS)
