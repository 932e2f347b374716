"""Payload bytes over ``torch.distributed`` point-to-point: gloo between CPU processes, NCCL between GPUs.

The caller initialises the process group (``torchrun``, ``init_process_group``). A payload goes out as frames, each an
int64 length tensor followed by a uint8 tensor of that many bytes; a zero-length frame ends the payload, so several
payloads can follow each other between the same two ranks (one :class:`DistributedSender` and one
:func:`receive_chunks` call per payload).

What gloo does, seen with torch 2.13 on loopback (tests/test_transport.py checks the timeout, the dead peer and the
closed pair):

- ``Work.is_completed()`` of a gloo receive stays False even after its data has arrived, until ``wait()`` is
  called, so polling cannot see a frame arrive; the receiver waits with ``Work.wait(timeout=...)``, which raises
  ``Timed out waiting ...ms for recv operation to complete``.
- ``isend`` returns at once, but its ``Work`` completes only when the peer has received the frame: a sender waiting
  on its end frame waits for the receiver to read it.
- A peer that exits or crashes makes a pending receive fail at once (``Connection reset by peer`` /
  ``Connection closed by peer``), well inside any deadline.
- After a receive times out, gloo closes the pair to that rank (``Application timeout caused pair closure``): every
  later send or receive between those two ranks fails at once, on both sides. So after a :class:`TransportTimeout`
  the process group cannot carry another payload between them; destroy it and initialise a new one.

NCCL receives are waited on by polling ``is_completed()`` (a CUDA event query) until the deadline. NCCL point-to-point
needs two GPUs (one per rank) and was not run here; after a timeout a pending NCCL receive stays posted, so abort
the group (``destroy_process_group``) before reusing the device.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .errors import TransportClosed, TransportError, TransportTimeout, check_limits

__all__ = ["DistributedSender", "receive_chunks"]

_POLL_SECONDS = 0.001


def _backend(group) -> str:
    if not dist.is_available() or not dist.is_initialized():
        raise TransportError("torch.distributed has no process group; initialise one first (run under torchrun, or "
                             "call torch.distributed.init_process_group('gloo') on CPU, 'nccl' on GPUs).")
    return str(dist.get_backend(group)).lower()


def _default_device(backend: str) -> torch.device:
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_peer(rank: int, what: str) -> None:
    """``rank`` is a global rank, as torch.distributed's own point-to-point calls take it."""
    size, me = dist.get_world_size(), dist.get_rank()
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size or rank == me:
        raise ValueError(f"{what} must be another global rank (0..{size - 1}, not this rank {me}), got {rank!r}.")


class DistributedSender:
    """Sends one payload to rank ``dst``: ``write(data)`` sends ``data`` as one frame, ``close()`` sends the end frame
    and waits until every frame has left.

    ``write`` starts the send and returns (``isend``), so a producer passing it to ``encode_to`` keeps computing the
    next layer while this one's section is on the wire; the frames' tensors are kept until ``close()``. Errors of a
    send (the peer is gone) are raised by ``close()`` as ``TransportClosed``. A gloo send completes only once the peer
    has received it, so ``close()`` returns when the receiver has taken the end frame too: a reader that stops at the
    payload's last section (``read_payload``, ``SCDTransferCache.from_stream`` over a :class:`ChunkStream`) must
    call ``ChunkStream.finish()`` afterwards, or pass ``close(timeout_s=...)``. An empty ``write`` sends nothing (an empty
    frame would end the payload). Used as a context manager, an exception inside the block still sends the end frame
    (the consumer then fails at once on a truncated payload instead of waiting out its deadline) and is re-raised.
    """

    def __init__(self, dst: int, group=None, device: str | torch.device | None = None):
        self._backend = _backend(group)
        _check_peer(dst, "dst")
        self.dst = dst
        self.group = group
        self.device = torch.device(device) if device is not None else _default_device(self._backend)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._closed = False
        self.bytes_sent = 0
        self.frames_sent = 0

    def _send(self, tensor: torch.Tensor) -> None:
        try:
            work = dist.isend(tensor, self.dst, group=self.group)
        except RuntimeError as error:
            raise TransportClosed(f"sending to rank {self.dst} failed after {self.bytes_sent} bytes: {error}") from error
        self._pending.append((work, tensor))  # the tensor must outlive its send

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._closed:
            raise TransportError("this DistributedSender is closed; make a new one for the next payload.")
        view = memoryview(data).cast("B")
        if not view.nbytes:
            return 0
        self._send(torch.tensor([view.nbytes], dtype=torch.int64, device=self.device))
        self._send(torch.frombuffer(bytearray(view), dtype=torch.uint8).to(self.device))
        self.bytes_sent += view.nbytes
        self.frames_sent += 1
        return view.nbytes

    def close(self, timeout_s: float | None = None) -> None:
        """Send the end frame and wait for every frame to leave (at most ``timeout_s`` seconds per send when given)."""
        if self._closed:
            return
        self._closed = True
        self._send(torch.zeros(1, dtype=torch.int64, device=self.device))
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        pending, self._pending = self._pending, []
        for work, _ in pending:
            try:
                work.wait(timeout) if timeout is not None else work.wait()
            except RuntimeError as error:
                error_type = TransportTimeout if "timed out" in str(error).lower() else TransportClosed
                raise error_type(f"a frame to rank {self.dst} did not leave ({self.bytes_sent} bytes written): "
                                 f"{error}") from error

    def __enter__(self) -> DistributedSender:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
            return
        try:
            self.close()
        except TransportError:
            pass  # the block's own exception says more than the peer that also went away


