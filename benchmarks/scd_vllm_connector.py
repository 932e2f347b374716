"""The SCD vLLM connector end to end on the default model, at a chosen code precision: vLLM's offline engine as
producer (its own prefill: the baseline tokens, and the payloads) and then as consumer (the tokens after loading
the payloads), beside the transformers path decoding the same payload files (``SCDTransferCache.from_payload`` then
``generate``). Reports the payload bytes per token, how many greedy tokens the consumer shares with vLLM's own
prefill and with the transformers path, and each engine run's wall time.

Run in the vLLM venv (``make vllm-env``), one heavy process at a time:

    .venv-vllm/bin/python benchmarks/scd_vllm_connector.py --code-bits 8 --out benchmarks/results/scd_vllm_8bit.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

ENGINE = textwrap.dedent('''
    import json, sys, time

    def main():
        from vllm import LLM, SamplingParams

        model, role, kb, storage, prompts, new_tokens, out = sys.argv[1:8]
        started = time.perf_counter()
        llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                  disable_hybrid_kv_cache_manager=True, enable_prefix_caching=False, kv_transfer_config={
                      "kv_connector": "SCDConnector", "kv_connector_module_path": "hf_kvcodecs.scd.vllm_connector",
                      "kv_role": role, "kv_load_failure_policy": "recompute",
                      "kv_connector_extra_config": {"knowledge_base": kb, "storage_path": storage}})
        built = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in json.load(open(prompts))],
                               SamplingParams(max_tokens=int(new_tokens), temperature=0.0))
        json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                   "cached": [o.num_cached_tokens for o in outputs],
                   "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
                   "engine_start_seconds": built - started, "generate_seconds": time.perf_counter() - built},
                  open(out, "w"))

    if __name__ == "__main__":
        main()
''')


def run_engine(work: Path, model: Path, role: str, kb: Path, storage: Path, new_tokens: int) -> dict:
    script, out = work / "engine.py", work / f"{role}.json"
    script.write_text(ENGINE)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, str(script), str(model), role, str(kb), str(storage),
                             str(work / "prompts.json"), str(new_tokens), str(out)], capture_output=True, text=True,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if result.returncode:
        raise SystemExit(f"the {role} engine failed:\n{(result.stdout + result.stderr)[-6000:]}")
    return {**json.loads(out.read_text()), "wall_seconds": time.perf_counter() - started}


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code-bits", type=int, default=8, choices=(4, 8, 16, 32))
    parser.add_argument("--code-format", default="flat", choices=("flat", "whitened"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--windows", type=int, default=6, help="calibration windows of 256 tokens for the fit")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))

    from transformers import LlamaForCausalLM

    from hf_kvcodecs.models import load_model
    from hf_kvcodecs.scd import SCDTransferCache, full_rank_knowledge_base
    from hf_kvcodecs.scd.paged_transfer import PromptPayloadStore
    from hf_kvcodecs.scd.vllm_connector import prefix_tokens
    from hf_kvcodecs.text import CALIBRATION_DEFAULT, EVALUATION_DEFAULT, load_corpus, tokenize_corpus

    work = Path(tempfile.mkdtemp(prefix="scd_vllm_"))
    model_dir, kb_dir, storage = work / "model", work / "kb", work / "payloads"
    loaded = load_model("default")
    loaded.model.save_pretrained(model_dir)
    loaded.tokenizer.save_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    print("fitting a full-rank Reuse-only knowledge base ...", flush=True)
    calibration = tokenize_corpus(loaded.tokenizer, load_corpus(None, default=CALIBRATION_DEFAULT))
    kb = full_rank_knowledge_base(model, model, calibration, window_tokens=256, windows=args.windows, exact_tokens=0,
                                  code_bits=args.code_bits, code_format=args.code_format,
                                  tokenizer=loaded.tokenizer)
    kb.save(kb_dir)
    text = tokenize_corpus(loaded.tokenizer, load_corpus(None, default=EVALUATION_DEFAULT))
    stride = len(text) // args.prompts
    prompts = [text[i * stride:i * stride + args.prompt_tokens].tolist() for i in range(args.prompts)]
    (work / "prompts.json").write_text(json.dumps(prompts))

    print("vLLM producer ...", flush=True)
    producer = run_engine(work, model_dir, "kv_producer", kb_dir, storage, args.new_tokens)
    print("vLLM consumer ...", flush=True)
    consumer = run_engine(work, model_dir, "kv_consumer", kb_dir, storage, args.new_tokens)
    covered = prefix_tokens(args.prompt_tokens, producer["block_size"])
    store = PromptPayloadStore(storage)
    rows = []
    for prompt, own, loaded_tokens, cached in zip(prompts, producer["tokens"], consumer["tokens"],
                                                  consumer["cached"]):
        payload = store.path(prompt[:covered]).read_bytes()
        ids = torch.tensor([prompt])
        cache = SCDTransferCache.from_payload(payload, model, kb, input_ids=ids)
        with torch.no_grad():
            transformers_scd = model.generate(ids, past_key_values=cache, max_new_tokens=args.new_tokens,
                                              do_sample=False)[0, len(prompt):].tolist()
        rows.append({"loaded_tokens": cached, "payload_bytes": len(payload),
                     "bytes_per_token": len(payload) / covered,
                     "shared_prefix_with_vllm_prefill": shared_prefix(loaded_tokens, own),
                     "shared_prefix_with_transformers_scd": shared_prefix(loaded_tokens, transformers_scd),
                     "vllm_prefill": own, "vllm_scd": loaded_tokens, "transformers_scd": transformers_scd})
    report = {"code_bits": args.code_bits, "code_format": args.code_format, "prompt_tokens": args.prompt_tokens,
              "covered_tokens": covered, "new_tokens": args.new_tokens,
              "bf16_kv_bytes_per_token": 2 * 2 * kb.num_layers * model.config.num_key_value_heads
              * model.config.head_dim,
              "producer_engine": {k: producer[k] for k in ("engine_start_seconds", "generate_seconds",
                                                          "wall_seconds")},
              "consumer_engine": {k: consumer[k] for k in ("engine_start_seconds", "generate_seconds",
                                                          "wall_seconds")},
              "prompts": rows}
    for row in rows:
        print(f"loaded {row['loaded_tokens']} tokens, {row['bytes_per_token']:.0f} bytes/token; greedy tokens "
              f"shared with vLLM's prefill {row['shared_prefix_with_vllm_prefill']}/{args.new_tokens}, with the "
              f"transformers SCD path {row['shared_prefix_with_transformers_scd']}/{args.new_tokens}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
