"""SCD payloads read as they arrive: progressive payloads (a base pass, then refinements), and the partial policies
for a stream that stops short (deadline, byte budget, a transport error, a corrupted section), on tiny random Llamas.

A missing or corrupt section is never filled in: ``accept`` decodes a Reuse layer from its base pass only, and refuses
layers with base sections missing; ``recompute`` computes those on the consumer; ``fail`` refuses any cut."""

from __future__ import annotations

import io

import pytest
import torch
from transformers import DynamicCache

from hf_kvcodecs.scd import (
    PairMismatchError,
    PayloadError,
    SCDTransferCache,
    encode,
    full_rank_knowledge_base,
    truncate_payload,
)
from hf_kvcodecs.scd.manifest import PayloadManifest
from hf_kvcodecs.scd.payload import payload_summary, unpack_payload
from hf_kvcodecs.scd.stream import PartialPayloadError


@pytest.fixture(scope="module")
def reuse_kb(producer, stream, tmp_path_factory):
    kb = full_rank_knowledge_base(producer, producer, stream, window_tokens=128, windows=6, code_bits=8)
    kb.save(tmp_path_factory.mktemp("reuse_kb"))
    return kb


@pytest.fixture(scope="module")
def recompute_kb(producer, stream, tmp_path_factory):
    kb = full_rank_knowledge_base(producer, producer, stream, window_tokens=128, windows=6, patch_layers=(2,),
                                  patch_depths=(2,), code_bits=4)
    kb.save(tmp_path_factory.mktemp("recompute_kb"))
    return kb


def _prompt(stream, start=200, tokens=61):
    return stream[start:start + tokens][None]


def _assert_same_cache(cache, other, atol=1e-5):
    for ours, theirs in zip(cache.layers, other.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=atol, rtol=1e-4)
        torch.testing.assert_close(ours.values, theirs.values, atol=atol, rtol=1e-4)


def _oracle(model, prompt):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt, cache=cache, use_cache=True)
    return cache


def _section_end(payload: bytes, name: str) -> int:
    """The byte offset right after section ``name`` and its CRC-32."""
    summary = payload_summary(payload)
    offset = 20 + summary["manifest_bytes"] + summary["tag_bytes"]
    for section, nbytes in summary["sections"].items():
        offset += nbytes + 4 + summary["tag_bytes"]
        if section == name:
            return offset
    raise KeyError(name)


@pytest.mark.parametrize("kb_name", ["reuse_kb", "recompute_kb"])
def test_a_complete_progressive_payload_decodes_as_the_one_pass_payload(producer, stream, kb_name, request):
    kb = request.getfixturevalue(kb_name)
    prompt = _prompt(stream)
    one_pass = encode(producer, prompt[:, :-1], kb)
    progressive = encode(producer, prompt[:, :-1], kb, progressive=0.5)
    raw, sections = unpack_payload(progressive)
    names = list(sections)
    refinements = [name for name in names if name.endswith("_refine")]
    assert refinements and names.index(refinements[0]) > max(names.index(n) for n in names if n.endswith("_codes"))
    assert PayloadManifest.read(raw).progressive == 0.5
    # the same codes: the section bytes add up to the one-pass payload's, plus a CRC-32 per refinement section
    # (and the manifest lists those sections)
    assert sum(payload_summary(progressive)["sections"].values()) == sum(payload_summary(one_pass)["sections"].values())
    expected = SCDTransferCache.from_payload(one_pass, producer, kb, input_ids=prompt)
    _assert_same_cache(SCDTransferCache.from_payload(progressive, producer, kb, input_ids=prompt), expected)
    streamed = SCDTransferCache.from_stream(iter([progressive[i:i + 97] for i in range(0, len(progressive), 97)]),
                                            producer, kb, input_ids=prompt)
    _assert_same_cache(streamed, expected)
    report = streamed.transfer_report["stream"]
    assert report["stopped"] is None and report["bytes_received"] == len(progressive)
    assert report["first_layer_rebuilt_at_bytes"] < len(progressive)  # rebuilt before the last byte arrived
    # truncating a progressive payload cuts the same codes as truncating the one-pass payload
    assert truncate_payload(progressive, 0.25) == truncate_payload(one_pass, 0.25)


