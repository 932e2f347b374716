"""SCD's whitened codes (issue 53, item 3): per-component bit widths water-filled at the bytes of today's flat codes.

On tiny random Llamas: a whitened payload round-trips through encode -> from_payload for Reuse, recompute Patch and
projection-only Patch layers; it costs what the flat code of the same plan costs (within a byte per vector); it
truncates to a byte prefix that still decodes; the knowledge base saves its widths; a payload whose widths or
sections disagree with the knowledge base is refused; and at equal bytes it lands closer to the oracle than the flat
code on a mismatched pair."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from transformers import DynamicCache

from hf_kvcodecs.codecs import bit_allocation
from hf_kvcodecs.evaluation import kl_divergence
from hf_kvcodecs.scd import (
    PairMismatchError,
    PayloadError,
    SCDKnowledgeBase,
    SCDTransferCache,
    encode,
    full_rank_knowledge_base,
    truncate_payload,
)
from hf_kvcodecs.scd.cache import rebuild_into
from hf_kvcodecs.scd.coding import allocate_code, section_layout, whiten_plan
from hf_kvcodecs.scd.encode import encode_sections
from hf_kvcodecs.scd.fit import continuation_logprobs
from hf_kvcodecs.scd.knowledge_base import (
    METADATA_FILE,
    TENSORS_FILE,
    CodeWidths,
    KnowledgeBaseError,
    LayerPlan,
    _read_plan,
    flat_vector_bytes,
    plan_bytes_per_token,
    plan_problems,
)
from hf_kvcodecs.scd.manifest import PayloadManifest
from hf_kvcodecs.scd.payload import pack_payload, unpack_payload

LAYERS = 4


@pytest.fixture(scope="module")
def consumer(deep_mismatch_consumer):
    return deep_mismatch_consumer


KB_SETTINGS = {"reuse": {}, "recompute": {"patch_layers": (1,), "patch_depths": (2,)},
               "project": {"patch_layers": (2,), "patch_mode": "project"}}


@pytest.fixture(scope="module")
def knowledge_bases(producer, consumer, stream, tmp_path_factory):
    """Per Patch setting, saved full-rank knowledge bases: whitened (with and without the gain byte) and flat, at
    4-bit bytes."""
    made = {}
    for name, options in KB_SETTINGS.items():
        flat = full_rank_knowledge_base(producer, consumer, stream, window_tokens=128, windows=10, code_bits=4,
                                        **options)
        made[name, "flat"] = flat
        for code, gain in (("whitened", False), ("whitened+gain", True)):
            kb = copy.copy(flat)  # the same maps, re-coded (what full_rank_knowledge_base(code_format=...) does)
            kb.plan = whiten_plan(flat.plan, flat, 4, gain)
            made[name, code] = kb
        for kb in (made[name, code] for code in ("flat", "whitened", "whitened+gain")):
            kb.save(tmp_path_factory.mktemp(name))
    return made


def test_full_rank_knowledge_base_whitens_its_plan(knowledge_bases, producer, consumer, stream):
    kb = full_rank_knowledge_base(producer, consumer, stream, window_tokens=128, windows=10, code_bits=4,
                                  code_format="whitened", code_gain=False, **KB_SETTINGS["recompute"])
    assert kb.code_format == "whitened" and kb.plan == knowledge_bases["recompute", "whitened"].plan
    assert kb.fitting["settings"]["code_format"] == "whitened"
    floats = full_rank_knowledge_base(producer, consumer, stream, window_tokens=128, windows=10, code_bits=16,
                                      code_format="whitened")
    assert floats.code_format == "flat"  # 16-bit codes are floats in either format


def _codes(kb: SCDKnowledgeBase, code: str) -> list[tuple[int, str, int, CodeWidths | None]]:
    return [(layer.index, name, rank, layer.widths.get(name)) for layer in kb.plan for name, rank in layer.code_ranks()]


def test_whitened_widths_spend_the_flat_codes_bytes(knowledge_bases):
    """Each whitened code is allocated the bytes of the flat code of the same map and rank: within one byte per
    vector, with non-increasing widths (the prefix property) and the rank the count of components given bits."""
    for (name, code), kb in knowledge_bases.items():
        if code == "flat":
            continue
        flat = knowledge_bases[name, "flat"]
        assert kb.code_format == "whitened" and flat.code_format == "flat"
        for (index, part, rank, widths), (_, _, flat_rank, _) in zip(_codes(kb, code), _codes(flat, "flat")):
            assert widths is not None and widths.rank == rank and widths.gain == (code == "whitened+gain")
            assert list(widths.bits) == sorted(widths.bits, reverse=True) and min(widths.bits) >= 1
            assert abs(widths.bytes_per_vector() - flat_vector_bytes(flat_rank, 4)) <= 1, (name, index, part)
        vectors = len(_codes(kb, code))
        assert abs(kb.bytes_per_token() - flat.bytes_per_token()) <= vectors
        assert kb.bytes_per_token() <= flat.bytes_per_token()  # the allocation never overspends


def test_allocation_gives_the_gain_byte_back_to_the_widths(knowledge_bases):
    kb = knowledge_bases["reuse", "flat"]
    mapping = kb.keys[0]
    for rank in (1, 5, mapping.rank):
        plain, gained = allocate_code(mapping, rank, 4, False), allocate_code(mapping, rank, 4, True)
        assert sum(plain.bits) <= 8 * flat_vector_bytes(rank, 4) and plain.bytes_per_vector() <= flat_vector_bytes(rank, 4)
        assert sum(gained.bits) <= sum(plain.bits) - 8 or sum(plain.bits) == 8 * mapping.rank
        assert gained.bytes_per_vector() <= flat_vector_bytes(rank, 4)


def test_section_layout_is_the_payloads_table(knowledge_bases, producer, stream):
    """The producer writes exactly the sections section_layout lists (names, dtypes, shapes), and their bytes per
    coded token are the plan's bytes per token."""
    prompt = stream[100:161][None]
    for key in (("recompute", "whitened+gain"), ("project", "whitened"), ("reuse", "flat")):
        kb = knowledge_bases[key]
        manifest, sections = encode_sections(producer, prompt, kb)
        coded = manifest.coded_tokens
        specs = [spec for layer in kb.plan for spec in section_layout(layer, kb.code_bits, 1, coded)]
        assert [spec.name for spec in specs] == [name for name in sections if name.startswith("layers.")]
        for spec in specs:
            assert sections[spec.name].dtype == spec.dtype and tuple(sections[spec.name].shape) == spec.shape
        assert sum(spec.nbytes for spec in specs) == coded * kb.bytes_per_token()


