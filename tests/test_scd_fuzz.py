"""Fuzzing SCD's consumer on a tiny pair: every payload that is not exactly one made for this consumer, knowledge base,
adapter, tokenizer and prompt ends in a named refusal (PayloadError, PairMismatchError or KnowledgeBaseError), or,
for a progressive prefix written by ``truncate_payload``, in the documented partial decode. Never another exception
type, a hang, an unbounded allocation or a silently wrong cache.

Each case's outcome is counted in ``OUTCOMES``; the counts are printed when the module ends (``pytest -s``) and the
last test checks that every kind of case ran into the refusals it should.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import resource
import struct
import time
import zlib
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from hf_kvcodecs.scd import (
    KnowledgeBaseError,
    PairMismatchError,
    PayloadError,
    SCDTransferCache,
    encode,
    full_rank_knowledge_base,
    truncate_payload,
)
from hf_kvcodecs.scd.manifest import DEFAULT_MAX_TOKENS, PayloadManifest
from hf_kvcodecs.scd.payload import HEADER_BYTES, MAGIC, read_payload, unpack_payload

from .conftest import tiny_llama_config

FUZZ = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
REFUSALS = (PayloadError, PairMismatchError, KnowledgeBaseError)
# the last test reads what every case recorded, so the module must run on one xdist worker (`make test`: --dist loadfile)
OUTCOMES: Counter = Counter()
CASE_SECONDS = 5.0  # a refusal is immediate; this bounds a "hang" on a slow shared machine


def _run(case: str, call):
    """Run one case: its outcome is "accepted" or the refusal's class name; any other exception fails the test."""
    started = time.perf_counter()
    try:
        result, outcome = call(), "accepted"
    except REFUSALS as error:
        result, outcome = error, type(error).__name__
    elapsed = time.perf_counter() - started
    assert elapsed < CASE_SECONDS, f"{case} took {elapsed:.1f} s"
    OUTCOMES[case, outcome] += 1
    return outcome, result


def _same_cache(ours, theirs) -> bool:
    return len(ours.layers) == len(theirs.layers) and all(
        torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(ours.layers, theirs.layers))


def _wire(raw: dict, data: list[bytes], *, version: int = 2, flags: int = 0, manifest_bytes: int | None = None) -> bytes:
    """A payload written by hand (NaN and Infinity allowed in the JSON), each section followed by its CRC-32."""
    text = json.dumps(raw, allow_nan=True).encode()
    length = len(text) if manifest_bytes is None else manifest_bytes
    header = struct.pack("<8sHHII", MAGIC, version, flags, length, zlib.crc32(text))
    return header + text + b"".join(chunk + struct.pack("<I", zlib.crc32(chunk)) for chunk in data)


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


# ---- the pair ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def report_outcomes():
    """Print the outcome counts when the module is done, and check that nothing allocated without bound."""
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    print(f"\nSCD fuzz outcomes (peak memory grew {grown_mib:.0f} MiB):")
    for (case, outcome), count in sorted(OUTCOMES.items()):
        print(f"  {case:<48} {outcome:<20} {count}")
    assert grown_mib < 1024


@pytest.fixture(scope="module")
def stream():
    return torch.randint(3, 128, (3000,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4)).eval()


@pytest.fixture(scope="module")
def kb(model, stream, tmp_path_factory):
    """Reuse, a recompute Patch block of depth 2 and 8-bit codes: every kind of section (codes, scales, RMS)."""
    made = full_rank_knowledge_base(model, model, stream, window_tokens=64, windows=8, patch_layers=(1,),
                                    patch_depths=(2,), code_bits=8)
    made.save(tmp_path_factory.mktemp("fuzz_kb"))
    assert [layer.kind for layer in made.plan] == ["reuse", "patch", "recomputed", "reuse"]
    return made


