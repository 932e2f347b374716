"""The codec ablation on a tiny random Llama: the metrics, the rate bookkeeping, the rows both studies must produce,
and the basic sanity of what they measure (more bits -> lower error)."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_kvcodecs.bench.codec_ablation import ablation_markdown, run_codec_ablation, vector_metrics
from hf_kvcodecs.codecs.kmeans import CODEBOOK_LEARNERS
from hf_kvcodecs.codecs.residual import FP16_SCALE_BITS, stages_for_rate

VOCAB, HEAD_DIM, KV_HEADS = 128, 32, 2
BITS = (2.0, 4.0)
CODEBOOK_BITS = 4  # 16-word codebooks: enough to be meaningful on the few hundred vectors a tiny run collects


class CharTokenizer:
    """One token per character (code point modulo the vocabulary)."""

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
        return {"input_ids": [ord(character) % VOCAB for character in text]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("texts")
    calibration, evaluation = directory / "calibration.txt", directory / "evaluation.txt"
    generator = torch.Generator().manual_seed(1)
    # Different random character streams, so evaluation is held out from calibration.
    calibration.write_text("".join(chr(97 + int(i)) for i in torch.randint(26, (1200,), generator=generator)))
    evaluation.write_text("".join(chr(65 + int(i)) for i in torch.randint(26, (600,), generator=generator)))
    return run_codec_ablation(
        model, CharTokenizer(), layers=(0, 1), bits=BITS, seeds=(0, 1), calibration_windows=8, eval_windows=4,
        window_tokens=128, sampled_tokens_per_window=64, codebook_bits=CODEBOOK_BITS,
        calibration_text=[str(calibration)], evaluation_text=[str(evaluation)], progress=False,
    )


def test_stages_for_rate_pays_for_the_scale_first():
    assert stages_for_rate(1.0, 64, 8) == 7  # (64 - 8) / 8 with the default 8-bit scale
    assert stages_for_rate(2.0, 64, 8) == 15  # (128 - 8) / 8
    assert stages_for_rate(1.0, 64, 8, FP16_SCALE_BITS) == 6  # (64 - 16) / 8
    assert stages_for_rate(2.0, 64, 8, FP16_SCALE_BITS) == 14  # (128 - 16) / 8
    assert stages_for_rate(1.1, 64, 8, FP16_SCALE_BITS) == 6  # 54.4 index bits: a partial stage is not counted
    with pytest.raises(ValueError, match="scale"):
        stages_for_rate(0.2, 64, 8, FP16_SCALE_BITS)


def test_vector_metrics_on_a_known_shrinkage():
    x = torch.randn(3, 50, 16)
    metrics = vector_metrics(x, 0.5 * x)
    assert metrics["relative_mse"] == pytest.approx(0.25, rel=1e-5)
    assert metrics["cosine"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["norm_ratio"] == pytest.approx(0.5, rel=1e-5)


def test_rows_cover_both_studies(results):
    learner_rows = [row for row in results["rows"] if row["config"]["study"] == "learner"]
    layout_rows = [row for row in results["rows"] if row["config"]["study"] == "layout"]
    assert {(row["config"]["learner"], row["config"]["weighted"]) for row in learner_rows} == {
        (learner, weighted) for learner in CODEBOOK_LEARNERS for weighted in (False, True)
    }
    assert all(set(row["metrics"]) == {"keys", "values"} for row in learner_rows)
    selected = {results["selection"]["best_gskm"], results["selection"]["best_l2"]}
    assert results["selection"]["best_l2"].startswith("l2,") and not results["selection"]["best_gskm"].startswith("l2,")
    changes = {
        (row["config"]["transform"], row["config"]["group_dim"], row["config"]["key_space"]) for row in layout_rows
    }
    assert changes == {("none", 8, "pre_rope"), ("pca", 16, "pre_rope"), ("pca", 8, "post_rope")}
    assert len(layout_rows) == 6
    for row in layout_rows:
        assert row["name"].split(";")[0] in selected
        # Values carry no RoPE: a post-RoPE row only measures keys.
        assert set(row["metrics"]) == ({"keys"} if row["config"]["key_space"] == "post_rope" else {"keys", "values"})


def test_metrics_are_sane_and_more_bits_help(results):
    low, high = (f"{b:g}" for b in BITS)
    assert results["settings"]["stages"] == {low: stages_for_rate(BITS[0], HEAD_DIM, CODEBOOK_BITS, FP16_SCALE_BITS),
                                             high: stages_for_rate(BITS[1], HEAD_DIM, CODEBOOK_BITS, FP16_SCALE_BITS)}
    for row in results["rows"]:
        for kind, cells in row["metrics"].items():
            for rate, cell in cells.items():
                assert cell["bits_per_element"] <= float(rate) + 1e-9
                assert 0 < cell["relative_mse"] < 1, (row["name"], kind, rate)
                assert 0 < cell["cosine"] <= 1 + 1e-6 and 0 < cell["norm_ratio"] < 2
                assert len(cell["per_layer_relative_mse"]) == 2 and cell["relative_mse_seed_std"] >= 0
            assert cells[high]["relative_mse"] < cells[low]["relative_mse"], (row["name"], kind)
            assert cells[high]["cosine"] > cells[low]["cosine"], (row["name"], kind)
            # The Gaussian reference also falls with the rate (it is water-filled on the same index bits).
            assert cells[high]["rate_distortion_reference"] < cells[low]["rate_distortion_reference"]


def test_report_is_json_and_markdown(results):
    assert json.loads(json.dumps(results)) == results
    markdown = ablation_markdown(results)
    assert markdown.startswith("# Codec ablation")
    for row in results["rows"]:
        assert f"| {row['name']} |" in markdown
    assert "Gaussian rate-distortion reference (post-RoPE keys)" in markdown
    assert "Pre- vs post-RoPE keys" in markdown and " ± " in markdown  # two seeds: spreads are shown
