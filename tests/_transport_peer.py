"""One rank of a two-process transport scenario, started by tests/test_transport.py with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set: ``python tests/_transport_peer.py SCENARIO RESULT_JSON``.

Rank 0 sends, rank 1 receives and writes what happened (the exception's class and message, the seconds it took) to
RESULT_JSON. Scenarios:

- ``corrupt-then-oversize``: a tiny SCD payload with one section byte flipped in flight (the consumer must raise
  PayloadError from the CRC check, never build a cache), then a frame declaring 2**40 bytes (refused before its buffer
  is allocated; allocating it would fail loudly).
- ``stall``: a first frame, then the sender stops sending but stays alive (TransportTimeout by the deadline).
- ``exit``: a first frame, then the sender's process exits (TransportClosed, well before the deadline).

The last two import neither transformers nor the SCD package (they start in a fraction of the time); that a
transport error crosses ChunkStream and read_payload unchanged is tested in process.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hf_kvcodecs.transport import ChunkStream, DistributedSender, receive_chunks

DEADLINE_S = 5.0
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "scd_two_process.py"


def _example():
    spec = importlib.util.spec_from_file_location("scd_two_process", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _outcome(run) -> dict:
    started = time.monotonic()
    try:
        value = run()
    except Exception as error:  # the test asserts on the class and message
        return {"error": type(error).__name__, "classes": [cls.__name__ for cls in type(error).__mro__],
                "message": str(error), "seconds": time.monotonic() - started}
    return {"error": None, "value": repr(value)[:200], "seconds": time.monotonic() - started}


def corrupt_then_oversize(rank: int, results: dict) -> None:
    example = _example()
    producer, consumer, kb, stream, _ = example.tiny_pair(rank, 90.0)  # rank 0 fits the knowledge base meanwhile
    prompt = example.prompt_of(stream, 64)
    if rank == 0:
        chunks: list[bytes] = []
        example.encode_to(producer, prompt[:, :-1], kb, chunks.append)
        largest = max(range(1, len(chunks)), key=lambda index: len(chunks[index]))  # a layer's codes
        with DistributedSender(1) as sender:
            for index, chunk in enumerate(chunks):
                if index == largest:  # one byte of the section's data flipped in flight, its CRC-32 left as sent
                    chunk = bytearray(chunk)
                    chunk[len(chunk) // 2] ^= 0x40
                sender.write(chunk)
        dist.send(torch.tensor([1 << 40], dtype=torch.int64), 1)  # a frame length no buffer is made for
        time.sleep(0.5)
        return
    max_bytes = example.PayloadLimits().max_payload_bytes(kb)
    results["corrupt"] = _outcome(lambda: example.SCDTransferCache.from_payload(
        b"".join(receive_chunks(0, deadline_s=DEADLINE_S, max_bytes=max_bytes)), consumer, kb, input_ids=prompt))
    results["oversize"] = _outcome(lambda: list(receive_chunks(0, deadline_s=DEADLINE_S, max_bytes=1 << 20)))


def half_then(rank: int, results: dict, ending: str) -> None:
    payload = bytes(range(256)) * 256
    if rank == 0:
        sender = DistributedSender(1)
        sender.write(payload[:len(payload) // 2])
        time.sleep(1.0)  # let the frame leave before the ending
        if ending == "exit":
            os._exit(0)
        # Alive and silent until the consumer gives up: its timed-out receive makes gloo close the pair, which
        # ends this receive at once (the documented state of the group after a timeout), well before the guard.
        started = time.monotonic()
        try:
            dist.irecv(torch.zeros(1), 1).wait(datetime.timedelta(seconds=DEADLINE_S + 30))
        except RuntimeError as error:
            Path(sys.argv[2] + ".producer").write_text(json.dumps(
                {"message": str(error), "seconds": time.monotonic() - started}))
        return
    stream = ChunkStream(receive_chunks(0, deadline_s=DEADLINE_S, max_bytes=len(payload)))
    results[ending] = _outcome(lambda: stream.read())
    results[ending]["bytes_read"] = stream.bytes_read


def main() -> int:
    scenario, result_path = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict = {}
    if scenario == "corrupt-then-oversize":
        corrupt_then_oversize(rank, results)
    elif scenario in ("stall", "exit"):
        half_then(rank, results, scenario)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    if rank == 1:
        result_path.write_text(json.dumps(results))
    # no destroy_process_group: after a refused or timed-out frame gloo has closed the pair, and both ranks just exit
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