@pytest.fixture(scope="module")
def prompt(stream):
    """A left-padded batch of two prompts (and the token that follows each)."""
    ids = torch.stack((stream[:25], torch.cat((torch.zeros(6, dtype=torch.long), stream[100:119]))))
    mask = torch.stack((torch.ones(25, dtype=torch.long), torch.cat((torch.zeros(6), torch.ones(19))).long()))
    return ids, mask


@pytest.fixture(scope="module")
def payload(model, kb, prompt):
    ids, mask = prompt
    return encode(model, ids[:, :-1], kb, attention_mask=mask[:, :-1])


@pytest.fixture(scope="module")
def reference(model, kb, payload, prompt):
    return SCDTransferCache.from_payload(payload, model, kb, input_ids=prompt[0], attention_mask=prompt[1])


def _decode(payload, model, kb, **options):
    return lambda: SCDTransferCache.from_payload(payload, model, kb, **options)


# ---- bytes: truncation and flips --------------------------------------------------------------------------------


def _boundaries(payload: bytes) -> list[int]:
    raw = unpack_payload(payload)[0]
    manifest_end = HEADER_BYTES + struct.unpack_from("<I", payload, 12)[0]
    points, offset = [0, 8, 10, 12, 16, HEADER_BYTES, manifest_end], manifest_end
    for entry in raw["sections"]:
        points += [offset + entry["nbytes"], offset + entry["nbytes"] + 2]  # the data's end, inside its CRC
        offset += entry["nbytes"] + 4
        points.append(offset)
    return sorted({cut for point in points for cut in (point - 1, point, point + 1) if 0 <= cut < len(payload)})


def test_truncation_at_every_section_boundary_is_refused(model, kb, payload):
    cuts = _boundaries(payload)
    assert len(cuts) > 40
    for cut in cuts:
        outcome, error = _run("truncated at a boundary", _decode(payload[:cut], model, kb))
        assert outcome == "PayloadError" and "truncated" in str(error), (cut, error)
        with pytest.raises(PayloadError, match="truncated"):
            read_payload(io.BytesIO(payload[:cut]))


@FUZZ
@given(position=st.integers(0, 10**6), flip=st.integers(1, 255), span=st.integers(1, 3))
def test_random_byte_flips_are_refused(model, kb, payload, position, flip, span):
    damaged = bytearray(payload)
    for offset in range(span):
        damaged[(position + offset) % len(damaged)] ^= flip
    outcome, _ = _run("byte flips", _decode(bytes(damaged), model, kb))
    assert outcome == "PayloadError"


# ---- extreme header and manifest values -------------------------------------------------------------------------

EXTREMES = [2**62, 2**31, 2**31 - 1, 10**30, -1, -(2**63), 0, float("nan"), float("inf"), -float("inf"), 1e308, 0.5,
            None, "", "x" * 300, True, [], {}, [2**40], [-1]]
TOP_KEYS = ["codec", "codec_version", "knowledge_base", "tokenizer_sha256", "token_ids_sha256", "batch", "tokens",
            "exact_columns", "code_bits", "layers", "producer", "consumer", "sections", "unknown_key"]
SIDE_KEYS = ["weights_sha256", "adapter_sha256", "adapter_scaling_sha256", "active_adapters"]
LAYER_KEYS = ["index", "kind", "key_rank", "value_rank", "patch_rank", "patch_mode", "depth"]
SECTION_KEYS = ["name", "dtype", "shape", "nbytes"]


