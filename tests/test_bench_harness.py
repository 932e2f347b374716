"""The benchmark harness on a tiny random Llama: exact memory accounting, metrics checked against independent
computations, and identical / degraded / broken caches each reported as such."""

import json
import math

import pytest
import torch
from transformers import Cache, DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

from hf_kvcodecs.bench.harness import (
    BASELINE_IDS,
    FULL_PRECISION,
    TRANSFORMERS_QUANTIZED,
    TURBOQUANT,
    CacheMethod,
    _greedy_agreement,
    _quanto_token_multiple,
    evaluate_methods,
    shipped_baselines,
)
from hf_kvcodecs.bench.memory import cache_bytes, shared_storages, tensor_storages
from hf_kvcodecs.bench.report import write_reports
from hf_kvcodecs.evaluation.passkey import answer_has_key, passkey_cases

LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 2, 2, 16, 128
CONTEXT, CONTINUATION = 64, 8


class CharTokenizer:
    """One token per character (code point modulo the vocabulary): enough for the pass-key prompts."""

    pad_token_id = 0
    eos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(character) % VOCAB for character in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class NoisyKeysLayer(DynamicLayer):
    """Stores keys with strong deterministic noise: a cache that must show up as clearly worse."""

    def update(self, key_states, value_states, *args, **kwargs):
        generator = torch.Generator().manual_seed(key_states.shape[-2])
        noise = torch.randn(key_states.shape, generator=generator) * key_states.std()
        return super().update(key_states + noise, value_states, *args, **kwargs)


class SharedTableLayer(DynamicLayer):
    """A DynamicLayer that also references a table shared by every cache, like a codec's codebook."""

    table = torch.zeros(1000)

    def __init__(self):
        super().__init__()
        self.codebook = SharedTableLayer.table