def _wait(work, backend: str, deadline: float, received: int, frames: int, src: int, deadline_s: float) -> None:
    def timed_out(detail: str) -> TransportTimeout:
        return TransportTimeout(
            f"no complete payload from rank {src} within the {deadline_s:g} s deadline: {received} bytes in {frames} "
            f"frames arrived before it passed ({detail}). The producer stopped sending or is slower than the deadline: "
            "check the producer's log, or raise deadline_s. The group cannot carry another payload between these "
            "ranks; destroy it and initialise a new one.")

    if "gloo" in backend:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise timed_out("deadline already passed")
        try:
            work.wait(datetime.timedelta(seconds=remaining))
        except RuntimeError as error:
            message = str(error)
            if "timed out" in message.lower():
                raise timed_out(message) from error
            raise TransportClosed(f"rank {src} went away after {received} bytes in {frames} frames: {message}. Check "
                                  "the producer's log.") from error
        return
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise timed_out("receive still pending")
        time.sleep(_POLL_SECONDS)
    work.wait()


def receive_chunks(src: int, *, deadline_s: float, max_bytes: int, group=None,
                   device: str | torch.device | None = None) -> Iterator[bytes]:
    """The frames of one payload from rank ``src``, each yielded as bytes as soon as it has arrived.

    The deadline covers the whole payload and starts at this call. A frame whose declared length would take the
    payload over ``max_bytes`` is refused (``TransportError``) before its buffer is allocated. Raises
    ``TransportTimeout`` when the deadline passes first and ``TransportClosed`` when the sender goes away; never waits
    past the deadline. The iterator ends after the sender's end frame.
    """
    check_limits(deadline_s, max_bytes)
    backend = _backend(group)
    _check_peer(src, "src")
    target = torch.device(device) if device is not None else _default_device(backend)
    deadline = time.monotonic() + deadline_s

    def frames() -> Iterator[bytes]:
        received = count = 0
        while True:
            length = torch.zeros(1, dtype=torch.int64, device=target)
            _wait(_irecv(length, src, group, received, count), backend, deadline, received, count, src, deadline_s)
            declared = int(length.item())
            if declared == 0:
                return
            if declared < 0 or received + declared > max_bytes:
                raise TransportError(f"rank {src} declared a {declared}-byte frame after {received} bytes; the payload "
                                     f"may take at most max_bytes={max_bytes}. Refused before allocating it: raise "
                                     "max_bytes if the payload is expected to be this large. The group cannot carry "
                                     "another payload between these ranks (the frame is still in flight).")
            data = torch.empty(declared, dtype=torch.uint8, device=target)
            _wait(_irecv(data, src, group, received, count), backend, deadline, received, count, src, deadline_s)
            received += declared
            count += 1
            yield data.cpu().numpy().tobytes()

    return frames()


def _irecv(tensor: torch.Tensor, src: int, group, received: int, frames: int):
    try:
        return dist.irecv(tensor, src, group=group)
    except RuntimeError as error:
        raise TransportClosed(f"receiving from rank {src} failed after {received} bytes in {frames} frames: "
                              f"{error}") from error
