"""Keys coded head by head, each conditionally on the heads decoded before it (key_layout="conditional_heads")."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from hf_kvcodecs import GSRQCache, GSRQCodebooks
from hf_kvcodecs.codecs.conditional import ConditionalHeadResidualVQ, fit_conditional_head_residual_vq
from hf_kvcodecs.codecs.residual import fit_transform_residual_vq, relative_mse
from hf_kvcodecs.gsrq import fit_gsrq_codebooks
from hf_kvcodecs.gsrq.attention import conditional_key_table_of
from hf_kvcodecs.gsrq.codebooks import METADATA_FILE, TENSORS_FILE, CodebookFileError
from hf_kvcodecs.kernels import reference
from hf_kvcodecs.kernels.cpu import prerope_decode_attention
from hf_kvcodecs.kernels.cpu_native import native_ops

from .conftest import (
    SMALL_WINDOW,
    _tiny_codebooks,
    generate_gsrq,
    generation_mode,
    layout_prompt,
    resave_codebook_tensors,
    tiny_llama_config,
)

HEADS, DIM = 3, 64


def _correlated_heads(n=3000, seed=0):
    """Three heads that read one shared latent through their own projections, plus private noise and per-token gains
    (as the KV heads of one layer read one residual stream)."""
    generator = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, 12, generator=generator)
    projections = torch.randn(HEADS, 12, DIM, generator=generator)
    private = torch.randn(HEADS, n, DIM, generator=generator)
    gains = torch.rand(1, n, 1, generator=generator) * 2 + 0.3
    return (torch.einsum("nl,hld->hnd", latent, projections) + 0.3 * private) * gains


@pytest.fixture(scope="module")
def fitted():
    samples = _correlated_heads()
    settings = dict(max_stages=8, n_iter=4, fit_rows=2000)
    conditional = fit_conditional_head_residual_vq(samples[:, :2500], **settings)
    per_head = fit_transform_residual_vq(samples[:, :2500], **settings)
    return conditional, per_head, samples[:, 2500:]


def test_conditional_codes_beat_per_head_codes_at_the_same_rate(fitted):
    conditional, per_head, test = fitted
    assert conditional.bits_per_element() == pytest.approx(per_head.bits_per_element())
    assert conditional.code_heads == HEADS  # one code row per head vector, as the per-head layout
    conditional_error = relative_mse(test, conditional.reconstruct(test))
    per_head_error = relative_mse(test, per_head.reconstruct(test))
    assert conditional_error < 0.7 * per_head_error, (conditional_error, per_head_error)


def test_decoder_rebuilds_what_the_encoder_predicted_from(fitted):
    conditional, _, test = fitted
    codes, scales = conditional.encode(test)
    assert codes.shape == (HEADS, test.shape[1], 8) and codes.dtype == torch.uint8 and scales.dtype == torch.uint8
    decoded = conditional.decode(codes, scales)
    # closed loop: head h's code is of k_h minus the prediction from the *decoded* heads before it
    residuals = torch.stack([codec.decode(codes[h : h + 1], scales[h : h + 1])[0]
                             for h, codec in enumerate(conditional.head_codecs)])
    mixed = (residuals.permute(1, 0, 2).reshape(-1, HEADS * DIM) @ conditional.mixing()).reshape(-1, HEADS, DIM)
    torch.testing.assert_close(mixed.permute(1, 0, 2), decoded, rtol=1e-4, atol=1e-4)
    # head 0 is coded without prediction
    torch.testing.assert_close(decoded[0], residuals[0])
    # lower rates are prefixes with the same predictors
    prefix = conditional.truncated(4)
    assert prefix.num_stages == 4 and prefix.predictors is conditional.predictors
    assert relative_mse(test, prefix.reconstruct(test)) > relative_mse(test, decoded)


def test_predictors_may_only_read_earlier_heads(fitted):
    conditional, _, _ = fitted
    bad = conditional.predictors.clone()
    bad[DIM + 3, DIM + 5] = 1.0  # head 1 predicted from itself
    with pytest.raises(ValueError, match="predictors for head 1 read heads 1 or later"):
        ConditionalHeadResidualVQ(conditional.head_codecs, bad)
    with pytest.raises(ValueError, match="predictors must be"):
        ConditionalHeadResidualVQ(conditional.head_codecs, bad[:DIM])


@pytest.mark.skipif(native_ops() is None, reason="needs the compiled CPU loops (a C++ compiler)")
@pytest.mark.parametrize("query_length, groups", [(1, 3), (2, 1)])
def test_compiled_conditional_key_loop_matches_float64_dequantize_then_attend(fitted, query_length, groups):
    conditional, _, _ = fitted
    codec = conditional.truncated(6)  # reads a prefix of the full-rate table
    generator = torch.Generator().manual_seed(3)
    batch, tokens, exact = 2, 300, 5  # not a multiple of the loop's 256-token blocks
    keys = _correlated_heads(batch * tokens, seed=4)
    codes, scales = codec.encode(keys)
    decoded = codec.decode(codes, scales).reshape(HEADS, batch, tokens, DIM).permute(1, 0, 2, 3)
    codes = codes.reshape(HEADS, batch, tokens, -1).permute(1, 0, 2, 3).contiguous()
    scales = scales.reshape(HEADS, batch, tokens).permute(1, 0, 2).contiguous()
    value_codec = fit_transform_residual_vq(torch.randn(HEADS, 1000, DIM, generator=generator), max_stages=4, n_iter=2)
    values = torch.randn(HEADS, batch * tokens, DIM, generator=generator)
    value_codes, value_scales = value_codec.encode(values)
    values = value_codec.decode(value_codes, value_scales).reshape(HEADS, batch, tokens, DIM).permute(1, 0, 2, 3)
    value_codes = value_codes.reshape(HEADS, batch, tokens, -1).permute(1, 0, 2, 3).contiguous()
    value_scales = value_codec.scale_values(value_scales.reshape(HEADS, batch, tokens).permute(1, 0, 2).contiguous())
    positions = torch.arange(tokens)[None].expand(batch, -1) + 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
    cos, sin = reference.rotary_tables(positions, inv_freq, 1.0)
    query = torch.randn(batch, HEADS * groups, query_length, DIM, generator=generator)
    exact_keys, exact_values = torch.randn(2, batch, HEADS, exact, DIM, generator=generator)
    mask = torch.zeros(batch, query_length, tokens)
    mask[1, :, :7] = -float("inf")  # a padded row
    value_mean, value_synthesis, value_codebooks, value_stage_groups = value_codec.attention_operands()
    out, _ = prerope_decode_attention(
        native_ops(), query, codes, scales, codec.scale_level_table("cpu"), *conditional_key_table_of(codec), cos, sin,
        codec.codebook_size, value_codes, value_scales, None, value_codebooks, value_stage_groups, value_mean,
        value_synthesis, mask, 0.125, exact_keys, exact_values, None, conditional_keys=True,
    )
    half = DIM // 2
    rotate = lambda k, c, s: k * c + torch.cat([-k[..., half:], k[..., :half]], -1) * s  # noqa: E731
    all_keys = torch.cat([rotate(decoded.double(), cos[:, None].double(), sin[:, None].double()), exact_keys.double()], 2)
    all_values = torch.cat([values.double(), exact_values.double()], 2)
    scores = query.double() @ all_keys.repeat_interleave(groups, 1).transpose(-1, -2) * 0.125
    scores[..., :tokens] += mask[:, None].double()
    expected = torch.softmax(scores, -1) @ all_values.repeat_interleave(groups, 1)
    # budget: a few times float32's error of the same computation done plainly
    plain = torch.softmax(scores.float(), -1) @ all_values.float().repeat_interleave(groups, 1)
    budget = max(5 * float((plain.double() - expected).abs().max()), 1e-6)
    assert float((out.double() - expected).abs().max()) <= budget


@pytest.fixture(scope="module")
def model64():
    """Head size 64, which the compiled conditional-key loop is built for."""
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(head_dim=64, num_key_value_heads=2, num_attention_heads=4)).eval()


@pytest.fixture(scope="module")
def conditional_dir(model64, tiny_token_stream, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_conditional_codebooks")
    fit_gsrq_codebooks(
        model64, tiny_token_stream, text_info={"description": "random token ids (unit test, not an evaluation)"},
        bits=2.0, key_layout="conditional_heads", value_layout="joint_heads", window_tokens=128,
        sampled_tokens_per_window=64, num_windows=8, holdout_windows=1, n_iter=3, fit_rows=512, out=directory,
        progress=False,
    )
    return directory


@pytest.mark.skipif(native_ops() is None, reason="needs the compiled CPU loops (a C++ compiler)")
@pytest.mark.parametrize("mode", ["greedy", "beam", "padded_batch"])
def test_code_reading_generation_equals_dequantize_path(model64, conditional_dir, mode):
    ids, kwargs = generation_mode(mode)
    expected, _ = generate_gsrq(model64, ids, conditional_dir, "dequantize", **kwargs)
    got, cache = generate_gsrq(model64, ids, conditional_dir, "auto", **kwargs)
    assert cache.attention_path == "codes" and cache.layers[0].last_attention == "codes"
    assert isinstance(cache.layers[0].key_codec, ConditionalHeadResidualVQ)
    assert cache.layers[0].region_lengths()["codes"] > 0
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kernels", ["reference", "pytorch"])
def test_without_the_compiled_loop_conditional_keys_are_still_read_from_codes(model64, conditional_dir, monkeypatch,
                                                                              kernels):
    """As on a machine without a C++ compiler: the op's PyTorch reference rebuilds the keys chunk by chunk."""
    ids = layout_prompt(batch=1)
    expected, _ = generate_gsrq(model64, ids, conditional_dir, "dequantize")
    monkeypatch.setenv("HF_KVCODECS_KERNELS", kernels)
    assert native_ops() is None
    got, cache = generate_gsrq(model64, ids, conditional_dir, "auto")
    assert cache.attention_path == "codes" and cache.layers[0].last_attention == "codes"
    assert torch.equal(got, expected)