@st.composite
def _edits(draw):
    where = draw(st.sampled_from(["top", "side", "layer", "section", "header"]))
    value = draw(st.sampled_from(EXTREMES) | st.integers(-(2**64), 2**64))
    if where == "top":
        return where, draw(st.sampled_from(TOP_KEYS)), None, value
    if where == "side":
        return where, draw(st.sampled_from(SIDE_KEYS)), draw(st.sampled_from(["producer", "consumer"])), value
    if where == "layer":
        return where, draw(st.sampled_from(LAYER_KEYS)), draw(st.integers(0, 3)), value
    if where == "section":
        return where, draw(st.sampled_from(SECTION_KEYS)), draw(st.integers(0, 12)), value
    key = draw(st.sampled_from(["version", "flags", "manifest_bytes"]))
    limit = 0xFFFFFFFF if key == "manifest_bytes" else 0xFFFF  # the header's u32 and u16 fields
    return where, key, None, draw(st.sampled_from([0, 1, 3, 5, 2**20 + 1, 0xFFFF, 0xFFFFFFFF]).filter(
        lambda value: value <= limit))


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(edit=_edits())
def test_extreme_manifest_and_header_values_are_refused(model, kb, payload, reference, edit):
    raw, sections = unpack_payload(payload)
    data = [_bytes(tensor) for tensor in sections.values()]
    where, key, which, value = edit
    header = {}
    if where == "top":
        raw[key] = value
    elif where == "side":
        raw[which][key] = value
    elif where == "layer":
        raw["layers"][which][key] = value
    elif where == "section":
        raw["sections"][which][key] = value
    else:
        header = {key: value}
    outcome, result = _run(f"extreme {where} value", _decode(_wire(raw, data, **header), model, kb))
    if outcome == "accepted":  # only a value the payload already held, or a label that binds nothing, gets here
        assert _same_cache(result, reference), edit
    else:
        assert outcome in ("PayloadError", "PairMismatchError"), (edit, result)


# ---- forged, self-consistent payloads: what fuzzing found -------------------------------------------------------


def _forge(kb, payload, *, sections=None, **changes) -> bytes:
    """A well-formed payload whose manifest is changed and whose sections (the original ones where their shapes still
    fit, else filler) match its table: it passes every container check, so only the manifest's meaning can refuse
    it."""
    base, tensors = unpack_payload(payload)
    manifest = dataclasses.replace(PayloadManifest.read(base), **changes)
    made = {}
    for spec in manifest.section_table():
        if sections and spec.name in sections:
            made[spec.name] = sections[spec.name]
        elif spec.name in tensors and (tensors[spec.name].dtype, tuple(tensors[spec.name].shape)) == spec[1:]:
            made[spec.name] = tensors[spec.name]
        elif spec.name == "input.attention_mask":
            made[spec.name] = torch.ones(spec.shape, dtype=spec.dtype)
        else:
            made[spec.name] = torch.ones(spec.shape, dtype=spec.dtype) if spec.dtype.is_floating_point else \
                torch.full(spec.shape, 5, dtype=spec.dtype)
    return manifest.pack(made)


def test_all_tokens_exact_is_refused_before_any_prefill(model, kb, payload):
    """Found: 4,096 tokens all marked exact (a 40 KB payload) made the consumer prefill them all itself."""
    forged = _forge(kb, payload, batch=1, tokens=4096, exact_columns=4096)
    assert len(forged) < 50_000
    outcome, error = _run("all tokens exact", _decode(forged, model, kb))
    assert outcome == "PayloadError" and "leading columns exact" in str(error) and "4 exact tokens" in str(error)
    # fewer exact columns than the knowledge base's exact tokens is refused from the manifest alone
    outcome, error = _run("too few exact columns", _decode(_forge(kb, payload, exact_columns=1), model, kb))
    assert outcome == "PayloadError" and "at least its 4 exact tokens" in str(error)


