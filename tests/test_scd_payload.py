"""The SCD wire payload: exact round trips, every refusal the reader makes, and fuzzing that shows malformed bytes
only ever raise PayloadError. Format 2: the manifest lists each section's name, dtype, shape and size, and each
section's bytes are followed by their CRC-32, so sections can be written as they are produced."""

from __future__ import annotations

import io
import json
import math
import struct
import time
import tracemalloc
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_kvcodecs.scd.payload import (
    FORMAT_VERSION,
    MAGIC,
    MAX_MANIFEST_BYTES,
    MAX_SECTIONS,
    PayloadError,
    PayloadWriter,
    SectionSpec,
    iter_payload_chunks,
    pack_payload,
    payload_summary,
    read_payload,
    unpack_payload,
)

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
    "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
}
# No example database: the repository does not ignore .hypothesis/, and these properties are cheap to re-search.
FAST = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _header(manifest_bytes: int, manifest_crc: int, *, magic: bytes = MAGIC, version: int = FORMAT_VERSION,
            flags: int = 0) -> bytes:
    return struct.pack("<8sHHII", magic, version, flags, manifest_bytes, manifest_crc)


def _raw_payload(manifest: object, tail: bytes = b"", **header) -> bytes:
    """A payload built by hand around any manifest (a JSON value, or raw bytes), with a correct manifest CRC."""
    raw = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    return _header(len(raw), zlib.crc32(raw), **header) + raw + tail


def _entry(name: str, dtype: str, shape: list[int], data: bytes) -> dict:
    return {"name": name, "dtype": dtype, "shape": shape, "nbytes": len(data)}


