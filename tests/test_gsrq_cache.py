"""GSRQCache under every generation path, checked against DynamicCache.

"Exact" configurations keep every token in the full-precision window (window_length larger than the sequence), so
outputs must be identical to DynamicCache; "coded" configurations really quantize, and are checked for invariants.
"""

import copy

import torch
from transformers import DynamicCache, GenerationConfig, pipeline

from hf_kvcodecs import GSRQCache, GSRQCodebooks
from hf_kvcodecs.codecs.residual import TransformResidualVQ

EXACT = {"window_length": 10_000}
CODED = {"window_length": 4, "flush_interval": 4, "num_sink_tokens": 2}


def _prompt(batch=2, length=24, seed=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)


def test_exact_window_equals_dynamic_cache_greedy(tiny_model, tiny_codebooks_dir):
    ids = _prompt()
    reference = _greedy(tiny_model, ids)
    via_name = _greedy(tiny_model, ids, cache_implementation="gsrq", cache_config={"codebooks": str(tiny_codebooks_dir), **EXACT})
    via_object = _greedy(tiny_model, ids, cache=GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **EXACT))
    assert torch.equal(reference, via_name) and torch.equal(reference, via_object)


def test_deprecated_past_key_values_argument_still_works(tiny_model, tiny_codebooks_dir):
    ids = _prompt()
    reference = _greedy(tiny_model, ids)
    legacy = _greedy(tiny_model, ids, past_key_values=GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **EXACT))
    assert torch.equal(reference, legacy)


def test_exact_window_equals_dynamic_cache_sampling(tiny_model, tiny_codebooks_dir):
    ids = _prompt()
    kwargs = dict(max_new_tokens=12, do_sample=True, top_k=20, eos_token_id=None, pad_token_id=0, num_return_sequences=2)
    torch.manual_seed(7)
    reference = tiny_model.generate(ids, **kwargs)
    torch.manual_seed(7)
    sampled = tiny_model.generate(ids, cache_implementation="gsrq", cache_config={"codebooks": str(tiny_codebooks_dir), **EXACT}, **kwargs)
    assert torch.equal(reference, sampled)


def test_exact_window_equals_dynamic_cache_beam_search(tiny_model, tiny_codebooks_dir):
    ids = _prompt()
    kwargs = dict(max_new_tokens=10, num_beams=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    reference = tiny_model.generate(ids, **kwargs)
    beams = tiny_model.generate(ids, cache_implementation="gsrq", cache_config={"codebooks": str(tiny_codebooks_dir), **EXACT}, **kwargs)
    assert torch.equal(reference, beams)


def test_exact_window_equals_dynamic_cache_prompt_lookup(tiny_model, tiny_codebooks_dir):
    ids = torch.cat([_prompt(1, 12), _prompt(1, 12)], dim=1)  # repetition gives prompt lookup something to propose
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0, prompt_lookup_num_tokens=3)
    reference = tiny_model.generate(ids, **kwargs)
    looked_up = tiny_model.generate(ids, cache_implementation="gsrq", cache_config={"codebooks": str(tiny_codebooks_dir), **EXACT}, **kwargs)
    assert torch.equal(reference, looked_up)


def test_exact_window_equals_dynamic_cache_padded_batch(tiny_model, tiny_codebooks_dir):
    ids = _prompt(2, 20)
    mask = torch.ones_like(ids)
    ids[0, :6], mask[0, :6] = 0, 0  # left padding in the first row
    reference = _greedy(tiny_model, ids, attention_mask=mask)
    padded = _greedy(tiny_model, ids, attention_mask=mask, cache_implementation="gsrq",
                     cache_config={"codebooks": str(tiny_codebooks_dir), **EXACT})
    assert torch.equal(reference, padded)


