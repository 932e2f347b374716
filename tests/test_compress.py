"""`hf-kvcodecs compress`: quantize → calibrate → evaluate → save with card, on a tiny model with a real tokenizer."""

import json
import shlex
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_kvcodecs.cli import build_parser, main
from hf_kvcodecs.gsrq.codebooks import METADATA_FILE, TENSORS_FILE
from hf_kvcodecs.quantization import KV_CODEBOOKS_FOLDER, PackedLinear
from hf_kvcodecs.quantization.compress import CompressSettings, compress
from hf_kvcodecs.quantization.hub import REPORT_FILE

from .conftest import tiny_llama_config

FAST_CALIBRATION = {"n_iter": 2, "fit_rows": 512, "sampled_tokens_per_window": 64}


def _settings(model_dir, **overrides):
    # 96 context + 16 decoded tokens > 4 sinks + 32 window + 32 flush: the GSRQ cache really codes tokens
    settings = dict(model=str(model_dir), weight_bits=4, group_size=16, kv="gsrq", kv_bits=2.0, calibration_windows=4,
                    calibration_window_tokens=128, calibration_holdout_windows=1, eval_windows=2,
                    eval_context_tokens=96, eval_decoded_tokens=16, calibration_fit=FAST_CALIBRATION)
    settings.update(overrides)
    return CompressSettings(**settings)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a real (tiny) BPE tokenizer trained on a licence text, saved like a Hub model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = tmp_path_factory.mktemp("tiny_llama_with_tokenizer")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=["<pad>", "<s>", "</s>", "<unk>"], show_progress=False)
    tokenizer.train_from_iterator([open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def compressed(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("compressed")
    return out, compress(_settings(tiny_model_dir), out, progress=False)


def test_compress_saves_a_complete_model_folder(compressed):
    out, report = compressed
    names = {path.relative_to(out).as_posix() for path in out.rglob("*") if path.is_file()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md", REPORT_FILE,
            f"{KV_CODEBOOKS_FOLDER}/{METADATA_FILE}", f"{KV_CODEBOOKS_FOLDER}/{TENSORS_FILE}"} <= names
    assert report == json.loads((out / REPORT_FILE).read_text())
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model.model.layers[1].mlp.down_proj, PackedLinear)
    out_ids = model.generate(torch.tensor([[1, 40, 41, 42]]), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert type(out_ids.cache).__name__ == "GSRQCache" and out_ids.cache.bits == 2.0


def test_report_holds_measured_paired_numbers(compressed):
    out, report = compressed
    baseline, weights, full = report["evaluation"]["rows"]
    assert baseline["is_reference"] and baseline["delta_ppl_pct"] == 0 and baseline["kl_mean"] == 0
    assert 1 < baseline["perplexity"] < 10_000 and baseline["scored_tokens"] == 2 * 16
    for row in (weights, full):
        assert row["kl_mean"] > 0 and 0 <= row["top1_agreement"] <= 1 and row["delta_ppl_pct_se"] is not None
    assert full["kl_mean"] != weights["kl_mean"]  # the GSRQ cache coded tokens: its row measures something else
    assert report["evaluation"]["held_out"] is True
    sizes = report["sizes"]
    assert weights["bytes"] == sizes["weights"] == (out / "model.safetensors").stat().st_size
    assert full["bytes"] == sizes["weights"] + sizes["kv_codebooks"]
    assert weights["bytes"] < baseline["bytes"]  # 4-bit layers (the tied embedding stays fp32)
    assert report["weights"]["converted_layers"] == 14 and report["weights"]["kept_float"] == ["lm_head"]
    calibration = report["kv_cache"]["calibration"]
    assert "pydoc_data" in calibration["text"] and calibration["tokens"] == 4 * 128
    assert report["quantization_config"]["kv_cache_config"] == {"bits": 2.0, "codebooks": KV_CODEBOOKS_FOLDER}


def test_model_card_shows_the_measured_table_and_the_command(compressed):
    out, report = compressed
    card = (out / "README.md").read_text()
    for row in report["evaluation"]["rows"]:
        assert f"| {row['name']} |" in card and f"{row['perplexity']:.3f}" in card
    weights = report["evaluation"]["rows"][1]
    assert f"{weights['delta_ppl_pct']:+.2f}% ± {weights['delta_ppl_pct_se']:.2f}" in card
    assert report["commands"][-2] in card and "--weight-bits 4 --group-size 16 --kv gsrq --kv-bits 2" in card
    assert "pydoc_data.topics" in card and "Debian licence texts" in card
    assert f"transformers {report['environment']['versions']['transformers']}" in card
    assert card.startswith("---\n") and "library_name: transformers" in card and "- hf_kvcodecs" in card


def test_recorded_command_reproduces_the_settings(compressed, tiny_model_dir):
    out, report = compressed
    command = next(c for c in report["commands"] if c.startswith("hf-kvcodecs compress"))
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert (args.model, args.weight_bits, args.group_size, args.kv, args.kv_bits) == (str(tiny_model_dir), 4, 16, "gsrq", 2.0)
    assert (args.calibration_windows, args.eval_windows, args.eval_context_tokens, args.eval_decoded_tokens) == (4, 2, 96, 16)
    assert str(args.out) == str(out) and report["commands"][-1].startswith("# plus calibration settings")


def test_compress_takes_existing_codebooks_instead_of_calibrating(compressed, tiny_model_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from hf_kvcodecs.gsrq import calibrate as calibration

    out, first = compressed
    monkeypatch.setattr(calibration, "collect_kv_samples", lambda *a, **k: pytest.fail("calibrated again"))
    source = str(out / KV_CODEBOOKS_FOLDER)  # e.g. the codebooks of an earlier run
    again = tmp_path / "again"
    assert main(["compress", "--model", str(tiny_model_dir), "--weight-bits", "4", "--group-size", "16",
                 "--codebooks", source, "--eval-windows", "2", "--eval-context-tokens", "96",
                 "--eval-decoded-tokens", "16", "--out", str(again), "--threads", "1"]) == 0
    report = json.loads((again / REPORT_FILE).read_text())
    assert report["kv_cache"]["codebooks_source"] == source and first["kv_cache"]["codebooks_source"] is None
    assert report["kv_cache"]["calibration"] == first["kv_cache"]["calibration"]  # what they were calibrated on
    saved, given = (load_file(str(d / KV_CODEBOOKS_FOLDER / TENSORS_FILE)) for d in (again, out))
    assert saved.keys() == given.keys() and all(torch.equal(saved[k], given[k]) for k in given)
    card = (again / "README.md").read_text()
    assert f"| KV codebooks | reused ({source}), calibrated on" in card
    command = next(c for c in report["commands"] if c.startswith("hf-kvcodecs compress"))
    assert build_parser().parse_args(shlex.split(command)[1:]).codebooks == source
    with pytest.raises(ValueError, match="need kv='gsrq'"):
        CompressSettings(model=str(tiny_model_dir), kv="none", codebooks=source)


def test_cli_compress_weights_only_and_push(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    uploads = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo",
                        lambda self, repo_id, **kwargs: type("RepoUrl", (), {"repo_id": repo_id})())
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder",
                        lambda self, **kwargs: uploads.append((kwargs, sorted(p.name for p in Path(kwargs["folder_path"]).iterdir()))))
    out = tmp_path / "w3"
    code = main(["compress", "--model", str(tiny_model_dir), "--weight-bits", "3", "--group-size", "32", "--kv", "none",
                 "--eval-windows", "2", "--eval-context-tokens", "24", "--eval-decoded-tokens", "8", "--out", str(out),
                 "--push-to-hub", "someone/tiny-w3", "--threads", "1"])
    assert code == 0
    report = json.loads((out / REPORT_FILE).read_text())
    assert [row["name"] for row in report["evaluation"]["rows"]] == ["fp32 original (DynamicCache)", "W3 g32 weights (DynamicCache)"]
    assert report["kv_cache"] is None and not (out / KV_CODEBOOKS_FOLDER).exists()
    (kwargs, files), = uploads
    assert kwargs["repo_id"] == "someone/tiny-w3" and kwargs["folder_path"] == str(out)
    assert {"README.md", "config.json", "model.safetensors", REPORT_FILE} <= set(files)
    card = (out / "README.md").read_text()
    assert 'from_pretrained("someone/tiny-w3")' in card and "--push-to-hub someone/tiny-w3" in card
    assert "W3 g32 weights (DynamicCache)" in capsys.readouterr().out


def test_kv_only_compression_keeps_float_weights(tiny_model_dir, tmp_path):
    report = compress(_settings(tiny_model_dir, weight_bits=None), tmp_path / "kv_only", progress=False)
    assert [row["name"] for row in report["evaluation"]["rows"]] == [
        "fp32 original (DynamicCache)", "GSRQ 2-bit KV cache (the saved model's default)"]
    assert report["weights"] is None and report["quantization_config"]["weight_bits"] is None
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "kv_only")
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear"
    output = model.generate(torch.tensor([[1, 40, 41]]), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert type(output.cache).__name__ == "GSRQCache"
    assert "floating-point weights" in (tmp_path / "kv_only" / "README.md").read_text()


@pytest.mark.parametrize("overrides, message", [
    ({"kv": "quanto"}, "kv must be one of"),
    ({"weight_bits": None, "kv": "none"}, "Nothing to compress"),
    ({"weight_bits": 12}, "weight_bits must be an integer from 1 to 8"),
    ({"group_size": 24}, "group_size must be a power of two"),
    ({"eval_windows": 0}, "eval_windows must be a positive integer"),
])
def test_bad_settings_fail_before_any_work(tiny_model_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        _settings(tiny_model_dir, **overrides)


def test_more_evaluation_windows_than_text_is_a_clear_error(tiny_model_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("A short licence. " * 14)  # about 170 tokens: one window fits, two do not
    with pytest.raises(ValueError, match="windows of 112 tokens need .* the evaluation text has"):
        compress(_settings(tiny_model_dir, evaluation_text=[str(short)], kv="none"), tmp_path / "out", progress=False)


@pytest.mark.integration
def test_compress_the_default_model_and_load_it_back(tmp_path):
    """The real default model end to end, with small calibration/evaluation settings (numbers are not a benchmark)."""
    from hf_kvcodecs.models import load_model

    loaded = load_model("default")
    settings = CompressSettings(weight_bits=4, group_size=64, kv="gsrq", kv_bits=2.0, calibration_windows=2,
                                calibration_holdout_windows=1, eval_windows=1, eval_context_tokens=160,
                                eval_decoded_tokens=16, calibration_fit={"n_iter": 2, "fit_rows": 2048})
    report = compress(settings, tmp_path / "smollm2", loaded=loaded, progress=False)
    baseline, weights, full = report["evaluation"]["rows"]
    assert 1 < baseline["perplexity"] < 100 and weights["kl_mean"] > 0 and full["kl_mean"] > 0
    assert report["sizes"]["weights"] < 0.4 * baseline["bytes"]  # 4-bit layers; the tied embedding stays fp32
    assert report["model"]["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert report["weights"]["converted_layers"] == 30 * 7

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "smollm2")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "smollm2")
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    output = model.generate(**inputs, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    assert type(output.cache).__name__ == "GSRQCache"
    assert tokenizer.decode(output.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
