"""A read-only binary stream over an iterator of byte chunks, so a payload reader can parse chunks as they arrive."""

from __future__ import annotations

import io
from collections.abc import Iterable

from .errors import TransportError

__all__ = ["ChunkStream"]


class ChunkStream(io.RawIOBase):
    """``read(n)`` / ``readinto(buffer)`` over ``chunks`` (bytes-like objects), pulling the next chunk only when the
    current one is used up.

    The stream ends when the iterator does. An exception the iterator raises (a transport's ``TransportTimeout`` or
    ``TransportClosed``) propagates unchanged out of ``read`` / ``readinto``, so a stalled sender is never mistaken for
    a short payload. Empty chunks are skipped. Reads may return fewer bytes than asked for (one chunk's remainder at a
    time), as a raw stream's may; ``read_payload`` retries short reads.

    ``read_payload`` stops right after a payload's last section, before the transport's end-of-payload marker (the end
    frame of :func:`~hf_kvcodecs.transport.receive_chunks`, whose sender waits in ``close()`` until it is received):
    call :meth:`finish` after it.
    """

    def __init__(self, chunks: Iterable[bytes | bytearray | memoryview]):
        super().__init__()
        self._chunks = iter(chunks)
        self._current = memoryview(b"")
        self._ended = False
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def _next_chunk(self) -> bool:
        """Make ``_current`` non-empty; False once the iterator is exhausted."""
        while not self._current:
            if self._ended:
                return False
            try:
                chunk = next(self._chunks)
            except StopIteration:
                self._ended = True
                return False
            view = memoryview(chunk)
            self._current = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        return True

    def readinto(self, buffer) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed ChunkStream")
        target = memoryview(buffer).cast("B")
        if not target.nbytes or not self._next_chunk():
            return 0
        count = min(target.nbytes, self._current.nbytes)
        target[:count] = self._current[:count]
        self._current = self._current[count:]
        self.bytes_read += count
        return count

    def finish(self) -> None:
        """Read to the end of the chunks, refusing any byte left after what was read (``TransportError``): for a
        transport, this receives its end-of-payload marker, so the sender's ``close()`` returns and the next payload
        starts clean."""
        if self._next_chunk():
            raise TransportError(f"bytes follow the {self.bytes_read} bytes read from this stream (the next one: "
                                 f"{bytes(self._current[:16])!r}...); the sender wrote more than one payload")

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None and not self.closed:
            close()  # a generator's finally blocks run now, not at garbage collection
        super().close()