def _oracle(consumer, prompt, following):
    cache = DynamicCache(config=consumer.config)
    with torch.no_grad():
        consumer(input_ids=prompt[:, :-1], cache=cache, use_cache=True)
    return continuation_logprobs(consumer, cache, prompt, following)


@pytest.mark.parametrize("name", list(KB_SETTINGS))
def test_whitened_payload_round_trips(knowledge_bases, producer, consumer, stream, name):
    """encode -> from_payload rebuilds the cache the in-memory sections rebuild (bit for bit), for Reuse, recompute
    Patch and projection-only Patch layers, and lands near the lossless (32-bit) payload's cache."""
    window = stream[300:381][None]
    prompt, following = window[:, :-8], window[:, -8:]
    for code in ("whitened", "whitened+gain"):
        kb = knowledge_bases[name, code]
        payload = encode(producer, prompt[:, :-1], kb)
        raw, _ = unpack_payload(payload)
        assert raw["code_format"] == "whitened"
        manifest, sections = encode_sections(producer, prompt[:, :-1], kb)
        cache = SCDTransferCache.from_payload(payload, consumer, kb, input_ids=prompt[:, :-1])
        direct = DynamicCache(config=consumer.config)
        rebuild_into(direct, consumer, kb, list(manifest.layers), sections, manifest.code_bits)
        lossless = SCDTransferCache.from_payload(encode(producer, prompt[:, :-1], kb, code_bits=32), consumer, kb)
        for index in range(LAYERS):
            assert torch.equal(cache.layers[index].keys, direct.layers[index].keys)
            assert torch.equal(cache.layers[index].values, direct.layers[index].values)
            for got, want in ((cache.layers[index].keys, lossless.layers[index].keys),
                              (cache.layers[index].values, lossless.layers[index].values)):
                error = (got - want).pow(2).sum() / want.pow(2).sum()
                assert error < 0.05, (name, code, index, float(error))
        logprobs = continuation_logprobs(consumer, cache, prompt, following)
        assert torch.isfinite(logprobs).all()


