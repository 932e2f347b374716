"""GSRQCache's code-reading attention path against its dequantize path, under every generation path."""

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from hf_kvcodecs import GSRQCache, enable_code_attention
from hf_kvcodecs.bench.memory import cache_bytes, shared_storages

from .conftest import tiny_llama_config

CODED = {"window_length": 4, "flush_interval": 4, "num_sink_tokens": 2}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


@pytest.fixture(params=["default", "per_head", "joint_heads"])
def codebooks_dir(request, tiny_codebooks_dir, tiny_per_head_codebooks_dir, tiny_joint_codebooks_dir):
    """Codebooks of every layout: the default (keys per head, values joint), both per head vector, both one code
    per token for all heads."""
    return {"default": tiny_codebooks_dir, "per_head": tiny_per_head_codebooks_dir,
            "joint_heads": tiny_joint_codebooks_dir}[request.param]


def _prompt(batch=2, length=60, seed=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, codebooks, attention, **kwargs):
    settings = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    settings.update(kwargs)
    out = model.generate(ids, cache_implementation="gsrq", return_dict_in_generate=True,
                         cache_config={"codebooks": str(codebooks), "attention": attention, **CODED}, **settings)
    return out.sequences, out.past_key_values


@pytest.mark.parametrize("mode", ["greedy", "sampling", "beam", "prompt_lookup", "padded_batch"])
def test_code_reading_generation_equals_dequantize_path(model, codebooks_dir, mode):
    ids = _prompt()
    kwargs = {}
    if mode == "sampling":
        kwargs = dict(do_sample=True, top_k=20)
    elif mode == "beam":
        kwargs = dict(num_beams=3)
    elif mode == "prompt_lookup":
        ids = torch.cat([ids, ids[:, :20]], dim=1)[:1]  # repeated n-grams to propose; assisted decoding is batch 1
        kwargs = dict(prompt_lookup_num_tokens=4)
    elif mode == "padded_batch":
        ids[1, :9] = 0
        kwargs = dict(attention_mask=(torch.arange(ids.shape[1]) >= 9).long()[None].expand(2, -1).clone())
        kwargs["attention_mask"][0] = 1
    torch.manual_seed(5)
    expected, dequantize_cache = _generate(model, ids, codebooks_dir, "dequantize", **kwargs)
    torch.manual_seed(5)
    got, code_cache = _generate(model, ids, codebooks_dir, "auto", **kwargs)
    assert dequantize_cache.attention_path == "dequantize"
    assert code_cache.attention_path == "codes" and model.config._attn_implementation == "kvcodecs_sdpa"
    assert code_cache.layers[0].region_lengths()["codes"] > 0  # the codes were really read
    assert torch.equal(got, expected)
    if mode == "padded_batch":  # the padded row's first real tokens are among the exact sinks on both paths
        for cache in (code_cache, dequantize_cache):
            assert cache.layers[0].region_lengths()["sinks"] == CODED["num_sink_tokens"] + 9


def test_decode_logits_match_and_no_extra_tensors_are_held(model, codebooks_dir):
    enable_code_attention(model)
    ids = _prompt(batch=1, length=80)
    caches = {path: GSRQCache(model.config, codebooks=codebooks_dir, attention=path, **CODED)
              for path in ("dequantize", "codes")}
    logits = {}
    with torch.inference_mode():
        for path, cache in caches.items():
            model(ids[:, :70], cache=cache)
            logits[path] = torch.cat([model(ids[:, i:i + 1], cache=cache).logits for i in range(70, 80)], dim=1)
    assert torch.allclose(logits["codes"], logits["dequantize"], atol=1e-5)
    shared = shared_storages(*caches.values())
    assert cache_bytes(caches["codes"], excluding=shared) == cache_bytes(caches["dequantize"], excluding=shared)
    assert caches["codes"].ledger._angles is None  # the step's rotary tables are released after the last layer