def test_head_sizes_the_compiled_loop_is_not_built_for_read_codes_through_the_reference(tiny_model, tiny_token_stream,
                                                                                        tmp_path):
    directory = _tiny_codebooks(tiny_model, tiny_token_stream, tmp_path, key_layout="conditional_heads")  # head_dim 16
    ids = layout_prompt(batch=2, length=40)
    expected, _ = generate_gsrq(tiny_model, ids, directory, "dequantize")
    got, cache = generate_gsrq(tiny_model, ids, directory, "auto")
    assert isinstance(cache.layers[0].key_codec, ConditionalHeadResidualVQ) and cache.layers[0].key_codec.head_dim == 16
    assert cache.layers[0].last_attention == "codes"
    assert torch.equal(got, expected)


def test_attention_operands_describe_the_decoder(fitted):
    """What every attention implementation reads (pairs of mean and synthesis per source and target head) rebuilds
    exactly the codec's decoded keys, at the full rate and at a lower one."""
    conditional, _, test = fitted
    for codec in (conditional, conditional.truncated(5)):
        codes, scales = codec.encode(test[:, :40])
        mean, synthesis, codebooks, groups = codec.attention_operands()
        assert synthesis.shape == (HEADS, HEADS, DIM, DIM) and codebooks.shape[:2] == (HEADS, codec.num_stages)
        assert not synthesis[1, 0].any() and not mean[2, 1].any()  # no head reads a later one
        rebuilt = reference.conditional_dequantize_reference(codes[None], codec.scale_values(scales)[None], mean,
                                                             synthesis, codebooks, groups, torch.float64)[0]
        torch.testing.assert_close(rebuilt.float(), codec.decode(codes, scales), rtol=1e-4, atol=1e-4)


