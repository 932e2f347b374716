"""SCD on tiny random Llamas: the low-rank math, exactness of the trivial pair, progressive truncation, the payload's
refusals, generate() after SCDTransferCache, and the budgeted fit on a LoRA pair."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from transformers import DynamicCache, LlamaForCausalLM

from hf_kvcodecs.codecs.lowrank import (
    CrossMoments,
    fit_pca_map,
    fit_reduced_rank_map,
    pack_int4,
    quantize_codes,
    relative_error_by_rank,
    unpack_int4,
)
from hf_kvcodecs.scd import (
    KnowledgeBaseError,
    PairMismatchError,
    PayloadError,
    SCDFitSettings,
    SCDKnowledgeBase,
    SCDTransferCache,
    encode,
    encode_stream,
    fit_knowledge_base,
    full_rank_knowledge_base,
    truncate_payload,
)
from hf_kvcodecs.scd.payload import pack_payload, unpack_payload

from .conftest import tiny_llama_config

# ---- low-rank math ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def correlated_pair():
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(3000, 20, generator=generator) @ torch.randn(20, 20, generator=generator)
    b = a @ torch.randn(20, 12, generator=generator) + 0.1 * torch.randn(3000, 12, generator=generator)
    moments = CrossMoments(20, 12)
    for start in range(0, 3000, 700):  # streamed in uneven batches
        moments.update(a[start:start + 700], b[start:start + 700])
    return a.double(), b.double(), moments


def test_pca_prefix_decoder_is_the_least_squares_decoder_of_the_prefix(correlated_pair):
    a, b, moments = correlated_pair
    pca = fit_pca_map(moments, 20, ridge=0.0)
    codes = pca.encode(a.float()).double()
    for kept in (1, 5, 13):
        design = torch.cat((codes[:, :kept], torch.ones(len(a), 1, dtype=torch.float64)), 1)
        solution = torch.linalg.lstsq(design, b).solution
        torch.testing.assert_close(solution[:kept], pca.decoder[:kept].double(), atol=2e-5, rtol=1e-4)


def test_error_curve_matches_direct_measurement_and_decreases(correlated_pair):
    a, b, moments = correlated_pair
    pca = fit_pca_map(moments, 20, ridge=0.0)
    curve = relative_error_by_rank(moments, pca)
    assert curve[0] == 1.0 and bool((curve[1:] <= curve[:-1] + 1e-9).all())
    for kept in (3, 11, 20):
        decoded = pca.decode(pca.encode(a.float())[:, :kept]).double()
        direct = ((b - decoded) ** 2).sum() / ((b - b.mean(0)) ** 2).sum()
        assert float(curve[kept]) == pytest.approx(float(direct), rel=1e-4, abs=1e-7)


def test_self_pca_at_full_rank_reconstructs_and_full_rank_rrr_is_ridge(correlated_pair):
    a, b, moments = correlated_pair
    own = CrossMoments(20, paired=False)
    own.update(a)
    pca = fit_pca_map(own, 20, ridge=0.0)
    torch.testing.assert_close(pca.decode(pca.encode(a.float())), a.float(), atol=1e-3, rtol=1e-4)
    rrr = fit_reduced_rank_map(moments, 12, ridge=0.0)
    design = torch.cat((a - a.mean(0), torch.ones(len(a), 1, dtype=torch.float64)), 1)
    ridge = design @ torch.linalg.lstsq(design, b).solution
    torch.testing.assert_close(rrr.decode(rrr.encode(a.float())).double(), ridge, atol=1e-3, rtol=1e-4)


def test_code_quantization_and_int4_packing():
    codes = torch.randn(5, 7, 9)
    for bits in (8, 4):
        quantized, scales = quantize_codes(codes, bits)
        limit = 2 ** (bits - 1) - 1
        assert int(quantized.abs().max()) == limit and scales.dtype == torch.float16
        error = (quantized.float() * scales.float()[..., None] - codes).abs().max()
        assert float(error) <= float(scales.float().max()) / 2 + 1e-3
    quantized, _ = quantize_codes(codes, 4)
    assert torch.equal(unpack_int4(pack_int4(quantized), 9), quantized)
    with pytest.raises(ValueError, match="Code bits"):
        quantize_codes(codes, 1)


# ---- the trivial pair: exact ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_scd_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3)).eval()


@pytest.fixture(scope="module")
def stream():
    return torch.randint(3, 128, (6000,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def exact_kb(tiny_scd_model, stream, tmp_path_factory):
    kb = full_rank_knowledge_base(tiny_scd_model, tiny_scd_model, stream, window_tokens=128, windows=10,
                                  patch_layers=(1,), code_bits=32)
    kb.save(tmp_path_factory.mktemp("exact_kb"))
    return kb


def _oracle_last_logits(model, prompt):
    with torch.no_grad():
        return model(prompt).logits[0, -1]


def _scd_last_logits(model, cache, prompt):
    with torch.no_grad():
        position = torch.tensor([[prompt.shape[1] - 1]])
        return model(prompt[:, -1:], cache=cache, position_ids=position).logits[0, -1]


def test_trivial_pair_at_full_rank_reproduces_the_oracle(tiny_scd_model, exact_kb, stream):
    prompt = stream[100:181][None]
    payload = encode(tiny_scd_model, prompt[:, :-1], exact_kb)
    cache = SCDTransferCache.from_payload(payload, tiny_scd_model, exact_kb, input_ids=prompt)
    assert cache.get_seq_length() == 80 and cache.transfer_report["patch_layers"] == [1]
    oracle = DynamicCache(config=tiny_scd_model.config)
    with torch.no_grad():
        tiny_scd_model(prompt[:, :-1], cache=oracle)
    for ours, theirs in zip(cache.layers, oracle.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(_scd_last_logits(tiny_scd_model, cache, prompt),
                               _oracle_last_logits(tiny_scd_model, prompt), atol=1e-5, rtol=1e-4)


def test_knowledge_base_round_trip_and_mixed_saves_refused(exact_kb, tmp_path):
    exact_kb.save(tmp_path / "a")
    loaded = SCDKnowledgeBase.load(tmp_path / "a")
    assert loaded.plan == exact_kb.plan and loaded.save_id == exact_kb.save_id
    for index, mapping in exact_kb.keys.items():
        assert torch.equal(loaded.keys[index].decoder, mapping.decoder)
    exact_kb.save(tmp_path / "b")
    (tmp_path / "a" / "scd_knowledge_base.json").write_text((tmp_path / "b" / "scd_knowledge_base.json").read_text())
    with pytest.raises(KnowledgeBaseError, match="different saves"):
        SCDKnowledgeBase.load(tmp_path / "a")
    with pytest.raises(KnowledgeBaseError, match="does not exist"):
        SCDKnowledgeBase.load(tmp_path / "missing")


def test_streamed_payload_equals_the_payload(tiny_scd_model, exact_kb, stream):
    prompt = stream[:40][None]
    assert b"".join(encode_stream(tiny_scd_model, prompt, exact_kb)) == encode(tiny_scd_model, prompt, exact_kb)


def test_truncated_progressive_payload_decodes_with_growing_error(tiny_scd_model, stream, tmp_path):
    kb = full_rank_knowledge_base(tiny_scd_model, tiny_scd_model, stream, window_tokens=128, windows=10, code_bits=16)
    kb.save(tmp_path)
    prompt = stream[300:381][None]
    payload = encode(tiny_scd_model, prompt[:, :-1], kb)
    oracle = DynamicCache(config=tiny_scd_model.config)
    with torch.no_grad():
        tiny_scd_model(prompt[:, :-1], cache=oracle)
    reference = torch.log_softmax(_oracle_last_logits(tiny_scd_model, prompt), -1)
    state_errors, kls, sizes = [], [], []
    for fraction in (1.0, 0.75, 0.5, 0.25, 0.0625):
        smaller = truncate_payload(payload, fraction)
        cache = SCDTransferCache.from_payload(smaller, tiny_scd_model, kb, input_ids=prompt)
        state_errors.append(sum(float(((ours.values - theirs.values) ** 2).sum() + ((ours.keys - theirs.keys) ** 2).sum())
                                for ours, theirs in zip(cache.layers, oracle.layers)))
        logprobs = torch.log_softmax(_scd_last_logits(tiny_scd_model, cache, prompt), -1)
        kls.append(float((reference.exp() * (reference - logprobs)).sum()))
        sizes.append(len(smaller))
    assert sizes == sorted(sizes, reverse=True)
    assert all(later > earlier for earlier, later in zip(state_errors, state_errors[1:]))
    assert kls[-1] > kls[0] and kls[0] < 1e-4


# ---- refusals ---------------------------------------------------------------------------------------------------


def _repacked(payload: bytes, change) -> bytes:
    manifest, sections = unpack_payload(payload)
    manifest.pop("sections")
    change(manifest, sections)
    return pack_payload(manifest, sections)


def test_payload_for_another_prompt_pair_or_version_is_refused(tiny_scd_model, exact_kb, stream, tmp_path):
    prompt = stream[:60][None]
    payload = encode(tiny_scd_model, prompt, exact_kb)
    other_prompt = prompt.clone()
    other_prompt[0, 10] += 1
    with pytest.raises(PairMismatchError, match="another prompt"):
        SCDTransferCache.from_payload(payload, tiny_scd_model, exact_kb, input_ids=other_prompt)
    other_model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3)).eval()
    with pytest.raises(PairMismatchError, match="weights"):
        SCDTransferCache.from_payload(payload, other_model, exact_kb)
    with pytest.raises(PairMismatchError, match="producer"):
        encode(other_model, prompt, exact_kb)
    other_kb = copy.copy(exact_kb)
    other_kb.save(tmp_path)
    with pytest.raises(PairMismatchError, match="knowledge base"):
        SCDTransferCache.from_payload(payload, tiny_scd_model, other_kb)
    wrong_version = _repacked(payload, lambda manifest, sections: manifest.update(codec_version=4))
    with pytest.raises(PayloadError, match="version 4 is not supported"):
        SCDTransferCache.from_payload(wrong_version, tiny_scd_model, exact_kb)
    with pytest.raises(PayloadError, match="max_bytes"):
        SCDTransferCache.from_payload(payload, tiny_scd_model, exact_kb, max_payload_bytes=1000)
    with pytest.raises(PayloadError):
        SCDTransferCache.from_payload(payload[:-7], tiny_scd_model, exact_kb)


def _mutations():
    def set_key(key, value):
        return lambda manifest, sections: manifest.update({key: value})

    def set_layer(field, value):
        return lambda manifest, sections: manifest["layers"][1].update({field: value})

    def reshape(name):
        return lambda manifest, sections: sections.update({name: sections[name][:, :-1].contiguous()})

    def retype(name):
        return lambda manifest, sections: sections.update({name: sections[name].to(torch.float16)})

    def drop(name):
        return lambda manifest, sections: sections.pop(name)

    numbers = st.one_of(st.integers(-3, 10**6), st.none(), st.text(max_size=3), st.floats(allow_nan=True))
    return st.one_of(
        st.builds(set_key, st.sampled_from(["tokens", "batch", "exact_columns", "code_bits", "layers", "codec",
                                            "tokenizer_sha256", "consumer", "producer"]), numbers),
        st.builds(set_layer, st.sampled_from(["kind", "key_rank", "value_rank", "patch_rank", "index"]), numbers),
        st.builds(reshape, st.sampled_from(["input.attention_mask", "layers.0.key_codes", "layers.1.patch_codes"])),
        st.builds(retype, st.sampled_from(["input.exact_token_ids", "layers.2.value_codes", "input.attention_mask"])),
        st.builds(drop, st.sampled_from(["layers.0.value_codes", "input.exact_token_ids"])),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=_mutations())
def test_manifest_and_section_tampering_is_refused_not_crashed(tiny_scd_model, exact_kb, stream, mutation):
    payload = encode(tiny_scd_model, stream[:30][None], exact_kb)
    try:
        tampered = _repacked(payload, mutation)
    except (PayloadError, TypeError, ValueError):
        return  # the sender's own packer refused it
    if tampered == payload:
        return
    with pytest.raises((PayloadError, PairMismatchError)):
        SCDTransferCache.from_payload(tampered, tiny_scd_model, exact_kb)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.integers(0, 10**6), value=st.integers(1, 255))
def test_any_flipped_byte_is_refused(tiny_scd_model, exact_kb, stream, position, value):
    payload = bytearray(encode(tiny_scd_model, stream[:20][None], exact_kb))
    payload[position % len(payload)] ^= value
    with pytest.raises(PayloadError):
        SCDTransferCache.from_payload(bytes(payload), tiny_scd_model, exact_kb)


# ---- generate() -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [dict(do_sample=False), dict(do_sample=True, top_k=20, temperature=0.8),
                                     dict(do_sample=False, num_beams=3)], ids=["greedy", "sampling", "beam"])
def test_generate_after_scd_cache_matches_own_prefill(tiny_scd_model, exact_kb, stream, options):
    prompt = stream[500:560][None]
    payload = encode(tiny_scd_model, prompt[:, :-1], exact_kb)
    torch.manual_seed(0)
    reference = tiny_scd_model.generate(prompt, max_new_tokens=8, pad_token_id=0, **options)
    cache = SCDTransferCache.from_payload(payload, tiny_scd_model, exact_kb, input_ids=prompt,
                                          expand=options.get("num_beams", 1))
    torch.manual_seed(0)
    ours = tiny_scd_model.generate(prompt, cache=cache, max_new_tokens=8, pad_token_id=0, **options)
    assert torch.equal(ours, reference)


def test_generate_with_a_padded_batch_and_cache_implementation(tiny_scd_model, exact_kb, stream):
    long, short = stream[700:760], stream[800:840]
    prompt = torch.stack((long, torch.cat((torch.zeros(20, dtype=torch.long), short))))
    mask = torch.stack((torch.ones(60, dtype=torch.long), torch.cat((torch.zeros(20), torch.ones(40))).long()))
    reference = tiny_scd_model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    payload = encode(tiny_scd_model, prompt[:, :-1], exact_kb, attention_mask=mask[:, :-1])
    cache = SCDTransferCache.from_payload(payload, tiny_scd_model, exact_kb, input_ids=prompt)
    ours = tiny_scd_model.generate(prompt, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False,
                                   pad_token_id=0)
    assert torch.equal(ours, reference)
    by_name = tiny_scd_model.generate(prompt, attention_mask=mask, cache_implementation="scd", max_new_tokens=6,
                                      cache_config={"payload": payload, "knowledge_base": exact_kb},
                                      do_sample=False, pad_token_id=0)
    assert torch.equal(by_name, reference)
    with pytest.raises(ValueError, match="left padding"):
        encode(tiny_scd_model, prompt, exact_kb, attention_mask=mask.flip(1))


# ---- the budgeted fit on a LoRA pair ----------------------------------------------------------------------------


def test_budgeted_fit_on_a_lora_pair_meets_its_budget_and_serves_the_merged_consumer(stream, tmp_path):
    torch.manual_seed(1)
    base = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3)).eval()
    lora = LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                      init_lora_weights=False)
    consumer = get_peft_model(copy.deepcopy(base), lora).eval()
    budget = SCDFitSettings(windows=6, window_tokens=256, holdout_prompts=2, holdout_context=128,
                            holdout_continuation=32, budget_kl=0.02, max_patch_layers=1, bisection_steps=4)
    kb = fit_knowledge_base(base, consumer, stream, settings=budget, progress=False)
    kb.save(tmp_path)
    fitting = kb.fitting
    assert fitting["budget_met"] and fitting["kl"] <= 0.02
    assert kb.bytes_per_token() < fitting["raw_16bit_bytes_per_token"]
    assert all(1 <= layer.components() for layer in kb.plan if layer.kind != "recomputed")
    prompt = stream[2000:2100][None]
    payload = encode(base, prompt[:, :-1], kb)
    merged = copy.deepcopy(consumer).merge_and_unload()
    from_adapter = SCDTransferCache.from_payload(payload, consumer, kb, input_ids=prompt)
    from_merged = SCDTransferCache.from_payload(payload, merged, kb, input_ids=prompt)
    torch.testing.assert_close(from_adapter.layers[2].keys, from_merged.layers[2].keys, atol=1e-5, rtol=1e-4)
    with pytest.raises(PairMismatchError, match="adapter"):
        SCDTransferCache.from_payload(payload, base, kb)


def test_forced_patch_layers_are_used_and_unknown_ones_refused(tiny_scd_model, stream):
    settings = SCDFitSettings(windows=4, window_tokens=128, holdout_prompts=1, holdout_context=64,
                              holdout_continuation=16, budget_kl=0.5, patch_layers=(1,), bisection_steps=2,
                              code_bits=(8,))
    kb = fit_knowledge_base(tiny_scd_model, tiny_scd_model, stream, settings=settings, progress=False)
    assert kb.patch_layers == [1] and kb.fitting["search"]["forced_patch_layers"] == [1]
    settings.patch_layers = (7,)
    with pytest.raises(ValueError, match="do not exist"):
        fit_knowledge_base(tiny_scd_model, tiny_scd_model, stream, settings=settings, progress=False)