def test_batch_and_tokens_are_bounded_before_anything_is_allocated(model, kb, payload):
    """Found: a 183 KB payload ran past 60 s and 2.8 GB, a 1.4 MB one ran out of memory."""
    for changes, limit in (({"batch": 64, "tokens": 4, "exact_columns": 4}, "max_batch=16"),
                           ({"batch": 1, "tokens": DEFAULT_MAX_TOKENS + 1}, f"max_tokens={DEFAULT_MAX_TOKENS}")):
        forged = _forge(kb, payload, **changes)
        outcome, error = _run("over the batch / token limits", _decode(forged, model, kb))
        assert outcome == "PayloadError" and limit in str(error), error
    outcome, error = _run("over the batch / token limits", _decode(payload, model, kb, max_tokens=10))
    assert outcome == "PayloadError" and "max_tokens=10" in str(error)
    outcome, error = _run("over the batch / token limits", _decode(payload, model, kb, max_batch=1))
    assert outcome == "PayloadError" and "max_batch=1" in str(error)
    # a header declaring a huge table is refused by the byte limit the token limits size, before any read
    raw, _ = unpack_payload(payload)
    raw["sections"][0] = {"name": "input.attention_mask", "dtype": "uint8", "shape": [2**20, 2**20],
                          "nbytes": 2**40}
    outcome, error = _run("over the batch / token limits", _decode(_wire(raw, []), model, kb))
    assert outcome == "PayloadError"
    outcome, error = _run("over the batch / token limits",
                          lambda: read_payload(io.BytesIO(_wire(raw, [])), max_bytes=10**9))
    assert outcome == "PayloadError" and "max_bytes" in str(error)


def test_exact_token_ids_outside_the_vocabulary_are_refused(model, kb, payload):
    ids = torch.full((2, 10), 5, dtype=torch.int64)
    ids[1, 9] = 10**6
    outcome, error = _run("exact ids outside the vocabulary", _decode(
        _forge(kb, payload, sections={"input.exact_token_ids": ids}), model, kb))
    assert outcome == "PayloadError" and "vocabulary of 128" in str(error)
    ids[1, 9] = -3
    outcome, _ = _run("exact ids outside the vocabulary", _decode(
        _forge(kb, payload, sections={"input.exact_token_ids": ids}), model, kb))
    assert outcome == "PayloadError"


def test_empty_sections_with_huge_dimensions_and_nan_in_the_manifest_are_refused(model, kb, payload):
    raw, sections = unpack_payload(payload)
    data = [_bytes(tensor) for tensor in sections.values()]
    huge = copy.deepcopy(raw)
    huge["sections"][1].update(shape=[0, 2**62], nbytes=0)
    data_without_ids = data[:1] + [b""] + data[2:]
    outcome, error = _run("empty section, huge dimension", _decode(_wire(huge, data_without_ids), model, kb))
    assert outcome == "PayloadError" and "extent" in str(error)
    for constant in (float("nan"), float("inf")):
        raw_nan = copy.deepcopy(raw)
        raw_nan["layers"][0]["key_rank"] = constant
        outcome, error = _run("NaN / Infinity in the manifest", _decode(_wire(raw_nan, data), model, kb))
        assert outcome == "PayloadError" and "not JSON" in str(error)


def test_the_layer_table_is_checked_with_its_indices(model, kb, payload):
    raw, sections = unpack_payload(payload)
    data = [_bytes(tensor) for tensor in sections.values()]
    raw["layers"][0]["index"], raw["layers"][3]["index"] = 3, 0
    outcome, error = _run("layer table", _decode(_wire(raw, data), model, kb))
    assert outcome == "PayloadError" and "layer index 3 at position 0" in str(error)
    forged = _forge(kb, payload, layers=(kb.plan[0], dataclasses.replace(kb.plan[1], depth=1),
                                         dataclasses.replace(kb.plan[2], kind="reuse", key_rank=1, value_rank=1),
                                         kb.plan[3]))
    outcome, error = _run("layer table", _decode(forged, model, kb))
    assert outcome == "PayloadError" and "Layer 1 is a recompute Patch layer of depth 1" in str(error) and \
        "of depth 2" in str(error)
    for rank in (0, 10**5):
        forged = _forge(kb, payload, layers=(dataclasses.replace(kb.plan[0], key_rank=rank), *kb.plan[1:]))
        outcome, error = _run("layer table", _decode(forged, model, kb))
        assert outcome == "PayloadError" and f"key rank {rank}" in str(error)


