"""The decode benchmark's measuring tools and the GPU benchmark script (smoke run on CPU, Triton interpreter)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from hf_kvcodecs.bench.decode import _peak_transient_bytes

ROOT = Path(__file__).resolve().parents[1]


def test_transient_memory_sees_a_temporary_allocation():
    def allocate():
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched, then freed
        return float(block[-1])

    assert _peak_transient_bytes(allocate) >= 56 * 2**20
    assert _peak_transient_bytes(lambda: sum(range(1000))) < 8 * 2**20


def test_gpu_benchmark_script_runs_its_parity_check_and_writes_results(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_decode", ROOT / "benchmarks" / "gpu_decode.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "gpu.json"
    assert script.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert {row["method"] for row in results["rows"]} == {"sdpa-fp16", "gsrq-triton", "gsrq-triton-conditional",
                                                          "gsrq-triton-conditional-values-given-keys"}
    gsrq = next(row for row in results["rows"] if row["method"] == "gsrq-triton")
    sdpa = next(row for row in results["rows"] if row["method"] == "sdpa-fp16")
    assert gsrq["bytes"] < sdpa["bytes"] / 3  # codes + scales + positions vs fp16 keys and values
    assert (tmp_path / "gpu.md").read_text().startswith("GPU decode attention")


def test_decode_table_reports_prefill_time_next_to_decode_speed():
    from hf_kvcodecs.bench.decode import REFERENCE, decode_markdown

    def row(name, tokens_per_s, prefill_s):
        speed = {"1024": {"tokens_per_s": tokens_per_s, "ratio_to_fp32": tokens_per_s / 20.0, "prefill_s": prefill_s,
                          "prefill_ratio_to_fp32": prefill_s / 2.0}}
        return {"method": name, "speed": speed,
                "memory": {"bits_per_element": 2.5, "held_mib": 1.0, "transient_mib": 2.0, "shared_mib": 3.0},
                "quality": {"kl_mean": 0.05, "top1_agreement": 0.9, "delta_ppl_pct": 12.0, "delta_ppl_pct_se": 5.0}}

    results = {"contexts": [1024], "model": "m", "text": "t", "steps": 4, "repeats": 3, "threads": 2, "memory_steps": 2,
               "seconds": 1.0, "environment": {"date": "today", "versions": {"torch": "x", "transformers": "y"}},
               "rows": [row(REFERENCE, 20.0, 2.0), row("GSRQ", 16.0, 3.0)]}
    table = decode_markdown(results)
    assert "| GSRQ | 3.00 (1.50×) |" in table and "prefill s @1024 (×)" in table
    assert "16.0 (0.80×)" in table


@pytest.fixture
def stored_tiny_codebooks(monkeypatch, tiny_model, tiny_codebooks_dir):
    """``(loaded tiny model, settings of every calibration asked for)``: each calibration returns the tiny codebooks."""
    from hf_kvcodecs import GSRQCodebooks
    from hf_kvcodecs.bench import decode
    from hf_kvcodecs.models import LoadedModel

    calibrated, codebooks = [], GSRQCodebooks.load(tiny_codebooks_dir)

    def fake_calibration(loaded, **settings):
        calibrated.append(settings)
        return codebooks, tiny_codebooks_dir, True

    monkeypatch.setattr(decode, "ensure_codebooks", fake_calibration)
    return LoadedModel(tiny_model, None, "tiny", "tiny random model"), calibrated


def test_only_keeps_the_named_rows_and_calibrates_nothing_else(stored_tiny_codebooks):
    from hf_kvcodecs.bench import decode

    loaded, calibrated = stored_tiny_codebooks
    names = [m.name for m in decode.decode_methods(loaded, only=["values given the keys"], progress=False)]
    assert names == [decode.REFERENCE, "GSRQ 2-bit, keys pre-rope, code-reading, keys rebuilt from codes, keys "
                     "conditional on earlier heads, values given the keys"]
    assert [(c["key_layout"], c["value_layout"]) for c in calibrated] == [("conditional_heads", "given_keys")]
    calibrated.clear()
    anchored = [m.name for m in decode.decode_methods(loaded, only=["rebuilt from codes$"], progress=False)]
    assert anchored == [decode.REFERENCE, "GSRQ 2-bit, keys pre-rope, code-reading, keys rebuilt from codes"]
    assert len(calibrated) == 1 and "key_layout" not in calibrated[0]  # the default layout only
    calibrated.clear()
    everything = decode.decode_methods(loaded, progress=False)
    assert len(calibrated) == 1 + len(decode.LAYOUT_VARIANTS) + 1  # default, the variants, keys after RoPE
    assert len(everything) > len(names) and "bf16 DynamicCache" in [m.name for m in everything]
    by_name = {m.name: m for m in everything}
    if decode.QUANTO_4BIT in by_name:  # quanto installed: it also runs on the bf16 copy, for same-model ratios
        assert by_name[decode.QUANTO_4BIT + decode.BF16_SUFFIX].precision == "bf16"
    assert by_name["GSRQ 2-bit, keys pre-rope, code-reading, keys rebuilt from codes" + decode.BF16_SUFFIX].precision == "bf16"


def test_group_dims_add_a_labelled_set_of_rows_per_size_and_reject_sizes_the_model_cannot_use(
        stored_tiny_codebooks, tiny_model):
    from hf_kvcodecs.bench import decode

    loaded, calibrated = stored_tiny_codebooks
    default = "GSRQ 2-bit, keys pre-rope, code-reading, keys rebuilt from codes"
    methods = decode.decode_methods(loaded, only=["rebuilt from codes$", "rebuilt from codes, 16-dim groups$"],
                                    group_dims=(8, 16), progress=False)
    assert [m.name for m in methods] == [decode.REFERENCE, default, default + ", 16-dim groups"]
    assert [c.get("group_dim") for c in calibrated] == [None, 16]  # the default size names the default codebooks
    assert [m.extra["group_dim"] for m in methods[1:]] == [8, 16]
    calibrated.clear()
    only_16 = decode.decode_methods(loaded, only=["greedy encoder"], group_dims=(16,), progress=False)
    assert [m.name for m in only_16] == [decode.REFERENCE, default + ", greedy encoder, 16-dim groups"]
    head_dim = tiny_model.config.head_dim
    for sizes, message in (((8, 8), "given once"), ((head_dim + 1,), "divides the model's head_dim")):
        with pytest.raises(ValueError, match=message):
            decode.decode_methods(loaded, group_dims=sizes, progress=False)
    assert [c.get("group_dim") for c in calibrated] == [16]  # nothing calibrated before the bad sizes were refused


def test_same_model_table_compares_each_row_with_the_caches_that_ran_on_its_copy_of_the_model():
    from hf_kvcodecs.bench.decode import BF16_SUFFIX, QUANTO_4BIT, REFERENCE, decode_markdown, same_model_ratios

    def row(name, precision, tokens_per_s):
        return {"method": name, "precision": precision,
                "speed": {"4096": {"tokens_per_s": tokens_per_s, "ratio_to_fp32": tokens_per_s / 8.0}},
                "memory": {"bits_per_element": 2.5, "held_mib": 1.0, "transient_mib": 2.0, "shared_mib": 3.0},
                "quality": {"kl_mean": 0.05, "top1_agreement": 0.9, "delta_ppl_pct": 1.0, "delta_ppl_pct_se": 0.5}}

    rows = [row(REFERENCE, "fp32", 8.0), row("bf16 DynamicCache", "bf16", 6.0), row(QUANTO_4BIT, "fp32", 5.0),
            row("GSRQ", "fp32", 10.0), row("GSRQ" + BF16_SUFFIX, "bf16", 12.0)]
    results = {"contexts": [4096], "model": "m", "text": "t", "steps": 4, "repeats": 2, "threads": 2,
               "memory_steps": 2, "seconds": 1.0,
               "environment": {"date": "today", "versions": {"torch": "x", "transformers": "y"}}, "rows": rows}
    ratios = {r["method"]: r["ratios"] for r in same_model_ratios(results)}
    assert ratios["GSRQ"][("dynamic", 4096)] == 10.0 / 8.0 and ratios["GSRQ"][("quanto", 4096)] == 2.0
    assert ratios["GSRQ" + BF16_SUFFIX][("dynamic", 4096)] == 2.0  # against bf16 DynamicCache, not fp32's
    assert ratios["GSRQ" + BF16_SUFFIX][("quanto", 4096)] is None  # quanto did not run on the bf16 copy here
    table = decode_markdown(results)
    assert "| GSRQ, bf16 model | bf16 | 2.00× | – |" in table and "| GSRQ | fp32 | 1.25× | 2.00× |" in table


def test_decode_command_records_the_group_sizes_and_the_parser_refuses_a_non_positive_one(capsys):
    from hf_kvcodecs.cli import build_parser
    from hf_kvcodecs.cli.bench.decode import command_line

    parser = build_parser()
    args = parser.parse_args(["bench", "decode", "--group-dim", "8", "32", "--only", "rebuilt from codes$"])
    assert args.group_dim == [8, 32]
    assert command_line(args).endswith("--only 'rebuilt from codes$' --group-dim 8 32")
    assert "--group-dim" not in command_line(parser.parse_args(["bench", "decode"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "decode", "--group-dim", "0"])
    assert "expected a positive integer" in capsys.readouterr().err


def test_calibrate_group_dim_defaults_to_the_fit_default_and_refuses_a_non_positive_one(capsys):
    from hf_kvcodecs.cli import build_parser
    from hf_kvcodecs.gsrq.store import calibration_defaults

    parser = build_parser()
    assert parser.parse_args(["calibrate", "--out", "x"]).group_dim == calibration_defaults()["group_dim"]
    assert parser.parse_args(["calibrate", "--out", "x", "--group-dim", "32"]).group_dim == 32
    with pytest.raises(SystemExit):
        parser.parse_args(["calibrate", "--out", "x", "--group-dim", "-8"])
    assert "expected a positive integer" in capsys.readouterr().err
