"""`bench scd-transport`: time to first token with the payload moving between two real processes.

The producer and the consumer run as two processes joined by a gloo process group on loopback
(:mod:`hf_kvcodecs.transport`); every time is taken on the consumer's clock, from the moment it sends its request to
the moment it has its first generated token (the argmax of the step on the prompt's last token):

- ``local-prefill``: the consumer prefills the whole prompt itself; no request, no transport;
- ``scd-stream``: the producer prefills and writes the SCD payload with ``encode_to`` straight into a
  :class:`~hf_kvcodecs.transport.DistributedSender` (each layer's sections leave as soon as that layer has run); the
  consumer rebuilds each layer as its sections arrive (``SCDTransferCache.from_stream``) and runs the first step;
- ``scd-whole``: the same payload, but the consumer waits for its last byte before rebuilding (``from_payload``): the
  difference to ``scd-stream`` is what overlapping the rebuild with the producer's prefill saves;
- ``raw-bf16-stream``: the producer prefills and sends each layer's keys and values in bfloat16 as soon as that layer
  has written them (one payload section each, in the same container with its CRC-32s); the consumer reads them as they
  arrive into a ``DynamicCache`` and runs the first step;
- ``wire-only``: the raw-bf16 payload's bytes, already built, sent on request: the transport alone, whose rate is the
  measured loopback bandwidth.

Methods run round-robin (one of each per repeat, the order rotated every repeat, after an untimed warm-up round), so
the load of a shared machine drifts into all of them alike; medians are reported. Beside them, the TTFT that ``bench
scd`` models for the same prompt length (:func:`hf_kvcodecs.bench.scd.cost_at` and :func:`~hf_kvcodecs.bench.scd.
ttft_table`: producer encode + bytes / bandwidth + rebuild + first step, its parts measured in one process) at the
measured loopback bandwidth and at 1, 10 and 100 Gbit/s.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

METHODS = ("local-prefill", "scd-stream", "scd-whole", "raw-bf16-stream", "wire-only")
PRODUCER, CONSUMER = 0, 1
_REQUEST_BYTES = 64


@dataclass
class TransportBenchSettings:
    producer: str = "default"
    consumer: str = "default"
    knowledge_base: str = ""
    tokens: tuple[int, ...] = (1024,)
    repeats: int = 5
    threads: int = 1  # torch threads per process
    text: str = "debian-licenses"
    deadline_s: float = 600.0  # the consumer's deadline for one payload
    modelled_repeats: int = 3
    modelled_bandwidths_gbps: tuple[float, ...] = (1.0, 10.0, 100.0)
    timeout_s: float = 3600.0  # both processes must be done by then
    progress: bool = True

    def to_json(self) -> str:
        return json.dumps({name: list(value) if isinstance(value, tuple) else value
                           for name, value in asdict(self).items()})

    @classmethod
    def from_json(cls, text: str) -> TransportBenchSettings:
        values = json.loads(text)
        for name in ("tokens", "modelled_bandwidths_gbps"):
            values[name] = tuple(values[name])
        return cls(**values)


# ---- one process of the pair ---------------------------------------------------------------------------------------


def _load(settings: TransportBenchSettings, rank: int):
    import torch

    from ..models import load_model
    from ..scd import SCDKnowledgeBase
    from ..text import load_corpus, tokenize_corpus

    torch.set_num_threads(settings.threads)
    kb = SCDKnowledgeBase.load(settings.knowledge_base)
    # the consumer needs no producer; both need the producer's tokenizer for the same prompt
    model = load_model(settings.producer if rank == PRODUCER else settings.consumer)
    text_ids = tokenize_corpus(model.tokenizer, load_corpus(settings.text, default=settings.text))
    if text_ids.numel() < max(settings.tokens) + 1:
        raise ValueError(f"{settings.text} has {text_ids.numel()} tokens; --tokens {max(settings.tokens)} needs "
                         f"{max(settings.tokens) + 1}")
    return model.model, kb, text_ids


def _request(method: str) -> None:
    from ..transport import DistributedSender

    with DistributedSender(PRODUCER) as sender:
        sender.write(method.encode())


def _await_request(deadline_s: float) -> str:
    from ..transport import receive_chunks

    return b"".join(receive_chunks(CONSUMER, deadline_s=deadline_s, max_bytes=_REQUEST_BYTES)).decode()


def _raw_bf16_table(model, tokens: int):
    import torch

    from ..scd.model_access import shapes
    from ..scd.payload import SectionSpec

    model_shapes = shapes(model)
    shape = (1, model_shapes.kv_heads, tokens, model_shapes.head_dim)
    return [SectionSpec(f"layers.{index}.{part}", torch.bfloat16, shape)
            for index in range(model_shapes.layers) for part in ("keys", "values")]


def _stream_raw_bf16(producer, ids, write) -> None:
    """Prefill ``ids`` and write each layer's keys and values (bfloat16) as soon as the layer has cached them."""
    import torch
    from transformers.cache_utils import DynamicCache

    from ..scd.model_access import text_config, unwrapped
    from ..scd.payload import PayloadWriter

    writer = PayloadWriter({"what": "raw bfloat16 KV"}, _raw_bf16_table(producer, ids.shape[1]))
    write(writer.head)

    class StreamingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            result = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            write(writer.chunk(f"layers.{layer_idx}.keys", key_states.to(torch.bfloat16)))
            write(writer.chunk(f"layers.{layer_idx}.values", value_states.to(torch.bfloat16)))
            return result

    with torch.inference_mode():
        producer(input_ids=ids, cache=StreamingCache(config=text_config(unwrapped(producer))), use_cache=True,
                 logits_to_keep=1)
    writer.close()