def test_a_stream_cut_in_the_refinement_pass_decodes_the_base_pass(producer, stream, reuse_kb):
    prompt = _prompt(stream)
    progressive = encode(producer, prompt[:, :-1], reuse_kb, progressive=0.5)
    names = list(unpack_payload(progressive)[1])
    # the base pass and then the refinements go deepest layer first
    assert names[2:4] == ["layers.3.key_codes", "layers.3.key_scales"] and names[-1] == "layers.0.value_refine"
    budget = _section_end(progressive, "layers.3.value_refine")  # layer 3 refined, the others at their base pass
    with pytest.raises(PartialPayloadError, match="byte budget"):
        SCDTransferCache.from_stream(progressive, producer, reuse_kb, byte_budget=budget)
    cache = SCDTransferCache.from_stream(progressive, producer, reuse_kb, byte_budget=budget, partial="accept")
    report = cache.transfer_report["stream"]
    assert report["bytes_received"] == budget and "byte budget" in report["stopped"]
    assert report["layers_full"] == [3] and report["layers_at_base_rank"] == [0, 1, 2]
    # every layer decoded at its base rank is exactly what the truncated payload decodes
    base = SCDTransferCache.from_payload(truncate_payload(progressive, 0.5), producer, reuse_kb)
    full = SCDTransferCache.from_payload(progressive, producer, reuse_kb)
    for index in range(4):
        expected = full if index == 3 else base
        torch.testing.assert_close(cache.layers[index].keys, expected.layers[index].keys, atol=1e-5, rtol=1e-4)


def test_missing_base_sections_are_never_filled_in_and_recompute_computes_them(producer, stream, recompute_kb):
    prompt = _prompt(stream)
    payload = encode(producer, prompt[:, :-1], recompute_kb, progressive=0.5)
    names = list(unpack_payload(payload)[1])
    assert names[2:5] == ["layers.2.patch_codes", "layers.2.patch_scales", "layers.2.patch_rms"]  # Patch first
    oracle = _oracle(producer, prompt[:, :-1])
    # the Patch block and layer 1's base pass arrived, layer 0's did not
    cut = _section_end(payload, "layers.1.value_scales")
    with pytest.raises(PartialPayloadError, match=r"layers \[0\] have sections missing"):
        SCDTransferCache.from_stream(payload[:cut], producer, recompute_kb, partial="accept")
    with pytest.raises(PartialPayloadError, match="input_ids"):
        SCDTransferCache.from_stream(payload[:cut], producer, recompute_kb, partial="recompute")
    cache = SCDTransferCache.from_stream(payload[:cut], producer, recompute_kb, partial="recompute",
                                         input_ids=prompt)
    report = cache.transfer_report["stream"]
    assert "truncated" in report["stopped"] and report["layers_recomputed"] == [0]
    assert report["layers_at_base_rank"] == [1] and report["layers_full"] == [2, 3]
    torch.testing.assert_close(cache.layers[0].keys, oracle.layers[0].keys, atol=1e-4, rtol=1e-3)  # the consumer's
    complete = SCDTransferCache.from_payload(payload, producer, recompute_kb)
    for index in (2, 3):  # the block ran as soon as its sections were in, as from the whole payload
        torch.testing.assert_close(cache.layers[index].keys, complete.layers[index].keys, atol=1e-5, rtol=1e-4)
    # cut inside the Patch block's sections: every layer below the block's last is recomputed
    cut = _section_end(payload, "layers.2.patch_codes")
    cache = SCDTransferCache.from_stream(payload[:cut], producer, recompute_kb, partial="recompute",
                                         input_ids=prompt)
    assert cache.transfer_report["stream"]["layers_recomputed"] == [0, 1, 2, 3]
    _assert_same_cache(cache, oracle, atol=1e-4)
    # a prompt other than the payload's is refused before anything is recomputed from it
    with pytest.raises(PairMismatchError, match="another prompt"):
        SCDTransferCache.from_stream(payload[:cut], producer, recompute_kb, partial="recompute",
                                     input_ids=_prompt(stream, start=900))


def test_a_section_corrupted_in_flight_is_a_cut_not_a_cache(producer, stream, reuse_kb):
    prompt = _prompt(stream)
    payload = bytearray(encode(producer, prompt[:, :-1], reuse_kb))
    payload[_section_end(payload, "layers.2.key_codes") - 10] ^= 0x40
    with pytest.raises(PartialPayloadError, match="CRC-32"):
        SCDTransferCache.from_stream(bytes(payload), producer, reuse_kb)
    with pytest.raises(PartialPayloadError, match=r"layers \[2, 3\]"):
        SCDTransferCache.from_stream(bytes(payload), producer, reuse_kb, partial="accept")
    cache = SCDTransferCache.from_stream(bytes(payload), producer, reuse_kb, partial="recompute", input_ids=prompt)
    assert cache.transfer_report["stream"]["layers_recomputed"] == [0, 1, 2, 3]


