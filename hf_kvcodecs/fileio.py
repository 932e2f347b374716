"""Safe file I/O every fitted artifact shares: a safetensors file and a JSON description saved as one unit, and a
bounded read of JSON that may come from anywhere.

A save writes each file under a temporary name, flushes both to disk and only then moves them into place, so an
interrupted save never leaves a half-written file under the real name. Both files carry one ``save_id``; a reader
that finds two ids (a crash between the two moves, or files copied from two directories) refuses the pair. The JSON
also records the SHA-256 of the safetensors file (``tensors_sha256``), so a reader can tell a file damaged after the
save (a flipped byte, a partial copy) from the one that was written: :func:`check_tensors_checksum`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

# The JSON description's record of the safetensors file's SHA-256 (descriptions written before it have none).
TENSORS_CHECKSUM_KEY = "tensors_sha256"


def fsync(path: Path) -> None:
    """Flush a file (or a directory's entries) to disk; skipped where the platform cannot open directories."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def save_tensors_and_json(directory: Path, tensors_file: str, json_file: str, tensors: dict[str, torch.Tensor],
                          description: dict, header: dict[str, str]) -> str:
    """Write ``tensors`` (safetensors, ``header`` in its metadata) and ``description`` (JSON) into ``directory`` as
    one save; both get the same ``save_id``, which is returned, and the JSON the SHA-256 of the safetensors file
    (``tensors_sha256``)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in (tensors_file, json_file):  # left over by a save that was killed outright
        for leftover in directory.glob(f".{name}.*.partial"):
            leftover.unlink(missing_ok=True)
    save_id = uuid.uuid4().hex
    staged = {name: directory / f".{name}.{save_id}.partial" for name in (tensors_file, json_file)}
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    try:
        save_file(tensors, str(staged[tensors_file]), metadata={**header, "save_id": save_id})
        checksum = file_sha256(staged[tensors_file])
        staged[json_file].write_text(json.dumps({**description, "save_id": save_id, TENSORS_CHECKSUM_KEY: checksum},
                                                indent=2, sort_keys=True))
        for path in staged.values():  # on disk before the moves, so a power loss cannot leave moved empty files
            fsync(path)
        for name, path in staged.items():
            os.replace(path, directory / name)
        fsync(directory)
    finally:
        for path in staged.values():
            path.unlink(missing_ok=True)
    return save_id


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_tensors_checksum(description: dict, tensors_path: Path, json_path: Path, *, fix: str,
                           error: type[Exception] = ValueError) -> bool:
    """Check the safetensors file ``tensors_path`` against the SHA-256 its JSON description (read from ``json_path``)
    records; a clear ``error`` naming the file and the ``fix`` ("recalibrate or re-download it") when they differ.

    A description written before checksums were recorded has none: the file cannot be verified, which is logged as a
    warning, and False is returned (True when the file was verified)."""
    recorded = description.get(TENSORS_CHECKSUM_KEY)
    if recorded is None:
        logger.warning("%s records no checksum of %s (it was saved before hf_kvcodecs recorded one), so damage to "
                       "that file cannot be detected; saving it again records one.", json_path, tensors_path.name)
        return False
    actual = file_sha256(tensors_path)
    if actual != recorded:
        raise error(f"{tensors_path} is damaged: its SHA-256 is {actual}, but {json_path} recorded "
                    f"{str(recorded)[:64]!r} when the two were saved, so the file changed since (a flipped byte, an "
                    f"interrupted copy or download, an edit). Do not use it: {fix}.")
    return True


def read_json(path: Path, *, max_bytes: int, kind: str, content: str, fix: str,
              error: type[Exception] = ValueError) -> Any:
    """The JSON in ``path``, refusing a file larger than ``max_bytes`` before reading it and one nested too deeply.
    The errors name the expected ``kind`` of file ("a GSRQ codebook file"), what it holds ("a codebook
    description") and the ``fix`` ("re-run calibrate")."""
    size = path.stat().st_size
    if size > max_bytes:
        raise error(f"{path} is {size} bytes, more than {content} ever needs ({max_bytes}); it is not {kind}.")
    try:
        return json.loads(path.read_text())
    except RecursionError as nested:
        raise error(f"{path} nests too deeply to be {kind}.") from nested
    except (json.JSONDecodeError, UnicodeDecodeError) as invalid:
        raise error(f"{path} is not valid JSON ({invalid}); the file is corrupt: {fix}.") from invalid
