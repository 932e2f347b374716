"""A local store of calibrated codebooks, so commands reuse earlier calibrations instead of repeating them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

from ..codecs.joint import resolve_layouts
from ..codecs.kmeans import DEFAULT_LEARNER
from ..codecs.residual import ENCODER_REVISION
from ..models import LoadedModel, model_fingerprint
from .calibrate import GSRQFitSettings, calibrate_gsrq
from .codebooks import FORMAT_VERSION, CodebookFileError, GSRQCodebooks

logger = logging.getLogger(__name__)


def default_store() -> Path:
    return Path(os.environ.get("HF_KVCODECS_CACHE", Path.home() / ".cache" / "hf_kvcodecs")) / "codebooks"


def ensure_codebooks(loaded: LoadedModel, *, store: str | Path | None = None, text=None, progress: bool = True,
                     **settings) -> tuple[GSRQCodebooks, Path, bool]:
    """Load codebooks calibrated with exactly these settings for this model, or calibrate and store them.

    Returns ``(codebooks, directory, reused)``.
    """
    # The format and encoder versions are part of the key: codebooks stored by an older codec are refitted, not
    # silently reused, and their held-out statistics are measured with the encoder that will use them. So are the
    # defaults of every setting not given: a changed default (e.g. a layout) must not reuse codebooks fitted under the
    # old one, and a setting passed at its default value names the same codebooks as leaving it out.
    identity = {"model": loaded.name, "fingerprint": model_fingerprint(loaded.model.config), "text": text,
                "format_version": FORMAT_VERSION, "encoder_revision": ENCODER_REVISION,
                **calibration_defaults(), **settings}
    identity["key_layout"], identity["value_layout"] = resolve_layouts(  # None: the default for the key space
        identity["key_space"], identity["key_layout"], identity["value_layout"])
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in loaded.name)[-40:]
    directory = Path(store or default_store()) / f"{slug}-{settings.get('learner', DEFAULT_LEARNER)}-{digest}"
    if directory.is_dir():
        try:
            return GSRQCodebooks.load(directory), directory, True
        except CodebookFileError as error:
            logger.warning("Re-calibrating: stored codebooks in %s are unusable (%s).", directory, error)
    # (what is there is unusable, so replacing it loses nothing)
    codebooks = calibrate_gsrq(loaded.model, loaded.tokenizer, text=text, out=directory, overwrite=True,
                               progress=progress, **settings)
    return codebooks, directory, False


def calibration_defaults() -> dict:
    """The default value of every fit setting (what a calibration uses for a setting it is not given)."""
    return dataclasses.asdict(GSRQFitSettings())
