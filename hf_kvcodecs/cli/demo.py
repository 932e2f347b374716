"""`hf-kvcodecs demo`: generate from one prompt with the full-precision cache and GSRQ caches, and compare them."""

from __future__ import annotations

import time

from ._common import add_command, add_model_arguments, load_model
from ._gsrq_options import add_gsrq_cache_arguments, gsrq_cache_options
from .defaults import CODEBOOK_STORE, EVALUATION_TEXT

# The demo's --bits takes several rates, one generation each, in place of the cache's single rate.
OWN_OPTIONS = ("bits",)

# The passage is cut from the start of the evaluation text; this many characters hold more tokens than a prompt needs.
PASSAGE_CHARACTERS = 6000


def add_parser(commands) -> None:
    demo = add_command(commands, "demo", "calibrate (or reuse) codebooks, generate with fp and GSRQ caches, compare")
    add_model_arguments(demo)
    demo.add_argument("--bits", type=float, nargs="+", default=[2.0, 1.0],
                      help="GSRQ rates in bits per KV element (scales included), one generation each next to the fp32 "
                           "cache's; the codebooks are calibrated for the highest, or reused from the codebook store "
                           f"({CODEBOOK_STORE})")
    demo.add_argument("--context-tokens", type=int, default=700,
                      help=f"tokens of the {EVALUATION_TEXT} text in the prompt, before a question about it (at most "
                           f"what its first {PASSAGE_CHARACTERS} characters hold)")
    demo.add_argument("--max-new-tokens", type=int, default=48, help="tokens each cache generates, greedily")
    add_gsrq_cache_arguments(demo, skip=OWN_OPTIONS)
    demo.set_defaults(func=command)


def command(args) -> int:
    import torch
    from transformers import DynamicCache

    from ..bench.memory import cache_bytes, shared_storages
    from ..codecs.kmeans import DEFAULT_LEARNER
    from ..gsrq import GSRQCache, GSRQCacheConfig
    from ..gsrq.store import ensure_codebooks
    from ..models import model_fingerprint
    from ..text import EVALUATION_DEFAULT, load_corpus

    options = gsrq_cache_options(args, skip=OWN_OPTIONS)
    for bits in args.bits:  # a bad option fails now, not after the model load and the calibration
        GSRQCacheConfig(bits=bits, **options)
    loaded = load_model(args)
    model, tokenizer = loaded.model, loaded.tokenizer
    print(f"model: {loaded.description}")
    codebooks, directory, reused = ensure_codebooks(loaded, learner=DEFAULT_LEARNER, bits=max(args.bits))
    print(f"codebooks: {directory} ({'reused' if reused else 'calibrated now'}; calibration took "
          f"{codebooks.calibration['seconds_total']:.0f}s on {codebooks.calibration['text']['description']})")

    corpus = load_corpus(None, default=EVALUATION_DEFAULT)
    passage = tokenizer.decode(tokenizer(corpus.text[:PASSAGE_CHARACTERS], add_special_tokens=False)["input_ids"][: args.context_tokens])
    messages = [{"role": "user", "content": f"{passage}\n\nIn two sentences, what is the text above about?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_len = inputs["input_ids"].shape[1]
    print(f"prompt: {prompt_len} tokens of {corpus.description.split(':')[0]} + a question; "
          f"{args.max_new_tokens} new tokens, greedy\n")

    if model.device.type == "cpu":  # compiled once per machine: kept out of the timed generations below
        from ..kernels import native_ops

        started = time.perf_counter()
        ready = native_ops() is not None
        print(f"compiled CPU attention: {'ready' if ready else 'unavailable, the PyTorch implementation runs'} "
              f"({time.perf_counter() - started:.0f}s)\n")

    shape = model_fingerprint(model.config)
    elements_per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"]
    runs = [("fp32 DynamicCache", lambda: DynamicCache(config=model.config))]
    for bits in args.bits:
        runs.append((f"GSRQ {bits:g}-bit (cache_implementation='gsrq')", bits))
    rows, reference = [], None
    for name, how in runs:
        kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
        started = time.perf_counter()
        with torch.inference_mode():
            if callable(how):
                out = model.generate(**inputs, cache=how(), **kwargs)
            else:  # exactly what a user writes: one argument and its config
                out = model.generate(**inputs, cache_implementation="gsrq",
                                     cache_config={"codebooks": str(directory), "bits": how, **options}, **kwargs)
        seconds = time.perf_counter() - started
        tokens = out.sequences[0, prompt_len:]
        held = out.cache.get_seq_length()
        excluded = shared_storages(out.cache, GSRQCache(model.config, codebooks=directory, bits=how, **options)) \
            if not callable(how) else {}
        bits_held = 8 * cache_bytes(out.cache, excluding=excluded) / (held * elements_per_token)
        reference = tokens if reference is None else reference
        length = min(len(tokens), len(reference))
        agreement = float((tokens[:length] == reference[:length]).float().mean()) if length else 0.0
        rows.append((name, bits_held, seconds, agreement, tokenizer.decode(tokens, skip_special_tokens=True)))

    print(f"| cache | bits/element held ({held} tokens) | generate s | tokens equal to fp32 | ")
    print("|---|---|---|---|")
    for name, bits_held, seconds, agreement, _ in rows:
        print(f"| {name} | {bits_held:.2f} | {seconds:.1f} | {agreement:.0%} |")
    for name, *_, text in rows:
        print(f"\n--- {name}\n{text.strip()}")
    print("\nbits/element: bytes held by the cache's tensors (codes, scales, exact window and sink tokens, "
          "position ledger) / (tokens x layers x 2 x kv_heads x head_dim); codebooks (shared, per model) excluded.")
    return 0
