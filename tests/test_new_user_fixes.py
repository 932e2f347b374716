"""What a new user ran into: damaged codebook files that loaded, rates served below what was asked, codebook names
looked up on an unreachable Hub, install lines no index serves, raw text in SQuaT and calibrations repeated."""

from __future__ import annotations

import json
import logging
import shutil
import struct

import pytest
import torch

from hf_kvcodecs.fileio import TENSORS_CHECKSUM_KEY
from hf_kvcodecs.gsrq.codebooks import METADATA_FILE, TENSORS_FILE, CodebookFileError, GSRQCodebooks

from .conftest import resave_codebook_tensors


def _copy(directory, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(directory, target)
    return target


def _data_offset(path, tensor_name) -> int:
    """Where the first element of ``tensor_name`` lies in a safetensors file."""
    data = path.read_bytes()
    header_length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + header_length])
    return 8 + header_length + header[tensor_name]["data_offsets"][0]


# ---- damaged codebook files are refused ---------------------------------------------------------------------------


def _a_codebook_tensor(path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return next(name for name in handle.keys() if name.endswith("codebooks") and handle.get_tensor(name).dtype == torch.float32)


@pytest.mark.parametrize("damage", ["huge codeword", "flipped bit"])
def test_a_damaged_codebook_file_is_refused_with_the_file_and_the_fix(tiny_codebooks_dir, tmp_path, damage):
    target = _copy(tiny_codebooks_dir, tmp_path)
    path = target / TENSORS_FILE
    offset = _data_offset(path, _a_codebook_tensor(path))
    data = bytearray(path.read_bytes())
    if damage == "huge codeword":  # finite, so no value check could tell it from a real one
        data[offset:offset + 4] = struct.pack("<f", -1e38)
    else:
        data[offset + 1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CodebookFileError, match="is damaged") as error:
        GSRQCodebooks.load(target)
    message = str(error.value)
    assert str(path) in message and "recalibrate" in message and "download the codebooks again" in message


def test_files_saved_before_checksums_still_load_with_a_warning(tiny_codebooks_dir, tmp_path, caplog):
    target = _copy(tiny_codebooks_dir, tmp_path)
    description = json.loads((target / METADATA_FILE).read_text())
    assert len(description.pop(TENSORS_CHECKSUM_KEY)) == 64  # saves record one
    (target / METADATA_FILE).write_text(json.dumps(description))
    with caplog.at_level(logging.WARNING, logger="hf_kvcodecs.fileio"):
        loaded = GSRQCodebooks.load(target)
    assert loaded.num_layers == GSRQCodebooks.load(tiny_codebooks_dir).num_layers
    assert "records no checksum" in caplog.text
    loaded.save(target)  # saving again records one
    assert TENSORS_CHECKSUM_KEY in json.loads((target / METADATA_FILE).read_text())


@pytest.mark.parametrize("value", [float("nan"), float("-inf"), -1e38])
def test_non_finite_or_overflowing_codebook_values_are_refused(tiny_codebooks_dir, tmp_path, value):
    """Also in a file whose checksum matches (or that has none): values no calibration produces."""
    from safetensors.torch import load_file

    target = _copy(tiny_codebooks_dir, tmp_path)
    tensors = load_file(str(target / TENSORS_FILE))
    name = _a_codebook_tensor(target / TENSORS_FILE)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = value
    resave_codebook_tensors(target, tensors)  # (records the checksum of the damaged file: only the value checks are left)
    with pytest.raises(CodebookFileError, match="non-finite values" if value != value else f"tensor {name} holds an infinite value or one beyond"):
        GSRQCodebooks.load(target)
