"""Same process, same cache, alternating blocks of 33 decode steps (one flush each): the code as committed ("after")
against the same code with what the code before it did put back ("before"): the decode constants holding a contiguous
copy of the value synthesis, TransformResidualVQ decoding through a dense [S*K, D] table, the joint codec's decode
through index_add. Everything else a decode step runs is the same code."""
import json, os, statistics, time, torch
import torch.nn.functional as F
torch.set_num_threads(1)
from hf_kvcodecs.models import load_model
from hf_kvcodecs.gsrq import GSRQCache
from hf_kvcodecs.gsrq.store import ensure_codebooks
from hf_kvcodecs.gsrq.attention import _DECODE_CONSTANTS
from hf_kvcodecs.codecs.residual import TransformResidualVQ
from hf_kvcodecs.codecs.joint import JointHeadResidualVQ
from hf_kvcodecs.integrations.attention import enable_code_attention
from hf_kvcodecs.text import EVALUATION_DEFAULT, load_corpus, tokenize_corpus

AFTER = {"coded": TransformResidualVQ._coded_transform, "joint": JointHeadResidualVQ._decoded_shapes}


def dense_coded_transform(self, codes):
    num_heads, n, num_codes = codes.shape
    if num_codes == 0:
        return torch.zeros(num_heads, n, self.head_dim, device=codes.device, dtype=self.codebooks.dtype)
    source = self._table_source or self
    if "_dense" not in source.__dict__:
        stages, size, _ = source.codebooks.shape
        table = torch.zeros(stages, size, source.head_dim)
        for stage in range(stages):
            start = int(source.stage_groups[stage]) * source.group_dim
            table[stage, :, start:start + source.group_dim] = source.codebooks[stage]
        source.__dict__["_dense"] = (table.reshape(stages * size, source.head_dim), torch.arange(stages) * size)
    table, offsets = source.__dict__["_dense"]
    size = self.codebooks.shape[1]
    table, offsets = table[: self.num_stages * size], offsets[: self.num_stages]
    z = F.embedding_bag((codes.long() + offsets).reshape(-1, num_codes), table, mode="sum")
    return z.reshape(num_heads, n, self.head_dim)


def index_add_decoded_shapes(self, codes):
    inner = self.shape_codec
    tokens, stages = codes.shape[1], codes.shape[2]
    z = torch.zeros(tokens, inner.head_dim // inner.group_dim, inner.group_dim, dtype=inner.codebooks.dtype)
    if stages:
        words = inner.codebooks[torch.arange(stages), codes[0].long()]
        z.index_add_(1, inner.stage_groups, words)
    unit = torch.ones(1, tokens)
    return self._split(inner._synthesize(z.reshape(1, tokens, inner.head_dim), unit))


BEFORE = {"coded": dense_coded_transform, "joint": index_add_decoded_shapes}

loaded = load_model("default")
model = loaded.model
enable_code_attention(model)
ids = tokenize_corpus(loaded.tokenizer, load_corpus(None, default=EVALUATION_DEFAULT))
cb = ensure_codebooks(loaded, progress=False)[0]  # the default codebooks (l2, 2 bits), from the store
results = {}
for context in (int(c) for c in os.environ.get("CONTEXTS", "4096 8192").split()):
    cache = GSRQCache(model.config, codebooks=cb, bits=2, window_length=32, flush_interval=32, num_sink_tokens=4)
    position = context
    with torch.inference_mode():
        model(ids[None, :context], cache=cache, logits_to_keep=1)
        model(ids[None, position:position + 1], cache=cache); position += 1  # builds the decode constants
        constants = {}
        for layer in cache.layers:
            entries = layer.key_codec.__dict__[_DECODE_CONSTANTS]
            for key, (source, held) in entries.items():
                assert not held.value_synthesis.is_contiguous()
                copy = held._replace(value_synthesis=held.value_synthesis.contiguous())
                constants[(id(layer.key_codec), key)] = (entries, key, (source, held), (source, copy))
        logits = {}
        times = {"after": [], "before": []}
        blocks = int(os.environ.get("BLOCKS", "10"))
        for block in range(blocks):
            name = ("after", "before")[block % 2]
            functions = AFTER if name == "after" else BEFORE
            TransformResidualVQ._coded_transform = functions["coded"]
            JointHeadResidualVQ._decoded_shapes = functions["joint"]
            for entries, key, after, before in constants.values():
                entries[key] = after if name == "after" else before
            began = time.perf_counter()
            for _ in range(33):
                out = model(ids[None, position:position + 1], cache=cache); position += 1
            times[name].append(33 / (time.perf_counter() - began))
        TransformResidualVQ._coded_transform = AFTER["coded"]
        JointHeadResidualVQ._decoded_shapes = AFTER["joint"]
        for entries, key, after, before in constants.values():
            entries[key] = after
    results[context] = {name: {"median_tokens_per_s": statistics.median(v), "blocks": v} for name, v in times.items()}
    results[context]["after / before"] = (results[context]["after"]["median_tokens_per_s"]
                                          / results[context]["before"]["median_tokens_per_s"])
    print(context, results[context]["after / before"], flush=True)
    del cache
print(json.dumps(results, indent=1))