def test_a_transport_timeout_mid_stream_applies_the_policy(producer, stream, reuse_kb):
    prompt = _prompt(stream)
    payload = encode(producer, prompt[:, :-1], reuse_kb, progressive=0.5)
    base_end = _section_end(payload, next(n for n in unpack_payload(payload)[1] if n.endswith("_refine")))

    def stalls():
        yield payload[:base_end + 3]
        raise TimeoutError("no frame from rank 0 within 2 s")

    cache = SCDTransferCache.from_stream(stalls(), producer, reuse_kb, partial="accept")
    assert "TimeoutError" in cache.transfer_report["stream"]["stopped"]
    with pytest.raises(PartialPayloadError, match="TimeoutError"):
        SCDTransferCache.from_stream(stalls(), producer, reuse_kb)


def test_a_stream_cut_before_its_manifest_is_a_local_prefill_under_recompute(producer, stream, reuse_kb):
    prompt = _prompt(stream)
    payload = encode(producer, prompt[:, :-1], reuse_kb)
    with pytest.raises(PartialPayloadError, match="before its prompt"):
        SCDTransferCache.from_stream(io.BytesIO(payload[:15]), producer, reuse_kb, partial="accept")
    cache = SCDTransferCache.from_stream(payload[:15], producer, reuse_kb, partial="recompute",
                                         input_ids=prompt[:, :-1])
    assert cache.transfer_report["stream"]["layers_recomputed"] == [0, 1, 2, 3]
    _assert_same_cache(cache, _oracle(producer, prompt[:, :-1]), atol=1e-4)
    # a foreign or malformed header is refused whatever the policy: only a cut is a cut
    with pytest.raises(PayloadError, match="not an SCD payload"):
        SCDTransferCache.from_stream(b"x" * 64, producer, reuse_kb, partial="recompute", input_ids=prompt)


def test_progressive_fraction_is_validated(producer, stream, reuse_kb):
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        encode(producer, _prompt(stream)[:, :-1], reuse_kb, progressive=1.0)
    with pytest.raises(ValueError, match="partial must be one of"):
        SCDTransferCache.from_stream(b"", producer, reuse_kb, partial="guess")


def test_a_shared_key_binds_every_section_to_the_producer_that_signed_it(producer, stream, reuse_kb):
    key, other_key = b"k" * 32, b"o" * 32
    prompt = _prompt(stream)
    signed = encode(producer, prompt[:, :-1], reuse_kb, hmac_key=key, progressive=0.5)
    plain = encode(producer, prompt[:, :-1], reuse_kb, progressive=0.5)
    assert len(signed) - len(plain) == 32 * (1 + len(payload_summary(plain)["sections"]))
    expected = SCDTransferCache.from_payload(plain, producer, reuse_kb)
    _assert_same_cache(SCDTransferCache.from_payload(signed, producer, reuse_kb, hmac_key=key), expected)
    _assert_same_cache(SCDTransferCache.from_stream(signed, producer, reuse_kb, hmac_key=key), expected)
    with pytest.raises(PayloadError, match="pass the key"):
        SCDTransferCache.from_payload(signed, producer, reuse_kb)
    with pytest.raises(PayloadError, match="not authenticated"):
        SCDTransferCache.from_stream(plain, producer, reuse_kb, hmac_key=key)
    with pytest.raises(PayloadError, match="HMAC"):
        SCDTransferCache.from_stream(signed, producer, reuse_kb, hmac_key=other_key, partial="recompute",
                                     input_ids=prompt)
    with pytest.raises(PayloadError, match="at least 16"):
        encode(producer, prompt[:, :-1], reuse_kb, hmac_key=b"short")
    # a section spliced in from another signed payload passes its CRC-32 but not its tag
    other = encode(producer, _prompt(stream, start=900)[:, :-1], reuse_kb, hmac_key=key, progressive=0.5)
    start, end = _section_end(signed, "layers.3.key_scales"), _section_end(signed, "layers.3.value_codes")
    spliced = signed[:start] + other[start:end] + signed[end:]
    with pytest.raises(PayloadError, match="section 'layers.3.value_codes' failed its HMAC check"):
        SCDTransferCache.from_payload(spliced, producer, reuse_kb, hmac_key=key)
    with pytest.raises(PartialPayloadError, match="HMAC"):
        SCDTransferCache.from_stream(spliced, producer, reuse_kb, hmac_key=key)


def test_the_producer_runs_only_the_layers_its_plan_reads(producer, stream, recompute_kb):
    """The block 2..3 is the consumer's to run: the producer's prefill stops after layer 2's states."""
    calls = []
    handles = [layer.register_forward_hook(lambda module, args, output, index=index: calls.append(index))
               for index, layer in enumerate(producer.model.layers)]
    try:
        payload = encode(producer, _prompt(stream)[:, :-1], recompute_kb)
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [0, 1]  # layer 2 stops inside its attention, once its residual, keys and values were tapped
    cache = SCDTransferCache.from_payload(payload, producer, recompute_kb)
    assert cache.get_seq_length() == _prompt(stream).shape[1] - 1