def failing_cache(model):
    raise RuntimeError("this codec is broken")


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        # Larger than the default 0.02 so that attention, and therefore the cache, changes the predictions.
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def eval_ids():
    return torch.randint(3, VOCAB, (2000,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def results(model, eval_ids):
    pytest.importorskip("optimum.quanto")
    # one TurboQuant row stands for its family: the others differ only in bits (tests/test_turboquant.py)
    methods = shipped_baselines(model, only=[key for key in BASELINE_IDS if not key.startswith("turboquant")]
                                + ["turboquant-2"]) + [
        CacheMethod("identical DynamicCache", lambda m: DynamicCache(config=m.config), "test"),
        CacheMethod("noisy keys", lambda m: Cache(layer_class_to_replicate=NoisyKeysLayer), "test", nominal_bits=32.0),
        CacheMethod("broken", failing_cache, "test"),
    ]
    with torch.no_grad():
        return evaluate_methods(
            model,
            CharTokenizer(),
            methods,
            eval_token_ids=eval_ids,
            eval_description="random token ids",
            context_len=CONTEXT + 16,  # not a multiple of quanto's 32 on this model: must be trimmed to 64
            continuation_len=CONTINUATION,
            n_windows=3,
            greedy_prompts=2,
            greedy_tokens=6,
            passkey_trials=2,
            passkey_lengths=(64, 128),
            passkey_depths=(0.2, 0.8),
            speed_contexts=(64,),
            speed_tokens=4,
            speed_repeats=2,
            progress=False,
        )


def by_name(results, name):
    return next(entry for entry in results["methods"] if entry["name"] == name)


def test_cache_bytes_matches_dynamic_cache_analytic_size(model):
    cache = DynamicCache(config=model.config)
    tokens = 37
    model(torch.randint(0, VOCAB, (1, tokens)), cache=cache)
    assert cache_bytes(cache) == LAYERS * 2 * KV_HEADS * tokens * HEAD_DIM * 4  # fp32


def test_cache_bytes_counts_each_storage_once():
    base = torch.zeros(4, 100)
    holder = {"views": (base[0], base[1:]), "again": [base], "other": torch.zeros(10, dtype=torch.float16)}
    assert cache_bytes(holder) == 4 * 100 * 4 + 10 * 2
    assert len(tensor_storages(holder)) == 2


def test_cache_bytes_walks_quanto_tensor_subclasses(model):
    pytest.importorskip("optimum.quanto")
    two_bit_per_token = next(m for m in shipped_baselines(model) if m.name == "quanto 2-bit (default per-token keys)")
    cache = two_bit_per_token.make_cache(model)
    model(torch.randint(0, VOCAB, (1, CONTEXT)), cache=cache)
    elements = LAYERS * 2 * KV_HEADS * CONTEXT * HEAD_DIM
    # 2-bit codes packed four per byte, plus an fp32 scale and an fp32 shift per group of 64 values.
    assert cache_bytes(cache) == elements * 2 // 8 + (elements // 64) * 2 * 4


def test_shared_storages_finds_tables_common_to_caches(model):
    caches = [Cache(layer_class_to_replicate=SharedTableLayer) for _ in range(2)]
    for cache in caches:
        model(torch.randint(0, VOCAB, (1, 10)), cache=cache)
    shared = shared_storages(*caches)
    assert sum(shared.values()) == SharedTableLayer.table.nbytes
    assert cache_bytes(caches[0], excluding=shared) == LAYERS * 2 * KV_HEADS * 10 * HEAD_DIM * 4


def test_quanto_token_multiple_matches_what_quanto_accepts(model):
    pytest.importorskip("optimum.quanto")
    from transformers import QuantizedCache

    for axis in (-1, 0):
        multiple = _quanto_token_multiple(KV_HEADS, HEAD_DIM, axis, 64)
        cache = QuantizedCache("quanto", model.config, nbits=2, axis_key=axis, axis_value=axis)
        model(torch.randint(0, VOCAB, (1, multiple)), cache=cache)
        if multiple > 1:
            with pytest.raises(ValueError):
                cache = QuantizedCache("quanto", model.config, nbits=2, axis_key=axis, axis_value=axis)
                model(torch.randint(0, VOCAB, (1, multiple // 2)), cache=cache)


def test_shipped_baselines_cover_best_and_default_settings(model):
    methods = shipped_baselines(model)
    assert methods[0].family == FULL_PRECISION
    quanto = {m.name: m.extra for m in methods if m.extra.get("backend") == "quanto"}
    assert quanto["quanto 4-bit (per-channel keys)"]["axis_key"] == -1
    assert quanto["quanto 2-bit (per-channel keys)"]["axis_key"] == -1
    assert quanto["quanto 2-bit (default per-token keys)"]["axis_key"] == 0
    assert all(settings["axis_value"] == 0 for settings in quanto.values())
    hqq = [m for m in methods if m.extra.get("backend") == "hqq"]
    assert [m.extra["axis_key"] for m in hqq] == [1, 1]
    try:
        import hqq as _  # noqa: F401

        assert all(m.skip_reason is None for m in hqq)
    except ImportError:
        assert all("hqq" in m.skip_reason for m in hqq)
    with pytest.raises(ValueError):
        shipped_baselines(model, residual_length=100)  # quanto could not flush 100 tokens on this model


def test_lengths_are_trimmed_for_quanto_and_recorded(results):
    assert results["settings"]["context_len"] == CONTEXT
    assert results["settings"]["prefill_alignment"] == 32
    assert any("context_len 80 trimmed to 64" in note for note in results["adjustments"])


def test_perplexity_matches_an_independent_no_cache_forward(results, model, eval_ids):
    assert results["checks"]["fp_decode_vs_full_forward_max_abs_logprob_diff"] < 1e-4
    reference = by_name(results, results["reference"])
    span = CONTEXT + CONTINUATION + 1
    for start, reported in zip(results["settings"]["window_starts"], reference["perplexity"]["window_ppl"]):
        window = eval_ids[start : start + span]
        with torch.no_grad():
            logits = model(window[None, :-1], use_cache=False).logits[0, CONTEXT:]
        nll = torch.nn.functional.cross_entropy(logits.double(), window[CONTEXT + 1 :])
        assert reported == pytest.approx(math.exp(nll.item()), rel=1e-4)
    assert reference["perplexity"]["scored_tokens"] == 3 * CONTINUATION


def test_identical_cache_agrees_exactly_with_the_reference(results):
    reference = by_name(results, results["reference"])
    twin = by_name(results, "identical DynamicCache")
    assert results["methods"][0]["name"] == results["reference"] == "fp32 DynamicCache"
    assert twin["perplexity"]["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    assert twin["perplexity"]["top1_agreement"] == 1.0
    assert twin["perplexity"]["delta_ppl_pct"] == pytest.approx(0.0, abs=1e-6)
    assert twin["greedy"]["prefix_match_tokens"] == 6 and twin["greedy"]["position_agreement"] == 1.0
    assert [a["answer"] for a in twin["passkey"]["answers"]] == [a["answer"] for a in reference["passkey"]["answers"]]
    for entry in (reference, twin):
        assert entry["memory"]["after_prefill"]["bits_per_element"] == 32.0
        assert entry["memory"]["after_decode"]["bits_per_element"] == 32.0
        assert entry["memory"]["shared_bytes"] == 0


def test_degraded_caches_are_measured_as_worse(results):
    noisy = by_name(results, "noisy keys")
    collapsed = by_name(results, "quanto 2-bit (default per-token keys)")
    for entry in (noisy, collapsed):
        assert entry["perplexity"]["kl_mean"] > 1e-3
        assert entry["perplexity"]["top1_agreement"] < 1.0
        assert entry["perplexity"]["delta_ppl_pct_se"] > 0
        assert len(entry["perplexity"]["window_delta_ppl_pct"]) == 3


def test_quantized_cache_bits_per_element(results):
    collapsed = by_name(results, "quanto 2-bit (default per-token keys)")
    assert collapsed["family"] == TRANSFORMERS_QUANTIZED
    # After prefill: 2-bit codes + fp32 scale and shift per 64 values = 3 bits. After the continuation, the 8 decoded
    # tokens sit in quanto's fp32 residual window (no flush before 128 tokens).
    assert collapsed["memory"]["after_prefill"]["bits_per_element"] == pytest.approx(3.0)
    expected = (3.0 * CONTEXT + 32.0 * CONTINUATION) / (CONTEXT + CONTINUATION)
    assert collapsed["memory"]["after_decode"]["bits_per_element"] == pytest.approx(expected)


def test_turboquant_bits_per_element_count_codes_norms_and_window(results):
    from hf_kvcodecs.codecs.turboquant import held_bits_per_element, rotation_bytes

    turboquant = by_name(results, BASELINE_IDS["turboquant-2"])
    assert turboquant["family"] == TURBOQUANT and turboquant["extra"]["calibration"] == "none"
    window = turboquant["extra"]["residual_length"]
    coded = held_bits_per_element(2, HEAD_DIM)  # 2-bit codes of 16 coordinates + a 16-bit norm: 3 bits per element
    assert coded == 3.0
    for point, tokens in (("after_prefill", CONTEXT), ("after_decode", CONTEXT + CONTINUATION)):
        expected = (coded * (tokens - window) + 32.0 * window) / tokens  # the window is fp32, like the model
        assert turboquant["memory"][point]["bits_per_element"] == pytest.approx(expected)
    # the rotations are one table per model, shared by every cache of the method: reported apart
    assert turboquant["memory"]["shared_bytes"] == rotation_bytes(LAYERS, KV_HEADS, HEAD_DIM)
    assert 0 < turboquant["perplexity"]["kl_mean"] < by_name(results, "quanto 2-bit (per-channel keys)")["perplexity"]["kl_mean"]


def test_skipped_and_failed_methods_are_reported_not_run(results):
    broken = by_name(results, "broken")
    assert "this codec is broken" in broken["error"]
    assert "perplexity" not in broken and "speed" not in broken
    for entry in results["methods"]:
        if "skipped" in entry:
            assert "perplexity" not in entry


def test_speed_is_relative_to_the_reference_from_the_same_run(results):
    reference_speed = by_name(results, results["reference"])["speed"]["64"]
    assert reference_speed["ratio_to_reference"] == 1.0
    assert len(reference_speed["tokens_per_s_runs"]) == 2
    twin_speed = by_name(results, "identical DynamicCache")["speed"]["64"]
    assert twin_speed["tokens_per_s"] > 0
    assert twin_speed["ratio_to_reference"] == pytest.approx(twin_speed["tokens_per_s"] / reference_speed["tokens_per_s"])


def test_greedy_agreement_counts_prefix_and_positions():
    agreement = _greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert agreement["per_prompt"] == [
        {"prefix_match": 2, "position_agreement": 0.75},
        {"prefix_match": 4, "position_agreement": 1.0},
    ]
    assert agreement["prefix_match_tokens"] == 3.0
    assert agreement["prefix_match_fraction"] == 0.75


def test_passkey_prompts_have_exact_length_and_needle_depth(eval_ids):
    tokenizer = CharTokenizer()
    cases = passkey_cases(tokenizer, eval_ids, [128], [0.0, 0.5], 3, torch.Generator().manual_seed(0))
    assert len(cases) == 6
    for case in cases:
        needle = torch.tensor(tokenizer(f"\nThe pass key is {case.key}. Remember it.\n")["input_ids"])
        assert len(case.prompt_ids) == 128 and len(case.key) == 5
        start = round(case.depth * (128 - len(needle)))
        assert torch.equal(case.prompt_ids[start : start + len(needle)], needle)


def test_answer_has_key_needs_the_exact_first_number():
    assert answer_has_key(" 12345. Remember", "12345")
    assert not answer_has_key(" 123456", "12345")
    assert not answer_has_key(" 54321 or 12345", "12345")
    assert not answer_has_key(" unknown", "12345")


def test_write_reports(results, tmp_path):
    paths = write_reports(results, tmp_path)
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(results))
    main_part = paths["markdown"].read_text().split("\n## ")[0]
    table = [line for line in main_part.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(results["methods"])
    assert any("failed: " in row and "broken" in row for row in table)
    reference_row = next(row for row in table if row.startswith("| fp32 DynamicCache"))
    assert "32.00" in reference_row and "(1.00×)" in reference_row
    assert paths["plot"].stat().st_size > 10_000


def test_seed_spread_summarises_methods_measured_with_several_calibration_seeds():
    from hf_kvcodecs.bench.report import _seed_spread

    def entry(seed, kl, ppl, correct, learner="gskm-principal", bits=2.0):
        return {"name": f"GSRQ seed {seed}", "family": "gsrq", "extra": {"seed": seed, "learner": learner, "bits": bits},
                "perplexity": {"kl_mean": kl, "delta_ppl_pct": ppl}, "passkey": {"correct": correct, "trials": 18}}

    lines = _seed_spread([entry(0, 0.10, 12.0, 5), entry(1, 0.08, 8.0, 9), entry(0, 0.4, 70.0, 0, bits=1.0),
                          {"name": "fp32", "family": "full precision", "extra": {}}])
    rows = [line for line in lines if line.startswith("| gsrq")]
    assert rows == ["| gsrq | gskm-principal | 2 | 0, 1 | 0.09 (0.08 – 0.1) | +10.0 (+8.0 – +12.0) | 5/18, 9/18 |"]
    assert _seed_spread([entry(0, 0.1, 1.0, 1)]) == []  # one seed: nothing to summarise
    # two configurations of one family calibrated with the same seed are not a spread over seeds
    assert _seed_spread([entry(0, 0.1, 1.0, 1), entry(0, 0.2, 2.0, 2)]) == []


def test_paired_comparison_against_shipped_4_bit_caches(results, tmp_path):
    from hf_kvcodecs.bench.report import paired_comparisons

    noisy, quanto = by_name(results, "noisy keys"), by_name(results, "quanto 4-bit (per-channel keys)")
    assert len(noisy["perplexity"]["window_kl"]) == 3 and noisy["perplexity"]["window_kl"][0] > 0
    pairs = {(item["method"], item["baseline"]): item for item in paired_comparisons(results["methods"])}
    item = pairs[("noisy keys", quanto["name"])]
    differences = torch.tensor(noisy["perplexity"]["window_nll"], dtype=torch.float64) - torch.tensor(
        quanto["perplexity"]["window_nll"], dtype=torch.float64)
    assert item["windows"] == 3
    assert item["ppl_ratio_pct"] == pytest.approx(100 * (differences.mean().exp().item() - 1))
    se = differences.std().item() / 3 ** 0.5
    assert item["ppl_ratio_pct_se"] == pytest.approx(100 * differences.mean().exp().item() * se)
    low, high = item["ppl_ratio_pct_interval"]
    assert low < item["ppl_ratio_pct"] < high
    assert item["windows_method_better"] == int((differences < 0).sum())
    kl = torch.tensor(noisy["perplexity"]["window_kl"]) - torch.tensor(quanto["perplexity"]["window_kl"])
    assert item["kl_difference"] == pytest.approx(kl.mean().item())
    assert sum(item["passkey"].values()) == noisy["passkey"]["trials"]
    assert item["passkey"]["both"] + item["passkey"]["only_method"] == noisy["passkey"]["correct"]
    # only shipped 4-bit caches are baselines; shipped caches and the reference are never the compared methods
    assert {baseline for _, baseline in pairs} <= {quanto["name"], "hqq 4-bit (axis 1)"}
    assert not {method for method, _ in pairs} & {"fp32 DynamicCache", quanto["name"], "quanto 2-bit (per-channel keys)"}
    assert "broken" not in {method for method, _ in pairs}  # failed: nothing measured to pair
    section = write_reports(results, tmp_path)["markdown"].read_text().split("## Paired")[1]
    assert f"| noisy keys | {quanto['name']} | 3 |" in section
