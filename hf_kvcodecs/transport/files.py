"""Payload bytes through a file: the sender publishes the whole file at once (write, fsync, rename), the receiver
waits for it until a deadline and reads it in chunks, refusing one over ``max_bytes`` before reading a byte."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

from ..fileio import fsync
from .errors import TransportClosed, TransportError, TransportTimeout, check_limits

__all__ = ["PARTIAL_SUFFIX", "FileSender", "file_chunks"]

PARTIAL_SUFFIX = ".partial"
_CHUNK_BYTES = 1 << 20


def _partial(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL_SUFFIX)


class FileSender:
    """Writes a payload to ``path + ".partial"``; ``close()`` flushes, fsyncs and renames it to ``path``, so a reader
    that sees ``path`` sees the whole payload. ``write(data)`` fits ``encode_to``'s callback. Used as a context
    manager, an exception inside the block removes the partial file instead of publishing it. An existing ``path`` is
    replaced only when the new file is complete."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.partial = _partial(self.path)
        self._file = open(self.partial, "wb")
        self.bytes_written = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._file.closed:
            raise TransportError(f"the FileSender for {self.path} is closed; make a new one for the next payload.")
        count = self._file.write(data)
        self.bytes_written += count
        return count

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.partial, self.path)
        fsync(self.path.parent)  # the rename is durable only once the directory entry is

    def abort(self) -> None:
        """Drop what was written; ``path`` is left as it was."""
        if not self._file.closed:
            self._file.close()
        self.partial.unlink(missing_ok=True)

    def __enter__(self) -> FileSender:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def file_chunks(path: str | os.PathLike, *, deadline_s: float, max_bytes: int, poll_s: float = 0.05,
                chunk_bytes: int = _CHUNK_BYTES) -> Iterator[bytes]:
    """The bytes of the file ``path`` once it exists, in chunks of at most ``chunk_bytes``.

    Waits for ``path`` (checking every ``poll_s`` seconds) until ``deadline_s`` has passed since this call, then raises
    ``TransportTimeout``; a ``path + ".partial"`` file is a payload still being written and is never read. A file over
    ``max_bytes`` is refused (``TransportError``) before any byte is read; one that shrinks while read raises
    ``TransportClosed``."""
    check_limits(deadline_s, max_bytes)
    if not poll_s > 0:
        raise ValueError(f"poll_s must be positive, got {poll_s!r}.")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes!r}.")
    path = Path(path)
    deadline = time.monotonic() + deadline_s

    def chunks() -> Iterator[bytes]:
        while True:
            try:
                handle = open(path, "rb", buffering=0)  # reads go to the file, not a stale buffer
                break
            except FileNotFoundError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    partial = _partial(path)
                    state = (f"{partial} holds {partial.stat().st_size} bytes still being written" if partial.exists()
                             else f"no {partial} either")
                    raise TransportTimeout(f"{path} did not appear within the {deadline_s:g} s deadline (0 bytes "
                                           f"received; {state}). Check the producer's log, or raise deadline_s.") \
                        from None
                time.sleep(min(poll_s, remaining))
        with handle:
            size = os.fstat(handle.fileno()).st_size
            if size > max_bytes:
                raise TransportError(f"{path} is {size} bytes, over max_bytes={max_bytes}; refused before reading it. "
                                     "Raise max_bytes if the payload is expected to be this large.")
            received = 0
            while received < size:
                chunk = handle.read(min(chunk_bytes, size - received))
                if not chunk:
                    raise TransportClosed(f"{path} ended after {received} of its {size} bytes (it was truncated while "
                                          "being read)")
                received += len(chunk)
                yield chunk

    return chunks()
