"""The SCD wire payload: a producer's prefill state, as a JSON manifest plus named raw tensor sections.

A payload crosses a network from a producer to a consumer that may run another build of hf_kvcodecs, so the
container is built to be parsed from bytes that came from anywhere:

- No pickle (and so no ``torch.load``): unpickling runs code chosen by whoever wrote the bytes. The manifest is JSON
  and tensors are raw little-endian arrays whose dtype and shape come from a short whitelist, so reading a payload
  can only ever produce data.
- Every byte is covered by a check: the magic, version and flags fields are compared with fixed values, the manifest
  has its own CRC-32 (checked before it is parsed), each section is followed by the CRC-32 of its bytes, and the
  section sizes (plus their CRCs) must add up to exactly the bytes that follow the manifest. Any single corrupted
  byte, any truncation and any trailing garbage is rejected, never read as a slightly wrong cache.
- Allocations are bounded before anything is read: the manifest is capped at ``MAX_MANIFEST_BYTES``, every section's
  size is derived from its declared shape (whose extent is bounded too) and checked against the bytes actually
  present (or, for a stream, against ``max_bytes`` and then against the bytes actually received), so a hostile
  header cannot make the reader allocate more than the input's own length plus a small constant. A reader's
  ``check`` sees the manifest and the section table before any section is turned into a tensor.
- The version is in the fixed header, ahead of the manifest, so a consumer too old for a payload says so plainly
  instead of failing somewhere inside a manifest layout it does not know.
- The manifest lists every section's name, dtype and shape, but no checksum: a section's CRC-32 follows its bytes.
  So a sender that knows its sections' shapes up front (SCD derives them from the layer plan) writes the header and
  manifest first and each section as soon as it exists (:class:`PayloadWriter`), and a receiver can verify each
  section as it arrives. Sections are concatenated without padding, in manifest order; a stream may carry several
  payloads back to back (``read_payload``).

This module is pure container code: what the manifest's other keys mean (codec, hashes, layer tables) is the caller's
business, and they are returned untouched. The layout is specified in docs/scd-payload.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
import sys
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, NamedTuple

import torch

__all__ = [
    "FLAG_AUTHENTICATED", "FORMAT_VERSION", "MAGIC", "TAG_BYTES", "MAX_MANIFEST_BYTES", "MAX_SECTIONS", "PayloadError", "PayloadStream", "PayloadWriter",
    "SectionSpec",
    "iter_payload_chunks", "pack_payload", "payload_summary", "read_payload", "unpack_payload",
]

MAGIC = b"HFKVSCD\x00"
FORMAT_VERSION = 2  # 1: each section's CRC-32 sat in the manifest, so no byte could be sent before every section existed
MAX_MANIFEST_BYTES = 1 << 20
MAX_SECTIONS = 4096
MAX_SECTION_NAME_CHARS = 128
MAX_SECTION_DIMS = 4
# A shape's extent (the product of its dimensions, zeros counted as 1) is bounded, so even an empty section's shape
# is one torch can allocate: torch.empty((0, 2**31, 2**31, 2**31)) overflows its stride computation.
MAX_SECTION_EXTENT = 1 << 48

# magic, format version, flags, manifest length, manifest CRC-32
_HEADER = struct.Struct("<8sHHII")
HEADER_BYTES = _HEADER.size  # 20
_CRC = struct.Struct("<I")
CRC_BYTES = _CRC.size  # after every section
# Flag bit 0: the payload is authenticated with a shared key. An HMAC-SHA256 tag follows the manifest (over the header
# and manifest) and each section's CRC-32 (over the previous tag, the section's index and its bytes), so a consumer
# holding the key verifies every section as it arrives and no section can be moved, replaced or spliced from another
# payload. CRC-32s stay: they tell corruption in transit from a wrong key.
FLAG_AUTHENTICATED = 0x0001
TAG_BYTES = 32
_INDEX = struct.Struct("<Q")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
    "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_SECTION_KEYS = ("name", "dtype", "shape", "nbytes")

# The format is little-endian; on a big-endian host every multi-byte element is swapped on the way in and out.
_SWAP_BYTES = sys.byteorder != "little"

# A stream is read in requests that start at this size and then grow with the bytes already received, so a section
# whose declared size is a lie costs at most about twice what the sender actually sent.
_FIRST_READ_BYTES = 1 << 16


class PayloadError(ValueError):
    """A payload that cannot be packed or must not be trusted; the message says what is wrong with it."""


class SectionSpec(NamedTuple):
    """One entry of a payload's section table: what a section is, known before its bytes exist."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def entry(self) -> dict:
        """The manifest's JSON entry for this section."""
        return {"name": self.name, "dtype": _DTYPE_NAMES[self.dtype], "shape": list(self.shape), "nbytes": self.nbytes}

    def describe(self) -> str:
        return f"{self.name!r} {_DTYPE_NAMES.get(self.dtype, self.dtype)} {list(self.shape)}"