def test_files_round_trip_and_are_checked(conditional_dir, tmp_path):
    codebooks = GSRQCodebooks.load(conditional_dir)
    assert codebooks.layout("keys") == "conditional_heads" and codebooks.layout("values") == "joint_heads"
    assert json.loads((conditional_dir / METADATA_FILE).read_text())["format_version"] == 5
    assert codebooks.stages_for_bits(2.0, "keys") == 15  # same rate as per-head keys: (2 * 64 - 8) / 8
    x = torch.randn(2, 10, 64)
    again = GSRQCodebooks.load(conditional_dir)
    torch.testing.assert_close(codebooks.key_codecs[1].reconstruct(x), again.key_codecs[1].reconstruct(x))

    target = tmp_path / "codebooks"
    shutil.copytree(conditional_dir, target)
    tensors = load_file(str(target / TENSORS_FILE))
    tensors["layers.1.keys.predictors"] = tensors["layers.1.keys.predictors"].T.contiguous()  # reads later heads
    resave_codebook_tensors(target, tensors)
    with pytest.raises(CodebookFileError, match="inconsistent codebooks .*predictors for head 0"):
        GSRQCodebooks.load(target)
    del tensors["layers.1.keys.predictors"]
    resave_codebook_tensors(target, tensors)
    with pytest.raises(CodebookFileError, match="lacks tensor 'layers.1.keys.predictors'"):
        GSRQCodebooks.load(target)
    metadata = json.loads((target / METADATA_FILE).read_text())
    metadata["config"]["value_layout"] = "conditional_heads"  # values have no conditional layout
    (target / METADATA_FILE).write_text(json.dumps(metadata))
    with pytest.raises(CodebookFileError, match="value_layout must be one of"):
        GSRQCodebooks.load(target)


def test_calibration_rejects_conditional_keys_after_rope_and_for_values(model64, tiny_token_stream):
    settings = dict(text_info={"description": "unit test"}, bits=2.0, window_tokens=128, num_windows=2,
                    holdout_windows=1, progress=False)
    with pytest.raises(ValueError, match="conditional_heads.*key_space='pre_rope'"):
        fit_gsrq_codebooks(model64, tiny_token_stream, key_layout="conditional_heads", key_space="post_rope", **settings)
    with pytest.raises(ValueError, match="value_layout must be one of"):
        fit_gsrq_codebooks(model64, tiny_token_stream, value_layout="conditional_heads", **settings)


def test_cache_holds_one_code_row_per_head(model64, conditional_dir):
    cache = GSRQCache(model64.config, codebooks=conditional_dir, attention="dequantize", **SMALL_WINDOW)
    model64(layout_prompt(batch=1, length=30), cache=cache)
    layer = cache.layers[0]
    assert layer.key_codes.shape == (1, 2, layer.region_lengths()["codes"], 15)
    assert layer.key_scales.dtype == torch.uint8
