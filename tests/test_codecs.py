import math

import pytest
import torch

from hf_kvcodecs.codecs import fit_codebook, nearest_codeword
from hf_kvcodecs.codecs.residual import fit_transform_residual_vq, gaussian_rate_distortion_reference, relative_mse
from hf_kvcodecs.codecs.scales import FP16_SCALE_BITS, LOG_SCALE_BITS, dequantize_scales, quantize_scales


def _correlated_vectors(heads=2, n=3000, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(heads, dim, dim, generator=generator) * torch.logspace(0, -1.5, dim)
    gains = torch.rand(heads, n, 1, generator=generator) * 3 + 0.1
    return torch.einsum("hnd,hde->hne", torch.randn(heads, n, dim, generator=generator), mixing) * gains


def test_nearest_codeword_matches_brute_force():
    generator = torch.Generator().manual_seed(0)
    x, codebook = torch.randn(500, 8, generator=generator), torch.randn(64, 8, generator=generator)
    brute = torch.cdist(x, codebook).argmin(dim=1)
    assert torch.equal(nearest_codeword(x, codebook), brute)


@pytest.mark.parametrize("learner", ["l2", "gskm", "gskm-cosine", "gskm-principal"])
def test_learners_are_drop_in_and_beat_random_codewords(learner):
    x = _correlated_vectors(heads=1)[0, :, :8]
    codebook = fit_codebook(x, 32, learner=learner, n_iter=10, seed=0)
    assert codebook.shape == (32, 8)
    error = relative_mse(x, codebook[nearest_codeword(x, codebook)])
    random_rows = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(3))[:32]]
    baseline = relative_mse(x, random_rows[nearest_codeword(x, random_rows)])
    # Cosine assignment ignores the gains, so on norm-heterogeneous data it is only required not to lose.
    assert error < (1.0 if learner == "gskm-cosine" else 0.8) * baseline


def test_l2_kmeans_fixed_point_is_weighted_cluster_mean():
    x = _correlated_vectors(heads=1)[0, :, :4]
    weights = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(5)) + 0.5
    codebook = fit_codebook(x, 8, learner="l2", weights=weights, n_iter=60, seed=1)
    assign = nearest_codeword(x, codebook)
    for j in range(8):
        members = assign == j
        if members.any():
            mean = (weights[members, None] * x[members]).sum(0) / weights[members].sum()
            torch.testing.assert_close(codebook[j], mean, atol=1e-3, rtol=1e-3)


def test_gskm_gain_is_least_squares_for_its_shape():
    x = _correlated_vectors(heads=1)[0, :, :8]
    codebook = fit_codebook(x, 16, learner="gskm", n_iter=20, seed=0)
    assign = nearest_codeword(x, codebook)
    shapes = codebook / codebook.norm(dim=1, keepdim=True)
    # Scaling any codeword's gain up or down must not lower its cluster's error (LS optimality, up to one iteration).
    for j in range(16):
        members = x[assign == j]
        if len(members) < 5:
            continue
        best = ((members @ shapes[j]).mean()).clamp_min(0)
        assert abs(float(codebook[j].norm() - best)) < 0.15 * float(best) + 1e-4


