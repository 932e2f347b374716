"""Same process, same cache: decode steps reading the value synthesis as a per-call contiguous copy of the basis view
(new) against a held contiguous copy (what the code before held), in alternating blocks of 33 steps (one flush each)."""
import json, os, statistics, time, torch
torch.set_num_threads(1)
from hf_kvcodecs.models import load_model
from hf_kvcodecs.gsrq import GSRQCache
from hf_kvcodecs.gsrq.store import ensure_codebooks
from hf_kvcodecs.gsrq.attention import _DECODE_CONSTANTS
from hf_kvcodecs.integrations.attention import enable_code_attention
from hf_kvcodecs.text import EVALUATION_DEFAULT, load_corpus, tokenize_corpus
loaded = load_model("default")
model = loaded.model
enable_code_attention(model)
ids = tokenize_corpus(loaded.tokenizer, load_corpus(None, default=EVALUATION_DEFAULT))
cb = ensure_codebooks(loaded, progress=False)[0]  # the default codebooks (l2, 2 bits), from the store
results = {}
for context in (int(c) for c in os.environ.get("CONTEXTS", "1024 8192").split()):
    cache = GSRQCache(model.config, codebooks=cb, bits=2, window_length=32, flush_interval=32, num_sink_tokens=4)
    position = context
    with torch.inference_mode():
        model(ids[None, :context], cache=cache, logits_to_keep=1)
        model(ids[None, position:position + 1], cache=cache); position += 1  # builds the decode constants
        variants = {"view": {}, "held copy": {}}
        for layer in cache.layers:
            entries = layer.key_codec.__dict__[_DECODE_CONSTANTS]
            for key, (source, constants) in entries.items():
                variants["view"][(id(layer.key_codec), key)] = (entries, key, (source, constants))
                copy = constants._replace(value_synthesis=constants.value_synthesis.contiguous())
                variants["held copy"][(id(layer.key_codec), key)] = (entries, key, (source, copy))
        first = next(iter(variants["view"].values()))[2][1]; print(type(first).__name__, first.value_synthesis.shape, first.value_synthesis.stride(), first.conditional_keys, first.value_predictor is not None, flush=True)
        times = {name: [] for name in variants}
        for block in range(8):
            name = ("view", "held copy")[block % 2]
            for entries, key, value in variants[name].values():
                entries[key] = value
            began = time.perf_counter()
            for _ in range(33):
                model(ids[None, position:position + 1], cache=cache); position += 1
            times[name].append(33 / (time.perf_counter() - began))
        for entries, key, value in variants["view"].values():  # the next cache of these codebooks reads them too
            entries[key] = value
    results[context] = {name: {"median_tokens_per_s": statistics.median(v), "blocks": v} for name, v in times.items()}
    results[context]["view / held copy"] = results[context]["view"]["median_tokens_per_s"] / results[context]["held copy"]["median_tokens_per_s"]
    del cache
print(json.dumps(results, indent=1))