def test_masks_and_non_finite_sections_are_refused(model, kb, payload):
    for mask, message in ((torch.tensor([[1] * 24, [1] * 20 + [0] * 4], dtype=torch.uint8), "left padding"),
                          (torch.full((2, 24), 2, dtype=torch.uint8), "only 0 and 1")):
        outcome, error = _run("bad masks and values", _decode(
            _forge(kb, payload, sections={"input.attention_mask": mask}), model, kb))
        assert outcome == "PayloadError" and message in str(error)
    scales = torch.ones(2, 14, dtype=torch.float16)
    scales[0, 3] = float("nan")
    outcome, error = _run("bad masks and values", _decode(
        _forge(kb, payload, sections={"layers.0.key_scales": scales}), model, kb))
    assert outcome == "PayloadError" and "non-finite" in str(error)


def test_a_payload_must_name_a_saved_knowledge_base(model, kb, payload):
    raw, sections = unpack_payload(payload)
    raw["knowledge_base"] = None
    nameless = _wire(raw, [_bytes(tensor) for tensor in sections.values()])
    outcome, error = _run("knowledge base id", _decode(nameless, model, kb))
    assert outcome == "PayloadError" and "names no knowledge base" in str(error)
    unsaved = copy.copy(kb)
    unsaved.save_id = None
    for data in (nameless, payload):
        outcome, error = _run("knowledge base id", _decode(data, model, unsaved))
        assert outcome == "KnowledgeBaseError" and "has not been saved" in str(error)
    with pytest.raises(KnowledgeBaseError, match="has not been saved"):
        encode(model, torch.arange(3, 20)[None], unsaved)


# ---- foreign pairs, knowledge bases, prompts, tokenizers and adapters ------------------------------------------


class _Tokenizer:
    def __init__(self, size: int):
        self.vocabulary = {f"t{i}": i for i in range(size)}
        self.special_tokens_map = {"bos_token": "t1", "eos_token": "t2"}

    def get_vocab(self):
        return self.vocabulary


def test_foreign_pair_knowledge_base_prompt_and_tokenizer_are_refused(model, kb, payload, prompt, stream, tmp_path):
    ids, mask = prompt
    other_model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4)).eval()
    outcome, error = _run("foreign consumer", _decode(payload, other_model, kb))
    assert outcome == "PairMismatchError" and "consumer's weights" in str(error)
    resaved = copy.copy(kb)
    resaved.save(tmp_path / "again")
    outcome, error = _run("foreign knowledge base", _decode(payload, model, resaved))
    assert outcome == "PairMismatchError" and "Use the knowledge base the producer used" in str(error)
    other = ids.clone()
    other[1, 12] += 1
    outcome, error = _run("foreign prompt", _decode(payload, model, kb, input_ids=other, attention_mask=mask))
    assert outcome == "PairMismatchError" and "another prompt" in str(error)
    shifted = torch.cat((torch.ones(2, 1, dtype=torch.long), mask[:, :-1]), 1)
    outcome, error = _run("foreign prompt", _decode(payload, model, kb, input_ids=ids, attention_mask=shifted))
    assert outcome == "PairMismatchError" and "another prompt" in str(error)
    # a knowledge base fitted with a tokenizer binds it on both sides
    tokenized = full_rank_knowledge_base(model, model, stream, window_tokens=64, windows=4, code_bits=8,
                                         tokenizer=_Tokenizer(128))
    tokenized.save(tmp_path / "tokenized")
    named = encode(model, ids[:, :-1], tokenized, attention_mask=mask[:, :-1], tokenizer=_Tokenizer(128))
    assert PayloadManifest.read(unpack_payload(named)[0]).tokenizer_sha256 == tokenized.tokenizer_sha256
    outcome, error = _run("foreign tokenizer", _decode(named, model, tokenized, tokenizer=_Tokenizer(127)))
    assert outcome == "PairMismatchError" and "consumer's tokenizer" in str(error)
    assert _run("matching tokenizer", _decode(named, model, tokenized, tokenizer=_Tokenizer(128)))[0] == "accepted"
    with pytest.raises(PairMismatchError, match="producer's tokenizer"):
        encode(model, ids[:, :-1], tokenized, attention_mask=mask[:, :-1], tokenizer=_Tokenizer(127))
    # one fitted without a tokenizer says it cannot check one
    outcome, error = _run("foreign tokenizer", _decode(payload, model, kb, tokenizer=_Tokenizer(128)))
    assert outcome == "KnowledgeBaseError" and "fitted without a tokenizer" in str(error)
    with pytest.raises(KnowledgeBaseError, match="fitted without a tokenizer"):
        encode(model, ids[:, :-1], kb, tokenizer=_Tokenizer(128))


