"""A model cast with ``.to(torch.bfloat16)`` applies RoPE with bf16-rounded frequencies (its ``inv_freq`` buffer is
cast too): the cache must undo and re-apply RoPE with the frequencies the model applies, not only the calibrated ones,
or the keys it codes are not the model's pre-RoPE keys."""

import copy

import pytest
import torch

import hf_kvcodecs  # noqa: F401  (registers cache_implementation="gsrq")
from hf_kvcodecs import GSRQCache, GSRQCodebooks, model_rope_inv_freq
from hf_kvcodecs.rope import apply_rope, rotary_cos_sin, undo_rope


@pytest.fixture(scope="module")
def bf16_model(tiny_model):
    return copy.deepcopy(tiny_model).to(torch.bfloat16)


def test_model_rope_inv_freq_reads_the_frequencies_the_model_applies(tiny_model, bf16_model):
    fp32 = model_rope_inv_freq(tiny_model)
    rounded = model_rope_inv_freq(bf16_model)
    assert fp32.dtype == rounded.dtype == torch.float32
    assert torch.equal(rounded, fp32.to(torch.bfloat16).float())
    assert not torch.equal(rounded, fp32)  # the cast rounded some of them
    assert model_rope_inv_freq(torch.nn.Linear(2, 2)) is None


def test_undoing_rope_with_the_applied_frequencies_recovers_the_pre_rope_keys(bf16_model):
    keys = torch.randn(1, 2, 300, 16)
    positions = torch.arange(300)[None]
    applied = model_rope_inv_freq(bf16_model)[: keys.shape[-1] // 2]
    rotated = apply_rope(keys, *rotary_cos_sin(positions, applied, 1.0))
    exact = undo_rope(rotated, *rotary_cos_sin(positions, applied, 1.0), 1.0)
    other = undo_rope(rotated, *rotary_cos_sin(positions, applied * (1 + 2**-9), 1.0), 1.0)
    assert (exact - keys).abs().max() < 1e-4
    assert (other - keys).abs().max() > 0.1  # a 2^-9 frequency error is a large angle error 300 tokens in


def test_generate_hands_the_models_rope_frequencies_to_the_cache(bf16_model, tiny_codebooks_dir):
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    out = bf16_model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="gsrq",
                              cache_config={"codebooks": str(tiny_codebooks_dir)}, return_dict_in_generate=True)
    applied = model_rope_inv_freq(bf16_model)
    assert all(torch.equal(layer.rope_inv_freq, applied) for layer in out.past_key_values.layers)
    assert not torch.equal(applied, GSRQCodebooks.load(tiny_codebooks_dir).rope_inv_freq)


def test_rope_frequencies_that_do_not_fit_the_codebooks_are_refused(tiny_codebooks_dir, tiny_model):
    calibrated = GSRQCodebooks.load(tiny_codebooks_dir).rope_inv_freq
    with pytest.raises(ValueError, match="rope_inv_freq must be a tensor of shape"):
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, rope_inv_freq=calibrated[:-1])
    with pytest.raises(ValueError, match="calibrated for another RoPE configuration"):
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, rope_inv_freq=calibrated * 1.05)
    cache = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, rope_inv_freq=calibrated.to(torch.bfloat16))
    assert cache.layers[0].rope_inv_freq.dtype == torch.float32