def test_left_padded_rows_keep_their_own_first_tokens_as_sinks(tiny_model, tiny_codebooks_dir):
    """A row padded on the left decodes as it would alone: its first real tokens, not its pads, are the exact sinks."""
    short, long_ = _prompt(1, 14, seed=2), _prompt(1, 20, seed=3)
    ids = torch.cat([torch.cat([torch.zeros(1, 6, dtype=torch.long), short], dim=1), long_])
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    settings = dict(codebooks=tiny_codebooks_dir, window_length=4, flush_interval=4, num_sink_tokens=3)
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
    batch_cache, alone_cache = GSRQCache(tiny_model.config, **settings), GSRQCache(tiny_model.config, **settings)
    batched = tiny_model.generate(ids, attention_mask=mask, cache=batch_cache, **kwargs)
    alone = tiny_model.generate(short, cache=alone_cache, **kwargs)
    layer = batch_cache.layers[0]
    assert batch_cache.ledger.leading_padding == 6 and layer.region_lengths()["sinks"] == 3 + 6
    assert layer.region_lengths()["codes"] > 0  # really quantized
    # the padded row's sink slots end with its first real tokens (position ids 0, 1, 2), exact
    assert batch_cache.ledger.positions[0, 6:9].tolist() == [0, 1, 2]
    torch.testing.assert_close(layer.sink_keys[0, :, 6:], alone_cache.layers[0].sink_keys[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(batched.sequences[0, 6:], alone.sequences[0])
    for batched_scores, alone_scores in zip(batched.scores, alone.scores):
        torch.testing.assert_close(batched_scores[0], alone_scores[0], rtol=1e-4, atol=1e-4)
    # prefilled in chunks shorter than the padding, the padding is still measured whole
    chunked_cache = GSRQCache(tiny_model.config, **settings)
    chunked = tiny_model.generate(ids, attention_mask=mask, cache=chunked_cache, prefill_chunk_size=4, **kwargs)
    assert chunked_cache.ledger.leading_padding == 6 and chunked_cache.layers[0].region_lengths()["sinks"] == 9
    assert torch.equal(chunked.sequences, batched.sequences)
    # the unpadded row keeps 9 exact leading tokens; without an attention mask nothing is counted as padding
    plain = GSRQCache(tiny_model.config, **settings)
    tiny_model(ids, cache=plain)
    assert plain.ledger.leading_padding == 0 and plain.layers[0].region_lengths()["sinks"] == 3
    # a cache cropped empty and reused measures the new batch's padding
    batch_cache.crop(-batch_cache.get_seq_length())
    tiny_model(ids, cache=batch_cache)  # (no attention mask this time: nothing counts as padding)
    assert batch_cache.ledger.leading_padding == 0 and batch_cache.layers[0].region_lengths()["sinks"] == 3


def test_long_left_padding_is_reported(tiny_model, tiny_codebooks_dir, caplog):
    ids = torch.cat([torch.zeros(1, 70, dtype=torch.long), _prompt(1, 10)], dim=1)
    mask = (ids != 0).long()
    cache = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, window_length=4, flush_interval=4,
                      num_sink_tokens=3)
    with caplog.at_level("WARNING", logger="hf_kvcodecs.gsrq.cache"):
        tiny_model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=2, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    assert "left-padded by up to 70 tokens" in caplog.text and "first 73 tokens exact" in caplog.text


def test_left_padding_is_read_from_the_first_call_positions():
    from hf_kvcodecs.gsrq.ledger import _left_padding

    rows = torch.tensor
    assert _left_padding(rows([[0, 1, 2, 3]])) == 0  # one run: unpadded
    assert _left_padding(rows([[0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]])) == 3  # transformers 5: pads at position 0
    assert _left_padding(rows([[1, 1, 1, 0, 1, 2]])) == 3  # pads at position 1
    assert _left_padding(rows([[0, 1, 2, 0, 0]])) == 0  # right padding: the last run is not the real tokens
    assert _left_padding(rows([[7]])) == 0 and _left_padding(rows([[10, 11, 12]])) == 0


def test_generation_config_default_and_pipeline_pick_up_gsrq(tiny_model, tiny_codebooks_dir):
    ids = _prompt(1)
    config = GenerationConfig(cache_implementation="gsrq", cache_config={"codebooks": str(tiny_codebooks_dir), **EXACT},
                              max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = tiny_model.generate(ids, generation_config=config, return_dict_in_generate=True)
    assert isinstance(out.cache, GSRQCache)
    assert config.cache_config == {"codebooks": str(tiny_codebooks_dir), **EXACT}  # the caller's dict is not consumed

    original = tiny_model.generation_config
    try:
        tiny_model.generation_config = config
        out = tiny_model.generate(ids, return_dict_in_generate=True)
        assert isinstance(out.cache, GSRQCache)
    finally:
        tiny_model.generation_config = original


def test_pipeline_text_generation_uses_gsrq(tiny_model, tiny_codebooks_dir, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(128)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="w0", eos_token="w2")
    built = []
    original_init = GSRQCache.__init__

    def spy(self, *args, **kwargs):
        built.append(kwargs)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(GSRQCache, "__init__", spy)
    generator = pipeline("text-generation", model=tiny_model, tokenizer=tokenizer)
    prompt = " ".join(f"w{i}" for i in range(5, 30))
    coded = generator(prompt, max_new_tokens=6, do_sample=False, cache_implementation="gsrq",
                      cache_config={"codebooks": str(tiny_codebooks_dir), **EXACT})
    plain = generator(prompt, max_new_tokens=6, do_sample=False)
    assert built, "the pipeline did not build a GSRQCache"
    assert coded[0]["generated_text"] == plain[0]["generated_text"]


def test_coded_cache_stores_codes_once_and_holds_no_float_copy(tiny_model, tiny_per_head_codebooks_dir, monkeypatch):
    encoded_tokens = []
    original_encode = TransformResidualVQ.encode

    encoder_options = set()

    def counting_encode(self, x, **options):
        encoded_tokens.append(x.shape[1])
        encoder_options.add(tuple(sorted(options.items())))
        return original_encode(self, x, **options)

    monkeypatch.setattr(TransformResidualVQ, "encode", counting_encode)
    ids = _prompt(1, 30)
    out = _greedy(tiny_model, ids, cache_implementation="gsrq",
                  cache_config={"codebooks": str(tiny_per_head_codebooks_dir), "beam_width": 3, "gain": "least_squares",
                                **CODED},
                  return_dict_in_generate=True)
    assert encoder_options == {(("beam_width", 3), ("gain", "least_squares"))}  # cache_config reaches the encoder
    cache = out.cache
    layer = cache.layers[0]
    lengths = layer.region_lengths()
    total = ids.shape[1] + 16 - 1  # the last generated token is never fed back
    assert sum(lengths.values()) == total == cache.get_seq_length()
    assert lengths["sinks"] == 2 and 4 <= lengths["window"] <= 8
    # Every coded token was encoded exactly once (per layer, for keys and values): no re-quantization.
    assert sum(encoded_tokens) == 2 * 2 * lengths["codes"]
    assert layer.key_codes.dtype == torch.uint8 and layer.value_codes.dtype == torch.uint8
    float_tokens = [t.shape[-2] for t in (layer.sink_keys, layer.window_keys)]
    assert sum(float_tokens) == lengths["sinks"] + lengths["window"]


def test_coded_cache_is_close_to_full_precision_and_improves_with_bits(tiny_model, tiny_codebooks_dir):
    ids = _prompt(1, 64, seed=3)
    with torch.inference_mode():
        reference = tiny_model(ids).logits[0, -8:].log_softmax(-1)

        def divergence(bits):
            cache = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, bits=bits, **CODED)
            tiny_model(ids[:, :-8], cache=cache)
            steps = [tiny_model(ids[:, i : i + 1], cache=cache).logits[0, -1].log_softmax(-1) for i in range(56, 64)]
            coded = torch.stack(steps)
            return float((reference.exp() * (reference - coded)).sum(-1).mean())

        low, high = divergence(1.5), divergence(3.0)
    assert 0 <= high < low
    assert high < 0.05  # a random tiny model: a loose bound that a broken decode (wrong RoPE, wrong order) fails


def test_crop_rolls_back_every_region_exactly(tiny_model, tiny_codebooks_dir):
    ids = _prompt(1, 40, seed=4)
    with torch.inference_mode():
        cache = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **CODED)
        tiny_model(ids[:, :30], cache=cache)
        keys_before, values_before = cache.layers[1]._full_keys_and_values()
        codes_before = cache.layers[1].key_codes.clone()
        tiny_model(ids[:, 30:33], cache=cache)  # stays inside the window: a rollback restores the exact state
        cache.crop(-3)
        assert cache.get_seq_length() == 30 and cache.ledger.positions.shape[1] == 30
        keys_after, values_after = cache.layers[1]._full_keys_and_values()
        torch.testing.assert_close(keys_after, keys_before)
        torch.testing.assert_close(values_after, values_before)
        tiny_model(ids[:, 30:], cache=cache)  # forces a flush; rolling back keeps earlier codes untouched
        cache.crop(-10)
        assert cache.get_seq_length() == 30 and sum(cache.layers[1].region_lengths().values()) == 30
        assert torch.equal(cache.layers[1].key_codes[..., : codes_before.shape[-2], :], codes_before)
        cache.crop(-29)  # into the codes and the sinks
        assert cache.layers[0].region_lengths() == {"sinks": 1, "codes": 0, "window": 0}


