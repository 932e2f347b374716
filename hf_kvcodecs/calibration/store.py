"""A local store of calibrated codebooks, so commands reuse earlier calibrations instead of repeating them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from ..codecs.gsrq_codebooks import FORMAT_VERSION, CodebookFileError, GSRQCodebooks
from ..codecs.kmeans import DEFAULT_LEARNER
from ..codecs.residual import ENCODER_REVISION
from ..models import LoadedModel, model_fingerprint
from .gsrq import calibrate_gsrq

logger = logging.getLogger(__name__)


def default_store() -> Path:
    return Path(os.environ.get("HF_KVCODECS_CACHE", Path.home() / ".cache" / "hf_kvcodecs")) / "codebooks"


def ensure_codebooks(loaded: LoadedModel, *, store: str | Path | None = None, text=None, progress: bool = True,
                     **settings) -> tuple[GSRQCodebooks, Path, bool]:
    """Load codebooks calibrated with exactly these settings for this model, or calibrate and store them.

    Returns ``(codebooks, directory, reused)``.
    """
    # The format and encoder versions are part of the key: codebooks stored by an older codec are refitted, not
    # silently reused, and their held-out statistics are measured with the encoder that will use them.
    identity = {"model": loaded.name, "fingerprint": model_fingerprint(loaded.model.config), "text": text,
                "format_version": FORMAT_VERSION, "encoder_revision": ENCODER_REVISION, **settings}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in loaded.name)[-40:]
    directory = Path(store or default_store()) / f"{slug}-{settings.get('learner', DEFAULT_LEARNER)}-{digest}"
    if directory.is_dir():
        try:
            return GSRQCodebooks.load(directory), directory, True
        except CodebookFileError as error:
            logger.warning("Re-calibrating: stored codebooks in %s are unusable (%s).", directory, error)
    codebooks = calibrate_gsrq(loaded.model, loaded.tokenizer, text=text, out=directory, progress=progress, **settings)
    return codebooks, directory, False
