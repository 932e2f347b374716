"""One SCD payload between two real processes: rank 0 prefills and streams the payload, rank 1 rebuilds its cache.

    torchrun --nproc-per-node 2 examples/scd_two_process.py                      # tiny random pair, fitted here
    torchrun --nproc-per-node 2 examples/scd_two_process.py --model default \\
        --producer artifacts/draft-w4g64 --consumer default \\
        --knowledge-base artifacts/kb-w4-ablation/recompute-5-25_tau0_8-bit --tokens 1024

Rank 0 (producer) runs ``encode_to`` with a :class:`~hf_kvcodecs.transport.DistributedSender` as its ``write``
callback, so each section leaves as soon as the prefill has produced it. Rank 1 (consumer) receives the frames with
:func:`~hf_kvcodecs.transport.receive_chunks` (bounded by a deadline and by the largest payload the knowledge base can
write) and rebuilds its cache with ``SCDTransferCache.from_stream``, each layer as soon as its sections are in (so
the rebuild overlaps the producer's prefill), then greedy-generates a few tokens. Then it checks the transfer against an in-process run:
the received payload must be byte-identical to ``encode()`` of the same prompt, and the first tokens must equal those
generated from ``SCDTransferCache.from_payload`` of that payload. It prints both checks and exits non-zero on a
mismatch. gloo on CPU (the default), NCCL with ``--backend nccl`` on two GPUs.

The tiny pair is a random Llama and a perturbed copy; rank 0 fits their knowledge base, saves it to a temporary
directory and sends the directory's path as a first payload, so this mode needs both ranks on one machine. A real
knowledge base (``hf-kvcodecs scd fit --out DIR``) is passed as ``--knowledge-base DIR`` and loaded by both ranks.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hf_kvcodecs.scd import (
    PayloadLimits,
    SCDKnowledgeBase,
    SCDTransferCache,
    encode,
    encode_to,
    full_rank_knowledge_base,
)
from hf_kvcodecs.transport import ChunkStream, DistributedSender, receive_chunks

PRODUCER, CONSUMER = 0, 1
TINY_VOCAB = 128


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "default"), default="tiny",
                        help="tiny: a random Llama pair fitted on the fly; default: real models and --knowledge-base")
    parser.add_argument("--producer", default="default", help="with --model default: the producer ('default' or a path)")
    parser.add_argument("--consumer", default="default", help="with --model default: the consumer ('default' or a path)")
    parser.add_argument("--knowledge-base", type=Path, default=None, help="the pair's knowledge base directory")
    parser.add_argument("--tokens", type=int, default=None,
                        help="prompt tokens (default 96 for tiny, 1024 for default: Debian licence text)")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens the consumer generates greedily")
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds the consumer waits for the payload")
    parser.add_argument("--backend", default="gloo", help="torch.distributed backend (gloo on CPU, nccl on GPUs)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads per rank (the byte-identity check needs the same on both)")
    parser.add_argument("--report", type=Path, default=None, help="write the consumer's checks as JSON here")
    args = parser.parse_args(argv)
    if args.model == "default" and args.knowledge_base is None:
        parser.error("--model default needs --knowledge-base DIR (a knowledge base fitted for --producer -> --consumer)")
    if args.tokens is None:
        args.tokens = 96 if args.model == "tiny" else 1024
    return args


# ---- the pair ------------------------------------------------------------------------------------------------------


def tiny_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A random 3-layer Llama and a copy whose layers from 1 on are perturbed; the same on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    producer = LlamaForCausalLM(config).eval()
    consumer = copy.deepcopy(producer)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in consumer.model.layers[1:]:
            for module in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                module.weight.add_(0.1 * module.weight.std() * torch.randn(module.weight.shape, generator=generator))
    return producer, consumer


def tiny_token_stream() -> torch.Tensor:
    return torch.randint(3, TINY_VOCAB, (4000,), generator=torch.Generator().manual_seed(3))


def send_bytes(data: bytes, dst: int) -> None:
    with DistributedSender(dst) as sender:
        sender.write(data)


def receive_bytes(src: int, deadline_s: float, max_bytes: int) -> bytes:
    return b"".join(receive_chunks(src, deadline_s=deadline_s, max_bytes=max_bytes))


def tiny_pair(rank: int, deadline_s: float):
    """Rank 0 fits and saves the knowledge base, then sends its directory to rank 1 as a short payload of its own."""
    producer, consumer = tiny_models()
    stream = tiny_token_stream()
    if rank == PRODUCER:
        kb = full_rank_knowledge_base(producer, consumer, stream, window_tokens=128, windows=10, patch_layers=(1,),
                                      code_bits=8)
        directory = tempfile.mkdtemp(prefix="hf_kvcodecs_two_process_kb_")
        kb.save(directory)
        send_bytes(directory.encode(), CONSUMER)
    else:
        directory = receive_bytes(PRODUCER, deadline_s, max_bytes=4096).decode()
        kb = SCDKnowledgeBase.load(directory)
    return producer, consumer, kb, stream, None


def real_pair(args):
    from hf_kvcodecs.models import load_model
    from hf_kvcodecs.text import load_corpus, tokenize_corpus

    kb = SCDKnowledgeBase.load(args.knowledge_base)
    producer = load_model(args.producer)
    consumer = load_model(args.consumer)
    stream = tokenize_corpus(producer.tokenizer, load_corpus(None, default="debian-licenses"))
    return producer.model, consumer.model, kb, stream, producer.tokenizer


# ---- the two roles -------------------------------------------------------------------------------------------------


def prompt_of(stream: torch.Tensor, tokens: int) -> torch.Tensor:
    """The prompt ``[1, tokens + 1]``: the producer encodes all but its last token, which the consumer feeds."""
    if stream.numel() < tokens + 1:
        raise ValueError(f"the text has {stream.numel()} tokens; --tokens {tokens} needs {tokens + 1}")
    return stream[:tokens + 1][None]


def produce(producer, kb, prompt: torch.Tensor) -> dict:
    started = time.perf_counter()
    with DistributedSender(CONSUMER) as sender:
        encode_to(producer, prompt[:, :-1], kb, sender.write)
    return {"payload_bytes": sender.bytes_sent, "frames": sender.frames_sent,
            "encode_and_send_s": time.perf_counter() - started}


def greedy(consumer, cache, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    output = consumer.generate(prompt, cache=cache, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return output[0, prompt.shape[1]:].tolist()


def consume(consumer, kb, prompt: torch.Tensor, new_tokens: int, deadline_s: float) -> tuple[bytes, list[int], dict]:
    """Rebuild the cache while the payload arrives, then generate; the payload as received (kept only for the
    check), the tokens and the timings."""
    started = time.perf_counter()
    received: list[bytes] = []
    arrivals: list[float] = []

    def recorded(chunks):
        for chunk in chunks:
            received.append(chunk)
            arrivals.append(time.perf_counter())
            yield chunk

    stream = ChunkStream(recorded(receive_chunks(PRODUCER, deadline_s=deadline_s,
                                                 max_bytes=PayloadLimits().max_payload_bytes(kb))))
    cache = SCDTransferCache.from_stream(stream, consumer, kb, input_ids=prompt)
    stream.finish()  # the producer's end frame: its sender's close() waits until it is received
    rebuilt = time.perf_counter()
    tokens = greedy(consumer, cache, prompt, new_tokens)
    return b"".join(received), tokens, {
        "last_byte_s": arrivals[-1] - started, "rebuilt_s": rebuilt - started,
        "rebuild_after_last_byte_s": rebuilt - arrivals[-1], "generate_s": time.perf_counter() - rebuilt,
        "frames": len(received)}


def check_in_process(producer, consumer, kb, prompt: torch.Tensor, payload: bytes, tokens: list[int],
                     new_tokens: int) -> dict:
    reference = encode(producer, prompt[:, :-1], kb)
    cache = SCDTransferCache.from_payload(reference, consumer, kb, input_ids=prompt)
    reference_tokens = greedy(consumer, cache, prompt, new_tokens)
    return {"payload_identical": payload == reference, "payload_bytes": len(payload),
            "reference_payload_bytes": len(reference), "tokens": tokens, "reference_tokens": reference_tokens,
            "tokens_equal": tokens == reference_tokens}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend)
    try:
        rank = dist.get_rank()
        if dist.get_world_size() != 2:
            raise SystemExit("run with exactly two processes: torchrun --nproc-per-node 2 ...")
        if args.model == "tiny":
            producer, consumer, kb, stream, _ = tiny_pair(rank, args.deadline)
        else:
            producer, consumer, kb, stream, _ = real_pair(args)
        prompt = prompt_of(stream, args.tokens)
        if rank == PRODUCER:
            sent = produce(producer, kb, prompt)
            print(f"[producer] sent {sent['payload_bytes']} bytes in {sent['frames']} frames "
                  f"({sent['encode_and_send_s']:.2f} s prefill + code + send)", flush=True)
            return 0
        payload, tokens, timings = consume(consumer, kb, prompt, args.new_tokens, args.deadline)
        print(f"[consumer] received {len(payload)} bytes in {timings['frames']} frames (last byte at "
              f"{timings['last_byte_s']:.2f} s), cache rebuilt {timings['rebuild_after_last_byte_s']:.2f} s after the "
              f"last byte, generated {tokens}", flush=True)
        checks = {**check_in_process(producer, consumer, kb, prompt, payload, tokens, args.new_tokens), **timings,
                  "model": args.model, "prompt_tokens": args.tokens, "backend": args.backend}
        print(f"[consumer] payload byte-identical to in-process encode(): {checks['payload_identical']}; "
              f"first tokens equal to in-process from_payload(): {checks['tokens_equal']}", flush=True)
        if args.report is not None:
            args.report.write_text(json.dumps(checks, indent=2))
        return 0 if checks["payload_identical"] and checks["tokens_equal"] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
