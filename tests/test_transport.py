"""hf_kvcodecs.transport: SCD payloads between two real processes over gloo on loopback (the example's run checked
against an in-process one; a corrupted section, an oversize frame, a stalled and an exited producer), and the file and
chunk-stream transports in process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hf_kvcodecs.scd.payload import PayloadError, iter_payload_chunks, pack_payload, read_payload, unpack_payload
from hf_kvcodecs.transport import (
    ChunkStream,
    FileSender,
    TransportClosed,
    TransportError,
    TransportTimeout,
    file_chunks,
    receive_chunks,
)

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "tests" / "_transport_peer.py"
EXAMPLE = ROOT / "examples" / "scd_two_process.py"
PEER_DEADLINE_S = 5.0  # tests/_transport_peer.py's
HANG_GUARD_S = 120  # a pair of processes still running after this has hung: the test fails instead of waiting


# ---- two processes over gloo ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_pair(arguments: list[str]) -> list[subprocess.CompletedProcess]:
    """Run ``python ARGUMENTS`` as ranks 0 and 1 of a gloo group on loopback; both must finish within the guard."""
    port = _free_port()
    processes = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
        if Path("/sys/class/net/lo").exists():
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        processes.append(subprocess.Popen([sys.executable, *arguments], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    results, deadline = [], time.monotonic() + HANG_GUARD_S
    try:
        for rank, process in enumerate(processes):
            try:
                output, _ = process.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} of {arguments} still ran after {HANG_GUARD_S} s: the transport hung")
            results.append(subprocess.CompletedProcess(process.args, process.returncode, output))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def _explain(results) -> str:
    return "\n".join(f"--- rank {rank} (exit {result.returncode}):\n{result.stdout[-3000:]}"
                     for rank, result in enumerate(results))


def _scenario(name: str, tmp_path: Path) -> dict:
    report = tmp_path / f"{name}.json"
    results = _run_pair([str(PEER), name, str(report)])
    assert results[1].returncode == 0 and report.exists(), _explain(results)
    return json.loads(report.read_text())


def test_example_streams_a_payload_identical_to_the_in_process_one(tmp_path):
    report = tmp_path / "example.json"
    results = _run_pair([str(EXAMPLE), "--model", "tiny", "--report", str(report), "--deadline", "60"])
    assert [result.returncode for result in results] == [0, 0], _explain(results)
    checks = json.loads(report.read_text())
    assert checks["payload_identical"] and checks["payload_bytes"] == checks["reference_payload_bytes"] > 0
    assert checks["tokens_equal"] and len(checks["tokens"]) == 8
    # sent as the prefill produced it: the header and manifest, the two prompt sections, then each layer's
    assert checks["frames"] >= 3 + 3
    assert "byte-identical to in-process encode(): True" in results[1].stdout


def test_corrupted_section_raises_payload_error_and_oversize_frame_is_refused_before_allocation(tmp_path):
    results = _scenario("corrupt-then-oversize", tmp_path)
    corrupt = results["corrupt"]
    assert corrupt["error"] == "PayloadError" and "failed its CRC-32 check" in corrupt["message"], corrupt
    oversize = results["oversize"]
    # a buffer of 2**40 bytes would have failed to allocate: the refusal came first
    assert oversize["error"] == "TransportError" and "max_bytes=1048576" in oversize["message"], oversize
    assert "Refused before allocating" in oversize["message"]


def test_producer_that_stops_sending_times_out_at_the_deadline(tmp_path):
    stall = _scenario("stall", tmp_path)["stall"]
    # TransportTimeout reaches the caller through ChunkStream and read_payload, not a "truncated" PayloadError
    assert stall["error"] == "TransportTimeout" and "TimeoutError" in stall["classes"], stall
    assert PEER_DEADLINE_S - 0.5 <= stall["seconds"] <= PEER_DEADLINE_S + 2
    assert stall["bytes_read"] > 0 and "bytes in 1 frames arrived" in stall["message"]
    assert "raise deadline_s" in stall["message"]
    # gloo closed the pair when the receive timed out: the producer's own pending receive failed then, not later
    producer = json.loads((tmp_path / "stall.json.producer").read_text())
    assert producer["seconds"] < PEER_DEADLINE_S + 5 and "closed" in producer["message"].lower(), producer


def test_producer_that_exits_mid_payload_is_reported_closed_before_the_deadline(tmp_path):
    ended = _scenario("exit", tmp_path)["exit"]
    assert ended["error"] == "TransportClosed" and ended["seconds"] < PEER_DEADLINE_S, ended
    assert ended["bytes_read"] > 0


def test_receiver_needs_limits_and_a_process_group():
    with pytest.raises(ValueError, match="deadline_s must be a positive, finite"):
        receive_chunks(1, deadline_s=float("inf"), max_bytes=10)
    with pytest.raises(ValueError, match="max_bytes must be a positive integer"):
        receive_chunks(1, deadline_s=1.0, max_bytes=0)
    if not torch.distributed.is_initialized():
        with pytest.raises(TransportError, match="init_process_group"):
            receive_chunks(1, deadline_s=1.0, max_bytes=10)


# ---- chunks as a stream --------------------------------------------------------------------------------------------


def _payload() -> tuple[dict, dict[str, torch.Tensor]]:
    sections = {"a": torch.arange(1000, dtype=torch.int32), "b": torch.linspace(-1, 1, 77, dtype=torch.float16),
                "empty": torch.zeros(0, 3, dtype=torch.uint8)}
    return {"what": "chunks"}, sections


def test_chunk_stream_reads_a_payload_across_chunk_boundaries():
    manifest, sections = _payload()
    data = pack_payload(manifest, sections)
    pieces = [data[index:index + 37] for index in range(0, len(data), 37)]
    for chunks in (list(iter_payload_chunks(manifest, sections)), [b"", *pieces, b""]):
        stream = ChunkStream(iter(chunks))
        got_manifest, got = read_payload(stream)
        assert got_manifest == unpack_payload(data)[0] and stream.bytes_read == len(data)
        for name, tensor in sections.items():
            assert torch.equal(got[name], tensor)
        stream.finish()
        assert stream.read(10) == b""
    stream = ChunkStream(iter([data, data[:5]]))
    read_payload(stream)
    with pytest.raises(TransportError, match=f"bytes follow the {len(data)} bytes read"):
        stream.finish()


def test_chunk_stream_passes_the_iterators_error_on_unchanged():
    data = pack_payload(*_payload())

    def stalled():
        yield data[:len(data) // 2]
        raise TransportTimeout("stalled")

    with pytest.raises(TransportTimeout, match="stalled"):
        read_payload(ChunkStream(stalled()))
    with pytest.raises(PayloadError, match="truncated"):  # a stream that really ends early is a short payload
        read_payload(ChunkStream(iter([data[:len(data) // 2]])))


# ---- files ---------------------------------------------------------------------------------------------------------


def test_file_round_trip_and_a_partial_file_is_never_read_as_complete(tmp_path):
    manifest, sections = _payload()
    data = pack_payload(manifest, sections)
    path = tmp_path / "payload.scd"
    sender = FileSender(path)
    sender.write(data[:100])
    assert sender.partial.exists() and not path.exists()
    started = time.monotonic()
    with pytest.raises(TransportTimeout, match=r"payload.scd.partial holds \d+ bytes still being written"):
        list(file_chunks(path, deadline_s=0.3, max_bytes=len(data), poll_s=0.05))
    assert time.monotonic() - started < 2
    sender.write(data[100:])
    sender.close()
    assert path.read_bytes() == data and not sender.partial.exists()
    got_manifest, got = read_payload(ChunkStream(file_chunks(path, deadline_s=1, max_bytes=len(data), chunk_bytes=64)))
    assert all(torch.equal(got[name], tensor) for name, tensor in sections.items())
    with pytest.raises(TransportError, match=f"{len(data)} bytes, over max_bytes={len(data) - 1}"):
        next(file_chunks(path, deadline_s=1, max_bytes=len(data) - 1))
    chunks = file_chunks(path, deadline_s=1, max_bytes=len(data), chunk_bytes=64)
    assert next(chunks) == data[:64]
    os.truncate(path, 64)  # cut while being read
    with pytest.raises(TransportClosed, match=f"ended after 64 of its {len(data)} bytes"):
        next(chunks)


def test_file_receiver_waits_for_the_file_and_a_failed_sender_publishes_nothing(tmp_path):
    data = pack_payload(*_payload())
    path = tmp_path / "later.scd"

    def publish():
        time.sleep(0.3)
        with FileSender(path) as sender:
            sender.write(data)

    writer = threading.Thread(target=publish)
    writer.start()
    assert b"".join(file_chunks(path, deadline_s=10, max_bytes=len(data), poll_s=0.02)) == data
    writer.join()

    failed = tmp_path / "failed.scd"
    with pytest.raises(RuntimeError, match="prefill failed"):
        with FileSender(failed) as sender:
            sender.write(data[:10])
            raise RuntimeError("prefill failed")
    assert not failed.exists() and not sender.partial.exists()
    with pytest.raises(TransportTimeout, match=r"0 bytes received; no .*failed.scd.partial either"):
        list(file_chunks(failed, deadline_s=0.1, max_bytes=10))


# ---- bench scd-transport's pieces ----------------------------------------------------------------------------------


def test_raw_bf16_stream_is_each_layers_cached_keys_and_values_in_bfloat16():
    from transformers import DynamicCache, LlamaForCausalLM

    from hf_kvcodecs.bench.scd_transport import _stream_raw_bf16

    from .conftest import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    chunks: list[bytes] = []
    _stream_raw_bf16(model, ids, chunks.append)
    assert len(chunks) == 1 + 2 * model.config.num_hidden_layers  # the head, then each layer's keys and values
    _, sections = read_payload(ChunkStream(iter(chunks)))
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=reference)
    for index, layer in enumerate(reference.layers):
        assert torch.equal(sections[f"layers.{index}.keys"], layer.keys.to(torch.bfloat16))
        assert torch.equal(sections[f"layers.{index}.values"], layer.values.to(torch.bfloat16))


def test_transport_summary_report_and_curve(tmp_path):
    from hf_kvcodecs.bench.scd_transport import measured_summary, transport_markdown, transport_plot

    def rows(ttfts, **extra):
        return [{"ttft_s": ttft, "last_byte_s": ttft / 2, "first_token": token, "payload_bytes": 1000, **extra}
                for ttft, token in ttfts]

    consumer = {tokens: {"local-prefill": [{"ttft_s": 2.0, "first_token": 5}, {"ttft_s": 4.0, "first_token": 6}],
                         "scd-stream": rows([(1.0, 5), (3.0, 7)], rebuild_s=0.1, first_step_s=0.05),
                         "scd-whole": rows([(1.5, 5), (2.5, 6)]), "raw-bf16-stream": rows([(2.0, 5), (2.0, 6)]),
                         "wire-only": [{"ttft_s": 0.008, "last_byte_s": 0.008, "payload_bytes": 10**6}] * 2}
                for tokens in ("64", "128")}
    producer = {tokens: {"scd-stream": [{"produce_and_send_s": 0.9, "payload_bytes": 1000, "frames": 3}] * 2}
                for tokens in ("64", "128")}
    summary = measured_summary(producer, consumer)
    scd = summary["64"]["scd-stream"]
    assert scd["ttft_s"] == 2.0 and scd["first_token_equals_local_prefill"] == 0.5 and scd["producer"]["frames"] == 3
    assert summary["64"]["raw-bf16-stream"]["first_token_equals_local_prefill"] == 1.0
    assert summary["64"]["wire-only"]["loopback_gbps"] == pytest.approx(1.0)
    modelled = {tokens: {"measured_loopback_gbps": 1.0, "cost": {},
                         "ttft_s": {name: {"1.0": 3.0, "10.0": 2.0} for name in ("oracle", "scd", "raw-16")}}
                for tokens in ("64", "128")}
    results = {"settings": {"threads": 1, "text": "t", "repeats": 2, "modelled_bandwidths_gbps": [10.0],
                            "modelled_repeats": 1},
               "knowledge_base": {"producer": "p", "consumer": "c", "directory": "kb", "code_bits": 4},
               "transport": "gloo", "measured": summary, "modelled": modelled}
    markdown = transport_markdown(results)
    assert "| scd-stream | 2.000 | 1.000 | 0.100 | 0.050 | 0.900 | 1000 | 50% | 3.000 | 2.000 |" in markdown
    assert transport_plot(results, tmp_path / "curve.png") and (tmp_path / "curve.png").stat().st_size > 0
