"""`bench split`: caches that divide the bits between keys and values differently, measured side by side."""

import pytest
import torch

from hf_kvcodecs import GSRQCodebooks
from hf_kvcodecs.bench.bit_split import plot_split, split_markdown, split_methods
from hf_kvcodecs.bench.harness import evaluate_methods


@pytest.fixture(scope="module")
def results(tiny_model, tiny_codebooks_dir, tiny_token_stream):
    codebooks = GSRQCodebooks.load(tiny_codebooks_dir)  # calibrated at 3 bits: every split below is a prefix
    methods = split_methods({"default": (codebooks, codebooks)}, average_bits=2.5, offsets=(-0.5, 0.5))
    with torch.no_grad():
        return evaluate_methods(tiny_model, None, methods, eval_token_ids=tiny_token_stream[:1200],
                                eval_description="random token ids (unit test)", context_len=96, continuation_len=8,
                                n_windows=2, greedy_prompts=0, passkey_trials=0, speed_contexts=(), progress=False)


def test_each_split_holds_the_stages_its_bits_buy(tiny_model, tiny_codebooks_dir):
    codebooks = GSRQCodebooks.load(tiny_codebooks_dir)
    methods = split_methods({"default": (codebooks, codebooks)}, average_bits=2.5, offsets=(-0.5, 0.5))
    assert [(m.extra["key_bits"], m.extra["value_bits"], m.extra["control"]) for m in methods] == [
        (2.5, 2.5, True), (2.0, 3.0, False), (3.0, 2.0, False)]
    stages = {}
    for method in methods:
        cache = method.make_cache(tiny_model)
        tiny_model(torch.randint(3, 128, (1, 80)), cache=cache)
        layer = cache.layers[0]
        stages[(method.extra["key_bits"], method.extra["value_bits"])] = (layer.key_codes.shape[-1],
                                                                         layer.value_codes.shape[-1])
    # head_dim 16, 8-bit scales and codewords: keys (16 b - 8) / 8 per head; values one code for both heads
    assert stages == {(2.5, 2.5): (4, 8), (2.0, 3.0): (3, 10), (3.0, 2.0): (5, 6)}


def test_report_lists_every_split_and_plots_them(results, tmp_path):
    results["command"] = "hf-kvcodecs bench split (unit test)"
    table = split_markdown(results)
    assert "| default (control) | 2.5 | 2.5 | 3 |" in table
    assert "| default | 2 | 3 | 3 |" in table and "| default | 3 | 2 | 3 |" in table
    kls = [entry["perplexity"]["kl_mean"] for entry in results["methods"][1:]]
    assert all(kl > 0 for kl in kls)  # quantized: measurably different from the reference
    plot_split(results, tmp_path / "split.png")
    assert (tmp_path / "split.png").stat().st_size > 10_000
