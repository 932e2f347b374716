"""benchmarks/gskm_regime.py: its metric functions on known cases, and centroid shrinkage on tiny synthetic data."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from hf_kvcodecs.codecs.kmeans import fit_codebook, nearest_codeword

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def regime():
    spec = importlib.util.spec_from_file_location("gskm_regime", ROOT / "benchmarks" / "gskm_regime.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(autouse=True)
def one_thread():
    # small GEMMs: on a busy machine a second intra-op thread makes the k-means fits many times slower, not faster
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_metrics_on_known_cases(regime):
    x = torch.tensor([[3.0, 4.0], [0.0, 2.0]])
    half = 0.5 * x
    assert regime.relative_mse(x, half) == pytest.approx(0.25)
    assert regime.mean_norm_ratio(x, half) == pytest.approx(0.5)
    assert regime.mean_cosine(x, half) == pytest.approx(1.0)
    rotated = torch.stack([-x[:, 1], x[:, 0]], dim=1)  # 90 degrees: same norms, orthogonal
    assert regime.mean_norm_ratio(x, rotated) == pytest.approx(1.0)
    assert regime.mean_cosine(x, rotated) == pytest.approx(0.0, abs=1e-7)
    assert regime.relative_mse(x, rotated) == pytest.approx(2.0)
    assert regime.mean_cosine(x, torch.zeros_like(x)) == 0.0  # a zero decoded vector counts as cosine 0
    # different per-row ratios: the mean of the ratios, not the ratio of the means
    assert regime.mean_norm_ratio(x, torch.stack([x[0], 3 * x[1]])) == pytest.approx(2.0)
    assert regime.relative_error(torch.ones(4), torch.full((4,), 1.5)) == pytest.approx(0.5)


def test_head_vector_metrics_and_paired_difference(regime):
    heads = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    metrics = regime.vector_metrics(heads, 0.8 * heads, 32)
    assert metrics["rel_mse"] == pytest.approx(0.04, rel=1e-5)
    assert metrics["norm_ratio"] == pytest.approx(0.8) and metrics["sub_norm_ratio"] == pytest.approx(0.8)
    assert metrics["cosine"] == pytest.approx(1.0) and metrics["sub_cosine"] == pytest.approx(1.0)
    assert regime.split_subvectors(heads, 32).shape == (128, 32)
    assert torch.equal(regime.split_subvectors(heads, 32)[1], heads[0, 32:])
    mean, se = regime.paired_block_difference(heads, 0.5 * heads, 0.8 * heads, 4)
    assert mean == pytest.approx(0.25 - 0.04, rel=1e-5) and se == pytest.approx(0.0, abs=1e-6)


def test_codings_decode_exactly_with_a_codebook_holding_every_row(regime):
    generator = torch.Generator().manual_seed(1)
    heads = torch.randn(10, 64, generator=generator) * torch.rand(10, 1, generator=generator) * 5
    for weighting in regime.WEIGHTINGS:
        rows, weights, gain = regime.coding_rows(heads, 32, weighting)
        assert rows.shape == (20, 32) and gain.shape == (20,)
        decoded = regime.decode_heads(heads, [rows.clone()], 32, weighting)
        torch.testing.assert_close(decoded, heads, rtol=1e-5, atol=1e-5)
        if weighting == "raw":
            assert weights is None
        else:  # rows are head vectors over their RMS, weighted by the RMS squared
            assert rows.reshape(10, 64).pow(2).mean(-1).sqrt() == pytest.approx(torch.ones(10))
            torch.testing.assert_close(weights, (heads.pow(2).mean(-1)).repeat_interleave(2))
    # two greedy stages: the second codes the first stage's residual
    codebook = torch.zeros(1, 32)
    assert torch.equal(regime.encode_rows(torch.ones(3, 32), [codebook, torch.ones(1, 32)]), torch.ones(3, 32))


def test_causal_attention_is_softmax_qk_v_with_gqa(regime):
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(4, 5, 8, generator=generator), torch.randn(2, 5, 8, generator=generator),
               torch.randn(2, 5, 8, generator=generator))
    out = regime.causal_attention(q, k, v)
    head, token = 3, 2  # query head 3 reads key/value head 1 (two query heads per kv head), tokens 0..2
    weights = (q[head, token] @ k[1, : token + 1].T / math.sqrt(8)).softmax(-1)
    torch.testing.assert_close(out[head, token], weights @ v[1, : token + 1])
    torch.testing.assert_close(out[:, 0], v.repeat_interleave(2, dim=0)[:, 0])  # the first token sees only itself
    kept = regime.keep_first(torch.zeros(1, 2, 5, 8), torch.ones(1, 2, 5, 8))
    assert kept[:, :, 0].eq(1).all() and kept[:, :, 1:].eq(0).all()


def test_group_heads_round_trip(regime):
    layers = (2, 3)
    tensors = {layer: torch.randn(2, 3, 5, 4) for layer in layers}  # [W, H, T, D]
    rows = regime.group_heads(tensors, layers)
    assert rows.shape == (2 * 5 * 2 * 3, 4)
    torch.testing.assert_close(rows[0], tensors[2][0, 0, 0])  # token-major: window 0, token 0, layer 2, head 0
    torch.testing.assert_close(rows[1], tensors[2][0, 1, 0])
    for layer in layers:
        torch.testing.assert_close(regime.ungroup_layer(rows, tensors[layer], layers, layer), tensors[layer])


def _uneven_gain_data(dim, rows=4096):
    generator = torch.Generator().manual_seed(0)
    gains = torch.exp(0.7 * torch.randn(rows, 1, generator=generator))
    return torch.randn(rows, dim, generator=generator) * gains * torch.linspace(0.3, 1.5, dim)


def _held_out_norm_ratio_and_cosine(regime, x, learner):
    codebook = fit_codebook(x[:3072], 64, learner=learner, n_iter=20, seed=0)
    test = x[3072:]
    decoded = codebook[nearest_codeword(test, codebook)]
    return regime.mean_norm_ratio(test, decoded), regime.mean_cosine(test, decoded)


def test_l2_centroids_shrink_in_high_dimension_and_gskm_shrinks_less(regime):
    # 64 words: 1.5 bits/dim at 4 dims, 0.19 bit/dim at 32 dims; per-vector gains log-normal (sigma 0.7)
    low_ratio, _ = _held_out_norm_ratio_and_cosine(regime, _uneven_gain_data(4), "l2")
    high = _uneven_gain_data(32)
    l2_ratio, l2_cosine = _held_out_norm_ratio_and_cosine(regime, high, "l2")
    gskm_ratio, gskm_cosine = _held_out_norm_ratio_and_cosine(regime, high, "gskm")
    assert low_ratio > 0.85 and l2_ratio < 0.5  # measured 0.93 and 0.38
    assert gskm_ratio > l2_ratio + 0.03  # measured 0.47 vs 0.38 (unit-mean shapes: spherical averaging)
    assert gskm_cosine > l2_cosine + 0.03  # measured 0.40 vs 0.32
    # the per-run shrinkage summary agrees with the norm ratio of the decoded rows
    codebook = fit_codebook(high[:1024], 16, learner="l2", n_iter=5, seed=0)
    assert regime.centroid_shrinkage(high[:1024], codebook) == pytest.approx(
        regime.mean_norm_ratio(high[:1024], codebook[nearest_codeword(high[:1024], codebook)]))
