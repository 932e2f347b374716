"""A local store of calibrated codebooks, so commands reuse earlier calibrations instead of repeating them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..models import LoadedModel
from .calibrate import GSRQFitSettings, calibrate_or_reuse
from .codebooks import GSRQCodebooks
from .identity import default_store

__all__ = ["calibration_defaults", "default_store", "ensure_codebooks"]


def ensure_codebooks(loaded: LoadedModel, *, store: str | Path | None = None, text=None, progress: bool = True,
                     **settings) -> tuple[GSRQCodebooks, Path, bool]:
    """Load codebooks calibrated with exactly these settings for this model, or calibrate and store them.

    Returns ``(codebooks, directory, reused)``. Stored codebooks are found by the identity of their calibration
    (:mod:`hf_kvcodecs.gsrq.identity`): the model's weights, the calibration tokens, every setting with its default
    filled in (a changed default, e.g. a layout, must not reuse codebooks fitted under the old one, and a setting
    passed at its default value names the same codebooks as leaving it out), the format and encoder revisions.
    :func:`~hf_kvcodecs.gsrq.calibrate_gsrq` finds them the same way.
    """
    done = calibrate_or_reuse(loaded.model, loaded.tokenizer, text=text, settings=GSRQFitSettings().replaced(**settings),
                              store=store, keep_as=loaded.name, progress=progress)
    return done.codebooks, done.directory, done.reused


def calibration_defaults() -> dict:
    """The default value of every fit setting (what a calibration uses for a setting it is not given)."""
    return dataclasses.asdict(GSRQFitSettings())