def test_truncated_whitened_payload_is_a_byte_prefix_and_decodes(knowledge_bases, producer, consumer, stream):
    kb = knowledge_bases["recompute", "whitened+gain"]
    prompt = stream[500:571][None]
    payload = encode(producer, prompt[:, :-1], kb)
    raw, sections = unpack_payload(payload)
    half = truncate_payload(payload, 0.5)
    assert len(half) < len(payload)
    cut_raw, cut = unpack_payload(half)
    manifest = PayloadManifest.read(cut_raw)
    for old, new in zip(PayloadManifest.read(raw).layers, manifest.layers):
        for (name, rank), (_, kept) in zip(old.code_ranks(), new.code_ranks()):
            assert kept == max(1, round(rank * 0.5))
            assert new.widths[name] == old.widths[name].prefix(kept)
            key = f"layers.{old.index}.{name}_codes"
            assert torch.equal(cut[key], bit_allocation.truncate(sections[key], old.widths[name].bits, kept))
            if old.widths[name].gain:
                assert torch.equal(cut[f"layers.{old.index}.{name}_gains"], sections[f"layers.{old.index}.{name}_gains"])
            # the prefix decodes to the full code's first components exactly
            mapping = kb.keys[old.index] if name == "key" else kb.values[old.index] if name == "value" else \
                kb.patch_map(old)
            gains = sections.get(f"layers.{old.index}.{name}_gains")
            full = bit_allocation.decode(sections[key], mapping.component_energy[:rank], old.widths[name].bits, gains)
            prefix = bit_allocation.decode(cut[key], mapping.component_energy[:kept], new.widths[name].bits, gains)
            assert torch.equal(prefix, full[..., :kept])
    cache = SCDTransferCache.from_payload(half, consumer, kb, input_ids=prompt[:, :-1])
    assert cache.get_seq_length() == prompt.shape[1] - 1


def test_knowledge_base_saves_and_loads_the_widths(knowledge_bases, tmp_path):
    kb = knowledge_bases["recompute", "whitened+gain"]
    kb.save(tmp_path)
    loaded = SCDKnowledgeBase.load(tmp_path)
    assert loaded.plan == kb.plan and loaded.code_format == "whitened"
    with safe_open(str(tmp_path / TENSORS_FILE), "pt") as handle:
        for layer in kb.plan:
            for name, code in layer.widths.items():
                stored = handle.get_tensor(f"layers.{layer.index}.{name}_bits")
                assert stored.dtype == torch.uint8 and stored.tolist() == list(code.bits)
    description = json.loads((tmp_path / METADATA_FILE).read_text())
    assert description["code_format"] == "whitened"
    assert description["plan"][0]["codes"] == {"key": {"gain": True}, "value": {"gain": True}}
    assert description["bytes_per_token"] == kb.bytes_per_token()
    # a description that claims another format than its plan codes is refused
    description["code_format"] = "flat"
    (tmp_path / METADATA_FILE).write_text(json.dumps(description))
    with pytest.raises(KnowledgeBaseError):
        SCDKnowledgeBase.load(tmp_path)


def test_flat_knowledge_bases_without_a_code_format_still_load(knowledge_bases, tmp_path):
    """Knowledge bases written before the choice existed (no code_format, no widths) read as flat."""
    kb = knowledge_bases["reuse", "flat"]
    kb.save(tmp_path)
    description = json.loads((tmp_path / METADATA_FILE).read_text())
    del description["code_format"]
    (tmp_path / METADATA_FILE).write_text(json.dumps(description))
    loaded = SCDKnowledgeBase.load(tmp_path)
    assert loaded.code_format == "flat" and loaded.plan == kb.plan


def test_plans_with_bad_widths_are_refused():
    widths = CodeWidths((3, 2, 2), gain=True)
    good = [LayerPlan(0, "reuse", 3, 3, widths={"key": widths, "value": widths}),
            LayerPlan(1, "patch", patch_rank=3, patch_mode="recompute", depth=1, widths={"patch": widths})]
    assert plan_problems(good) == []
    assert _read_plan([layer.to_dict() for layer in good]) == good
    assert good[0].to_dict()["codes"]["key"] == {"gain": True, "bits": [[3, 1], [2, 2]]}
    assert plan_bytes_per_token(good, 4) == 3 * (1 + 1) + 2  # three vectors of 7 bits and a gain byte; one RMS
    assert plan_bytes_per_token(good, 32) == 9 * 4 + 4  # float codes at 32 bits in either format
    increasing = [LayerPlan(0, "reuse", 3, 3, widths={"key": CodeWidths((2, 3, 3)), "value": widths})]
    assert any("must not increase" in problem for problem in plan_problems(increasing))
    wrong_rank = [LayerPlan(0, "reuse", 4, 3, widths={"key": widths, "value": widths})]
    assert any("key rank 4" in problem for problem in plan_problems(wrong_rank))
    mixed = [good[0], LayerPlan(1, "reuse", 2, 2)]
    assert any("one format" in problem for problem in plan_problems(mixed))
    with pytest.raises(ValueError):
        _read_plan([{"index": 0, "kind": "reuse", "key_rank": 1, "value_rank": 1,
                     "codes": {"key": {"gain": False, "bits": [[9, 1]]}, "value": {"gain": False, "bits": [[1, 1]]}}}])
    with pytest.raises(ValueError, match="at most"):  # a manifest may not ask for a huge widths table
        _read_plan([{"index": 0, "kind": "reuse", "key_rank": 1, "value_rank": 1,
                     "codes": {"key": {"gain": False, "bits": [[1, 2**40]]}, "value": {"gain": False, "bits": [[1, 1]]}}}])
    wide = {"gain": False, "bits": [[1, 60_000]]}  # not per code, nor over the whole plan
    with pytest.raises(ValueError, match="at most"):
        _read_plan([{"index": index, "kind": "reuse", "key_rank": 60_000, "value_rank": 60_000,
                     "codes": {"key": wide, "value": wide}} for index in range(10)])