def test_deepcopy_shares_the_codebooks_and_copies_the_tokens(tiny_model, tiny_codebooks_dir):
    """transformers' prefix-caching recipe: fill a cache with a prompt once, deep-copy it for each request."""
    from hf_kvcodecs.bench.memory import cache_bytes, shared_storages

    ids = _prompt(1, 40, seed=9)
    with torch.inference_mode():
        prompt_cache = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **CODED)
        tiny_model(ids[:, :30], cache=prompt_cache)
        tiny_model(ids[:, 30:31], cache=prompt_cache)
        copied = copy.deepcopy(prompt_cache)
        assert copied.codebooks is prompt_cache.codebooks
        assert all(mine.key_codec is theirs.key_codec and mine.value_codec is theirs.value_codec
                   for mine, theirs in zip(copied.layers, prompt_cache.layers))
        # the copy shares what any other cache of these codebooks shares, and holds its own copy of every token
        shared = shared_storages(prompt_cache, copied)
        assert shared == shared_storages(prompt_cache, GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **CODED))
        assert cache_bytes(copied, excluding=shared) == cache_bytes(prompt_cache, excluding=shared) > 0
        assert copied.ledger is not prompt_cache.ledger and copied.layers[0].ledger is copied.ledger

        rest = ids[:, 31:]  # crosses a flush of the 4-token window
        from_copy = tiny_model(rest, cache=copied).logits
        assert prompt_cache.get_seq_length() == 31 and copied.get_seq_length() == 40
        torch.testing.assert_close(from_copy, tiny_model(rest, cache=prompt_cache).logits, rtol=0, atol=0)


