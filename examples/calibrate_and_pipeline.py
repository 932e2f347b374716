"""Calibrate GSRQ codebooks on your own text, save them, and use them through `pipeline("text-generation")`.

    python examples/calibrate_and_pipeline.py --text my_corpus.txt --out my_codebooks

Calibrate on text like the text you will run: the codec's error grows on text unlike its calibration text. The
cache codes only what lies between a prompt's first 4 tokens and its most recent 32 to 64, so the question below
comes after a few hundred tokens of context (the start of the first --text file, or of CPython's reference manual
topics, the default calibration text).
"""

import argparse
import pydoc_data.topics
from pathlib import Path

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

if args.text:
    context = Path(args.text[0]).read_text(encoding="utf-8")[:2000]
else:
    context = pydoc_data.topics.topics["with"][:2000]  # the reference manual's page on the `with` statement
generator = pipeline("text-generation", model=loaded.model, tokenizer=loaded.tokenizer)
messages = [{"role": "user", "content": f"{context}\n\nSummarise the text above in two sentences."}]
reply = generator(messages, max_new_tokens=60, do_sample=False,
                  cache_implementation="gsrq", cache_config={"codebooks": args.out, "bits": args.bits})
print(reply[0]["generated_text"][-1]["content"])

# The same cache as an object, for code that manages caches itself:
cache = GSRQCache(loaded.model.config, codebooks=args.out, bits=args.bits)
print(type(cache).__name__, cache.bits_per_element())
