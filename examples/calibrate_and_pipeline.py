"""Calibrate GSRQ codebooks on your own text, save them, and use them through `pipeline("text-generation")`.

    python examples/calibrate_and_pipeline.py --text my_corpus.txt --out my_codebooks
"""

import argparse

from transformers import pipeline

from hf_kvcodecs import GSRQCache, calibrate_gsrq
from hf_kvcodecs.models import load_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="default")
parser.add_argument("--text", nargs="+", default=None, help="calibration text files (default: CPython's docs)")
parser.add_argument("--out", default="gsrq_codebooks")
parser.add_argument("--bits", type=float, default=2.0)
args = parser.parse_args()

loaded = load_model(args.model)
calibrate_gsrq(loaded.model, loaded.tokenizer, text=args.text, bits=args.bits, out=args.out)

generator = pipeline("text-generation", model=loaded.model, tokenizer=loaded.tokenizer)
messages = [{"role": "user", "content": "What is a context manager?"}]
reply = generator(messages, max_new_tokens=60, do_sample=False,
                  cache_implementation="gsrq", cache_config={"codebooks": args.out, "bits": args.bits})
print(reply[0]["generated_text"][-1]["content"])

# The same cache as an object, for code that manages caches itself:
cache = GSRQCache(loaded.model.config, codebooks=args.out, bits=args.bits)
print(type(cache).__name__, cache.bits_per_element())
