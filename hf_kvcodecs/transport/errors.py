"""What a transport raises: the peer is gone, or the deadline passed, each saying what was received and the fix."""

from __future__ import annotations

__all__ = ["TransportClosed", "TransportError", "TransportTimeout", "check_limits"]


class TransportError(ConnectionError):
    """Bytes could not be moved, or what arrived must not be accepted (a frame over ``max_bytes``)."""


class TransportClosed(TransportError):
    """The peer went away, or the stream ended before the payload did."""


class TransportTimeout(TransportError, TimeoutError):
    """The receiver's deadline passed before the payload's end arrived."""


def check_limits(deadline_s: float, max_bytes: int) -> None:
    """Refuse receiver limits that would make it wait forever or accept anything."""
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not 0 < deadline_s < float("inf"):
        raise ValueError(f"deadline_s must be a positive, finite number of seconds, got {deadline_s!r}; a receiver "
                         "without a deadline waits forever on a producer that stopped sending.")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}; pass the largest payload the "
                         "consumer accepts (e.g. PayloadLimits.max_payload_bytes(kb)).")
