"""The positions of every token a GSRQCache holds, recorded once per cache and shared by its layers.

Keys coded before RoPE are rotated back with their own positions, and the left padding of a batch's first call sets
how many sink slots each layer keeps.
"""

from __future__ import annotations

import torch

from ..rope import rotary_cos_sin


class PositionLedger:
    """Positions ``[B, T]`` (int32) of every token the cache holds, shared by all layers of one cache."""

    def __init__(self):
        self.positions: torch.Tensor | None = None
        self.leading_padding = 0  # the longest left padding of the first call's rows (see _left_padding)
        self._angles = None  # ((start, end), (cos, sin)) shared by the layers during one forward pass
        self._halves = None  # the same for rotary_halves
        self.rotary_table = None  # a RotaryHalfTable, set by GSRQCache where keys are coded before RoPE

    def append(self, position_ids: torch.Tensor | None, batch_size: int, new_tokens: int, device, *,
               only_sinks_held: bool = False) -> None:
        """Record the positions of ``new_tokens`` new tokens. While the layers hold nothing but sinks
        (``only_sinks_held``: no token coded or in the window yet), the left padding is re-read from every position
        recorded, so a prompt prefilled in chunks is measured whole; after that it is fixed, since growing the sink
        region then would put tokens out of order."""
        if position_ids is None:
            start = 0 if self.positions is None else self.positions.shape[1]
            position_ids = torch.arange(start, start + new_tokens, device=device)[None]
        position_ids = position_ids.to(device=device, dtype=torch.int32)
        if position_ids.ndim == 1:
            position_ids = position_ids[None]
        if position_ids.shape[-1] != new_tokens:
            raise ValueError(f"position_ids cover {position_ids.shape[-1]} tokens but {new_tokens} new tokens arrived.")
        position_ids = position_ids.expand(batch_size, new_tokens)
        self.positions = position_ids.clone() if self.positions is None else torch.cat([self.positions, position_ids], dim=1)
        if only_sinks_held:
            self.leading_padding = _left_padding(self.positions)
        self.forget_angles()

    def apply(self, fn) -> None:
        if self.positions is not None:
            self.positions = fn(self.positions)
        self.forget_angles()

    def rotary_angles(self, start: int, end: int, inv_freq: torch.Tensor, attention_scaling: float):
        """cos/sin for the tokens in slots ``[start, end)``; every layer asks for the same range in one forward
        pass, so the result is kept until :meth:`forget_angles` (called once the last layer is done)."""
        return self._kept("_angles", start, end,
                          lambda positions: rotary_cos_sin(positions, inv_freq, attention_scaling))

    def rotary_halves(self, start: int, end: int):
        """:meth:`rotary_angles` as the compiled CPU loops take them: ``[B, T, D/2]`` (one half of each row), from
        the shared :class:`RotaryHalfTable` (views of it where the positions are consecutive)."""
        if self.rotary_table is None:
            raise RuntimeError("GSRQCache has no rotary table: its keys are not coded before RoPE.")
        return self._kept("_halves", start, end, self.rotary_table.halves)

    def _kept(self, slot: str, start: int, end: int, compute):
        """``compute(positions of slots [start, end))``, kept in ``slot`` for the rest of the forward pass."""
        if self.positions is None or self.positions.shape[1] < end:
            raise RuntimeError("GSRQCache position ledger is behind its layers; update layers through "
                               "GSRQCache.update.")
        held = getattr(self, slot)
        if held is None or held[0] != (start, end):
            held = ((start, end), compute(self.positions[:, start:end]))
            setattr(self, slot, held)
        return held[1]

    def forget_angles(self) -> None:
        self._angles = self._halves = None


def _left_padding(positions: torch.Tensor) -> int:
    """The longest left padding over the rows of a first call's ``positions`` ``[B, T]``.

    generate() gives a left-padded row's pad tokens position 0 (or 1, in older transformers) and numbers its real tokens
    0, 1, 2, ...: the real tokens are the row's last run of consecutive positions, and that run holds the row's largest
    position. A row whose last run does not (right padding) or that is one run (no padding) counts as unpadded.
    Conventions this cannot tell apart: pads numbered one below the first real token (e.g. -1) count one pad too
    few; a single real token after pads at position 1, or before right padding, is misread.
    """
    if positions.shape[-1] < 2 or positions.device.type == "meta":  # (meta: refused with a clear error by the layers)
        return 0
    steps = positions[:, 1:] - positions[:, :-1]
    breaks = torch.arange(1, positions.shape[-1], device=positions.device).expand_as(steps) * (steps != 1)
    run_starts = breaks.amax(dim=-1)  # 0 when the whole row is one run
    holds_max = positions[:, -1] == positions.amax(dim=-1)  # (the last run's largest position is its last)
    return int(torch.where(holds_max, run_starts, torch.zeros_like(run_starts)).max())