def _repack(payload: bytes, edit) -> bytes:
    raw, sections = unpack_payload(payload)
    raw = copy.deepcopy(raw)
    sections = dict(sections)
    edit(raw, sections)
    raw.pop("sections", None)
    return pack_payload(raw, sections)


def test_payloads_whose_widths_or_sections_disagree_are_refused(knowledge_bases, producer, consumer, stream):
    kb = knowledge_bases["recompute", "whitened+gain"]
    prompt = stream[700:761][None]
    payload = encode(producer, prompt[:, :-1], kb)
    SCDTransferCache.from_payload(payload, consumer, kb)  # accepted as sent

    def other_widths(raw, sections):  # a consistent table for widths the knowledge base does not hold
        entry = raw["layers"][0]["codes"]["key"]
        entry["bits"] = [[1, raw["layers"][0]["key_rank"]]]
        key = "layers.0.key_codes"
        sections[key] = sections[key][..., :(raw["layers"][0]["key_rank"] + 7) // 8].contiguous()

    def no_gain(raw, sections):
        raw["layers"][0]["codes"]["key"]["gain"] = False
        del sections["layers.0.key_gains"]

    def short_codes(raw, sections):  # the widths say more bytes than the section holds
        sections["layers.0.key_codes"] = sections["layers.0.key_codes"][..., :-1].contiguous()

    def flat_claim(raw, sections):
        raw["code_format"] = "flat"

    for edit in (other_widths, no_gain, short_codes, flat_claim):
        with pytest.raises(PayloadError):
            SCDTransferCache.from_payload(_repack(payload, edit), consumer, kb)
    flat_payload = encode(producer, prompt[:, :-1], knowledge_bases["recompute", "flat"])
    with pytest.raises((PayloadError, PairMismatchError)):  # another knowledge base's flat codes
        SCDTransferCache.from_payload(flat_payload, consumer, kb)
    with pytest.raises(KnowledgeBaseError, match="whitened widths"):  # the widths were allocated at 4-bit bytes
        encode(producer, prompt[:, :-1], kb, code_bits=8)


@torch.inference_mode()
def test_whitened_codes_beat_flat_codes_at_equal_bytes(producer, consumer, stream):
    """On the mismatched pair, plans cut by the fit's rank knob and re-coded whitened at the same bytes land closer
    to the oracle (KL on held-out continuations) than the flat codes do, at 4 and 8 bits."""
    full = full_rank_knowledge_base(producer, consumer, stream, window_tokens=256, windows=6, code_bits=4)
    windows = [stream[4000 + 200 * i:4000 + 200 * i + 160][None] for i in range(3)]
    for bits in (4, 8):
        for ranks in ((3, 3), (8, 6)):
            flat_plan = [LayerPlan(index, "reuse", *ranks) for index in range(LAYERS)]
            whitened = whiten_plan(flat_plan, full, bits, True)
            assert abs(plan_bytes_per_token(whitened, bits) - plan_bytes_per_token(flat_plan, bits)) <= 2 * LAYERS
            kl = {}
            for name, plan in (("flat", flat_plan), ("whitened", whitened)):
                total = 0.0
                for window in windows:
                    prompt, following = window[:, :128], window[:, 128:]
                    reference = _oracle(consumer, prompt, following)
                    full.plan = plan
                    _, sections = _sections(producer, full, prompt[:, :-1], bits)
                    cache = DynamicCache(config=consumer.config)
                    rebuild_into(cache, consumer, full, plan, sections, bits)
                    total += float(kl_divergence(reference, continuation_logprobs(consumer, cache, prompt,
                                                                                 following)).mean())
                kl[name] = total / len(windows)
            print(bits, ranks, kl)
            assert kl["whitened"] < kl["flat"], (bits, ranks, kl)


def _sections(producer, kb, ids, bits):
    from hf_kvcodecs.scd.coding import encode_layer
    from hf_kvcodecs.scd.encode import exact_columns
    from hf_kvcodecs.scd.model_access import prefill_with_taps

    mask = torch.ones_like(ids)
    start = exact_columns(mask, kb.exact_tokens)
    sections = {"input.attention_mask": mask.to(torch.uint8), "input.exact_token_ids": ids[:, :start]}
    captures = []
    prefill_with_taps(producer, ids, None, captures.append, all_residuals=True)
    for layer, capture in zip(kb.plan, captures):
        sections.update(encode_layer(capture, layer, kb, start, bits))
    return start, sections
