"""Safe file I/O every fitted artifact shares: a safetensors file and a JSON description saved as one unit, and a
bounded read of JSON that may come from anywhere.

A save writes each file under a temporary name, flushes both to disk and only then moves them into place, so an
interrupted save never leaves a half-written file under the real name. Both files carry one ``save_id``; a reader
that finds two ids (a crash between the two moves, or files copied from two directories) refuses the pair.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


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
    one save; both get the same ``save_id``, which is returned."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in (tensors_file, json_file):  # left over by a save that was killed outright
        for leftover in directory.glob(f".{name}.*.partial"):
            leftover.unlink(missing_ok=True)
    save_id = uuid.uuid4().hex
    staged = {name: directory / f".{name}.{save_id}.partial" for name in (tensors_file, json_file)}
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    try:
        save_file(tensors, str(staged[tensors_file]), metadata={**header, "save_id": save_id})
        staged[json_file].write_text(json.dumps({**description, "save_id": save_id}, indent=2, sort_keys=True))
        for path in staged.values():  # on disk before the moves, so a power loss cannot leave moved empty files
            fsync(path)
        for name, path in staged.items():
            os.replace(path, directory / name)
        fsync(directory)
    finally:
        for path in staged.values():
            path.unlink(missing_ok=True)
    return save_id


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
