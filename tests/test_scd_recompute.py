"""SCD's recompute Patch on tiny random Llamas: the consumer runs its own decoder layers from a predicted residual
stream, so an error that a mismatched producer accumulates with depth is cut off at the transition layer.

The gate: a consumer that differs from the producer only in layers >= 1 has the producer's exact residual stream
entering layer 1, so a full-rank recompute Patch at layer 1 running to the last layer must reproduce the oracle,
while Reuse of every layer and the projection-only Patch (an ablation) cannot."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvcodecs.evaluation import kl_divergence
from hf_kvcodecs.scd import (
    PayloadError,
    SCDFitSettings,
    SCDKnowledgeBase,
    SCDTransferCache,
    encode,
    fit_knowledge_base,
    full_rank_knowledge_base,
    truncate_payload,
)
from hf_kvcodecs.scd.fit import continuation_logprobs, patch_trials
from hf_kvcodecs.scd.knowledge_base import LayerPlan, _read_plan, plan_bytes_per_token, plan_problems
from hf_kvcodecs.scd.payload import pack_payload, unpack_payload

LAYERS = 4


@pytest.fixture
def saved(tmp_path):
    """Save a knowledge base (payloads name the save) and return it."""
    count = iter(range(100))

    def save(kb: SCDKnowledgeBase) -> SCDKnowledgeBase:
        kb.save(tmp_path / str(next(count)))
        return kb
    return save


def _kl_to_oracle(producer, consumer, kb, stream, start=4000, context=96, continuation=24) -> float:
    window = stream[start:start + context + continuation][None]
    prompt, following = window[:, :context], window[:, context:]
    oracle = DynamicCache(config=consumer.config)
    with torch.no_grad():
        consumer(input_ids=prompt[:, :-1], cache=oracle, use_cache=True)
    reference = continuation_logprobs(consumer, oracle, prompt, following)
    payload = encode(producer, prompt[:, :-1], kb)
    cache = SCDTransferCache.from_payload(payload, consumer, kb, input_ids=prompt)
    return float(kl_divergence(reference, continuation_logprobs(consumer, cache, prompt, following)).mean())


def test_trivial_pair_recompute_block_reproduces_the_oracle_cache(producer, stream, saved):
    kb = saved(full_rank_knowledge_base(producer, producer, stream, window_tokens=128, windows=10, patch_layers=(1,),
                                        patch_depths=(2,), code_bits=32))
    assert [layer.kind for layer in kb.plan] == ["reuse", "patch", "recomputed", "reuse"]
    prompt = stream[100:181][None]
    cache = SCDTransferCache.from_payload(encode(producer, prompt[:, :-1], kb), producer, kb, input_ids=prompt)
    assert cache.transfer_report["recompute_blocks"] == [[1, 2]] and cache.transfer_report["recompute_seconds"] > 0
    oracle = DynamicCache(config=producer.config)
    with torch.no_grad():
        producer(input_ids=prompt[:, :-1], cache=oracle, use_cache=True)
    for index in range(LAYERS):
        torch.testing.assert_close(cache.layers[index].keys, oracle.layers[index].keys, atol=2e-4, rtol=1e-3)
        torch.testing.assert_close(cache.layers[index].values, oracle.layers[index].values, atol=2e-4, rtol=1e-3)


def test_recompute_patch_cuts_off_the_error_that_reuse_and_projection_keep(producer, deep_mismatch_consumer, stream,
                                                                           saved):
    common = dict(window_tokens=128, windows=12, code_bits=32)
    reuse_only = full_rank_knowledge_base(producer, deep_mismatch_consumer, stream, **common)
    projected = full_rank_knowledge_base(producer, deep_mismatch_consumer, stream, patch_layers=(1, 2, 3),
                                         patch_mode="project", **common)
    recomputed = full_rank_knowledge_base(producer, deep_mismatch_consumer, stream, patch_layers=(1,),
                                          patch_depths=(LAYERS - 1,), **common)
    kl = {name: _kl_to_oracle(producer, deep_mismatch_consumer, saved(kb), stream)
          for name, kb in (("reuse", reuse_only), ("project", projected), ("recompute", recomputed))}
    assert kl["recompute"] < 1e-4, kl  # the residual entering layer 1 is shared: recomputing from it is exact
    assert kl["reuse"] > 100 * max(kl["recompute"], 1e-6) and kl["project"] > 100 * max(kl["recompute"], 1e-6), kl
    # and it is cheaper on the wire than sending the three layers' KV
    assert recomputed.bytes_per_token() < reuse_only.bytes_per_token()


def test_fit_chooses_a_recompute_block_on_a_deep_mismatch(producer, deep_mismatch_consumer, stream):
    settings = SCDFitSettings(windows=6, window_tokens=256, holdout_prompts=2, holdout_context=128,
                              holdout_continuation=32, budget_kl=0.02, max_patch_layers=1, bisection_steps=3,
                              code_bits=(8,), recompute_depths=(1, 8), max_recompute_layers=LAYERS)
    kb = fit_knowledge_base(producer, deep_mismatch_consumer, stream, settings=settings, progress=False)
    search = kb.fitting["search"]
    assert search["patch_mode"] == "recompute" and search["patch_rounds"]
    assert kb.residual_layers, search["patch_rounds"]
    chosen = search["patch_rounds"][0]
    chosen_kl = next(trial["kl"] for trial in chosen["trials"] if [trial["layer"], trial["depth"]] == chosen["chosen"])
    assert chosen_kl < 0.95 * search["reuse_only_full_rank_kl"] and kb.fitting["recomputed_layers"] >= 1
    assert kb.fitting["budget_met"] and kb.fitting["kl"] <= 0.02
    assert search["recompute_seconds_per_layer"]["seconds"] > 0


def test_projection_only_patch_stays_available_as_the_ablation(producer, stream, saved):
    kb = saved(full_rank_knowledge_base(producer, producer, stream, window_tokens=128, windows=10, patch_layers=(2,),
                                        patch_mode="project", code_bits=32))
    assert kb.input_layers == [2] and not kb.residual_layers
    prompt = stream[200:260][None]
    cache = SCDTransferCache.from_payload(encode(producer, prompt[:, :-1], kb), producer, kb, input_ids=prompt)
    assert cache.transfer_report["recompute_blocks"] == [] and cache.get_seq_length() == 59


def test_recompute_knowledge_base_round_trips_and_truncates(producer, deep_mismatch_consumer, stream, tmp_path):
    kb = full_rank_knowledge_base(producer, deep_mismatch_consumer, stream, window_tokens=128, windows=10,
                                  patch_layers=(1,), patch_depths=(2,), code_bits=8)
    kb.save(tmp_path)
    loaded = SCDKnowledgeBase.load(tmp_path)
    assert loaded.plan == kb.plan and loaded.residual_layers == [1]
    prompt = stream[300:380][None]
    payload = encode(producer, prompt[:, :-1], loaded)
    manifest, sections = unpack_payload(payload)
    assert sections["layers.1.patch_rms"].dtype == torch.float16 and "layers.2.key_codes" not in sections
    # bytes per coded token: codes, scales and the RMS (the exact tokens and the header aside)
    assert len(payload) > (prompt.shape[1] - 1 - kb.exact_tokens) * kb.bytes_per_token()
    half = truncate_payload(payload, 0.5)
    cache = SCDTransferCache.from_payload(half, deep_mismatch_consumer, loaded, input_ids=prompt)
    assert cache.get_seq_length() == prompt.shape[1] - 1 and len(half) < len(payload)
    # a payload whose RMS section is missing is refused before anything is built
    sections.pop("layers.1.patch_rms")
    manifest.pop("sections")
    with pytest.raises(PayloadError, match="missing"):
        SCDTransferCache.from_payload(pack_payload(manifest, sections), deep_mismatch_consumer, loaded)
    # a payload that claims another Patch mode or depth than the knowledge base is refused
    manifest["layers"][1]["depth"], manifest["layers"][2] = 1, {"index": 2, "kind": "reuse", "key_rank": 1,
                                                                "value_rank": 1, "patch_rank": 0}
    sections = unpack_payload(payload)[1]
    with pytest.raises(PayloadError, match="depth"):
        SCDTransferCache.from_payload(pack_payload(manifest, sections), deep_mismatch_consumer, loaded)


def test_plan_structure_is_validated():
    good = [LayerPlan(0, "reuse", 2, 2), LayerPlan(1, "patch", patch_rank=3, patch_mode="recompute", depth=2),
            LayerPlan(2, "recomputed"), LayerPlan(3, "reuse", 1, 1)]
    assert plan_problems(good) == []
    assert plan_bytes_per_token(good, 8) == (2 + 2 + 3 + 1 + 1) + 2 * 5 + 2  # codes, five scales, one RMS
    assert _read_plan([layer.to_dict() for layer in good]) == good
    orphan = [LayerPlan(0, "reuse", 1, 1), LayerPlan(1, "recomputed")]
    assert any("no recompute Patch block" in problem for problem in plan_problems(orphan))
    past_end = [LayerPlan(0, "patch", patch_rank=1, patch_mode="recompute", depth=3), LayerPlan(1, "recomputed")]
    assert any("depth 3" in problem for problem in plan_problems(past_end))
    uncovered = [LayerPlan(0, "patch", patch_rank=1, patch_mode="recompute", depth=2), LayerPlan(1, "reuse", 1, 1)]
    assert any("inside the recompute block" in problem for problem in plan_problems(uncovered))
    # a plan written before recompute Patch existed reads as projection-only
    legacy = _read_plan([{"index": 0, "kind": "patch", "patch_rank": 4}])
    assert legacy[0].patch_mode == "project" and legacy[0].depth == 1
    with pytest.raises(ValueError, match="patch_mode"):
        _read_plan([{"index": 0, "kind": "patch", "patch_rank": 4, "patch_mode": "guess", "depth": 1}])


def test_patch_trials_respect_blocks_and_the_compute_cap(producer, stream):
    settings = SCDFitSettings(recompute_depths=(1, 4, 32), max_recompute_layers=6, patch_candidates=2)
    floors = [0.0] * 10
    measured = []

    def evaluate(candidate):  # a stand-in KL: blocks starting at layer 3 help most, deeper blocks help more
        measured.append(candidate)
        return abs(candidate[0] - 3) + 1 / candidate[1]

    trials = patch_trials({6: 2}, floors, settings, evaluate)
    assert set(trials) == set(measured) and len(measured) == len(set(measured))
    assert all(not 6 <= layer < 8 for layer, _ in trials)
    assert all(depth <= 4 for _, depth in trials)  # 6 - 2 layers of compute left
    assert all(layer + depth <= 6 for layer, depth in trials if layer < 6)  # a block stops at the next one
    first_stage = {layer for layer, depth in trials if depth == min(4, 6 - layer if layer < 6 else 10 - layer)}
    assert first_stage == {0, 1, 2, 3, 4, 5, 8, 9}  # every free layer is measured as a start
    assert {(3, 1), (3, 3), (2, 1), (2, 4)} <= set(trials)  # the two best starts at every shallower depth
    assert patch_trials({0: 6}, floors, settings, evaluate) == {}
    project = SCDFitSettings(patch_mode="project", patch_candidates=2)
    assert set(patch_trials({}, [0.1, 0.5, 0.2], project, evaluate)) == {(1, 1), (2, 1)}
    with pytest.raises(ValueError, match="patch_depths"):
        SCDFitSettings(patch_layers=(1,), patch_depths=(1, 2)).check()
    overlapping = SCDFitSettings(patch_layers=(1, 2), patch_depths=(3, 1))
    with pytest.raises(ValueError, match="do not make a valid plan"):  # refused before any statistics
        fit_knowledge_base(producer, producer, stream, settings=overlapping, progress=False)


def test_recompute_block_of_an_unpadded_prompt_runs_as_a_prefill_with_no_mask_tensor(producer, stream, saved):
    """The block runs over the exact tokens and the coded ones from an empty cache, so a prompt without padding needs
    no explicit mask and attention takes its causal path (a mask tensor over a cached prefix is much slower)."""
    producer.set_attn_implementation("sdpa")
    kb = saved(full_rank_knowledge_base(producer, producer, stream, window_tokens=128, windows=10, patch_layers=(1,),
                                        patch_depths=(2,), code_bits=32))
    assert kb.exact_tokens > 0
    masks = []
    hook = producer.model.layers[1].register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True)
    prompt = stream[200:281][None]
    try:
        payload = encode(producer, prompt[:, :-1], kb)
        masks.clear()
        cache = SCDTransferCache.from_payload(payload, producer, kb, input_ids=prompt)
    finally:
        hook.remove()
    # the exact tokens' own prefill, then the block over all 80 tokens
    assert len(masks) == 2 and masks[1] is None, masks
    assert cache.get_seq_length() == 80