def _first_token(consumer, cache, prompt) -> int:
    import torch

    tokens = prompt.shape[1] - 1
    with torch.inference_mode():
        logits = consumer(input_ids=prompt[:, -1:], cache=cache, position_ids=torch.tensor([[tokens]]),
                          use_cache=True).logits
    return int(logits[0, -1].argmax())


def _produce(method: str, producer, kb, prompt, raw_blob: bytes) -> dict:
    from ..scd import encode_to
    from ..transport import DistributedSender

    started = time.perf_counter()
    with DistributedSender(CONSUMER) as sender:
        if method in ("scd-stream", "scd-whole"):
            encode_to(producer, prompt[:, :-1], kb, sender.write)
        elif method == "raw-bf16-stream":
            _stream_raw_bf16(producer, prompt[:, :-1], sender.write)
        else:
            sender.write(raw_blob)
    return {"produce_and_send_s": time.perf_counter() - started, "payload_bytes": sender.bytes_sent,
            "frames": sender.frames_sent}


def _consume(method: str, consumer, kb, prompt, settings: TransportBenchSettings) -> dict:
    import torch
    from transformers.cache_utils import DynamicCache

    from ..scd import PayloadLimits, SCDTransferCache
    from ..scd.model_access import text_config, unwrapped
    from ..scd.payload import read_payload
    from ..transport import ChunkStream, receive_chunks

    started = time.perf_counter()
    if method == "local-prefill":
        with torch.inference_mode():
            logits = consumer(input_ids=prompt, logits_to_keep=1).logits
        return {"ttft_s": time.perf_counter() - started, "first_token": int(logits[0, -1].argmax())}
    _request(method)
    requested = time.perf_counter()
    row = {"request_s": requested - started}
    if method == "scd-stream":
        arrivals: list[float] = []

        def timed(chunks):
            for chunk in chunks:
                arrivals.append(time.perf_counter())
                yield chunk

        stream = ChunkStream(timed(receive_chunks(PRODUCER, deadline_s=settings.deadline_s,
                                                  max_bytes=PayloadLimits().max_payload_bytes(kb))))
        cache = SCDTransferCache.from_stream(stream, consumer, kb, input_ids=prompt)
        stream.finish()  # receives the end frame the producer's close() waits for
        arrived, payload_bytes = arrivals[-1], stream.bytes_read
    elif method == "scd-whole":
        payload = b"".join(receive_chunks(PRODUCER, deadline_s=settings.deadline_s,
                                          max_bytes=PayloadLimits().max_payload_bytes(kb)))
        arrived = time.perf_counter()
        payload_bytes = len(payload)
        cache = SCDTransferCache.from_payload(payload, consumer, kb, input_ids=prompt)
    else:
        raw_bytes = sum(spec.nbytes + 4 for spec in _raw_bf16_table(consumer, prompt.shape[1] - 1)) + (1 << 20)
        stream = ChunkStream(receive_chunks(PRODUCER, deadline_s=settings.deadline_s, max_bytes=raw_bytes))
        _, sections = read_payload(stream)
        stream.finish()  # receives the end frame the producer's close() waits for
        arrived = time.perf_counter()
        payload_bytes = stream.bytes_read
        if method == "wire-only":
            return {**row, "ttft_s": arrived - started, "last_byte_s": arrived - started,
                    "payload_bytes": stream.bytes_read}
        dtype = next(unwrapped(consumer).parameters()).dtype
        cache = DynamicCache(config=text_config(unwrapped(consumer)))
        for index in range(len(sections) // 2):
            cache.update(sections[f"layers.{index}.keys"].to(dtype), sections[f"layers.{index}.values"].to(dtype),
                         index)
    rebuilt = time.perf_counter()
    token = _first_token(consumer, cache, prompt)
    done = time.perf_counter()
    # rebuild_s: from the last byte to the rebuilt cache (for scd-stream most of the rebuild overlapped the transfer)
    return {**row, "ttft_s": done - started, "last_byte_s": arrived - started, "rebuild_s": rebuilt - arrived,
            "first_step_s": done - rebuilt, "first_token": token, "payload_bytes": payload_bytes}


def worker(settings_path: str, result_path: str) -> int:
    """One rank of the pair (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment)."""
    import torch.distributed as dist
    from tqdm.auto import tqdm

    settings = TransportBenchSettings.from_json(Path(settings_path).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, kb, text_ids = _load(settings, rank)
    rows: dict[str, dict[str, list[dict]]] = {}
    schedule = [(tokens, repeat, METHODS[(shift + repeat) % len(METHODS)])
                for tokens in settings.tokens for repeat in range(-1, settings.repeats)
                for shift in range(len(METHODS))]
    raw_blobs: dict[int, bytes] = {}  # wire-only's bytes: the raw-bf16 payload, built before any timing
    if rank == PRODUCER:
        for tokens in settings.tokens:
            chunks: list[bytes] = []
            _stream_raw_bf16(model, text_ids[:tokens][None], chunks.append)
            raw_blobs[tokens] = b"".join(chunks)
    for tokens, repeat, method in tqdm(schedule, desc="scd-transport", disable=rank != CONSUMER or not settings.progress):
        prompt = text_ids[:tokens + 1][None]
        dist.barrier()  # both sides idle and ready: the consumer's clock starts with the producer waiting
        if rank == CONSUMER:
            row = _consume(method, model, kb, prompt, settings)
        elif method != "local-prefill":
            asked = _await_request(settings.deadline_s)
            if asked != method:
                raise RuntimeError(f"the consumer asked for {asked!r} where the schedule has {method!r}")
            row = _produce(method, model, kb, prompt, raw_blobs.get(tokens, b""))
        else:
            continue
        if repeat >= 0:  # the first round warms both processes up and is not reported
            rows.setdefault(str(tokens), {}).setdefault(method, []).append(row)
    dist.barrier()
    Path(result_path).write_text(json.dumps({"rank": rank, "rows": rows}))
    dist.destroy_process_group()
    return 0


# ---- the parent: two processes, then the modelled TTFT -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_pair(settings: TransportBenchSettings, directory: Path) -> list[dict]:
    settings_path = directory / "settings.json"
    settings_path.write_text(settings.to_json())
    port, processes, logs = _free_port(), [], []
    for rank in (PRODUCER, CONSUMER):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(settings.threads),
               "TOKENIZERS_PARALLELISM": "false"}
        log = open(directory / f"rank{rank}.log", "w")
        logs.append(log)
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "hf_kvcodecs.bench.scd_transport", settings_path, directory / f"rank{rank}.json"],
            env=env, stdout=log, stderr=log if rank == PRODUCER else None))
    deadline = time.monotonic() + settings.timeout_s
    try:
        for rank, process in enumerate(processes):
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"the rank {rank} process ran past --timeout {settings.timeout_s:g} s; see "
                                   f"{directory}/rank*.log") from None
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
    failed = [rank for rank, process in enumerate(processes) if process.returncode != 0]
    if failed:
        tail = (directory / f"rank{failed[0]}.log").read_text()[-4000:]
        raise RuntimeError(f"rank {failed} of the transport pair failed (exit {processes[failed[0]].returncode}):\n"
                           f"{tail}")
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in (PRODUCER, CONSUMER)]