def test_layer_decode_constants_are_the_codecs_tables_and_follow_the_key_table_dtype(model, tiny_codebooks_dir,
                                                                                     monkeypatch):
    """The operands the compiled loop reads that depend only on a layer's codecs are built once per layer, hold no
    copy of the codecs' tables (it would be memory per model that nothing else reads), are shared by every cache of
    the codebooks, deep copies included, and are rebuilt when the key table dtype changes."""
    import copy

    from hf_kvcodecs.bench.memory import tensor_storages
    from hf_kvcodecs.gsrq.attention import _DECODE_CONSTANTS, held_decode_constants
    from hf_kvcodecs.kernels.cpu_native import native_ops

    if native_ops() is None:
        pytest.skip("the compiled CPU loops could not be built here")
    enable_code_attention(model)
    monkeypatch.setenv("HF_KVCODECS_KEY_TABLE", "int16")  # the library's default (the suite reads float32)
    ids = _prompt(batch=1, length=40)
    cache = GSRQCache(model.config, codebooks=tiny_codebooks_dir, attention="codes", **CODED)
    with torch.inference_mode():
        model(ids[:, :30], cache=cache)
        model(ids[:, 30:31], cache=cache)
        layer = cache.layers[0]
        first = held_decode_constants(layer)
        model(ids[:, 31:32], cache=cache)
        assert held_decode_constants(layer) is first
        for other in (copy.deepcopy(cache), GSRQCache(model.config, codebooks=tiny_codebooks_dir, attention="codes",
                                                      **CODED)):
            assert held_decode_constants(other.layers[0]) is first
        # everything the codecs hold but the constants themselves (held on the key codec)
        key_codec_state = {name: value for name, value in vars(layer.key_codec).items() if name != _DECODE_CONSTANTS}
        held_by_codecs = set(tensor_storages(key_codec_state)) | set(tensor_storages(layer.value_codec))
        # values coded given the keys (the default): the prediction folded into the key codes' terms, built once per
        # codec pair and shared by every cache of the codebooks
        held_by_codecs |= set(tensor_storages(list(layer.value_codec.attention_prediction(layer.key_codec))))
        assert tensor_storages(list(first)) and set(tensor_storages(list(first))) <= held_by_codecs
        assert first.key_table.dtype == torch.int16 and first.key_table_step is not None
        monkeypatch.setenv("HF_KVCODECS_KEY_TABLE", "float32")
        model(ids[:, 32:33], cache=cache)
        rebuilt = held_decode_constants(layer)
        assert rebuilt is not first and rebuilt.key_table.dtype == torch.float32 and rebuilt.key_table_step is None


def test_bf16_model_reads_codes_within_the_dequantize_paths_bf16_error(model, tiny_codebooks_dir):
    """A bf16 model (the bench's same-dtype row): the code path computes in fp32 from bf16 queries and exact tokens,
    the dequantize path attends in bf16. Both are held against the fp32 model's dequantize path (same codebooks):
    the code path's logit error must stay within twice the dequantize path's bf16 error."""
    import copy

    enable_code_attention(model)
    half = copy.deepcopy(model).to(torch.bfloat16)
    ids = _prompt(batch=1, length=80)

    def decode(net, path):
        cache = GSRQCache(net.config, codebooks=tiny_codebooks_dir, attention=path, **CODED)
        with torch.inference_mode():
            net(ids[:, :70], cache=cache)
            logits = torch.cat([net(ids[:, i:i + 1], cache=cache).logits for i in range(70, 80)], dim=1).float()
        return logits, cache

    reference, _ = decode(model, "dequantize")
    dequantized, _ = decode(half, "dequantize")
    coded, cache = decode(half, "codes")
    assert cache.attention_path == "codes" and cache.layers[0].window_keys.dtype == torch.bfloat16
    assert cache.layers[0].region_lengths()["codes"] > 0
    baseline = (dequantized - reference).abs().max()
    assert 0 < (coded - reference).abs().max() <= 2 * baseline


def test_eager_models_get_the_eager_stand_in(tiny_codebooks_dir):
    torch.manual_seed(0)
    eager = LlamaForCausalLM(tiny_llama_config()).eval()
    eager.set_attn_implementation("eager")
    ids = _prompt(batch=1)
    expected, _ = _generate(eager, ids, tiny_codebooks_dir, "dequantize")
    got, cache = _generate(eager, ids, tiny_codebooks_dir, "auto")
    assert eager.config._attn_implementation == "kvcodecs_eager" and cache.attention_path == "codes"
    assert torch.equal(got, expected)


def test_stand_in_leaves_other_caches_unchanged(model, tiny_codebooks_dir):
    torch.manual_seed(0)
    plain = LlamaForCausalLM(tiny_llama_config()).eval()
    plain.load_state_dict(model.state_dict())
    ids = _prompt()
    expected = plain.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert enable_code_attention(plain) and plain.config._attn_implementation == "kvcodecs_sdpa"
    got = plain.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                         cache=DynamicCache(config=plain.config))
    assert torch.equal(got, expected)


def test_fallback_when_the_attention_implementation_has_no_stand_in(tiny_codebooks_dir, caplog):
    torch.manual_seed(0)
    other = LlamaForCausalLM(tiny_llama_config()).eval()
    other.config._attn_implementation = "flex_attention"  # no code-reading stand-in exists for it
    assert enable_code_attention(other) is False
    assert other.config._attn_implementation == "flex_attention"
    cache = GSRQCache(other.config, codebooks=tiny_codebooks_dir)
    assert cache.attention_path == "dequantize"
    with pytest.warns(UserWarning, match="without the model's config"):  # no config: nothing to go on
        assert GSRQCache(codebooks=tiny_codebooks_dir).attention_path == "dequantize"


