import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from hf_kvcodecs import GSRQCache
from hf_kvcodecs.calibration import collect_kv_samples
from hf_kvcodecs.gsrq import fit_gsrq_codebooks

SMALL = dict(bits=2.0, window_tokens=64, sampled_tokens_per_window=32, num_windows=4, holdout_windows=1, n_iter=3,
             fit_rows=256, progress=False, text_info={"description": "random token ids (unit test)"})


def test_calibration_is_deterministic_for_a_seed(tiny_model, tiny_token_stream, tmp_path):
    fit_gsrq_codebooks(tiny_model, tiny_token_stream, out=tmp_path / "a", seed=3, **SMALL)
    fit_gsrq_codebooks(tiny_model, tiny_token_stream, out=tmp_path / "b", seed=3, **SMALL)
    fit_gsrq_codebooks(tiny_model, tiny_token_stream, out=tmp_path / "c", seed=4, **SMALL)
    a, b, c = (load_file(str(tmp_path / name / "gsrq_codebooks.safetensors")) for name in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_attention_metric_calibration_runs_and_is_recorded(tiny_model, tiny_token_stream):
    with pytest.raises(ValueError, match="metric='attention' needs per-head layouts"):
        fit_gsrq_codebooks(tiny_model, tiny_token_stream, metric="attention", **SMALL)
    codebooks = fit_gsrq_codebooks(tiny_model, tiny_token_stream, metric="attention", key_layout="per_head",
                                   value_layout="per_head", **SMALL)  # own key codebooks: test_per_head_codebooks.py
    assert codebooks.config["metric"] == "attention"
    assert all(codec.synthesis is not None for codec in codebooks.key_codecs + codebooks.value_codecs)
    ids = tiny_token_stream[:40][None]
    with torch.inference_mode():
        cache = GSRQCache(tiny_model.config, codebooks=codebooks, bits=1.5, window_length=4, flush_interval=4)
        assert torch.isfinite(tiny_model(ids, cache=cache).logits).all()


def test_samples_are_bounded_and_pre_rope_keys_invert_post_rope(tiny_model, tiny_token_stream):
    from hf_kvcodecs.rope import find_rotary_parameters

    samples = collect_kv_samples(tiny_model, tiny_token_stream, window_tokens=64, sampled_tokens_per_window=16,
                                 num_windows=3, rope=find_rotary_parameters(tiny_model), progress=False)
    assert samples.values[0].shape == (2, 48, 16)  # 3 windows x 16 sampled tokens, never all 192 tokens
    # pre-RoPE keys equal the k_proj output: check against a direct projection of the same hidden states
    assert samples.keys_pre_rope[0].shape == samples.keys_post_rope[0].shape
    assert not torch.allclose(samples.keys_pre_rope[0], samples.keys_post_rope[0])


def test_bad_calibration_requests(tiny_model, tiny_token_stream):
    with pytest.raises(ValueError, match="key_space must be"):
        fit_gsrq_codebooks(tiny_model, tiny_token_stream, key_space="middle", **SMALL)
    with pytest.raises(ValueError, match="Calibration needs .* tokens"):
        fit_gsrq_codebooks(tiny_model, tiny_token_stream[:100], **SMALL)


def test_fit_settings_are_one_object_and_unknown_ones_are_refused():
    from hf_kvcodecs.gsrq import GSRQFitSettings
    from hf_kvcodecs.gsrq.store import calibration_defaults

    defaults = GSRQFitSettings()
    assert calibration_defaults() == dataclasses.asdict(defaults)
    assert defaults.replaced(bits=1.5, seed=3) == GSRQFitSettings(bits=1.5, seed=3)
    with pytest.raises(TypeError, match=r"Unknown GSRQ calibration setting\(s\) \['bitz'\]; valid settings: \['bits',"):
        defaults.replaced(bitz=2)