def test_iterating_yields_decoded_layers_like_dynamic_cache(tiny_model, tiny_codebooks_dir):
    ids = _prompt(2, 20, seed=10)
    with torch.inference_mode():
        exact, dynamic = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **EXACT), DynamicCache()
        coded = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **CODED)
        for cache in (exact, dynamic, coded):
            tiny_model(ids, cache=cache)
    for (keys, values, sliding), layer in zip(exact, dynamic.layers):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values) and sliding is None
    converted = DynamicCache(list(coded))  # e.g. to hand a coded cache to code that needs DynamicCache
    for (keys, values), layer in zip((layer.dequantized_keys_and_values() for layer in coded.layers), converted.layers):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values) and keys.shape[-2] == 20
    empty = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir)
    assert list(empty) == [(None, None, None)] * 2


def test_codebooks_given_as_an_object_are_used_as_they_are(tiny_model, tiny_codebooks_dir):
    codebooks = GSRQCodebooks.load(tiny_codebooks_dir)
    out = _greedy(tiny_model, _prompt(), cache_implementation="gsrq", return_dict_in_generate=True,
                  cache_config={"codebooks": codebooks, **CODED})
    assert out.past_key_values.codebooks is codebooks  # not a per-call deep copy of the model-level tables


def test_batch_operations_match_dynamic_cache(tiny_model, tiny_codebooks_dir):
    ids = _prompt(3, 20, seed=5)
    with torch.inference_mode():
        gsrq, dynamic = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **EXACT), DynamicCache()
        for cache in (gsrq, dynamic):
            tiny_model(ids, cache=cache)
            cache.batch_repeat_interleave(2)
            cache.batch_select_indices(torch.tensor([0, 3, 5]))
            cache.reorder_cache(torch.tensor([2, 0, 1]))
        step = ids[[2, 0, 1], -1:]  # any next token per row
        a = tiny_model(step, cache=gsrq).logits
        b = tiny_model(step, cache=dynamic).logits
        torch.testing.assert_close(a, b)
        assert gsrq.ledger.positions.shape == (3, 21)

        gsrq.reset()
        assert gsrq.get_seq_length() == 0 and gsrq.ledger.positions is None
        fresh = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **EXACT)
        torch.testing.assert_close(tiny_model(ids, cache=gsrq).logits, tiny_model(ids, cache=fresh).logits)