def test_forcing_codes_without_the_stand_in_fails_loudly(tiny_codebooks_dir):
    torch.manual_seed(0)
    plain = LlamaForCausalLM(tiny_llama_config()).eval()
    with pytest.raises(ValueError, match="enable_code_attention"):  # given the config, the cache refuses at once
        GSRQCache(plain.config, codebooks=tiny_codebooks_dir, attention="codes", **CODED)
    with pytest.warns(UserWarning, match="without the model's config"):  # without it, at the second pass
        cache = GSRQCache(codebooks=tiny_codebooks_dir, attention="codes", **CODED)
    ids = _prompt(batch=1)
    with torch.inference_mode():
        first = plain(ids, cache=cache).logits
        assert torch.isnan(first).all()  # placeholders turn a wrong attention function into NaNs, never plausible output
        with pytest.raises(RuntimeError, match="enable_code_attention"):
            plain(ids[:, :1], cache=cache)


def test_a_model_switched_off_the_stand_in_gets_a_clear_error_before_any_output(tiny_codebooks_dir):
    torch.manual_seed(0)
    switched = LlamaForCausalLM(tiny_llama_config()).eval()
    enable_code_attention(switched)
    cache = GSRQCache(switched.config, codebooks=tiny_codebooks_dir, **CODED)
    assert cache.attention_path == "codes"
    switched.set_attn_implementation("eager")
    with torch.inference_mode(), pytest.raises(RuntimeError, match="now uses attn_implementation='eager'"):
        switched(_prompt(batch=1), cache=cache)  # before: NaN logits from this first call, the error only at the next


def test_calls_the_code_reading_op_cannot_serve_take_the_dequantize_path(tiny_codebooks_dir):
    """Attention weights (output_attentions) and gradients: the op returns no weights and has no autograd formula,
    so those calls attend over decoded states, as the dequantize path does, instead of returning none / wrong ones."""
    torch.manual_seed(0)
    eager = LlamaForCausalLM(tiny_llama_config()).eval()
    eager.set_attn_implementation("eager")
    ids = _prompt(batch=2, length=40)
    settings = dict(max_new_tokens=6, output_attentions=True)
    expected, _ = _generate(eager, ids, tiny_codebooks_dir, "dequantize", **settings)
    out = eager.generate(ids, cache_implementation="gsrq", return_dict_in_generate=True, do_sample=False,
                         eos_token_id=None, pad_token_id=0, cache_config={"codebooks": str(tiny_codebooks_dir), **CODED},
                         **settings)
    assert out.past_key_values.attention_path == "codes" and torch.equal(out.sequences, expected)
    assert [len(step) for step in out.attentions] == [2] * 6  # every step, every layer (none came back before)
    assert out.attentions[-1][0].shape == (2, 4, 1, 45)  # the last step attends 40 + 5 tokens

    def decode_step_gradient(path):
        cache = GSRQCache(eager.config, codebooks=tiny_codebooks_dir, attention=path, **CODED)
        with torch.no_grad():
            eager(ids, cache=cache)
        embeddings = eager.get_input_embeddings()(ids[:, -1:]).detach().requires_grad_()
        eager(inputs_embeds=embeddings, cache=cache).logits.square().sum().backward()
        return embeddings.grad, cache.layers[0].last_attention

    gradient, attended = decode_step_gradient("codes")
    assert attended == "dequantize"
    torch.testing.assert_close(gradient, decode_step_gradient("dequantize")[0], rtol=0, atol=0)


def test_invalid_attention_choice_is_rejected(tiny_codebooks_dir):
    with pytest.raises(ValueError, match="attention must be one of"):
        GSRQCache(codebooks=tiny_codebooks_dir, attention="fast")


@pytest.mark.parametrize("path", ["dequantize", "codes"])
def test_new_tokens_are_attended_exact_and_encoded_afterwards(model, tiny_codebooks_dir, path):
    """A prefill attends to its own tokens in full precision (as DynamicCache does): its logits are DynamicCache's,
    although by the end of the call most of those tokens are stored as codes. A chunk appended later attends to the
    earlier chunk's codes, so its logits differ from DynamicCache's."""
    enable_code_attention(model)
    ids = _prompt(batch=2, length=70)
    cache = GSRQCache(model.config, codebooks=tiny_codebooks_dir, attention=path, **CODED)
    reference_cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        got = model(ids[:, :60], cache=cache).logits
        expected = model(ids[:, :60], cache=reference_cache).logits
        assert torch.allclose(got, expected, atol=1e-5, rtol=0)
        assert cache.layers[-1].region_lengths() == {"sinks": 2, "codes": 54, "window": 4}
        later = model(ids[:, 60:], cache=cache).logits
        later_reference = model(ids[:, 60:], cache=reference_cache).logits
    assert cache.layers[0].region_lengths() == {"sinks": 2, "codes": 64, "window": 4}  # 4 + 10 new tokens, 10 flushed
    assert (later - later_reference).abs().max() > 1e-3
