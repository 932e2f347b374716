"""What a calibration is calibrated from, so that codebooks fitted once are found and reused instead of refitted.

A calibration's identity is the model's weights (their SHA-256; a quantized model, another checkpoint or a merged
adapter are other weights), the calibration tokens (text and tokenizer together), every fit setting with its default
filled in and the layouts resolved, and the file format and encoder revisions (codebooks of an older codec are refitted,
not silently reused). Codebooks record it in their calibration description (``calibration["identity"]``); the codebook
store (:func:`default_store`, filled by ``hf-kvcodecs demo`` and the benchmarks) names each directory by its digest.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ..codecs.joint import resolve_layouts
from ..codecs.kmeans import KMEANS_SEEDING_REVISION
from ..codecs.residual import ENCODER_REVISION
from ..models import model_fingerprint
from .codebooks import FORMAT_VERSION

IDENTITY_KEY = "identity"  # where a calibration description records its identity
# What a difference in these means, for the message that refuses to reuse codebooks calibrated otherwise.
_WHAT_DIFFERS = {"weights_sha256": "for other model weights", "tokens_sha256": "on other calibration tokens (text or "
                 "tokenizer)", "model": "for another model", "fingerprint": "for a model of another shape"}


def default_store() -> Path:
    """The codebook store: ``$HF_KVCODECS_CACHE/codebooks``, ``HF_KVCODECS_CACHE`` defaulting to ``~/.cache/hf_kvcodecs``."""
    return Path(os.environ.get("HF_KVCODECS_CACHE", Path.home() / ".cache" / "hf_kvcodecs")) / "codebooks"


def weights_sha256(model) -> str | None:
    """SHA-256 of every tensor of the model's state dict (names, dtypes, shapes and bytes); about a second for a 135M
    model. None where the weights cannot be read (offloaded to the meta device)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
            return None
        data = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{data.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def tokens_sha256(token_ids: torch.Tensor) -> str:
    return hashlib.sha256(token_ids.detach().cpu().to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def calibration_identity(model, token_ids: torch.Tensor, settings: dict, *, name: str | None = None) -> dict | None:
    """The identity of calibrating ``model`` on ``token_ids`` with ``settings`` (every field of
    ``GSRQFitSettings``), with its ``digest``. Where the weights cannot be read, ``name`` (the model as the user named
    it) stands in for them; without a name there is no identity (None) and nothing is reused."""
    weights = weights_sha256(model)
    if weights is None and name is None:
        return None
    identity = {"fingerprint": model_fingerprint(model.config), "tokens_sha256": tokens_sha256(token_ids),
                "format_version": FORMAT_VERSION, "encoder_revision": ENCODER_REVISION,
                "kmeans_seeding": KMEANS_SEEDING_REVISION, **settings}
    identity.update({"weights_sha256": weights} if weights is not None else {"model": name})
    identity["key_layout"], identity["value_layout"] = resolve_layouts(  # None: the default for the key space
        identity["key_space"], identity["key_layout"], identity["value_layout"])
    identity["digest"] = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return identity


def recorded_identity(codebooks) -> dict | None:
    recorded = codebooks.calibration.get(IDENTITY_KEY)
    return recorded if isinstance(recorded, dict) else None


def same_calibration(codebooks, identity: dict) -> bool:
    """Whether ``codebooks`` record the calibration ``identity`` describes."""
    recorded = recorded_identity(codebooks)
    return recorded is not None and recorded.get("digest") == identity["digest"]


def how_they_differ(codebooks, identity: dict) -> str:
    """Why ``codebooks`` are not those of ``identity``, as the end of "... holds GSRQ codebooks calibrated ..."."""
    recorded = recorded_identity(codebooks)
    if recorded is None:
        return "before hf_kvcodecs recorded what codebooks are calibrated from, so they cannot be matched to this request"
    differences = []
    for key in sorted((set(recorded) | set(identity)) - {"digest"}):
        if json.dumps(recorded.get(key), sort_keys=True, default=str) != json.dumps(identity.get(key), sort_keys=True,
                                                                                    default=str):
            differences.append(_WHAT_DIFFERS.get(key) or f"with {key}={recorded.get(key)!r} (asked: {identity.get(key)!r})")
    return ", ".join(differences) or "otherwise"


def store_directory(store: Path, name: str, identity: dict) -> Path:
    """Where the store keeps the codebooks of ``identity``, for the model the user named ``name``."""
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[-40:]
    return store / f"{slug}-{identity['learner']}-{identity['digest']}"


def stored_candidates(store: Path, identity: dict) -> list[Path]:
    """The store's directories named for ``identity`` (by any model name)."""
    return sorted(path for path in store.glob(f"*-{identity['digest']}") if path.is_dir()) if store.is_dir() else []