@pytest.fixture(scope="module")
def lora_pair(model, stream, tmp_path_factory):
    """A consumer with two LoRA adapters ("default" active, the one the knowledge base is fitted for, and "other")."""
    config = dict(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    torch.manual_seed(5)
    consumer = get_peft_model(copy.deepcopy(model), LoraConfig(**config)).eval()
    consumer.add_adapter("other", LoraConfig(**config))
    made = full_rank_knowledge_base(model, consumer, stream, window_tokens=64, windows=8, code_bits=8)
    made.save(tmp_path_factory.mktemp("fuzz_lora_kb"))
    return consumer, made


def test_the_active_adapter_is_bound(model, lora_pair, prompt):
    consumer, kb = lora_pair
    ids, mask = prompt
    payload = encode(model, ids[:, :-1], kb, attention_mask=mask[:, :-1])
    outcome, served = _run("adapter", _decode(payload, consumer, kb))
    assert outcome == "accepted"
    consumer.set_adapter("other")
    try:
        outcome, error = _run("adapter", _decode(payload, consumer, kb))
        assert outcome == "PairMismatchError" and "active ['other']" in str(error) and "set_adapter" in str(error)
    finally:
        consumer.set_adapter("default")
    with consumer.disable_adapter():
        outcome, error = _run("adapter", _decode(payload, consumer, kb))
        assert outcome == "PairMismatchError" and "no adapter applied" in str(error)
    # the merged consumer is accepted (full_rank_knowledge_base records the merged weights' hash) and equivalent
    merged = copy.deepcopy(consumer).merge_and_unload()
    outcome, from_merged = _run("adapter", _decode(payload, merged, kb))
    assert outcome == "accepted"
    torch.testing.assert_close(from_merged.layers[3].keys, served.layers[3].keys, atol=1e-5, rtol=1e-4)
    # an in-place change to the adapter after its identity was first hashed
    weight = consumer.base_model.model.model.layers[2].self_attn.v_proj.lora_B["default"].weight
    with torch.no_grad():
        weight.mul_(2)
    try:
        outcome, error = _run("adapter", _decode(payload, consumer, kb))
        assert outcome == "PairMismatchError" and "LoRA adapter" in str(error)
    finally:
        with torch.no_grad():
            weight.div_(2)
    # and to the base weights, through .data (no version counter sees it; the sampled values do)
    weight = consumer.base_model.model.model.layers[1].mlp.up_proj.weight
    weight.data.mul_(2)
    try:
        outcome, error = _run("adapter", _decode(payload, consumer, kb))
        assert outcome == "PairMismatchError" and "consumer's weights" in str(error)
    finally:
        weight.data.div_(2)
    outcome, _ = _run("adapter", _decode(payload, consumer, kb))
    assert outcome == "accepted"


def test_the_producer_adapter_is_bound(lora_pair, stream, tmp_path):
    consumer, _ = lora_pair
    both = full_rank_knowledge_base(consumer, consumer, stream, window_tokens=64, windows=4, code_bits=8)
    both.save(tmp_path)
    encode(consumer, stream[:20][None], both)
    consumer.set_adapter("other")
    try:
        with pytest.raises(PairMismatchError, match=r"producer's LoRA adapter \(active \['other'\]"):
            encode(consumer, stream[:20][None], both)
    finally:
        consumer.set_adapter("default")
    OUTCOMES["producer adapter", "PairMismatchError"] += 1


# ---- generate(): the payload is bound to its prompt on every path ----------------------------------------------


def test_generate_checks_its_prompt_against_the_payload(model, kb, payload, prompt):
    ids, mask = prompt
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    reference = model.generate(ids, attention_mask=mask, **options)
    by_name = model.generate(ids, attention_mask=mask, cache_implementation="scd",
                             cache_config={"payload": payload, "knowledge_base": kb}, **options)
    assert torch.equal(by_name, reference)
    other = ids.clone()
    other[0, 3] += 1
    outcome, error = _run("generate, foreign prompt", lambda: model.generate(
        other, attention_mask=mask, cache_implementation="scd", cache_config={"payload": payload, "knowledge_base": kb},
        **options))
    assert outcome == "PairMismatchError" and "another prompt" in str(error)
    outcome, error = _run("generate, foreign prompt", lambda: model.generate(
        ids, attention_mask=torch.ones_like(mask), cache_implementation="scd",
        cache_config={"payload": payload, "knowledge_base": kb}, **options))
    assert outcome == "PairMismatchError" and "another prompt" in str(error)  # the padding differs
    outcome, error = _run("generate, foreign prompt", lambda: model.generate(
        ids[:, :-1], attention_mask=mask[:, :-1], cache_implementation="scd",
        cache_config={"payload": payload, "knowledge_base": kb}, **options))
    assert outcome == "PairMismatchError" and "at least 1 token" in str(error)
    # a cache built without input_ids is checked by generate() too
    unchecked = SCDTransferCache.from_payload(payload, model, kb)
    outcome, error = _run("generate, foreign prompt", lambda: model.generate(
        other, attention_mask=mask, cache=unchecked, **options))
    assert outcome == "PairMismatchError" and "another prompt" in str(error)
    ours = model.generate(ids, attention_mask=mask, cache=SCDTransferCache.from_payload(payload, model, kb), **options)
    assert torch.equal(ours, reference)


# ---- the documented partial decode ------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(fraction=st.floats(0.01, 1.0))
def test_a_progressive_prefix_decodes_partially(model, kb, payload, reference, fraction):
    smaller = truncate_payload(payload, fraction)
    outcome, cache = _run("truncate_payload prefix", _decode(smaller, model, kb))
    assert outcome == "accepted"
    carried = PayloadManifest.read(unpack_payload(smaller)[0]).layers
    assert all(1 <= layer.key_rank <= fitted.key_rank for layer, fitted in zip(carried, kb.plan)
               if layer.kind == "reuse")
    assert cache.get_seq_length() == reference.get_seq_length()
    assert all(bool(torch.isfinite(layer.keys).all()) for layer in cache.layers)
    if carried == tuple(kb.plan):
        assert _same_cache(cache, reference)


def test_every_kind_of_case_ran_into_its_refusals():
    if not OUTCOMES:
        pytest.skip("run with the rest of the module")
    outcomes = {case: {outcome for (name, outcome) in OUTCOMES if name == case} for case, _ in OUTCOMES}
    assert outcomes["truncated at a boundary"] == {"PayloadError"}
    assert outcomes["byte flips"] == {"PayloadError"}
    assert outcomes["truncate_payload prefix"] == {"accepted"}
    assert outcomes.get("generate, foreign prompt", {"PairMismatchError"}) == {"PairMismatchError"}
