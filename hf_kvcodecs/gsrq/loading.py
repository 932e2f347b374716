"""Loading codebooks for a cache: from an object, a directory or a Hub repo id, each directory loaded once."""

from __future__ import annotations

from pathlib import Path

import torch

from .codebooks import METADATA_FILE, TENSORS_FILE, GSRQCodebooks
from .hub import resolve_codebooks

_CODEBOOK_MEMO: dict[tuple[str, float], GSRQCodebooks] = {}


def load_codebooks(source, *, revision: str | None = None, subfolder: str | None = None) -> GSRQCodebooks:
    """A ``GSRQCodebooks`` object, a directory path or a Hub repo id (memoized on the local path and its
    modification time; a Hub download is a local path in the Hub cache, one per commit)."""
    if isinstance(source, GSRQCodebooks):
        if revision is not None or subfolder is not None:
            raise ValueError("codebooks_revision / codebooks_subfolder only apply to a Hub repo id or a directory, "
                             "not to a GSRQCodebooks object.")
        return source
    if isinstance(source, (str, Path)):
        path = resolve_codebooks(source, revision=revision, subfolder=subfolder).resolve()
        # a directory without the files gets GSRQCodebooks.load's error, which says how to create them
        stamp = max(((path / f).stat().st_mtime for f in (METADATA_FILE, TENSORS_FILE) if (path / f).exists()),
                    default=0.0)
        key = (str(path), stamp)
        if key not in _CODEBOOK_MEMO:
            # loaded as normal tensors even inside torch.inference_mode(): the memo outlives the block, and inference
            # tensors would break a later forward pass that records gradients
            with torch.inference_mode(False):
                _CODEBOOK_MEMO[key] = GSRQCodebooks.load(path)
        return _CODEBOOK_MEMO[key]
    raise TypeError(f"codebooks must be a GSRQCodebooks object, a directory path or a Hub repo id, got "
                    f"{type(source).__name__}.")