# --------------------------------------------------------------------------------------------------------- writing


def _check_spec(spec: Any, what: str) -> SectionSpec:
    if not isinstance(spec, SectionSpec):
        raise PayloadError(f"{what} must be a SectionSpec, not a {type(spec).__name__}")
    _check_name(spec.name, f"section name {spec.name!r}")
    if spec.dtype not in _DTYPE_NAMES:
        raise PayloadError(f"section {spec.name!r} has dtype {spec.dtype}, which an SCD payload cannot carry "
                           f"(supported: {', '.join(_DTYPES)})")
    _check_shape(spec.shape, f"section {spec.name!r}")
    return spec


def _tensor_spec(name: Any, tensor: Any) -> SectionSpec:
    _check_name(name, f"section name {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise PayloadError(f"section {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.dtype not in _DTYPE_NAMES:
        raise PayloadError(f"section {name!r} has dtype {tensor.dtype}, which an SCD payload cannot carry "
                           f"(supported: {', '.join(_DTYPES)})")
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        raise PayloadError(f"section {name!r} is a {tensor.layout} tensor on {tensor.device}; an SCD payload needs a "
                           f"dense tensor with data")
    if tensor.dim() > MAX_SECTION_DIMS:
        raise PayloadError(f"section {name!r} has {tensor.dim()} dimensions; an SCD payload allows at most "
                           f"{MAX_SECTION_DIMS}")
    return SectionSpec(name, tensor.dtype, tuple(tensor.shape))


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.numel() == 0:
        return b""
    flat = tensor.reshape(-1).view(torch.uint8)
    if _SWAP_BYTES and tensor.element_size() > 1:
        flat = flat.reshape(-1, tensor.element_size()).flip(-1).reshape(-1)
    return flat.numpy().tobytes()


def _check_key(hmac_key: Any) -> bytes | None:
    if hmac_key is None:
        return None
    if not isinstance(hmac_key, (bytes, bytearray)) or len(hmac_key) < 16:
        raise PayloadError("hmac_key must be bytes of at least 16 (random) bytes, shared by producer and consumer; "
                           "e.g. secrets.token_bytes(32)")
    return bytes(hmac_key)


def _tag(key: bytes, previous: bytes, index: int | None, data) -> bytes:
    mac = hmac.new(key, previous, hashlib.sha256)
    if index is not None:
        mac.update(_INDEX.pack(index))
    mac.update(data)
    return mac.digest()


class PayloadWriter:
    """Writes one payload whose section table is known before any section exists.

    ``head`` (the fixed header and the manifest, with ``"sections"`` written from ``table``) can go on the wire at
    once; then ``chunk(name, tensor)`` for each section in ``table``'s order returns its bytes followed by their
    CRC-32, checked against the table entry, and ``close()`` checks that every section was written. So a producer can
    send a section while it is still computing the next. ``manifest`` must be a JSON-serialisable dict without a
    ``"sections"`` key. Raises ``PayloadError`` for anything the reader would refuse, always before the bytes in
    question are returned.
    """

    def __init__(self, manifest: dict, table: Sequence[SectionSpec], *, hmac_key: bytes | None = None):
        self._key = _check_key(hmac_key)
        if not isinstance(manifest, dict):
            raise PayloadError(f"the manifest must be a dict, not a {type(manifest).__name__}")
        if "sections" in manifest:
            raise PayloadError('the manifest must not contain "sections": the payload writer writes that key itself')
        if len(table) > MAX_SECTIONS:
            raise PayloadError(f"{len(table)} sections; an SCD payload allows at most {MAX_SECTIONS}")
        self.table = [_check_spec(spec, f"section table entry #{index}") for index, spec in enumerate(table)]
        names = [spec.name for spec in self.table]
        if len(set(names)) != len(names):
            twice = next(name for name in names if names.count(name) > 1)
            raise PayloadError(f"the section table lists section {twice!r} twice")
        try:
            text = json.dumps({**manifest, "sections": [spec.entry() for spec in self.table]}, ensure_ascii=True,
                              separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError, RecursionError) as error:
            raise PayloadError(f"the manifest is not JSON-serialisable: {error}") from None
        encoded = text.encode("ascii")
        if len(encoded) > MAX_MANIFEST_BYTES:
            raise PayloadError(f"the manifest encodes to {len(encoded)} bytes; an SCD payload allows at most "
                               f"{MAX_MANIFEST_BYTES}")
        # Read the manifest back with the reader's own rules (duplicate keys after int keys became strings, nesting
        # the reader's recursion limit refuses), so a payload this writes is never one a consumer rejects.
        try:
            _parse_manifest(encoded)
        except PayloadError as error:
            raise PayloadError(f"the manifest would not read back: {error}") from None
        flags = FLAG_AUTHENTICATED if self._key is not None else 0
        self.head = _HEADER.pack(MAGIC, FORMAT_VERSION, flags, len(encoded), zlib.crc32(encoded)) + encoded
        self._last_tag = b""
        if self._key is not None:
            self._last_tag = _tag(self._key, b"", None, self.head)
            self.head += self._last_tag
        self.written = 0

    @property
    def total_bytes(self) -> int:
        """The whole payload's length, known before any section is written."""
        tag = TAG_BYTES if self._key is not None else 0
        return len(self.head) + sum(spec.nbytes + CRC_BYTES + tag for spec in self.table)

    def chunk(self, name: str, tensor: torch.Tensor) -> bytes:
        if self.written >= len(self.table):
            raise PayloadError(f"section {name!r} is one more than the {len(self.table)} the manifest lists")
        expected = self.table[self.written]
        got = _tensor_spec(name, tensor)
        if got != expected:
            raise PayloadError(f"section #{self.written} is {got.describe()}; the manifest lists {expected.describe()} "
                               "there")
        data = _tensor_bytes(tensor)
        chunk = data + _CRC.pack(zlib.crc32(data))
        if self._key is not None:
            self._last_tag = _tag(self._key, self._last_tag, self.written, data)
            chunk += self._last_tag
        self.written += 1
        return chunk

    def close(self) -> None:
        if self.written != len(self.table):
            missing = [spec.name for spec in self.table[self.written:]]
            raise PayloadError(f"the payload stops after {self.written} of its {len(self.table)} sections (not written: "
                               f"{missing[:5]})")


def iter_payload_chunks(manifest: dict, sections: Mapping[str, torch.Tensor], *,
                        hmac_key: bytes | None = None) -> Iterator[bytes]:
    """A payload in pieces: the header and manifest first, then one chunk per section (its bytes and their CRC-32),
    in ``sections``' order.

    ``b"".join(iter_payload_chunks(manifest, sections)) == pack_payload(manifest, sections)``. Every section is copied
    to CPU bytes, and every check made, when this is called; a sender whose sections do not all exist yet uses
    :class:`PayloadWriter` with a table of their shapes instead. ``manifest`` must be a JSON-serialisable dict without
    a ``"sections"`` key (the writer writes that key); it goes through JSON, so tuples come back as lists. Raises
    ``PayloadError`` for anything the reader would refuse.
    """
    if not isinstance(sections, Mapping):
        raise PayloadError(f"sections must be a mapping of name to tensor, not a {type(sections).__name__}")
    if len(sections) > MAX_SECTIONS:
        raise PayloadError(f"{len(sections)} sections; an SCD payload allows at most {MAX_SECTIONS}")
    table = [_tensor_spec(name, tensor) for name, tensor in sections.items()]
    writer = PayloadWriter(manifest, table, hmac_key=hmac_key)
    chunks = [writer.head, *(writer.chunk(name, tensor) for name, tensor in sections.items())]
    writer.close()
    # Not a generator: everything is checked when this is called, before a sender has written anything anywhere.
    return iter(chunks)


def pack_payload(manifest: dict, sections: Mapping[str, torch.Tensor], *, hmac_key: bytes | None = None) -> bytes:
    """Serialise ``manifest`` (a JSON-serialisable dict without a ``"sections"`` key) and the named tensors into one
    payload. Tensors are written contiguous, from CPU copies, in the mapping's order; dtypes are limited to float32,
    float16, bfloat16, int8, uint8, int32, int64 and shapes to at most 4 dimensions. Raises ``PayloadError``."""
    return b"".join(iter_payload_chunks(manifest, sections, hmac_key=hmac_key))


# --------------------------------------------------------------------------------------------------------- reading


def _check_header(header: bytes, hmac_key: bytes | None = None, *, any_key: bool = False) -> tuple[int, int]:
    """Check the fixed header (possibly a short prefix of it, which is checked as far as it goes and then refused as
    truncated) against the reader's key (``any_key``: don't care, for summaries) and return the manifest's declared
    length and CRC-32."""
    if not header:
        raise PayloadError(f"payload truncated: 0 bytes, where an SCD payload starts with a {HEADER_BYTES}-byte header")
    got = header[:len(MAGIC)]
    if got != MAGIC[:len(got)]:
        raise PayloadError(f"not an SCD payload (magic {got!r} != {MAGIC!r})")
    if len(header) >= 10:
        (version,) = struct.unpack_from("<H", header, 8)
        if version != FORMAT_VERSION:
            raise PayloadError(f"SCD payload format version {version} is not supported by this hf_kvcodecs (reads "
                               f"version {FORMAT_VERSION}); upgrade hf_kvcodecs on the consumer or re-encode on the "
                               f"producer")
    if len(header) >= 12:
        (flags,) = struct.unpack_from("<H", header, 10)
        if flags & ~FLAG_AUTHENTICATED:
            raise PayloadError(f"SCD payload header has unknown flags 0x{flags:04x} (this hf_kvcodecs knows only "
                               f"0x{FLAG_AUTHENTICATED:04x}, authenticated)")
        authenticated = bool(flags & FLAG_AUTHENTICATED)
        if not any_key and authenticated and hmac_key is None:
            raise PayloadError("this SCD payload is authenticated with a shared key (HMAC-SHA256); pass the key the "
                               "producer used as hmac_key")
        if not any_key and not authenticated and hmac_key is not None:
            raise PayloadError("this SCD payload is not authenticated, and this consumer expects payloads signed with "
                               "its shared key: re-encode with hmac_key on the producer, or drop hmac_key here")
    if len(header) >= 16:
        (manifest_bytes,) = struct.unpack_from("<I", header, 12)
        if manifest_bytes > MAX_MANIFEST_BYTES:
            raise PayloadError(f"SCD payload manifest too long: the header declares {manifest_bytes} bytes, at most "
                               f"{MAX_MANIFEST_BYTES} are allowed")
    if len(header) < HEADER_BYTES:
        raise PayloadError(f"payload truncated: {len(header)} bytes, shorter than the {HEADER_BYTES}-byte header")
    _, _, _, manifest_bytes, manifest_crc = _HEADER.unpack(header)
    return manifest_bytes, manifest_crc


def _tag_bytes(header: bytes) -> int:
    """The bytes of HMAC tag after the manifest and after each section's CRC-32 (a checked header)."""
    return TAG_BYTES if struct.unpack_from("<H", header, 10)[0] & FLAG_AUTHENTICATED else 0


class _Authenticator:
    """Checks the tags of one authenticated payload in order: the head's, then each section's."""

    def __init__(self, key: bytes, head: bytes, tag: bytes):
        self._key = key
        if not hmac.compare_digest(_tag(key, b"", None, head), bytes(tag)):
            raise PayloadError("the payload's header and manifest failed their HMAC check: it was signed with another "
                               "key, or altered; refuse it (use the producer's shared key as hmac_key)")
        self._last = bytes(tag)

    def section(self, index: int, name: str, data, tag: bytes) -> None:
        if not hmac.compare_digest(_tag(self._key, self._last, index, data), bytes(tag)):
            raise PayloadError(f"section {name!r} failed its HMAC check: it was altered, moved or taken from another "
                               "payload")
        self._last = bytes(tag)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    # json.loads would keep the last of two equal keys; two readers that keep different ones would disagree.
    result = {}
    for key, value in pairs:
        if key in result:
            raise PayloadError(f"the manifest repeats the key {key!r} in one object")
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise PayloadError(f"the manifest holds {name}, which is not JSON (RFC 8259 has no NaN or Infinity)")


def _check_name(name: Any, what: str) -> None:
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_SECTION_NAME_CHARS:
        raise PayloadError(f"{what} must be a string of 1 to {MAX_SECTION_NAME_CHARS} characters")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_shape(shape: Any, where: str) -> None:
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_SECTION_DIMS or \
            not all(_is_int(d) and d >= 0 for d in shape):
        raise PayloadError(f"{where} has shape {shape!r}; a shape is a list of at most {MAX_SECTION_DIMS} "
                           f"non-negative integers")
    if math.prod(max(d, 1) for d in shape) > MAX_SECTION_EXTENT:
        raise PayloadError(f"{where} has shape {list(shape)}, whose extent is over the {MAX_SECTION_EXTENT} elements "
                           "an SCD payload allows (even for an empty section)")


def _check_section(index: int, entry: Any) -> SectionSpec:
    where = f"manifest section #{index}"
    if not isinstance(entry, dict):
        raise PayloadError(f"{where} is a {type(entry).__name__}, not an object")
    missing = [key for key in _SECTION_KEYS if key not in entry]
    unknown = sorted(key for key in entry if key not in _SECTION_KEYS)
    if missing or unknown:
        raise PayloadError(f"{where} must have exactly the keys {list(_SECTION_KEYS)}; missing {missing}, unknown "
                           f"{unknown}")
    name = entry["name"]
    _check_name(name, f"{where}'s name")
    where = f"manifest section {name!r}"
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise PayloadError(f"{where} has dtype {dtype!r}, which is not one of {', '.join(_DTYPES)}")
    shape = entry["shape"]
    if not isinstance(shape, list):
        raise PayloadError(f"{where} has shape {shape!r}; a shape is a list of at most {MAX_SECTION_DIMS} "
                           f"non-negative integers")
    _check_shape(shape, where)
    nbytes = entry["nbytes"]
    expected = math.prod(shape) * _DTYPES[dtype].itemsize
    if not _is_int(nbytes) or nbytes != expected:
        raise PayloadError(f"{where} declares nbytes {nbytes!r}, but shape {shape} of {dtype} is {expected} bytes")
    return SectionSpec(name, _DTYPES[dtype], tuple(shape))


def _parse_manifest(raw: bytes) -> tuple[dict, list[SectionSpec]]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise PayloadError(f"the manifest is not valid UTF-8 ({error.reason} at byte {error.start})") from None
    try:
        manifest = json.loads(text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant)
    except RecursionError:
        raise PayloadError("the manifest's JSON is nested too deeply to parse") from None
    except PayloadError:
        raise
    except ValueError as error:  # json.JSONDecodeError, and over-long integer literals
        raise PayloadError(f"the manifest is not valid JSON: {error}") from None
    if not isinstance(manifest, dict):
        raise PayloadError(f"the manifest must be a JSON object, not a {type(manifest).__name__}")
    if "sections" not in manifest:
        raise PayloadError('the manifest has no "sections" key')
    entries = manifest["sections"]
    if not isinstance(entries, list):
        raise PayloadError(f'the manifest\'s "sections" must be a list, not a {type(entries).__name__}')
    if len(entries) > MAX_SECTIONS:
        raise PayloadError(f"the manifest lists {len(entries)} sections; at most {MAX_SECTIONS} are allowed")
    sections = [_check_section(index, entry) for index, entry in enumerate(entries)]
    names: set[str] = set()
    for section in sections:
        if section.name in names:
            raise PayloadError(f"the manifest lists section {section.name!r} twice")
        names.add(section.name)
    return manifest, sections


def _check_manifest(raw: bytes, declared_crc: int) -> tuple[dict, list[SectionSpec]]:
    if zlib.crc32(raw) != declared_crc:
        raise PayloadError("the manifest failed its CRC-32 check (corrupted in transit)")
    return _parse_manifest(raw)


def _tensor(section: SectionSpec, data: bytearray, crc: bytes) -> torch.Tensor:
    """``data`` must be a buffer the caller owns and hands over: the tensor shares its memory."""
    if zlib.crc32(data) != _CRC.unpack(crc)[0]:
        raise PayloadError(f"section {section.name!r} failed its CRC-32 check (corrupted in transit)")
    if section.nbytes == 0:
        return torch.empty(section.shape, dtype=section.dtype)
    tensor = torch.frombuffer(data, dtype=section.dtype)
    if _SWAP_BYTES and section.dtype.itemsize > 1:
        raw = tensor.view(torch.uint8).reshape(-1, section.dtype.itemsize).flip(-1)
        tensor = raw.contiguous().view(section.dtype).reshape(-1)
    return tensor.reshape(section.shape)


def _as_bytes_view(data: Any) -> memoryview:
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"an SCD payload is read from bytes, bytearray or memoryview, not {type(data).__name__}") \
            from None
    if not view.c_contiguous:
        raise PayloadError("an SCD payload must be a contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _sections_bytes(sections: list[SectionSpec], tag: int = 0) -> int:
    return sum(section.nbytes + CRC_BYTES + tag for section in sections)


def _check_sections_fit(sections: list[SectionSpec], present: int, tag: int) -> None:
    declared = _sections_bytes(sections, tag)
    if declared > present:
        raise PayloadError(f"payload truncated: the manifest declares {declared} section bytes (with their CRC-32s), "
                           f"{present} are present")
    if declared < present:
        raise PayloadError(f"payload has trailing bytes: the manifest declares {declared} section bytes (with their "
                           f"CRC-32s), {present} are present")


def _parse_buffer(data: Any, max_bytes: int, hmac_key: bytes | None = None, *, any_key: bool = False,
                  ) -> tuple[memoryview, int, dict, list[SectionSpec], int, _Authenticator | None]:
    view = _as_bytes_view(data)
    if view.nbytes > max_bytes:
        raise PayloadError(f"payload is {view.nbytes} bytes, over the max_bytes limit of {max_bytes}")
    header = bytes(view[:HEADER_BYTES])
    manifest_bytes, manifest_crc = _check_header(header, hmac_key, any_key=any_key)
    tag = _tag_bytes(header)
    end = HEADER_BYTES + manifest_bytes
    if view.nbytes < end + tag:
        raise PayloadError(f"payload truncated: the header declares a {manifest_bytes}-byte manifest"
                           f"{' and its HMAC tag' if tag else ''}, {view.nbytes - HEADER_BYTES} bytes follow the header")
    # The manifest is copied before its CRC is taken, so the bytes checked are the bytes parsed even if the caller's
    # buffer changes underneath.
    raw = bytes(view[HEADER_BYTES:end])
    manifest, sections = _check_manifest(raw, manifest_crc)
    authenticator = None
    if tag and not any_key:
        authenticator = _Authenticator(hmac_key, header + raw, view[end:end + tag])
    end += tag
    _check_sections_fit(sections, view.nbytes - end, tag)
    return view, end, manifest, sections, tag, authenticator


ManifestCheck = Callable[[dict, list[SectionSpec]], Any]


def unpack_payload(data: bytes | bytearray | memoryview, *, max_bytes: int = 1 << 34,
                   check: ManifestCheck | None = None,
                   hmac_key: bytes | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Parse and verify a whole payload held in memory; return ``(manifest, {name: tensor})``.

    The manifest is returned as parsed, ``"sections"`` included; its other keys are the producer's and are not
    interpreted here. ``check(manifest, section_table)``, when given, runs once the container is known to be well
    formed and before any section is copied into a tensor: the place for a caller's own refusals (it raises).
    Tensors are fresh CPU tensors (each owns a copy of its bytes), in manifest order. The buffer must be exactly one
    payload: trailing bytes are an error (use ``read_payload`` for a stream of payloads). A buffer longer than
    ``max_bytes`` is refused before it is read. Every malformed, truncated or corrupted input raises
    ``PayloadError``; allocations never exceed about the input's length plus a bounded manifest. ``hmac_key``: the
    key shared with the producer; an authenticated payload is refused without it, and an unauthenticated one with it.
    """
    view, offset, manifest, sections, tag, authenticator = _parse_buffer(data, max_bytes, _check_key(hmac_key))
    if check is not None:
        check(manifest, sections)
    tensors = {}
    for index, section in enumerate(sections):
        end = offset + section.nbytes
        data_bytes = bytearray(view[offset:end])
        tensor = _tensor(section, data_bytes, bytes(view[end:end + CRC_BYTES]))
        if authenticator is not None:
            authenticator.section(index, section.name, data_bytes, view[end + CRC_BYTES:end + CRC_BYTES + tag])
        tensors[section.name] = tensor
        offset = end + CRC_BYTES + tag
    return manifest, tensors


def _read_up_to(stream: BinaryIO, count: int) -> bytearray:
    """Read ``count`` bytes, looping over short reads; fewer come back only if the stream ends first. Request sizes
    grow with what has arrived, so a declared size the stream cannot back costs at most about twice the bytes the
    stream really held."""
    chunks: list[bytes] = []
    received = 0
    while received < count:
        request = min(count - received, max(received, _FIRST_READ_BYTES))
        chunk = stream.read(request)
        if not chunk:
            break
        if not isinstance(chunk, (bytes, bytearray, memoryview)):
            raise TypeError(f"read_payload needs a binary stream; read() returned {type(chunk).__name__}")
        if len(chunk) > request:
            raise PayloadError(f"the stream returned {len(chunk)} bytes for a read of {request}")
        chunks.append(chunk)
        received += len(chunk)
    return bytearray().join(chunks)


def _read_exact(stream: BinaryIO, count: int, what: str) -> bytearray:
    data = _read_up_to(stream, count)
    if len(data) < count:
        raise PayloadError(f"payload truncated: {what} needs {count} bytes, the stream ended after {len(data)}")
    return data


class PayloadStream:
    """One payload read from a binary stream section by section, each verified as it arrives.

    Construction reads the header and the manifest, verifies both, refuses a payload whose declared total size is
    over ``max_bytes`` and runs ``check(manifest, section_table)`` before any section is read; ``manifest`` and
    ``table`` then hold them. Iterating yields ``(name, tensor)`` for each section, in table order, once its bytes and
    CRC-32 have arrived and matched; ``received`` counts the bytes read so far. A stream that ends early raises
    ``PayloadError("payload truncated ...")`` and a corrupted section ``PayloadError(... CRC-32 ...)``; errors raised
    by the stream itself (a transport's timeout) propagate unchanged, so a caller can tell a cut from corruption.
    Allocations are bounded by what :func:`read_payload` allows.
    """

    def __init__(self, stream: BinaryIO, *, max_bytes: int = 1 << 34, check: ManifestCheck | None = None,
                 hmac_key: bytes | None = None):
        self._stream = stream
        key = _check_key(hmac_key)
        header = bytes(_read_up_to(stream, HEADER_BYTES))
        manifest_bytes, manifest_crc = _check_header(header, key)
        self._tag = _tag_bytes(header)
        if HEADER_BYTES + manifest_bytes + self._tag > max_bytes:
            raise PayloadError(f"payload's header and manifest are {HEADER_BYTES + manifest_bytes} bytes, over the "
                               f"max_bytes limit of {max_bytes}")
        raw = bytes(_read_exact(stream, manifest_bytes, "the manifest"))
        self.manifest, self.table = _check_manifest(raw, manifest_crc)
        self._authenticator = None
        if self._tag:
            self._authenticator = _Authenticator(key, header + raw, _read_exact(stream, self._tag, "the HMAC tag"))
        self.received = HEADER_BYTES + manifest_bytes + self._tag
        self.total_bytes = self.received + _sections_bytes(self.table, self._tag)
        if self.total_bytes > max_bytes:
            raise PayloadError(f"payload declares {self.total_bytes} bytes in all, over the max_bytes limit of "
                               f"{max_bytes}")
        if check is not None:
            check(self.manifest, self.table)

    def section_bytes(self, section: SectionSpec) -> int:
        """The bytes ``section`` takes on the wire: its data, its CRC-32 and its tag when authenticated."""
        return section.nbytes + CRC_BYTES + self._tag

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index, section in enumerate(self.table):
            what = f"section {section.name!r} and its CRC-32{' and HMAC tag' if self._tag else ''}"
            data = _read_exact(self._stream, self.section_bytes(section), what)
            self.received += len(data)
            crc = bytes(data[section.nbytes:section.nbytes + CRC_BYTES])
            tag = bytes(data[section.nbytes + CRC_BYTES:])
            del data[section.nbytes:]
            tensor = _tensor(section, data, crc)
            if self._authenticator is not None:
                self._authenticator.section(index, section.name, data, tag)
            yield section.name, tensor


def read_payload(stream: BinaryIO, *, max_bytes: int = 1 << 34, check: ManifestCheck | None = None,
                 hmac_key: bytes | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read one payload from a binary stream (a file, ``socket.makefile("rb")``, ``io.BytesIO``); return what
    ``unpack_payload`` returns.

    Reads the header, then the manifest, verifies both, refuses a payload whose declared total size is over
    ``max_bytes`` and runs ``check`` (as ``unpack_payload`` does) before reading any section; then reads each section
    and verifies the CRC-32 that follows it (:class:`PayloadStream`, for a reader that uses each section as it
    arrives). Short reads are retried; a stream that ends early raises ``PayloadError("payload truncated ...")``.
    Reading stops right after the last section, so a stream may carry several payloads back to back; call again for
    the next one. A blocking stream is assumed (``read`` returning ``None`` or ``b""`` means the stream ended). On an
    error the stream is left wherever the error was found.
    """
    reader = PayloadStream(stream, max_bytes=max_bytes, check=check, hmac_key=hmac_key)
    return reader.manifest, dict(reader)


def payload_summary(data: bytes | bytearray | memoryview) -> dict:
    """``{"bytes": total, "manifest_bytes": M, "sections": {name: nbytes}}`` for reports and logs.

    Checks the header, the manifest (with its CRC-32) and that the section sizes add up to the buffer's length, but not
    the section CRCs, so it is cheap on large payloads; use ``unpack_payload`` to verify the data. Raises
    ``PayloadError`` for anything that is not one well-formed payload."""
    view, end, _, sections, tag, _ = _parse_buffer(data, max_bytes=1 << 62, any_key=True)
    return {"bytes": view.nbytes, "manifest_bytes": end - tag - HEADER_BYTES, "tag_bytes": tag,
            "sections": {section.name: section.nbytes for section in sections}}
