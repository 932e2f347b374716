"""Keys coded per head vector, each head with its own codebooks (key_layout="per_head_codebooks")."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from hf_kvcodecs import GSRQCache, GSRQCodebooks
from hf_kvcodecs.codecs.conditional import (
    PER_HEAD_CODEBOOKS_LAYOUT,
    ConditionalHeadResidualVQ,
    fit_conditional_head_residual_vq,
)
from hf_kvcodecs.codecs.residual import fit_transform_residual_vq, relative_mse
from hf_kvcodecs.gsrq import attention as cache_attention
from hf_kvcodecs.gsrq import fit_gsrq_codebooks
from hf_kvcodecs.gsrq.codebooks import METADATA_FILE, TENSORS_FILE, CodebookFileError
from hf_kvcodecs.kernels.cpu import FixedPointKeyTable
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

HEADS, DIM = 3, 32
SETTINGS = dict(max_stages=6, n_iter=4, fit_rows=2000)


def _unlike_heads(n=3000, seed=0):
    """Three heads with different distributions: one Gaussian, two each clustered around 64 points of its own, so
    that one set of codebooks shared by the heads fits neither cluster set as closely as its own codebooks do."""
    generator = torch.Generator().manual_seed(seed)
    heads = [torch.randn(n, DIM, generator=generator)]
    for _ in range(HEADS - 1):
        centers = 3 * torch.randn(64, DIM, generator=generator)
        picks = torch.randint(0, 64, (n,), generator=generator)
        heads.append(centers[picks] + 0.05 * torch.randn(n, DIM, generator=generator))
    return torch.stack(heads)


@pytest.fixture(scope="module")
def fitted():
    samples = _unlike_heads()
    own = fit_conditional_head_residual_vq(samples[:, :2500], predict=False, **SETTINGS)
    shared = fit_transform_residual_vq(samples[:, :2500], **SETTINGS)
    return own, shared, samples[:, 2500:]


def test_each_head_is_its_own_single_head_codec(fitted):
    own, _, test = fitted
    assert isinstance(own, ConditionalHeadResidualVQ) and own.layout == PER_HEAD_CODEBOOKS_LAYOUT
    assert not own.predicts_across_heads and not own.predictors.any()
    codes, scales = own.encode(test)
    for head, codec in enumerate(own.head_codecs):  # nothing of another head enters a head's code or its decoding
        head_codes, head_scales = codec.encode(test[head : head + 1])
        assert torch.equal(codes[head : head + 1], head_codes) and torch.equal(scales[head : head + 1], head_scales)
        torch.testing.assert_close(own.decode(codes, scales)[head], codec.decode(head_codes, head_scales)[0])


def test_own_codebooks_beat_shared_ones_at_the_same_rate(fitted):
    own, shared, test = fitted
    assert own.bits_per_element() == pytest.approx(shared.bits_per_element())
    own_decoded, shared_decoded = own.reconstruct(test), shared.reconstruct(test)
    errors = [(relative_mse(test[h : h + 1], own_decoded[h : h + 1]),
               relative_mse(test[h : h + 1], shared_decoded[h : h + 1])) for h in range(HEADS)]
    assert errors[0][0] < 1.02 * errors[0][1], errors  # the Gaussian head loses nothing
    assert all(own_error < 0.2 * shared_error for own_error, shared_error in errors[1:]), errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16])
def test_per_head_key_table_rebuilds_the_decoded_keys(fitted, dtype):
    """The per-head table the compiled loop reads (each head's codebooks times its synthesis) rebuilds the codec's
    decoded keys, at the full rate and at a lower one (a prefix of every head's rows)."""
    own, _, test = fitted
    for codec in (own, own.truncated(4)):
        codes, scales = codec.encode(test[:, :50])
        table, mean = cache_attention.per_head_key_table(codec, dtype)
        torch.testing.assert_close(mean, codec.mean)
        assert table.shape == (HEADS, own.num_stages * own.codebook_size, DIM)
        rows = table.float() if isinstance(table, FixedPointKeyTable) else table
        offsets = torch.arange(codec.num_stages) * codec.codebook_size
        rebuilt = rows[torch.arange(HEADS)[:, None, None], codes.long() + offsets].sum(-2) + mean[:, None]
        rebuilt = rebuilt * codec.scale_values(scales)[..., None]
        tolerance = 1e-4 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(rebuilt, codec.decode(codes, scales), rtol=tolerance, atol=tolerance)


def test_predicted_keys_have_no_per_head_table(fitted):
    predicted = fit_conditional_head_residual_vq(_unlike_heads(800, seed=1), **SETTINGS)
    assert predicted.predicts_across_heads
    with pytest.raises(ValueError, match="conditional_key_table_of"):
        cache_attention.per_head_key_table(predicted)


@pytest.fixture(scope="module")
def model64():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(head_dim=64, num_key_value_heads=2, num_attention_heads=4)).eval()


@pytest.fixture(scope="module", params=["joint_heads", "given_keys"])
def own_dir(request, model64, tiny_token_stream, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"tiny_own_codebooks_{request.param}")
    fit_gsrq_codebooks(
        model64, tiny_token_stream, text_info={"description": "random token ids (unit test, not an evaluation)"},
        bits=2.0, key_layout=PER_HEAD_CODEBOOKS_LAYOUT, value_layout=request.param, window_tokens=128,
        sampled_tokens_per_window=64, num_windows=8, holdout_windows=1, n_iter=3, fit_rows=512, out=directory,
        progress=False,
    )
    return directory


@pytest.mark.skipif(native_ops() is None, reason="needs the compiled CPU loops (a C++ compiler)")
@pytest.mark.parametrize("mode", ["greedy", "beam", "padded_batch"])
def test_compiled_loop_reads_them_as_per_head_keys_and_equals_the_dequantize_path(model64, own_dir, mode):
    ids, kwargs = generation_mode(mode)
    expected, _ = generate_gsrq(model64, ids, own_dir, "dequantize", **kwargs)
    got, cache = generate_gsrq(model64, ids, own_dir, "auto", **kwargs)
    layer = cache.layers[0]
    assert cache.attention_path == "codes" and layer.last_attention == "codes"
    assert isinstance(layer.key_codec, ConditionalHeadResidualVQ) and not layer.key_codec.predicts_across_heads
    assert layer.region_lengths()["codes"] > 0
    constants = cache_attention.held_decode_constants(layer)
    assert not constants.conditional_keys  # the per-head key loop, not the one for keys predicted across heads
    assert constants.key_table.shape == (2, layer.key_codec.num_stages * layer.key_codec.codebook_size, 64)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kernels", ["reference", "pytorch"])
def test_without_the_compiled_loop_they_are_still_read_from_codes(model64, own_dir, monkeypatch, kernels):
    ids = layout_prompt(batch=1)
    expected, _ = generate_gsrq(model64, ids, own_dir, "dequantize")
    monkeypatch.setenv("HF_KVCODECS_KERNELS", kernels)
    assert native_ops() is None
    got, cache = generate_gsrq(model64, ids, own_dir, "auto")
    assert cache.attention_path == "codes" and cache.layers[0].last_attention == "codes"
    assert torch.equal(got, expected)


def test_head_sizes_without_a_conditional_loop_use_the_per_head_loop(tiny_model, tiny_token_stream, tmp_path):
    directory = _tiny_codebooks(tiny_model, tiny_token_stream, tmp_path, key_layout=PER_HEAD_CODEBOOKS_LAYOUT)
    ids = layout_prompt(batch=2, length=40)
    expected, _ = generate_gsrq(tiny_model, ids, directory, "dequantize")
    got, cache = generate_gsrq(tiny_model, ids, directory, "auto")
    assert cache.layers[0].key_codec.head_dim == 16 and cache.layers[0].last_attention == "codes"
    if native_ops() is not None:  # head_dim 16: no loop for keys predicted across heads, the per-head one reads them
        assert not cache_attention.held_decode_constants(cache.layers[0]).conditional_keys
    assert torch.equal(got, expected)


def test_files_round_trip_without_predictors_and_are_checked(model64, own_dir, tmp_path):
    codebooks = GSRQCodebooks.load(own_dir)
    assert codebooks.layout("keys") == PER_HEAD_CODEBOOKS_LAYOUT
    assert json.loads((own_dir / METADATA_FILE).read_text())["format_version"] == 5
    assert codebooks.stages_for_bits(2.0, "keys") == 15  # the per-head rate: (2 * 64 - 8) / 8
    tensors = load_file(str(own_dir / TENSORS_FILE))
    assert not any(name.endswith(".predictors") for name in tensors)
    assert "layers.0.keys.head.1.codebooks" in tensors
    x = torch.randn(2, 10, 64)
    torch.testing.assert_close(codebooks.key_codecs[1].reconstruct(x),
                               GSRQCodebooks.load(own_dir).key_codecs[1].reconstruct(x))

    target = tmp_path / "codebooks"
    shutil.copytree(own_dir, target)
    tensors["layers.1.keys.predictors"] = torch.zeros(128, 128)  # a conditional file relabelled, or the reverse
    resave_codebook_tensors(target, tensors)
    with pytest.raises(CodebookFileError, match="holds cross-head predictors, but the layout is per_head_codebooks"):
        GSRQCodebooks.load(target)
    del tensors["layers.1.keys.predictors"]
    resave_codebook_tensors(target, tensors)
    metadata = json.loads((target / METADATA_FILE).read_text())
    metadata["config"]["key_layout"] = "conditional_heads"
    (target / METADATA_FILE).write_text(json.dumps(metadata))
    with pytest.raises(CodebookFileError, match="lacks tensor 'layers.0.keys.predictors'"):
        GSRQCodebooks.load(target)
    metadata["config"]["key_layout"] = "per_head"  # shared codebooks: the per-head tensors are not there
    (target / METADATA_FILE).write_text(json.dumps(metadata))
    with pytest.raises(CodebookFileError, match="lacks tensor"):
        GSRQCodebooks.load(target)


def test_cache_holds_one_code_row_per_head(model64, own_dir):
    cache = GSRQCache(model64.config, codebooks=own_dir, attention="dequantize", **SMALL_WINDOW)
    model64(layout_prompt(batch=1, length=30), cache=cache)
    layer = cache.layers[0]
    assert layer.key_codes.shape[1] == 2 and layer.key_codes.shape[-1] == 15


def test_calibration_refuses_them_after_rope(model64, tiny_token_stream):
    settings = dict(text_info={"description": "unit test"}, bits=2.0, window_tokens=128, sampled_tokens_per_window=64,
                    num_windows=2, holdout_windows=1, progress=False)
    with pytest.raises(ValueError, match="per_head_codebooks.*key_space='pre_rope'"):
        fit_gsrq_codebooks(model64, tiny_token_stream, key_space="post_rope", key_layout=PER_HEAD_CODEBOOKS_LAYOUT,
                           **settings)
    post_rope = fit_gsrq_codebooks(model64, tiny_token_stream, key_space="post_rope", n_iter=2, fit_rows=256, **settings)
    # the default layouts for keys coded after RoPE: shared key codebooks, values coded without the keys' prediction
    assert post_rope.layout("keys") == "per_head" and post_rope.layout("values") == "joint_heads"


def test_attention_metric_weights_each_heads_own_fit(tiny_model, tiny_token_stream):
    """Each head's codec gets its slice of the metric (``--metric attention`` works with the default key layout)."""
    codebooks = fit_gsrq_codebooks(tiny_model, tiny_token_stream, text_info={"description": "unit test"}, bits=2.0,
                                   metric="attention", value_layout="per_head", window_tokens=128,
                                   sampled_tokens_per_window=64, num_windows=2,
                                   holdout_windows=1, n_iter=2, fit_rows=256, progress=False)
    assert codebooks.layout("keys") == PER_HEAD_CODEBOOKS_LAYOUT and codebooks.config["metric"] == "attention"
    for codec in codebooks.key_codecs:
        assert all(head.synthesis is not None and head.stats["metric"] for head in codec.head_codecs)