def _with_crc(data: bytes) -> bytes:
    """A section on the wire: its bytes, then their CRC-32."""
    return data + struct.pack("<I", zlib.crc32(data))


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Any bit pattern (NaNs, infinities, subnormals included): the payload must carry bits, not values."""
    count = math.prod(shape) * dtype.itemsize
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _sample() -> tuple[dict, dict[str, torch.Tensor]]:
    manifest = {"codec": "gsrq-v1", "layers": [{"index": 0, "bits": 3.0}], "producer": {"model_sha": "abc"}}
    sections = {
        "layer0.keys": _random_tensor(torch.uint8, (2, 3, 4), 1),
        "layer0.scales": _random_tensor(torch.float16, (2, 3), 2),
        "positions": torch.arange(5, dtype=torch.int64),
        "empty": torch.empty(0, 7, dtype=torch.bfloat16),
        "scalar": torch.tensor(1.5),
    }
    return manifest, sections


# ----------------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (5,), (2, 3), (1, 2, 3, 2)])
def test_round_trip_is_exact_for_every_dtype_and_shape(dtype_name, shape):
    tensor = _random_tensor(DTYPES[dtype_name], shape, seed=len(shape))
    manifest, tensors = unpack_payload(pack_payload({"k": dtype_name}, {"t": tensor}))
    assert _same_bits(tensors["t"], tensor)
    assert manifest["k"] == dtype_name
    assert manifest["sections"] == [{"name": "t", "dtype": dtype_name, "shape": list(shape),
                                     "nbytes": tensor.numel() * tensor.element_size()}]


def test_many_sections_keep_their_order_and_the_caller_manifest_is_untouched():
    sections = {f"layer{i}.{part}": _random_tensor(torch.int8, (i % 5, 3), i) for i in range(300)
                for part in ("keys", "values")}
    manifest = {"codec": "x", "nested": {"a": [1, 2.5, None, True, "é"]}, "big": 2**70}
    got_manifest, tensors = unpack_payload(pack_payload(manifest, sections))
    assert list(tensors) == list(sections)
    assert all(_same_bits(tensors[name], sections[name]) for name in sections)
    assert {key: value for key, value in got_manifest.items() if key != "sections"} == manifest
    assert [entry["name"] for entry in got_manifest["sections"]] == list(sections)


def test_max_sections_is_allowed_and_one_more_is_refused():
    sections = {f"s{i}": torch.empty(0, dtype=torch.uint8) for i in range(MAX_SECTIONS)}
    assert len(unpack_payload(pack_payload({}, sections))[1]) == MAX_SECTIONS
    sections["one.more"] = torch.empty(0, dtype=torch.uint8)
    with pytest.raises(PayloadError, match="at most 4096"):
        pack_payload({}, sections)
    entries = [_entry(f"s{i}", "uint8", [0], b"") for i in range(MAX_SECTIONS + 1)]
    with pytest.raises(PayloadError, match="4097 sections; at most 4096"):
        unpack_payload(_raw_payload({"sections": entries}, _with_crc(b"") * (MAX_SECTIONS + 1)))


def test_no_sections_and_tensors_are_fresh_contiguous_cpu_copies():
    assert unpack_payload(pack_payload({"only": "metadata"}, {})) == ({"only": "metadata", "sections": []}, {})
    source = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()  # not contiguous
    buffer = bytearray(pack_payload({}, {"t": source}))
    _, tensors = unpack_payload(buffer)
    buffer[-4:] = b"\xff" * 4  # the caller's buffer is reused; the tensor must not see it
    assert torch.equal(tensors["t"], source) and tensors["t"].is_contiguous() and tensors["t"].device.type == "cpu"
    tensors["t"][0, 0] = 99  # writable, and shares nothing with the source
    assert source[0, 0] == 0
    _, from_view = unpack_payload(memoryview(bytes(pack_payload({}, {"t": source}))))
    assert torch.equal(from_view["t"], source)


def test_requires_grad_tensors_are_written_as_their_data():
    weights = torch.randn(3, requires_grad=True)
    assert torch.equal(unpack_payload(pack_payload({}, {"w": weights}))[1]["w"], weights.detach())


def test_chunks_join_to_the_packed_payload():
    manifest, sections = _sample()
    chunks = list(iter_payload_chunks(manifest, sections))
    assert b"".join(chunks) == pack_payload(manifest, sections)
    assert len(chunks) == 1 + len(sections)
    assert chunks[0][:8] == MAGIC and len(chunks[0]) == 20 + struct.unpack_from("<I", chunks[0], 12)[0]
    assert [len(chunk) for chunk in chunks[1:]] == [t.numel() * t.element_size() + 4 for t in sections.values()]
    assert all(chunk[-4:] == struct.pack("<I", zlib.crc32(chunk[:-4])) for chunk in chunks[1:])


def test_a_writer_sends_the_manifest_before_any_section_exists():
    manifest, sections = _sample()
    table = [SectionSpec(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in sections.items()]
    writer = PayloadWriter(manifest, table)
    assert writer.head == next(iter_payload_chunks(manifest, sections))  # written before any section is
    chunks = [writer.head]
    for name, tensor in sections.items():
        chunks.append(writer.chunk(name, tensor))
    writer.close()
    assert b"".join(chunks) == pack_payload(manifest, sections) and writer.total_bytes == len(b"".join(chunks))
    with pytest.raises(PayloadError, match="one more than the 5"):
        writer.chunk("extra", torch.zeros(1))
    fresh = PayloadWriter(manifest, table)
    with pytest.raises(PayloadError, match="section #0 is 'positions' int64 \\[5\\]; the manifest lists 'layer0.keys'"):
        fresh.chunk("positions", sections["positions"])
    with pytest.raises(PayloadError, match="section #0 is 'layer0.keys' uint8 \\[2, 3, 5\\]"):
        fresh.chunk("layer0.keys", torch.zeros(2, 3, 5, dtype=torch.uint8))
    with pytest.raises(PayloadError, match="stops after 0 of its 5 sections"):
        fresh.close()
    with pytest.raises(PayloadError, match="lists section 'a' twice"):
        PayloadWriter({}, [SectionSpec("a", torch.int8, (1,))] * 2)
    with pytest.raises(PayloadError, match="extent"):
        PayloadWriter({}, [SectionSpec("a", torch.int8, (0, 2**31, 2**31))])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_infinity_are_not_json_and_are_refused_both_ways(value):
    with pytest.raises(PayloadError, match="not JSON-serialisable"):
        pack_payload({"x": value}, {})
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        with pytest.raises(PayloadError, match="holds .*Infinity|holds NaN"):
            unpack_payload(_raw_payload(b'{"sections": [], "x": ' + literal + b"}"))


def test_read_payload_equals_unpack_and_reads_payloads_back_to_back():
    manifest, sections = _sample()
    first = pack_payload(manifest, sections)
    second = pack_payload({"second": True}, {"x": torch.ones(2, 2)})
    stream = io.BytesIO(first + second)
    read_manifest, read_tensors = read_payload(stream)
    unpacked_manifest, unpacked_tensors = unpack_payload(first)
    assert read_manifest == unpacked_manifest
    assert list(read_tensors) == list(unpacked_tensors)
    assert all(_same_bits(read_tensors[name], unpacked_tensors[name]) for name in read_tensors)
    assert stream.tell() == len(first)
    manifest_two, tensors_two = read_payload(stream)
    assert manifest_two["second"] is True and torch.equal(tensors_two["x"], torch.ones(2, 2))
    assert stream.tell() == len(first) + len(second)
    with pytest.raises(PayloadError, match="truncated"):
        read_payload(stream)  # at the end of the stream


class _Trickle(io.RawIOBase):
    """A stream that hands out at most ``step`` bytes per read, like a slow socket."""

    def __init__(self, data: bytes, step: int = 1):
        self._data, self._position, self._step = data, 0, step

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        size = self._step if size < 0 else min(size, self._step)
        chunk = self._data[self._position:self._position + size]
        self._position += len(chunk)
        return chunk


def test_a_stream_that_returns_one_byte_at_a_time_still_parses():
    manifest, sections = _sample()
    data = pack_payload(manifest, sections)
    got_manifest, tensors = read_payload(_Trickle(data + data))
    assert got_manifest == unpack_payload(data)[0]
    assert all(_same_bits(tensors[name], sections[name]) for name in sections)
    with pytest.raises(PayloadError, match="truncated"):
        read_payload(_Trickle(data[:-1], step=7))


def test_payload_summary():
    manifest, sections = _sample()
    data = pack_payload(manifest, sections)
    summary = payload_summary(data)
    assert summary["bytes"] == len(data)
    assert summary["manifest_bytes"] == struct.unpack_from("<I", data, 12)[0]
    assert summary["sections"] == {name: t.numel() * t.element_size() for name, t in sections.items()}
    with pytest.raises(PayloadError, match="trailing"):
        payload_summary(data + b"\x00")


# ---------------------------------------------------------------------------------------------- what pack refuses


@pytest.mark.parametrize("sections, message", [
    ({"t": torch.zeros(2, dtype=torch.float64)}, "dtype torch.float64"),
    ({"t": torch.zeros(2, dtype=torch.bool)}, "dtype torch.bool"),
    ({"t": torch.zeros(2, dtype=torch.complex64)}, "dtype torch.complex64"),
    ({"t": torch.zeros(1, 1, 1, 1, 1)}, "5 dimensions"),
    ({"t": [1, 2]}, "not a torch.Tensor"),
    ({"t": torch.zeros(2, device="meta")}, "dense tensor with data"),
    ({"": torch.zeros(1)}, "1 to 128 characters"),
    ({"x" * 129: torch.zeros(1)}, "1 to 128 characters"),
    ({3: torch.zeros(1)}, "must be a string"),
])
def test_pack_refuses_what_a_reader_would_refuse(sections, message):
    with pytest.raises(PayloadError, match=message):
        pack_payload({}, sections)
    with pytest.raises(PayloadError, match=message):
        iter_payload_chunks({}, sections)  # at the call, before the first chunk is asked for


@pytest.mark.parametrize("manifest, message", [
    ({"sections": []}, "must not contain"),
    ([], "must be a dict"),
    ({"x": object()}, "not JSON-serialisable"),
    ({1: "a", "1": "b"}, "would not read back.*repeats the key '1'"),
    ({"blob": "x" * MAX_MANIFEST_BYTES}, "at most 1048576"),
])
def test_pack_refuses_bad_manifests(manifest, message):
    with pytest.raises(PayloadError, match=message):
        pack_payload(manifest, {})


# ---------------------------------------------------------------------------------------------- what unpack refuses


def _valid() -> bytes:
    return pack_payload({"codec": "x"}, {"layer3.keys": torch.arange(10, dtype=torch.int32)})


def _with_section_entry(**changes) -> bytes:
    """A payload with one 40-byte section whose manifest entry is altered, the manifest CRC kept correct."""
    data = bytes(range(40))
    entry = {**_entry("layer3.keys", "int32", [10], data), **changes}
    return _raw_payload({"sections": [entry]}, _with_crc(data))


def _header_then(manifest: bytes, tail: bytes = b"") -> bytes:
    return _raw_payload(manifest, tail)


_DATA = bytes(range(40))
_GOOD = _entry("a", "int32", [10], _DATA)
_WIRE = _with_crc(_DATA)
_CASES = {
    "bad magic": (b"NOTSCD\x00\x00" + _valid()[8:], r"not an SCD payload \(magic b'NOTSCD\\x00\\x00' != "
                  r"b'HFKVSCD\\x00'\)"),
    "short bad magic": (b"GIF8", "not an SCD payload"),
    "empty": (b"", "truncated: 0 bytes"),
    "header only partly there": (_valid()[:15], "truncated: 15 bytes, shorter than the 20-byte header"),
    "wrong version": (_raw_payload({"sections": []}, version=7),
                      "format version 7 is not supported by this hf_kvcodecs \\(reads version 2\\); upgrade "
                      "hf_kvcodecs on the consumer or re-encode on the producer"),
    # the version is checked before the manifest: this one is not even JSON, and its CRC is wrong
    "wrong version before manifest": (_header(3, 0, version=1) + b"\xff\xfe\xfd", "format version 1"),
    "unknown flags": (_raw_payload({"sections": []}, flags=2), "unknown flags 0x0002"),
    "signed, no key given": (_raw_payload({"sections": []}, flags=1), "authenticated with a shared key"),
    "manifest too long": (_header(MAX_MANIFEST_BYTES + 1, 0) + b"{}", "manifest too long"),
    "manifest truncated": (_header(100, 0) + b"{}", "truncated: the header declares a 100-byte manifest, 2 bytes"),
    "manifest crc": (_header(2, zlib.crc32(b"{}") ^ 1) + b"{}", "manifest failed its CRC-32"),
    "not an object": (_header_then(b"[]"), "must be a JSON object, not a list"),
    "not json": (_header_then(b'{"sections": ['), "not valid JSON"),
    "empty manifest": (_header_then(b""), "not valid JSON"),
    "invalid utf-8": (_header_then(b'{"sections": [], "x": "\xff"}'), "not valid UTF-8"),
    "deeply nested": (_header_then(b'{"sections": [], "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
                      "nested too deeply"),
    "huge integer literal": (_header_then(b'{"sections": [], "x": ' + b"9" * 5000 + b"}"), "not valid JSON"),
    "duplicate keys": (_header_then(b'{"sections": [], "sections": []}'), "repeats the key 'sections'"),
    "no sections key": (_raw_payload({"codec": "x"}), 'no "sections" key'),
    "sections not a list": (_raw_payload({"sections": {}}), 'must be a list, not a dict'),
    "section not an object": (_raw_payload({"sections": [3]}), "section #0 is a int"),
    "missing name": (_raw_payload({"sections": [{k: v for k, v in _GOOD.items() if k != "name"}]}, _WIRE),
                     r"missing \['name'\]"),
    "unknown section key": (_raw_payload({"sections": [{**_GOOD, "offset": 0}]}, _WIRE), r"unknown \['offset'\]"),
    # format 1 kept each section's CRC-32 in the manifest
    "format 1 section entry": (_raw_payload({"sections": [{**_GOOD, "crc32": zlib.crc32(_DATA)}]}, _WIRE),
                               r"unknown \['crc32'\]"),
    "empty name": (_with_section_entry(name=""), "name must be a string of 1 to 128"),
    "name not a string": (_with_section_entry(name=7), "name must be a string"),
    "duplicate names": (_raw_payload({"sections": [_GOOD, _GOOD]}, _WIRE + _WIRE), "lists section 'a' twice"),
    "bad dtype": (_with_section_entry(dtype="float64"), "dtype 'float64', which is not one of"),
    "dtype not a string": (_with_section_entry(dtype=["int32"]), "dtype \\['int32'\\]"),
    "negative dim": (_with_section_entry(shape=[-10]), "shape \\[-10\\]"),
    "too many dims": (_with_section_entry(shape=[1, 1, 1, 1, 10]), "at most 4"),
    # an empty section, but torch could not allocate even that shape (its strides overflow)
    "empty with a huge extent": (_with_section_entry(shape=[0, 2**31, 2**31, 2**31], nbytes=0), "extent"),
    "float dim": (_with_section_entry(shape=[10.0]), "non-negative integers"),
    "bool dim": (_with_section_entry(shape=[True]), "non-negative integers"),
    "shape not a list": (_with_section_entry(shape=10), "non-negative integers"),
    "nbytes mismatch": (_with_section_entry(nbytes=39), "declares nbytes 39, but shape \\[10\\] of int32 is 40"),
    "nbytes not an int": (_with_section_entry(nbytes="40"), "declares nbytes '40'"),
    "truncated": (_valid()[:-1], r"payload truncated: the manifest declares 44 section bytes \(with their CRC-32s\), "
                  "43 are present"),
    "trailing bytes": (_valid() + b"\x00", r"trailing bytes: the manifest declares 44 section bytes \(with their "
                       r"CRC-32s\), 45 are present"),
    "section crc": (_valid()[:-1] + bytes([_valid()[-1] ^ 0x10]),
                    r"section 'layer3.keys' failed its CRC-32 check \(corrupted in transit\)"),
    "section byte": (_valid()[:-5] + bytes([_valid()[-5] ^ 0x01]) + _valid()[-4:],
                     r"section 'layer3.keys' failed its CRC-32 check"),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_each_malformed_payload_is_refused_with_a_clear_message(case):
    data, message = _CASES[case]
    with pytest.raises(PayloadError, match=message):
        unpack_payload(data)
    if case != "trailing bytes":  # a stream may carry more after a payload
        with pytest.raises(PayloadError):
            read_payload(io.BytesIO(data))


def test_payload_error_is_a_value_error():
    assert issubclass(PayloadError, ValueError)


def test_max_bytes_is_checked_before_the_data_is_read():
    data = _valid()
    with pytest.raises(PayloadError, match=f"payload is {len(data)} bytes, over the max_bytes limit of 50"):
        unpack_payload(data, max_bytes=50)
    assert unpack_payload(data, max_bytes=len(data))[1]["layer3.keys"].tolist() == list(range(10))
    stream = io.BytesIO(data)
    with pytest.raises(PayloadError, match=f"declares {len(data)} bytes in all, over the max_bytes limit"):
        read_payload(stream, max_bytes=len(data) - 1)
    assert stream.tell() == len(data) - 44  # header and manifest read, no section
    with pytest.raises(PayloadError, match="header and manifest are .* over the max_bytes limit of 30"):
        read_payload(io.BytesIO(data), max_bytes=30)


def test_non_buffers_are_a_type_error_and_strided_buffers_a_payload_error():
    with pytest.raises(TypeError, match="bytes, bytearray or memoryview"):
        unpack_payload("HFKVSCD")
    with pytest.raises(PayloadError, match="contiguous"):
        unpack_payload(memoryview(_valid())[::2])
    with pytest.raises(TypeError, match="binary stream"):
        read_payload(io.StringIO("HFKVSCD"))


# ------------------------------------------------------------------------------------------------- memory bounds


def _peak_python_bytes(function) -> int:
    tracemalloc.start()
    try:
        function()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def _refused(data: bytes, message: str, reader=unpack_payload):
    def run():
        with pytest.raises(PayloadError, match=message):
            reader(io.BytesIO(data) if reader is read_payload else data)
    return run


@pytest.mark.parametrize("reader", [unpack_payload, read_payload])
@pytest.mark.parametrize("data, message", [
    (_header(0xFFFFFFFF, 0) + b"\x00" * 80, "manifest too long"),
    (_header(MAX_MANIFEST_BYTES, 0) + b"\x00" * 80, "truncated"),
    (_raw_payload({"sections": [{"name": "huge", "dtype": "int8", "shape": [2**40], "nbytes": 2**40}]},
                  b"\x00" * 100), "declares 1099511627780 section bytes .*, 100 are present|max_bytes"),
    (_raw_payload({"sections": [{"name": "huge", "dtype": "int64", "shape": [2**12] * 4, "nbytes": 2**51}]},
                  b"\x00" * 100), "truncated|max_bytes"),
    (_raw_payload({"sections": [{"name": "huge", "dtype": "int64", "shape": [2**40] * 4, "nbytes": 2**163}]},
                  b"\x00" * 100), "extent"),
    # 8 GiB is under read_payload's default max_bytes, so only the bytes actually received can bound the reads
    (_raw_payload({"sections": [{"name": "big", "dtype": "uint8", "shape": [2**33], "nbytes": 2**33}]},
                  b"\x00" * 100), "truncated"),
])
def test_huge_declared_sizes_over_a_tiny_buffer_are_refused_without_allocating(reader, data, message):
    start = time.perf_counter()
    peak = _peak_python_bytes(_refused(data, message, reader))
    assert peak < 4 * 1024 * 1024
    assert time.perf_counter() - start < 5


# ---------------------------------------------------------------------------------------------- property-based


_json_leaves = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
_json = st.recursive(_json_leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5),
                                                                                               inner, max_size=3),
                     max_leaves=8)


@st.composite
def _payload_parts(draw) -> tuple[dict, dict[str, torch.Tensor]]:
    names = draw(st.lists(st.text(min_size=1, max_size=10), max_size=4, unique=True))
    sections = {}
    for name in names:
        dtype = DTYPES[draw(st.sampled_from(list(DTYPES)))]
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=4)))
        size = math.prod(shape) * dtype.itemsize
        raw = draw(st.binary(min_size=size, max_size=size))
        sections[name] = (torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
                          ).reshape(shape)
    manifest = draw(st.dictionaries(st.text(max_size=6).filter(lambda key: key != "sections"), _json, max_size=3))
    return manifest, sections


def _only_payload_errors(data: bytes) -> None:
    """Parsing ``data`` either works or raises PayloadError, through both readers, and both agree."""
    try:
        unpacked = unpack_payload(data)
    except PayloadError:
        unpacked = None
    try:
        stream = io.BytesIO(data)
        read = read_payload(stream)
        if stream.tell() != len(data):
            read = None  # a stream may hold more after a payload; unpack_payload calls that trailing bytes
    except PayloadError:
        read = None
    assert (unpacked is None) == (read is None)
    if unpacked is not None:
        assert unpacked[0] == read[0] and all(_same_bits(unpacked[1][n], read[1][n]) for n in unpacked[1])


@FAST
@given(_payload_parts())
def test_random_payloads_round_trip_through_both_readers(parts):
    manifest, sections = parts
    data = pack_payload(manifest, sections)
    assert b"".join(iter_payload_chunks(manifest, sections)) == data
    for got_manifest, tensors in (unpack_payload(data), read_payload(io.BytesIO(data))):
        assert {key: value for key, value in got_manifest.items() if key != "sections"} == manifest
        assert list(tensors) == list(sections)
        assert all(_same_bits(tensors[name], sections[name]) for name in sections)


@FAST
@given(_payload_parts(), st.data())
def test_every_single_byte_flip_is_detected(parts, data):
    payload = pack_payload(*parts)
    index = data.draw(st.integers(0, len(payload) - 1))
    flipped = bytearray(payload)
    flipped[index] ^= data.draw(st.integers(1, 255))
    with pytest.raises(PayloadError):
        unpack_payload(bytes(flipped))
    with pytest.raises(PayloadError):
        read_payload(io.BytesIO(bytes(flipped)))


def test_every_position_of_one_payload_detects_a_flip():
    payload = pack_payload(*_sample())
    for index in range(len(payload)):
        for delta in (0x01, 0x80, 0xFF):
            flipped = bytearray(payload)
            flipped[index] ^= delta
            with pytest.raises(PayloadError):
                unpack_payload(flipped)


@settings(max_examples=15, deadline=None, database=None)
@given(_payload_parts())
def test_every_truncation_is_detected(parts):
    payload = pack_payload(*parts)
    for length in range(len(payload)):
        with pytest.raises(PayloadError):
            unpack_payload(payload[:length])
        with pytest.raises(PayloadError, match="truncated"):
            read_payload(io.BytesIO(payload[:length]))


@FAST
@given(_payload_parts(), st.binary(min_size=1, max_size=64))
def test_any_appended_bytes_are_detected(parts, extra):
    with pytest.raises(PayloadError, match="trailing bytes"):
        unpack_payload(pack_payload(*parts) + extra)


@settings(max_examples=200, deadline=None, database=None)
@given(st.binary(max_size=256) | st.binary(max_size=64).map(lambda tail: MAGIC + tail)
       | st.binary(max_size=64).map(lambda tail: MAGIC + struct.pack("<HH", FORMAT_VERSION, 0) + tail))
def test_random_bytes_only_ever_raise_payload_error(data):
    _only_payload_errors(data)


_ANY_VALUE = _json | st.sampled_from([-1, 0, 1, 2**32, 2**40, True, "int8", "float64", [], [2, 3], [-1], [2**40]])
_entries = st.lists(
    st.fixed_dictionaries({
        "name": st.text(max_size=3) | _ANY_VALUE, "dtype": st.sampled_from([*DTYPES, "float64", "bool"]) | _ANY_VALUE,
        "shape": st.lists(st.integers(-1, 4), max_size=5) | _ANY_VALUE, "nbytes": st.integers(-1, 64) | _ANY_VALUE,
    }, optional={"extra": _json, "crc32": st.integers(-1, 2**32)}) | _ANY_VALUE,
    max_size=3)


@settings(max_examples=200, deadline=None, database=None)
@given(st.dictionaries(st.text(max_size=4), _json, max_size=2), _entries | _ANY_VALUE, st.binary(max_size=96))
def test_random_manifests_with_correct_crcs_only_ever_raise_payload_error(rest, entries, tail):
    """The header and manifest CRC are right, so these reach the manifest checks and the section reads."""
    _only_payload_errors(_raw_payload({**rest, "sections": entries}, tail))


@st.composite
def _damaged_payloads(draw) -> bytes:
    """Well-formed payloads, then zero to two edits to one manifest entry or to the section bytes, the manifest CRC
    recomputed: these get past the JSON checks and reach the shape, size and section-CRC checks."""
    entries, data = [], b""
    for name in draw(st.lists(st.text(min_size=1, max_size=2), max_size=3, unique=True)):
        dtype = draw(st.sampled_from(list(DTYPES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=4))
        size = math.prod(shape) * DTYPES[dtype].itemsize
        raw = draw(st.binary(min_size=size, max_size=size))
        entries.append(_entry(name, dtype, shape, raw))
        data += _with_crc(raw)
    for _ in range(draw(st.integers(0, 2))):
        edit = draw(st.sampled_from(["field", "drop", "extra", "flip", "bytes"] if entries else ["bytes"]))
        if edit == "flip" and data:
            index = draw(st.integers(0, len(data) - 1))
            data = data[:index] + bytes([data[index] ^ draw(st.integers(1, 255))]) + data[index + 1:]
            continue
        if edit in ("flip", "bytes"):
            cut = draw(st.integers(0, len(data)))
            data = data[:cut] + draw(st.binary(max_size=4)) + data[cut + draw(st.integers(0, 4)):]
            continue
        entry = entries[draw(st.integers(0, len(entries) - 1))]
        key = draw(st.sampled_from(sorted(entry)))
        if edit == "field":
            entry[key] = draw(_ANY_VALUE | st.integers(-1, 2**32))
        elif edit == "drop":
            del entry[key]
        else:
            entry[draw(st.text(max_size=6))] = draw(_json)
    return _raw_payload({"sections": entries}, data)


@settings(max_examples=300, deadline=None, database=None)
@given(_damaged_payloads())
def test_damaged_manifest_entries_and_section_bytes_only_ever_raise_payload_error(data):
    _only_payload_errors(data)
