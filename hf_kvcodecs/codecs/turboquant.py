"""A TurboQuant-style KV codec that needs no calibration: random rotation, then a Gaussian scalar quantizer.

Each head vector ``x`` (keys or values, ``head_dim`` = d coordinates) is stored as its norm (float16) and the codes
of its normalized, rotated coordinates: ``z = sqrt(d) * (x / |x|) @ R`` with ``R`` a random orthogonal matrix per
(layer, KV head). After a random rotation the coordinates of a unit vector are close to N(0, 1/d) whatever the
vector was, so ``z`` is close to N(0, 1) and one fixed Lloyd-Max quantizer for the standard Gaussian
(:mod:`.lloyd_max`) codes every coordinate; nothing is fitted to the model. Decoding inverts each step:
``x_hat = |x| * (levels[codes] / sqrt(d)) @ R.T``. This is the mean-squared-error variant of TurboQuant (no 1-bit
residual sketch for inner products).

Rates: integer widths 1 to 4 bits code every coordinate at that width. A rate of ``b + 0.5`` (1.5, 2.5, 3.5) splits
the rotated coordinates into two halves, the first ``d // 2`` coded at ``b`` bits and the rest at ``b + 1``; after
the rotation no coordinate is special, so which half gets the extra bit does not matter.

Bytes held per vector: the codes, bit-packed (each half packs 8 codes of ``w`` bits into ``w`` bytes; a half whose
length is not a multiple of 8 is padded with zero codes, and the padding is counted as held) plus the 16-bit norm,
nothing else. The rotations are regenerated from a seed (:class:`TurboQuantRotations`); where a cache keeps them they
are a per-model table of ``heads * d * d`` float32 per layer, reported apart (:func:`rotation_bytes`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from .lloyd_max import GAUSSIAN_QUANTIZER_BITS, gaussian_lloyd_max

SUPPORTED_BITS = (1, 1.5, 2, 2.5, 3, 3.5, 4)
NORM_BITS = 16
_CODES_PER_PACK = 8  # 8 codes of w bits fill w whole bytes
_FP16_MAX = torch.finfo(torch.float16).max


def check_bits(bits) -> float:
    """``bits`` as a float if TurboQuant offers that rate, else a ValueError naming the rates it offers."""
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or float(bits) not in SUPPORTED_BITS:
        raise ValueError(
            f"bits={bits!r}: TurboQuant codes each rotated coordinate with a Gaussian Lloyd-Max quantizer of "
            f"{GAUSSIAN_QUANTIZER_BITS[0]} to {GAUSSIAN_QUANTIZER_BITS[-1]} bits; choose one of "
            f"{[f'{rate:g}' for rate in SUPPORTED_BITS]} (a .5 rate codes half the coordinates at one bit more)."
        )
    return float(bits)


def coordinate_groups(bits: float, dim: int) -> tuple[tuple[int, int, int], ...]:
    """``(start, stop, width)`` per run of rotated coordinates coded at one width: all ``dim`` at an integer rate,
    ``[0, dim // 2)`` at ``floor(bits)`` and the rest at one bit more at a fractional one."""
    bits = check_bits(bits)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
        raise ValueError(f"dim={dim!r}: head vectors need at least 2 coordinates.")
    low = math.floor(bits)
    if bits == low:
        return ((0, dim, low),)
    return ((0, dim // 2, low), (dim // 2, dim, low + 1))


def packed_code_bytes(bits: float, dim: int) -> int:
    """Bytes of one vector's packed codes."""
    return sum(math.ceil((stop - start) / _CODES_PER_PACK) * width for start, stop, width in coordinate_groups(bits, dim))


def bytes_per_vector(bits: float, dim: int) -> int:
    """Bytes held per coded head vector: packed codes plus the 16-bit norm."""
    return packed_code_bytes(bits, dim) + NORM_BITS // 8


def held_bits_per_element(bits: float, dim: int) -> float:
    """Bits held per K/V element once coded (codes and norm; the rotations are a per-model table, not counted)."""
    return 8.0 * bytes_per_vector(bits, dim) / dim


def rotation_bytes(num_layers: int, heads: int, dim: int) -> int:
    """Bytes of the float32 rotations of ``num_layers`` layers, where a cache keeps them rather than regenerating."""
    return num_layers * heads * dim * dim * 4


def random_rotations(seed: int, layer: int, heads: int, dim: int) -> torch.Tensor:
    """``[heads, dim, dim]`` float32 orthogonal matrices, uniformly (Haar) distributed, the same for the same
    ``(seed, layer)`` whatever device the cache runs on: QR of a Gaussian matrix drawn from a seeded CPU generator,
    with each column multiplied by the sign of R's diagonal (without that fix the distribution depends on the QR
    implementation's sign convention and is not uniform)."""
    for name, value in (("seed", seed), ("layer", layer), ("heads", heads), ("dim", dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name in ("seed", "layer") else 1):
            raise ValueError(f"{name}={value!r} must be a {'non-negative' if name in ('seed', 'layer') else 'positive'} "
                             "integer.")
    # one stream per (seed, layer); float64 so that the orthogonality survives the QR to float32 rounding
    generator = torch.Generator().manual_seed((seed * 1_000_003 + layer) % 2**63)
    gaussian = torch.randn(heads, dim, dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    return (q * signs.unsqueeze(-2)).float()


class TurboQuantRotations:
    """The rotations of every layer of one model, generated from ``seed`` on first use per (layer, device) and kept.

    Pass one object to every cache of a model to share the tables between them (they are then held once per model,
    like a codec's codebooks); a cache given none builds its own.
    """

    def __init__(self, heads: int, dim: int, seed: int = 0):
        for name, value, least in (("heads", heads, 1), ("dim", dim, 2), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}={value!r} must be an integer of at least {least}.")
        self.heads, self.dim, self.seed = heads, dim, seed
        self._tables: dict[tuple[int, str], torch.Tensor] = {}

    def layer(self, layer: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[heads, dim, dim]`` float32 rotations of ``layer`` on ``device``."""
        key = (layer, str(torch.device(device)))
        if key not in self._tables:
            self._tables[key] = random_rotations(self.seed, layer, self.heads, self.dim).to(device)
        return self._tables[key]

    def nbytes(self) -> int:
        """Bytes of the rotations built so far."""
        return sum(table.nbytes for table in self._tables.values())


class TurboQuantCodes(NamedTuple):
    """Coded head vectors ``[..., T]``: packed codes (uint8, ``[..., T, packed_code_bytes]``) and norms (float16)."""

    codes: torch.Tensor
    norms: torch.Tensor


def _rotate(states: torch.Tensor, rotations: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``states @ R`` (or ``@ R.T``) per head: states ``[..., H, T, d]``, rotations ``[H, d, d]``."""
    return states @ (rotations.transpose(-1, -2) if inverse else rotations)


def _pack(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Integer codes ``[..., n]`` of ``width`` bits each -> ``[..., ceil(n / 8) * width]`` uint8."""
    count = codes.shape[-1]
    padded = math.ceil(count / _CODES_PER_PACK) * _CODES_PER_PACK
    codes = torch.nn.functional.pad(codes.to(torch.int64), (0, padded - count))
    shifts = width * torch.arange(_CODES_PER_PACK, device=codes.device)
    words = (codes.unflatten(-1, (-1, _CODES_PER_PACK)) << shifts).sum(-1)  # at most 32 bits each
    byte_shifts = 8 * torch.arange(width, device=codes.device)
    return ((words.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8).flatten(-2)


def _unpack(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: ``[..., ceil(count / 8) * width]`` uint8 -> ``[..., count]`` int64 codes."""
    byte_shifts = 8 * torch.arange(width, device=packed.device)
    words = (packed.to(torch.int64).unflatten(-1, (-1, width)) << byte_shifts).sum(-1)
    shifts = width * torch.arange(_CODES_PER_PACK, device=packed.device)
    codes = (words.unsqueeze(-1) >> shifts) & (2**width - 1)
    return codes.flatten(-2)[..., :count]


@functools.cache
def _byte_levels(width: int) -> torch.Tensor:
    """``[256, 8 // width]`` float32: the levels of the codes one packed byte holds, for widths that divide 8 (each
    byte then holds whole codes, in order), so that decoding is one lookup per byte instead of unpack then gather."""
    byte = torch.arange(256)
    codes = (byte.unsqueeze(-1) >> (width * torch.arange(8 // width))) & (2**width - 1)
    return torch.tensor(gaussian_lloyd_max(width).levels)[codes]


def _decode_levels(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Packed codes ``[..., bytes]`` of ``count`` coordinates -> their float32 levels ``[..., count]``."""
    if 8 % width == 0:
        return _byte_levels(width).to(packed.device)[packed.long()].flatten(-2)[..., :count]
    levels = torch.tensor(gaussian_lloyd_max(width).levels, device=packed.device)
    return levels[_unpack(packed, width, count)]


class TurboQuantCodec:
    """Encode and decode head vectors ``[..., H, T, d]`` at ``bits`` per coordinate (see the module docstring).

    The codec holds no tensor (its quantizer tables are Python floats, turned into tensors per call), so a cache that
    keeps one holds exactly the codes and norms it stores.
    """

    def __init__(self, bits: float, dim: int):
        self.bits = check_bits(bits)
        self.dim = dim
        self.groups = coordinate_groups(self.bits, dim)
        self.packed_bytes = packed_code_bytes(self.bits, dim)

    def encode(self, states: torch.Tensor, rotations: torch.Tensor) -> TurboQuantCodes:
        """``states`` ``[..., H, T, d]`` (any float dtype), ``rotations`` ``[H, d, d]`` -> codes and norms."""
        self._check_shapes(states.shape[-1], rotations)
        states = states.float()
        norms = torch.linalg.vector_norm(states, dim=-1)
        unit = states / norms.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
        rotated = _rotate(unit, rotations.to(states.device)) * math.sqrt(self.dim)
        packed = []
        for start, stop, width in self.groups:
            thresholds = torch.tensor(gaussian_lloyd_max(width).thresholds, device=states.device)
            packed.append(_pack(torch.bucketize(rotated[..., start:stop].contiguous(), thresholds), width))
        # a norm beyond float16's range is kept at its largest value rather than turned into inf
        return TurboQuantCodes(torch.cat(packed, dim=-1), norms.clamp(max=_FP16_MAX).to(torch.float16))

    def decode(self, coded: TurboQuantCodes, rotations: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Codes and norms ``[..., H, T]`` -> head vectors ``[..., H, T, d]`` in ``dtype``."""
        self._check_shapes(self.dim, rotations)
        if coded.codes.shape[-1] != self.packed_bytes:
            raise ValueError(f"codes hold {coded.codes.shape[-1]} bytes per vector; this codec ({self.bits:g} bits, "
                             f"d={self.dim}) packs {self.packed_bytes}.")
        parts, offset = [], 0
        for start, stop, width in self.groups:
            size = math.ceil((stop - start) / _CODES_PER_PACK) * width
            parts.append(_decode_levels(coded.codes[..., offset : offset + size], width, stop - start))
            offset += size
        rotated = torch.cat(parts, dim=-1) / math.sqrt(self.dim)
        states = _rotate(rotated, rotations.to(rotated.device), inverse=True) * coded.norms.float().unsqueeze(-1)
        return states.to(dtype)

    def _check_shapes(self, dim: int, rotations: torch.Tensor) -> None:
        if dim != self.dim or rotations.shape[-2:] != (self.dim, self.dim):
            raise ValueError(f"this codec codes {self.dim}-dim head vectors; got {dim}-dim vectors and rotations of "
                             f"shape {tuple(rotations.shape)}.")
