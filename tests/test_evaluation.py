"""The one paired evaluation: its statistics on values worked out by hand."""

import math

import pytest
import torch

from hf_kvcodecs.evaluation import (
    WindowScores,
    divergence_metrics,
    fixed_windows,
    paired_comparison,
    perplexity_metrics,
    strided_windows,
    token_nll,
)


def test_token_nll_reads_each_target_log_probability():
    logprobs = torch.tensor([[-0.5, -1.5], [-2.0, -0.25]])
    nll = token_nll(logprobs, torch.tensor([1, 0]))
    assert nll.dtype == torch.float64 and nll.tolist() == [1.5, 2.0]


def test_perplexity_change_is_paired_by_window():
    reference = [torch.tensor([1.0, 1.0], dtype=torch.float64), torch.tensor([3.0, 3.0], dtype=torch.float64)]
    # every window 0.1 nats worse: the paired differences have no spread, whatever the windows' difficulty
    model = [nll + 0.1 for nll in reference]
    metrics = perplexity_metrics(model, reference)
    assert metrics["ppl"] == pytest.approx(math.exp(2.1))
    assert metrics["delta_ppl_pct"] == pytest.approx(100 * (math.exp(0.1) - 1))
    assert metrics["delta_ppl_pct_se"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["window_delta_ppl_pct"] == pytest.approx([100 * (math.exp(0.1) - 1)] * 2)
    # differences of 0 and 0.2 nats: mean 0.1, standard error std / sqrt(2) = 0.1
    uneven = [reference[0], reference[1] + 0.2]
    metrics = perplexity_metrics(uneven, reference)
    ratio = math.exp(0.1)
    assert metrics["delta_ppl_pct"] == pytest.approx(100 * (ratio - 1))
    assert metrics["delta_ppl_pct_se"] == pytest.approx(100 * ratio * 0.1)
    assert perplexity_metrics(reference, None)["delta_ppl_pct"] == 0.0
    with pytest.raises(ValueError, match="2 windows scored against a reference of 1"):
        perplexity_metrics(reference, reference[:1])


def test_divergence_is_zero_against_itself_and_kl_otherwise():
    reference = [torch.tensor([[0.5, 0.5], [0.9, 0.1]]).log()]
    model = [torch.tensor([[0.25, 0.75], [0.9, 0.1]]).log()]
    metrics = divergence_metrics(model, reference)
    expected_first = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert metrics["kl_mean"] == pytest.approx(expected_first / 2, rel=1e-5)
    # first row: the reference ties and argmax takes index 0, the model picks 1; the second row agrees
    assert metrics["top1_agreement"] == 0.5
    assert divergence_metrics(model, None) == {"kl_mean": 0.0, "top1_agreement": 1.0, "window_kl": [0.0]}


def test_paired_comparison_of_window_scores():
    rows = torch.tensor([[0.5, 0.5], [0.5, 0.5]]).log()
    reference = WindowScores([token_nll(rows, torch.tensor([0, 1]))], [rows])
    same = paired_comparison(reference, reference)
    assert same["delta_ppl_pct"] == 0.0 and same["kl_mean"] == 0.0 and same["top1_agreement"] == 1.0
    assert same["perplexity"] == pytest.approx(2.0) and same["scored_tokens"] == 2 and same["windows"] == 1
    worse_rows = torch.tensor([[0.25, 0.75], [0.25, 0.75]]).log()
    worse = WindowScores([token_nll(worse_rows, torch.tensor([0, 1]))], [worse_rows])
    compared = paired_comparison(worse, reference)
    assert compared["perplexity"] == pytest.approx(math.exp((math.log(4) + math.log(4 / 3)) / 2))
    assert compared["delta_ppl_pct"] == pytest.approx(100 * (compared["perplexity"] / 2.0 - 1))
    assert compared["kl_mean"] > 0 and "kl_mean" not in paired_comparison(WindowScores(worse.nlls), reference)


def test_windows_are_spread_over_the_text_without_overlap():
    ids = torch.arange(100)
    spread = fixed_windows(ids, 3, 10)
    assert [int(w[0]) for w in spread] == [0, 45, 90]
    strided, starts = strided_windows(ids, 3, 10)
    assert starts == [0, 45, 90] and all(len(w) == 10 for w in strided)
    assert strided_windows(ids, 4, 10)[1] == [0, 30, 60, 90]
    with pytest.raises(ValueError, match="need 110 tokens"):
        fixed_windows(ids, 11, 10)
    with pytest.raises(ValueError, match="need 110 tokens"):
        strided_windows(ids, 11, 10)