def _medians(rows: list[dict]) -> dict:
    keys = [key for key in rows[0] if key.endswith("_s") or key in ("payload_bytes", "frames")]
    return {key: statistics.median(row[key] for row in rows) for key in keys}


def measured_summary(producer_rows: dict, consumer_rows: dict) -> dict:
    """Per prompt length and method: medians of the consumer's and the producer's times, the repeats, and how often
    the first token equals the consumer's own prefill's."""
    summary = {}
    for tokens, by_method in consumer_rows.items():
        local_tokens = [row["first_token"] for row in by_method["local-prefill"]]
        summary[tokens] = {}
        for method, rows in by_method.items():
            entry = {**_medians(rows), "repeats": len(rows), "ttft_all_s": [row["ttft_s"] for row in rows]}
            if "first_token" in rows[0]:
                entry["first_token_equals_local_prefill"] = sum(
                    row["first_token"] == local for row, local in zip(rows, local_tokens)) / len(rows)
            produced = producer_rows.get(tokens, {}).get(method)
            if produced:
                entry["producer"] = _medians(produced)
            summary[tokens][method] = entry
        wire = summary[tokens].get("wire-only")
        if wire:
            wire["loopback_gbps"] = wire["payload_bytes"] * 8 / wire["last_byte_s"] / 1e9
    return summary


