"""`bench scd` on tiny random models: every method builds a cache the consumer decodes from, the oracle scores zero
against itself, the trivial pair's SCD matches the oracle, and the report, TTFT sweeps and plot are produced."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from hf_kvcodecs.bench.scd import (
    SCDBenchSettings,
    kivi_cache,
    producer_cache,
    run_scd_bench,
    scd_bytes_plot,
    scd_markdown,
    scd_plot,
    token_f1,
)
from hf_kvcodecs.gsrq import GSRQCodebooks
from hf_kvcodecs.scd import full_rank_knowledge_base

from .conftest import TINY_BITS, _tiny_codebooks, tiny_llama_config


def test_kivi_quantization_error_shrinks_with_bits(tiny_model, tiny_token_stream):
    source = producer_cache(tiny_model, tiny_token_stream[:100][None])
    errors = [sum(float((ours.keys - layer.keys).abs().mean() + (ours.values - layer.values).abs().mean())
                  for ours, layer in zip(kivi_cache(source, bits, 32).layers, source.layers)) for bits in (2, 4, 8)]
    assert errors[0] > errors[1] > errors[2] > 0


def test_token_f1():
    assert token_f1("the pass key is 12345", "12345") == pytest.approx(2 * 0.2 * 1 / 1.2)
    assert token_f1("12345.", "12345") == 1.0 and token_f1("", "1") == 0.0


class StubChatTokenizer:
    """Enough of a chat tokenizer for the instruction prompts on a tiny model: the prompt's words become token ids."""

    chat_template = "stub"
    pad_token_id = 0

    def apply_chat_template(self, messages, **options):
        words = messages[0]["content"].split()[:60]
        return {"input_ids": torch.tensor([[3 + sum(map(ord, word)) % 120 for word in words]])}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(token)) for token in ids)


def test_instruction_prompts_are_chat_templated_licence_paragraphs():
    from hf_kvcodecs.bench.instructions import INSTRUCTIONS, instruction_prompts, licence_paragraphs

    paragraphs = licence_paragraphs()
    assert len(paragraphs) > 20 and all(60 <= len(text.split()) <= 220 for _, text in paragraphs)
    prompts = instruction_prompts(StubChatTokenizer(), 5, seed=1)
    assert len(prompts) == 5 and all(ids.ndim == 1 and ids.numel() > 10 for ids, _ in prompts)
    assert [description.split(": ", 1)[1] for _, description in prompts[:4]] == list(INSTRUCTIONS)
    assert instruction_prompts(StubChatTokenizer(), 5, seed=1)[0][1] == prompts[0][1]  # stable for a seed
    plain = StubChatTokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        instruction_prompts(plain, 1)


def test_bench_runs_end_to_end_on_a_tiny_lora_pair(tmp_path):
    torch.manual_seed(0)
    producer = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4)).eval()
    lora = LoraConfig(r=4, target_modules=["k_proj", "v_proj", "down_proj"], init_lora_weights=False)
    consumer = get_peft_model(copy.deepcopy(producer), lora).eval()
    stream = torch.randint(3, 128, (5000,), generator=torch.Generator().manual_seed(2))
    kb = full_rank_knowledge_base(producer, consumer, stream, window_tokens=128, windows=6, patch_layers=(2,),
                                  code_bits=8)
    kb.save(tmp_path / "kb")
    kvtc = full_rank_knowledge_base(producer, producer, stream, window_tokens=128, windows=6, code_bits=8)
    kvtc.save(tmp_path / "kvtc")
    sixteen_bit = full_rank_knowledge_base(producer, consumer, stream, window_tokens=128, windows=6, code_bits=16)
    sixteen_bit.save(tmp_path / "kb16")
    projected = full_rank_knowledge_base(producer, consumer, stream, window_tokens=128, windows=6, patch_layers=(2,),
                                         patch_mode="project", code_bits=8)
    projected.save(tmp_path / "kb-project")
    codebooks = GSRQCodebooks.load(_tiny_codebooks(producer, stream, tmp_path / "codebooks"))
    settings = SCDBenchSettings(windows=3, context_tokens=96, continuation_tokens=16, cost_contexts=(64, 128),
                                cost_repeats=1, passkey_trials=0, needle_trials=0, fact_trials=0, instruction_trials=2,
                                instruction_tokens=6, droidspeak_layers=(2,), gsrq_bits=(TINY_BITS,))
    results = run_scd_bench(SimpleNamespace(model=producer, description="tiny"),
                            SimpleNamespace(model=consumer, description="tiny+lora", tokenizer=StubChatTokenizer()),
                            kb, kvtc, stream[3000:], "random tokens", settings, progress=False,
                            gsrq_codebooks=codebooks, extra_kbs={"scd-16bit": sixteen_bit, "scd-project": projected})
    quality = results["quality"]
    assert set(quality) == {"oracle", "raw-16", "kivi-8", "kivi-4", "scd", "kvtc-like", "droidspeak-2",
                            f"gsrq-{TINY_BITS:g}", "scd-16bit", "scd-project"}
    assert quality["scd-16bit"]["bytes_per_token"] > quality["scd"]["bytes_per_token"]
    assert "scd-16bit_rebuild_s" in results["cost"]["128"]
    assert 0 < quality[f"gsrq-{TINY_BITS:g}"]["bytes_per_token"] < results["raw_16bit_bytes_per_token"]
    assert quality["oracle"]["kl_mean"] == 0.0 and quality["oracle"]["delta_ppl_pct"] == 0.0
    assert quality["raw-16"]["kl_mean"] > 0  # the adapter changed k/v projections: producer KV do not fit
    assert quality["kvtc-like"]["bytes_per_token"] <= quality["scd"]["bytes_per_token"] * 1.05
    assert results["raw_16bit_bytes_per_token"] == 2 * 4 * 32 * 2
    sweep = results["ttft"]["cpu_measured__codes_ready"]
    slow, fast = sweep["raw-16"]["128"]["1"], sweep["raw-16"]["128"]["400"]
    assert slow > fast and sweep["oracle"]["128"]["1"] == sweep["oracle"]["128"]["400"]
    assert results["knowledge_base"]["recompute_blocks"] == [[2, 1]]
    assert results["other_knowledge_bases"]["scd-project"]["patch_mode"] == "project"
    assert results["other_knowledge_bases"]["scd-project"]["recompute_blocks"] == []
    versus = results["pairwise_vs_scd"]
    assert set(versus) == {"scd-16bit", "scd-project", "droidspeak-2"} and versus["scd-16bit"]["bytes_ratio"] > 1
    assert versus["scd-16bit"]["nll"]["windows"] == 3 and versus["scd-project"]["kl"]["se"] is not None
    instructions = results["instructions"]
    assert instructions["oracle"]["f1"] == 1.0 and instructions["scd"]["trials"] == 2
    markdown = scd_markdown(results)
    assert "| scd |" in markdown and "recomputed layers 2..2" in markdown
    scd_plot(results, tmp_path / "scd.png")
    scd_bytes_plot(results, tmp_path / "scd_bytes.png")
    assert (tmp_path / "scd.png").stat().st_size > 1000 and (tmp_path / "scd_bytes.png").stat().st_size > 1000


def test_cost_times_every_operation_round_robin_so_load_drift_cannot_skew_their_ratios():
    from hf_kvcodecs.bench.scd import _interleaved_median_seconds

    calls = []
    medians = _interleaved_median_seconds({name: (lambda name=name: calls.append(name)) for name in "abc"}, 3)
    assert calls == list("abc") * 3
    assert set(medians) == set("abc") and all(value >= 0 for value in medians.values())
