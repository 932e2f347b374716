"""`bench memory`'s report: each cache's total with its per-model tables, beside a bf16 DynamicCache's bytes."""

import inspect

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from hf_kvcodecs.bench.kv import measure_memory, memory_markdown
from hf_kvcodecs.bench.memory import cache_bytes, dynamic_cache_bytes
from hf_kvcodecs.cli import build_parser

from .conftest import tiny_llama_config

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_the_bf16_dynamic_cache_bytes_are_what_a_bf16_dynamic_cache_holds():
    config = tiny_llama_config()
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    cache = DynamicCache(config=config)
    with torch.inference_mode():
        model(torch.randint(3, 128, (1, 37)), cache=cache)
    assert cache_bytes(cache) == dynamic_cache_bytes(config, 37) == 37 * 2 * 2 * 2 * 16 * 2


def test_the_report_gives_each_caches_total_beside_a_bf16_dynamic_caches():
    def row(method, bits, shared, totals):
        return {"method": method, "shared_mib": shared, "bits_after_prefill@1024": bits,
                "bits_after_decode@1024": bits, "total_mib@1088": totals[0], "key_error@1024": 0.0,
                "value_error@1024": 0.0, "bits_after_prefill@4096": bits, "bits_after_decode@4096": bits,
                "total_mib@4160": totals[1], "key_error@4096": 0.0, "value_error@4096": 0.0}

    results = {"model": "tiny", "text": "text", "decode_steps": 64,
               "rows": [row("fp32 DynamicCache", 32.0, 0.0, (47.8, 182.8)), row("GSRQ 2-bit", 2.5, 73.5, (78.0, 87.5))],
               "bf16_dynamic_cache_mib": {"1088": 23.9, "4160": 91.4}}
    report = memory_markdown(results)
    assert "| method | total MiB @1088 | total MiB @4160 | ratio to bf16 DynamicCache @4160 |" in report
    assert "| bf16 DynamicCache (computed) | 23.9 | 91.4 | 1.00x |" in report
    assert "| GSRQ 2-bit | 78.0 | 87.5 | 0.96x |" in report
    assert "| fp32 DynamicCache | 47.8 | 182.8 | 2.00x |" in report


def test_bench_memory_measures_every_learner_unless_told_otherwise():
    args = build_parser().parse_args(["bench", "memory"])
    assert tuple(args.learners) == inspect.signature(measure_memory).parameters["learners"].default
    assert build_parser().parse_args(["bench", "memory", "--learners", "l2"]).learners == ["l2"]


def test_bench_memory_calibrates_the_gsrq_rows_with_the_layout_and_text_it_is_given(monkeypatch):
    from types import SimpleNamespace

    from hf_kvcodecs.bench import kv

    seen = {}

    class Stop(Exception):
        pass

    def fake_gsrq_methods(loaded, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(kv, "gsrq_methods", fake_gsrq_methods)
    loaded = SimpleNamespace(model=LlamaForCausalLM(tiny_llama_config()).eval(),
                             tokenizer=lambda text, **_: {"input_ids": [5] * 64})
    with pytest.raises(Stop):
        measure_memory(loaded, calibration_text="mixed", key_layout="conditional_heads", group_dim=8, learners=("l2",))
    assert seen["text"] == "mixed" and seen["layout"] == kv.codec_layout("conditional_heads", None, 8)
    assert seen["layout"][1] == {"key_layout": "conditional_heads"}
    args = build_parser().parse_args(["bench", "memory", "--key-layout", "conditional_heads", "--calibration-text",
                                      "mixed"])
    assert (args.key_layout, args.calibration_text, args.value_layout) == ("conditional_heads", ["mixed"], None)