def test_coded_cache_beam_search_and_batch_ops_keep_rows_consistent(tiny_model, tiny_codebooks_dir):
    """With real quantization, a reordered cache must equal a cache filled directly with the reordered rows."""
    ids = _prompt(3, 24, seed=6)
    order = torch.tensor([2, 2, 0])
    with torch.inference_mode():
        reordered = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **CODED)
        tiny_model(ids, cache=reordered)
        reordered.reorder_cache(order)
        direct = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **CODED)
        tiny_model(ids[order], cache=direct)
        step = ids[order, -1:]
        torch.testing.assert_close(tiny_model(step, cache=reordered).logits, tiny_model(step, cache=direct).logits)
    out = tiny_model.generate(ids, max_new_tokens=8, num_beams=2, do_sample=False, eos_token_id=None, pad_token_id=0,
                              cache_implementation="gsrq", cache_config={"codebooks": str(tiny_codebooks_dir), **CODED})
    assert out.shape == (3, 32)


def test_memory_held_after_prefill_is_codes_plus_exact_tokens(tiny_model, tiny_codebooks_dir):
    """Counted from the tensors actually held (a view of the pre-flush window would keep every fp token alive)."""
    from hf_kvcodecs.bench.memory import cache_bytes, shared_storages

    ids = _prompt(1, 200, seed=8)
    with torch.inference_mode():
        cache = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **CODED)
        tiny_model(ids, cache=cache)
    shared = shared_storages(cache, GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **CODED))
    lengths = cache.layers[0].region_lengths()
    stages, scale_bytes = cache.layers[0].key_codec.num_stages, cache.layers[0].key_codec.scale_bits // 8
    per_layer = 2 * 2 * (lengths["codes"] * (stages + scale_bytes) + (lengths["sinks"] + lengths["window"]) * 16 * 4)
    expected = 2 * per_layer + 200 * 4  # two layers, plus one int32 position per token in the shared ledger
    assert cache_bytes(cache, excluding=shared) == expected


def test_joint_head_cache_holds_one_code_row_per_token_at_the_nominal_rate(tiny_model, tiny_joint_codebooks_dir):
    from hf_kvcodecs.bench.memory import cache_bytes, shared_storages

    ids = _prompt(1, 200, seed=8)
    with torch.inference_mode():
        cache = GSRQCache(tiny_model.config, codebooks=tiny_joint_codebooks_dir, **CODED)
        tiny_model(ids, cache=cache)
    layer = cache.layers[0]
    assert cache.bits_per_element() == {"keys": 2.0, "values": 2.0}  # the default rate: 6 stages + 2 scales
    assert layer.key_codes.shape[1] == 1 and layer.key_scales.shape[1] == 2  # codes shared, scales per head
    shared = shared_storages(cache, GSRQCache(tiny_model.config, codebooks=tiny_joint_codebooks_dir, **CODED))
    lengths = layer.region_lengths()
    stages = layer.key_codec.num_stages
    per_layer = 2 * (lengths["codes"] * (stages + 2) + 2 * (lengths["sinks"] + lengths["window"]) * 16 * 4)
    assert cache_bytes(cache, excluding=shared) == 2 * per_layer + 200 * 4
    with torch.inference_mode():
        reference = tiny_model(ids).logits[0, -8:].log_softmax(-1)

        def divergence(bits):
            cache = GSRQCache(tiny_model.config, codebooks=tiny_joint_codebooks_dir, bits=bits, **CODED)
            tiny_model(ids[:, :-8], cache=cache)
            coded = torch.stack([tiny_model(ids[:, i:i + 1], cache=cache).logits[0, -1].log_softmax(-1)
                                 for i in range(192, 200)])
            return float((reference.exp() * (reference - coded)).sum(-1).mean())

        low, high = divergence(1.5), divergence(3.0)
    assert 0 <= high < low and high < 0.05