def modelled_ttft(settings: TransportBenchSettings, summary: dict) -> dict:
    """``bench scd``'s modelled TTFT (producer on the critical path, CPU-measured parts) for each prompt length,
    at the measured loopback bandwidth and at ``settings.modelled_bandwidths_gbps``."""
    import torch

    from ..models import load_model
    from ..scd import SCDKnowledgeBase
    from ..scd.model_access import shapes
    from ..text import load_corpus, tokenize_corpus
    from .scd import GPU_MFU, GPU_PEAK_FLOPS, SCDBenchSettings, cost_at, prefill_flops, ttft_table

    torch.set_num_threads(settings.threads)
    kb = SCDKnowledgeBase.load(settings.knowledge_base)
    producer, consumer = load_model(settings.producer), load_model(settings.consumer)
    text_ids = tokenize_corpus(producer.tokenizer, load_corpus(settings.text, default=settings.text))
    model_shapes = shapes(consumer.model)
    raw_bytes_per_token = 2 * model_shapes.layers * model_shapes.kv_width * 2
    parameters = sum(p.numel() for name, p in consumer.model.named_parameters() if "lora_" not in name)
    results = {}
    for tokens in settings.tokens:
        measured_gbps = summary[str(tokens)].get("wire-only", {}).get("loopback_gbps")
        bandwidths = tuple(settings.modelled_bandwidths_gbps) + ((round(measured_gbps, 3),) if measured_gbps else ())
        bench = SCDBenchSettings(cost_repeats=settings.modelled_repeats, gsrq_bits=(), bandwidths_gbps=bandwidths)
        gpu = prefill_flops(model_shapes, parameters, tokens) / (GPU_PEAK_FLOPS * GPU_MFU)
        row = cost_at(producer.model, consumer.model, kb, text_ids, tokens, bench, gpu)
        sizes = {"oracle": 0.0, "scd": row["scd_bytes_per_token"], "raw-16": raw_bytes_per_token}
        table = ttft_table({tokens: row}, sizes, bench, model_shapes.layers, gpu_class=False, producer_on_path=True)
        results[str(tokens)] = {"cost": row, "ttft_s": {method: by_tokens[str(tokens)]
                                                        for method, by_tokens in table.items()},
                                "measured_loopback_gbps": measured_gbps}
    return results


def run_transport_bench(settings: TransportBenchSettings, work_directory: Path | None = None) -> dict:
    started = time.perf_counter()
    directory = Path(work_directory or tempfile.mkdtemp(prefix="hf_kvcodecs_scd_transport_"))
    directory.mkdir(parents=True, exist_ok=True)
    producer_result, consumer_result = _run_pair(settings, directory)
    measured_seconds = time.perf_counter() - started
    summary = measured_summary(producer_result["rows"], consumer_result["rows"])
    kb_description = json.loads((Path(settings.knowledge_base) / "scd_knowledge_base.json").read_text())
    return {
        "settings": json.loads(settings.to_json()),
        "knowledge_base": {"directory": settings.knowledge_base, "save_id": kb_description["save_id"],
                           "producer": kb_description["producer"].get("name"),
                           "consumer": kb_description["consumer"].get("name"),
                           "code_bits": kb_description["code_bits"],
                           "bytes_per_coded_token": kb_description.get("bytes_per_token")},
        "transport": "torch.distributed gloo, two processes on loopback (127.0.0.1)",
        "measured": summary, "modelled": modelled_ttft(settings, summary),
        "raw_measurements": {"producer": producer_result["rows"], "consumer": consumer_result["rows"]},
        "measured_seconds": measured_seconds, "seconds": time.perf_counter() - started,
    }


# ---- reports -------------------------------------------------------------------------------------------------------

_MODELLED_NAME = {"local-prefill": "oracle", "scd-stream": "scd", "scd-whole": "scd", "raw-bf16-stream": "raw-16"}


