"""fit_codebook's objective history and tolerance, and the chunked principal-shape moments."""

import pytest
import torch

from hf_kvcodecs.codecs import kmeans
from hf_kvcodecs.codecs.kmeans import CODEBOOK_LEARNERS, fit_codebook, nearest_codeword


def _data(rows=600, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=generator) * torch.rand(rows, 1, generator=generator) * 3
    return x, torch.rand(rows, generator=generator)


@pytest.mark.parametrize("learner", sorted(CODEBOOK_LEARNERS))
def test_history_records_each_iteration_and_changes_nothing(learner):
    x, w = _data()
    history = []
    tracked = fit_codebook(x, 16, learner=learner, weights=w, n_iter=6, seed=1, history=history)
    assert torch.equal(tracked, fit_codebook(x, 16, learner=learner, weights=w, n_iter=6, seed=1))
    assert len(history) == 6
    if CODEBOOK_LEARNERS[learner].assignment == "l2":  # entry 6: the distortion of the codebook after 5 iterations
        final = fit_codebook(x, 16, learner=learner, weights=w, n_iter=5, seed=1)
        assign = nearest_codeword(x, final)
        expected = float((w * ((x - final[assign]) ** 2).sum(1)).sum() / w.sum())
        assert history[5] == pytest.approx(expected, rel=1e-5)


def test_l2_history_never_increases():
    x, _ = _data(seed=3)
    history = []
    fit_codebook(x, 16, learner="l2", n_iter=12, seed=0, history=history)
    assert all(b <= a * (1 + 1e-6) for a, b in zip(history, history[1:]))


def test_tol_stops_early_and_zero_tol_runs_every_iteration():
    x, _ = _data(rows=2000, seed=4)
    history = []
    stopped = fit_codebook(x, 8, learner="l2", n_iter=200, seed=0, tol=1e-3, history=history)
    assert 1 < len(history) < 200
    assert abs(history[-2] - history[-1]) <= 1e-3 * history[-2]
    assert all(abs(a - b) > 1e-3 * a for a, b in zip(history[:-2], history[1:-1]))
    # same result as running exactly that many iterations without a tolerance
    assert torch.equal(stopped, fit_codebook(x, 8, learner="l2", n_iter=len(history), seed=0))
    full = []
    fit_codebook(x, 8, learner="l2", n_iter=7, seed=0, history=full)
    assert len(full) == 7


def test_chunked_principal_moments_match_all_outer_products_at_once(monkeypatch):
    x, w = _data(rows=1000, dim=6, seed=5)
    k = 12
    codebook = x[:k].clone()
    assign = nearest_codeword(x, codebook)
    shapes = kmeans._principal_shapes(x, w, assign, k, codebook)
    monkeypatch.setattr(kmeans, "_OUTER_CHUNK_ROWS", 10**9)  # one chunk: the former single accumulation
    assert torch.equal(shapes, kmeans._principal_shapes(x, w, assign, k, codebook))
    # and the moments are the weighted second moments of each cluster
    d = x.shape[1]
    outer = (w[:, None, None] * x[:, :, None] * x[:, None, :]).reshape(-1, d * d)
    moments = torch.zeros(k, d * d).index_add_(0, assign, outer).reshape(k, d, d)
    top = torch.linalg.eigh(moments)[1][:, :, -1]
    cosines = (top * shapes).sum(1).abs()
    counts = torch.bincount(assign, minlength=k)
    assert torch.all(cosines[counts > 0] > 1 - 1e-4)