def test_residual_vq_error_falls_with_stages_and_prefixes_are_consistent():
    train, test = _correlated_vectors(seed=0), _correlated_vectors(seed=1)
    codec = fit_transform_residual_vq(train, max_stages=4, group_dim=8, codebook_bits=6, n_iter=6, fit_rows=2048)
    errors = [relative_mse(test, codec.truncated(s).reconstruct(test)) for s in range(0, 5)]
    assert all(later < earlier for earlier, later in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.5
    codes, scales = codec.encode(test)
    assert codes.dtype == torch.uint8 and codes.shape == (2, test.shape[1], 4)
    assert scales.dtype == torch.uint8 and scales.shape == (2, test.shape[1])  # 8-bit log levels by default
    assert codec.bits_per_element() == pytest.approx((4 * 6 + LOG_SCALE_BITS) / 16)
    fp16 = fit_transform_residual_vq(train, max_stages=4, group_dim=8, codebook_bits=6, n_iter=6, fit_rows=2048,
                                     scale_bits=FP16_SCALE_BITS)
    assert fp16.encode(test)[1].dtype == torch.float16 and fp16.log_scale_range is None
    assert fp16.bits_per_element() == pytest.approx((4 * 6 + FP16_SCALE_BITS) / 16)
    # the 8 saved scale bits cost (almost) nothing in error at the same number of stages
    assert relative_mse(test, codec.reconstruct(test)) < 1.03 * relative_mse(test, fp16.reconstruct(test))


def test_log_scales_round_to_the_nearest_level_and_clamp_outside_the_range():
    log_range = torch.tensor([[-4.0, 4.0], [0.0, 2.0]])
    rms = torch.tensor([[2.0**-4, 1.0, 2.0**4, 2.0**9, 2.0**-9], [1.0, 2.0**0.5, 4.0, 3.0, 1e-6]])
    stored, values = quantize_scales(rms, log_range)
    assert stored.dtype == torch.uint8
    assert stored[0].tolist()[:3] == [0, 128, 255] and stored[0, 3] == 255 and stored[0, 4] == 0
    assert stored[1, 0] == 0 and stored[1, 2] == 255 and stored[1, 4] == 0
    inside = torch.tensor([[True, True, True, False, False], [True, True, True, True, False]])
    step = (log_range[:, 1] - log_range[:, 0]) / 255  # octaves per level, per head
    log_error = (torch.log2(values) - torch.log2(rms)).abs()
    assert torch.all(log_error[inside] <= (step[:, None].expand_as(rms)[inside] / 2) + 1e-5)
    assert torch.equal(dequantize_scales(stored[None], log_range)[0], values)  # [B, H, N] layout too
    with pytest.raises(ValueError, match="log_scale_range"):
        dequantize_scales(stored, None)


def _gain_test_codec(scale_bits, with_metric):
    samples = _correlated_vectors(seed=6)
    metric = None
    if with_metric:
        sensitive = torch.ones(16)
        sensitive[:4] = 20.0
        metric = torch.diag(sensitive).expand(2, 16, 16).clone()
    codec = fit_transform_residual_vq(samples[:, :2000], max_stages=2, group_dim=8, codebook_bits=5, n_iter=6,
                                      scale_bits=scale_bits, metric=metric)
    test = samples[:, 2000:]
    rms_stored = quantize_scales(test.pow(2).mean(-1).sqrt(), codec.log_scale_range)[0]

    def metric_norm2(v):  # per vector, in the codec's metric
        return v.pow(2).sum(-1) if metric is None else torch.einsum("hnd,hde,hne->hn", v, metric, v)

    return codec, test, rms_stored, metric_norm2


@pytest.mark.parametrize("scale_bits", [LOG_SCALE_BITS, FP16_SCALE_BITS])
@pytest.mark.parametrize("with_metric", [False, True])
def test_least_squares_gain_is_refitted_to_the_coded_shape_and_never_loses(scale_bits, with_metric):
    codec, test, rms_stored, metric_norm2 = _gain_test_codec(scale_bits, with_metric)
    codes, stored = codec.encode(test, gain="least_squares")
    assert torch.equal(codec.encode(test, gain="rms")[1], rms_stored)

    def error(codec, codes, scales):
        return metric_norm2(test - codec.decode(codes, scales))

    refitted, plain = error(codec, codes, stored), error(codec, codes, rms_stored)
    assert torch.all(refitted <= plain * (1 + 1e-5) + 1e-7)  # a vector keeps the RMS scale when refitting loses
    assert refitted.sum() < 0.97 * plain.sum()  # the scale also codes the error along the decoded shape
    assert (stored != rms_stored).float().mean() > 0.5
    for stages in (1, 0):  # lower rates (prefixes of the parent's stages), down to the mean alone
        prefix = codec.truncated(stages)
        prefix_codes, prefix_stored = prefix.encode(test, gain="least_squares")
        # the gain is chosen after the codes, never before (greedy codes of a prefix are a prefix of the codes)
        assert torch.equal(prefix.encode(test, gain="least_squares", beam_width=1)[0],
                           codec.encode(test, gain="rms", beam_width=1)[0][..., :stages])
        assert torch.all(error(prefix, prefix_codes, prefix_stored) <= error(prefix, prefix_codes, rms_stored) * (1 + 1e-5) + 1e-7)


@pytest.mark.parametrize("scale_bits", [LOG_SCALE_BITS, FP16_SCALE_BITS])
@pytest.mark.parametrize("with_metric", [False, True])
def test_default_gain_restores_each_vectors_norm(scale_bits, with_metric):
    codec, test, rms_stored, metric_norm2 = _gain_test_codec(scale_bits, with_metric)
    codes, stored = codec.encode(test)
    length = metric_norm2(test).sqrt()
    restored = metric_norm2(codec.decode(codes, stored)).sqrt() / length
    shrunk = metric_norm2(codec.decode(codes, rms_stored)).sqrt() / length
    # One 8-bit level is at most ~2 % of the scale on these ranges; fp16 rounds at 5e-4.
    tolerance = 0.02 if scale_bits == LOG_SCALE_BITS else 2e-3
    assert torch.all((restored - 1).abs() < tolerance)
    assert shrunk.mean() < 0.99  # what the RMS scale does: residual VQ returns shorter vectors
    assert (shrunk - 1).abs().mean() > 5 * (restored - 1).abs().mean()
    with pytest.raises(ValueError, match="gain must be one of"):
        codec.encode(test, gain="l2")


@pytest.mark.parametrize("scale_bits", [LOG_SCALE_BITS, FP16_SCALE_BITS])
def test_norm_gain_does_not_stretch_a_shape_that_missed_the_vector(scale_bits):
    samples = _correlated_vectors(seed=7)
    codec = fit_transform_residual_vq(samples[:, :2000], max_stages=2, group_dim=8, codebook_bits=5, n_iter=4,
                                      transform="none", scale_bits=scale_bits)
    test = samples[:, 2000:]
    empty = codec.truncated(0)  # no stages and a zero mean: the decoded shape is the zero vector
    codes, stored = empty.encode(test)
    assert torch.isfinite(empty.scale_values(stored).float()).all()
    assert torch.equal(stored, empty.encode(test, gain="least_squares")[1])
    assert torch.count_nonzero(empty.decode(codes, stored)) == 0


def test_codec_rejects_vectors_of_another_shape():
    codec = fit_transform_residual_vq(_correlated_vectors(), max_stages=1, group_dim=8, codebook_bits=4, n_iter=2)
    with pytest.raises(ValueError, match="different number of KV heads"):
        codec.encode(torch.randn(3, 10, 16))


def test_rate_distortion_reference_falls_with_rate_and_is_a_lower_bound():
    samples = _correlated_vectors(seed=2)
    references = [gaussian_rate_distortion_reference(samples, bits) for bits in (0, 8, 16, 32)]
    assert references[0] == pytest.approx(1.0)
    assert all(b < a for a, b in zip(references, references[1:]))
    codec = fit_transform_residual_vq(samples, max_stages=2, group_dim=8, codebook_bits=8, n_iter=6)
    achieved = relative_mse(samples, codec.reconstruct(samples))
    # The reference gets every bit the codec spends, the scale's included: the refitted gain makes those bits code
    # part of the shape's error, which without them lets the codec beat a Gaussian of these gain-mixed vectors.
    bits = codec.code_bits_per_vector() + codec.scale_bits
    assert achieved > gaussian_rate_distortion_reference(samples, bits) * 0.9


def test_water_filling_of_white_gaussian_matches_closed_form():
    samples = torch.randn(1, 200000, 4, generator=torch.Generator().manual_seed(0))
    # D(R) = 2^(-2R/d) of the variance for white Gaussian data.
    assert gaussian_rate_distortion_reference(samples, 8) == pytest.approx(2 ** (-2 * 8 / 4), rel=0.03)
    assert math.isclose(gaussian_rate_distortion_reference(samples, 0), 1.0)


def test_metric_moves_error_away_from_sensitive_directions():
    samples = _correlated_vectors(seed=4)
    sensitive = torch.ones(16)
    sensitive[:4] = 50.0  # errors in the first four channels cost 50x
    metric = torch.diag(sensitive).expand(2, 16, 16).clone()
    plain = fit_transform_residual_vq(samples, max_stages=2, group_dim=8, codebook_bits=6, n_iter=6)
    weighted = fit_transform_residual_vq(samples, max_stages=2, group_dim=8, codebook_bits=6, n_iter=6, metric=metric)

    def metric_error(codec):
        error = samples - codec.reconstruct(samples)
        return float((error**2 * sensitive).sum())

    assert metric_error(weighted) < metric_error(plain)
    # with every stage the codec can afford, the metric codec still reconstructs (its transform is invertible)
    exact = fit_transform_residual_vq(samples, max_stages=0, group_dim=8, metric=metric)
    assert exact.synthesis is not None
    torch.testing.assert_close(
        torch.bmm(exact.basis, exact.synthesis), torch.eye(16).expand(2, 16, 16), atol=1e-4, rtol=1e-4
    )


def test_attention_metrics_have_the_documented_structure(tiny_model):
    from hf_kvcodecs.calibration.metrics import key_metric, value_metric

    queries = torch.rand(4, 16)
    keys = key_metric(queries, num_kv_heads=2)
    assert keys.shape == (2, 16, 16)
    expected = 0.5 * (queries[0, :8] + queries[0, 8:] + queries[1, :8] + queries[1, 8:])
    torch.testing.assert_close(torch.diagonal(keys[0])[:8], expected)
    torch.testing.assert_close(torch.diagonal(keys[0])[8:], expected)
    weight = tiny_model.model.layers[0].self_attn.o_proj.weight
    values = value_metric(weight, num_kv_heads=2, head_dim=16)
    w0, w1 = weight[:, :16], weight[:, 16:32]
    torch.testing.assert_close(values[0], (w0.T @ w0 + w1.T @ w1).detach())


@pytest.mark.parametrize("learner", ["gskm-principal", "gskm", "l2"])
def test_learners_survive_tiny_residuals_and_more_codewords_than_samples(learner):
    # a late residual stage can see vectors ~1e-7 long (LAPACK's eigh gave NaN shapes) and fewer rows than codewords
    generator = torch.Generator().manual_seed(0)
    x = 1e-7 * torch.randn(100, 8, generator=generator)
    x[::3, 1:] = 0  # rank-1 clusters
    codebook = fit_codebook(x, 256, learner=learner, weights=torch.rand(100, generator=generator), n_iter=3)
    assert codebook.shape == (256, 8) and torch.isfinite(codebook).all()
    assert (x - codebook[nearest_codeword(x, codebook)]).norm(dim=1).max() < 1e-7


def test_beam_search_lowers_the_coding_error_and_greedy_is_its_first_beam():
    samples = _correlated_vectors(n=4000, seed=11)
    codec = fit_transform_residual_vq(samples[:, :3000], max_stages=6, group_dim=8, codebook_bits=5, n_iter=6)
    test = samples[:, 3000:]
    greedy = codec.reconstruct(test, gain="least_squares", beam_width=1)
    beam = codec.reconstruct(test, gain="least_squares", beam_width=8)
    greedy_error, beam_error = relative_mse(test, greedy), relative_mse(test, beam)
    assert beam_error < 0.97 * greedy_error  # measured ~0.9 here; 15 % lower KL on the default model's cache
    codes = codec.encode(test, beam_width=1)[0]
    assert torch.equal(codes, codec.encode(test, beam_width=1, gain="rms")[0])
    for bad in (0, 65, 2.0, True):
        with pytest.raises(ValueError, match="beam_width must be an integer from 1"):
            codec.encode(test, beam_width=bad)