def transport_markdown(results: dict) -> str:
    settings, kb = results["settings"], results["knowledge_base"]
    lines = [f"# bench scd-transport: {kb['producer']} -> {kb['consumer']}", "",
             f"Knowledge base `{kb['directory']}` ({kb['code_bits']}-bit codes). Transport: {results['transport']}; "
             f"{settings['threads']} torch thread(s) per process; prompt: the first tokens of {settings['text']}. "
             f"TTFT = from the consumer's request to its first generated token, on the consumer's clock; medians of "
             f"{settings['repeats']} interleaved repeats after a warm-up round. Producer done: from the request to its "
             "sender's close(), which returns once the consumer has taken the end frame (for scd-stream, after its "
             "rebuild).", ""]
    for tokens, by_method in results["measured"].items():
        modelled = results["modelled"].get(tokens, {})
        measured_gbps = modelled.get("measured_loopback_gbps")
        bandwidths = [str(bw) for bw in settings["modelled_bandwidths_gbps"]]
        header_bw = " | ".join(f"modelled @ {bw} Gbit/s" for bw in bandwidths)
        lines += [f"## {tokens} prompt tokens", "",
                  f"| method | measured TTFT (s) | last byte (s) | last byte -> cache (s) | first step (s) | producer done (s) | "
                  f"payload bytes | first token = local | modelled @ loopback (s) | {header_bw} |",
                  "|---|---|---|---|---|---|---|---|---|" + "---|" * len(bandwidths)]
        for method, entry in by_method.items():
            def cell(key, source=entry):
                value = source.get(key)
                return f"{value:.3f}" if isinstance(value, float) else ("" if value is None else str(value))

            name = _MODELLED_NAME.get(method)
            ttft = modelled.get("ttft_s", {}).get(name, {}) if name else {}
            at_loopback = ttft.get(str(round(measured_gbps, 3))) if measured_gbps else None
            agree = entry.get("first_token_equals_local_prefill")
            lines.append(f"| {method} | {cell('ttft_s')} | {cell('last_byte_s')} | {cell('rebuild_s')} | "
                         f"{cell('first_step_s')} | {cell('produce_and_send_s', entry.get('producer', {}))} | "
                         f"{int(entry['payload_bytes']) if 'payload_bytes' in entry else ''} | "
                         f"{'' if agree is None else f'{agree:.0%}'} | "
                         f"{'' if at_loopback is None else f'{at_loopback:.3f}'} | "
                         + " | ".join(f"{ttft[bw]:.3f}" if bw in ttft else "" for bw in bandwidths) + " |")
        if measured_gbps:
            lines += ["", f"Loopback bandwidth measured by `wire-only`: {measured_gbps:.2f} Gbit/s."]
        cost = modelled.get("cost", {})
        if cost:
            lines += ["", "Modelled TTFT (`bench scd`'s model, producer on the critical path): "
                          f"scd = encode {cost['scd_encode_s']:.3f} + bytes / bandwidth + rebuild "
                          f"{cost['scd_rebuild_s']:.3f} + first step {cost['first_step_s']:.3f} s; raw-16 = producer "
                          f"prefill {cost['producer_prefill_s']:.3f} + bytes / bandwidth + KIVI-4 dequantization "
                          f"{cost['kivi_rebuild_s']:.3f} (its stand-in for a raw rebuild) + first step; oracle = "
                          f"prefill {cost['oracle_prefill_s']:.3f} + first step. Its parts are medians of "
                          f"{settings['modelled_repeats']} runs in one process, timed after the two-process run."]
        lines.append("")
    return "\n".join(lines)


def transport_plot(results: dict, path) -> bool:
    """Measured and modelled TTFT against prompt length (a PNG only when there are several lengths)."""
    if len(results["measured"]) < 2:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    lengths = sorted(results["measured"], key=int)
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for method in ("local-prefill", "scd-stream", "scd-whole", "raw-bf16-stream"):
        measured = [results["measured"][tokens][method]["ttft_s"] for tokens in lengths]
        line, = axis.plot([int(t) for t in lengths], measured, marker="o", label=f"{method} (measured)")
        name = _MODELLED_NAME[method]
        modelled = []
        for tokens in lengths:
            entry = results["modelled"][tokens]
            gbps = entry["measured_loopback_gbps"]
            modelled.append(entry["ttft_s"][name].get(str(round(gbps, 3))) if gbps else None)
        if method != "scd-whole" and all(value is not None for value in modelled):  # one modelled scd line
            axis.plot([int(t) for t in lengths], modelled, linestyle="--", color=line.get_color(),
                      label=f"{name} (modelled at loopback bandwidth)")
    axis.set_xlabel("prompt tokens")
    axis.set_ylabel("TTFT (s)")
    axis.set_title("SCD transport: time to first token, two processes on loopback")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


if __name__ == "__main__":
    raise SystemExit(worker(sys.argv[1], sys.argv[2]))
