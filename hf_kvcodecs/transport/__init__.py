"""Moving payload bytes between processes: ``torch.distributed`` point-to-point frames and atomically published files.

Pure byte moving, below the methods: nothing here knows what the bytes mean. A receiver yields chunks as they arrive
(so a consumer can start before the last byte), bounds what it allocates by ``max_bytes`` before allocating, and never
waits past its deadline; :class:`ChunkStream` turns those chunks into the binary stream a payload reader takes.
"""

from __future__ import annotations

from .chunks import ChunkStream
from .distributed import DistributedSender, receive_chunks
from .errors import TransportClosed, TransportError, TransportTimeout
from .files import FileSender, file_chunks

__all__ = [
    "ChunkStream", "DistributedSender", "FileSender", "TransportClosed", "TransportError", "TransportTimeout",
    "file_chunks", "receive_chunks",
]
