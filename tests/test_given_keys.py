"""Values coded given the same token's decoded keys (value_layout "given_keys")."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache, LlamaForCausalLM

from hf_kvcodecs import GSRQCache, GSRQCodebooks, enable_code_attention
from hf_kvcodecs.codecs.given_keys import KeyPredictedValueVQ
from hf_kvcodecs.gsrq import fit_gsrq_codebooks
from hf_kvcodecs.gsrq.codebooks import METADATA_FILE, TENSORS_FILE, CodebookFileError

from .conftest import TINY_BITS, _tiny_codebooks, resave_codebook_tensors, tiny_llama_config

CODED = {"window_length": 4, "flush_interval": 4, "num_sink_tokens": 2}


def _prompt(batch=2, length=60, seed=11):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def shared_keys_dir(tiny_model, tiny_token_stream, tmp_path_factory):
    """Values coded jointly, without the prediction, with the keys of tiny_given_keys_codebooks_dir (per head, shared
    codebooks)."""
    return _tiny_codebooks(tiny_model, tiny_token_stream, tmp_path_factory.mktemp("tiny_shared_keys_codebooks"),
                           key_layout="per_head", value_layout="joint_heads")


def test_calibration_fits_a_prediction_from_the_keys_that_lowers_the_value_error(tiny_given_keys_codebooks_dir,
                                                                                  shared_keys_dir):
    given, joint = GSRQCodebooks.load(tiny_given_keys_codebooks_dir), GSRQCodebooks.load(shared_keys_dir)
    assert given.layout("values") == "given_keys" and isinstance(given.value_codecs[0], KeyPredictedValueVQ)
    # same rate, same residual code shape as the joint value codec: one code row per token for both heads
    assert given.value_codecs[0].num_stages == joint.value_codecs[0].num_stages
    assert given.stages_for_bits(TINY_BITS, "values") == joint.stages_for_bits(TINY_BITS, "values")
    assert all(0.3 < codec.stats["energy_explained_by_keys"] < 1 for codec in given.value_codecs)
    # held-out relative MSE of the values, each codec with the keys as the cache decodes them
    given_error = given.calibration["holdout_mean"]["values_relative_mse"]
    joint_error = joint.calibration["holdout_mean"]["values_relative_mse"]
    assert given_error < 0.85 * joint_error
    # the keys are coded alike: same key error
    assert given.calibration["holdout_mean"]["keys_relative_mse"] == pytest.approx(
        joint.calibration["holdout_mean"]["keys_relative_mse"], rel=1e-6)


def test_the_cache_codes_values_against_the_keys_it_decodes(tiny_model, tiny_given_keys_codebooks_dir, shared_keys_dir):
    """Closed loop: the values the cache decodes are closer to the model's values than the joint codec's at the same
    rate, and equal the codec's decode given the cache's own decoded (pre-RoPE) keys."""
    ids = _prompt(batch=4, length=128)
    with torch.inference_mode():
        reference = DynamicCache()
        tiny_model(ids, cache=reference)
        errors = {}
        for name, directory in (("given", tiny_given_keys_codebooks_dir), ("joint", shared_keys_dir)):
            cache = GSRQCache(tiny_model.config, codebooks=directory, bits=TINY_BITS, **CODED)
            tiny_model(ids, cache=cache)
            errors[name] = []
            for index, layer in enumerate(cache.layers):
                sinks, codes = layer.sink_keys.shape[-2], layer.key_codes.shape[-2]
                exact = reference.layers[index].values[..., sinks:sinks + codes, :]
                errors[name].append(float((layer.dequantized_values() - exact).pow(2).sum() / exact.pow(2).sum()))
            if name == "given":
                keys = layer._decode(layer.key_codec, layer.key_codes, layer.key_scales)  # pre-RoPE
                flat = lambda t: t.permute(1, 0, 2, 3).reshape(t.shape[1], -1, t.shape[-1])  # noqa: E731
                expected = layer.value_codec.decode(flat(layer.value_codes), layer.value_scales.permute(1, 0, 2)
                                                    .reshape(2, -1), flat(keys))
                torch.testing.assert_close(flat(layer.dequantized_values()), expected)
    assert sum(errors["given"]) < 0.85 * sum(errors["joint"])


def test_generation_paths_work_with_values_given_keys(tiny_model, tiny_given_keys_codebooks_dir):
    ids = _prompt(batch=2, length=30)
    settings = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                    cache_implementation="gsrq", cache_config={"codebooks": str(tiny_given_keys_codebooks_dir), **CODED})
    greedy = tiny_model.generate(ids, **settings)
    beams = tiny_model.generate(ids, num_beams=2, **settings)
    assert greedy.shape == beams.shape == (2, 42)
    # a lower rate is a prefix of the residual code; the prediction stays
    low = tiny_model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                              cache_implementation="gsrq", return_dict_in_generate=True,
                              cache_config={"codebooks": str(tiny_given_keys_codebooks_dir), "bits": 2.0, **CODED})
    layer = low.past_key_values.layers[0]
    assert layer.value_codes.shape[-1] == layer.value_codec.num_stages < GSRQCodebooks.load(
        tiny_given_keys_codebooks_dir).value_codecs[0].num_stages


@pytest.fixture(scope="module", params=["per_head", "conditional_heads", "joint_heads"])
def model_and_codebooks(request, tiny_model, tiny_token_stream, tiny_given_keys_codebooks_dir, tmp_path_factory):
    """Values given the keys, with each key layout (the prediction reads the key codes of every layout; the compiled
    loop for conditional keys needs head_dim 64 or 128)."""
    if request.param == "per_head":
        return tiny_model, tiny_given_keys_codebooks_dir
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(**({"head_dim": 64} if request.param == "conditional_heads" else {})))
    directory = tmp_path_factory.mktemp(f"tiny_given_keys_{request.param}")
    return model.eval(), _tiny_codebooks(model.eval(), tiny_token_stream, directory, key_layout=request.param,
                                         value_layout="given_keys")


@pytest.mark.parametrize("kernels", ["compiled", "reference"])
def test_code_reading_attention_adds_the_prediction_from_the_key_codes(model_and_codebooks, kernels, monkeypatch):
    """The compiled CPU attention, and the op's readable reference (what CUDA, torch.compile and machines without
    a compiler run for this layout), read the residual codes and the key codes (for the prediction) and match the
    dequantize path, which decodes the values and attends with SDPA."""
    import copy

    if kernels == "reference":
        monkeypatch.setenv("HF_KVCODECS_KERNELS", "reference")
    model, key_layout_codebooks = copy.deepcopy(model_and_codebooks[0]), model_and_codebooks[1]
    enable_code_attention(model)
    ids = _prompt(batch=2, length=80)
    logits, caches = {}, {}
    with torch.inference_mode():
        for path in ("dequantize", "codes"):
            cache = caches[path] = GSRQCache(model.config, codebooks=key_layout_codebooks, attention=path, **CODED)
            model(ids[:, :70], cache=cache)
            logits[path] = torch.cat([model(ids[:, i:i + 1], cache=cache).logits for i in range(70, 80)], dim=1)
    layer = caches["codes"].layers[0]
    assert layer.last_attention == "codes" and layer.region_lengths()["codes"] > 60
    torch.testing.assert_close(logits["codes"], logits["dequantize"], rtol=0, atol=1e-5)


def test_saved_predictors_round_trip_and_damaged_ones_are_refused(tiny_given_keys_codebooks_dir, tmp_path):
    original = GSRQCodebooks.load(tiny_given_keys_codebooks_dir)
    saved = GSRQCodebooks.load(original.save(tmp_path / "again"))
    assert torch.equal(saved.value_codecs[1].predictor, original.value_codecs[1].predictor)
    target = tmp_path / "damaged"
    shutil.copytree(tiny_given_keys_codebooks_dir, target)
    tensors = load_file(str(target / TENSORS_FILE))
    tensors["layers.1.values.predictor"] = tensors["layers.1.values.predictor"][:-1]
    resave_codebook_tensors(target, tensors)
    with pytest.raises(CodebookFileError, match="predictor must be"):
        GSRQCodebooks.load(target)
    tensors["layers.1.values.predictor"] = torch.full((33, 32), float("nan"))
    resave_codebook_tensors(target, tensors)
    with pytest.raises(CodebookFileError, match="non-finite value predictor"):
        GSRQCodebooks.load(target)
    shutil.copytree(tiny_given_keys_codebooks_dir, tmp_path / "edited")
    metadata = json.loads((tmp_path / "edited" / METADATA_FILE).read_text())
    metadata["config"]["key_space"] = "post_rope"
    (tmp_path / "edited" / METADATA_FILE).write_text(json.dumps(metadata))
    with pytest.raises(CodebookFileError, match="given_keys values need keys coded before RoPE"):
        GSRQCodebooks.load(tmp_path / "edited")


def test_calibration_refuses_values_given_rotated_keys(tiny_model, tiny_token_stream):
    with pytest.raises(ValueError, match="use key_space='pre_rope'"):
        fit_gsrq_codebooks(tiny_model, tiny_token_stream, text_info={"description": "unit test"}, bits=TINY_BITS,
                           key_space="post_rope", value_layout="given_keys", progress=False)
