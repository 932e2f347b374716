"""`bench squat`'s options for the decisive SQuaT experiment (activation quantization on chosen modules, the
activation steps' own learning rate, the distilled layers, the feature-only arm), the mechanism it keeps per run and
the SQuaT - raw-teacher difference per evaluation window over seeds, on a tiny random Llama."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaForCausalLM

from .conftest import tiny_llama_config

LAST_MLP_INPUTS = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]


def test_bench_squat_arms_mirror_the_library():
    from hf_kvcodecs.cli.bench import squat as cli_bench_squat
    from hf_kvcodecs.training.run import ARMS, BENCH_ARMS

    assert set(cli_bench_squat.BENCH_SQUAT_ARMS) == set(BENCH_ARMS) == {*ARMS, "feature-only"}
    assert BENCH_ARMS["feature-only"] == {"kd_loss": False}  # SQuaT's feature term (quantized target), no logit KD


def test_bench_squat_flags_reach_the_run_settings(tmp_path, monkeypatch, capsys):
    from hf_kvcodecs import cli, text
    from hf_kvcodecs.bench import squat as bench_squat
    from hf_kvcodecs.cli.bench import squat as cli_bench_squat

    seen = {}

    def fake_bench(loaded, train_ids, eval_ids, **kwargs):
        seen.update(kwargs)
        kwargs["out"].mkdir(parents=True, exist_ok=True)
        (kwargs["out"] / "squat.md").write_text("# bench squat\n")

    monkeypatch.setattr(bench_squat, "run_squat_bench", fake_bench)
    monkeypatch.setattr(cli_bench_squat, "load_model", lambda args: SimpleNamespace(tokenizer=None))
    monkeypatch.setattr(text, "tokenize_corpus", lambda tokenizer, corpus: torch.zeros(8, dtype=torch.long))
    assert cli.run(["bench", "squat", "--settings", "W4A2", "--arms", "squat", "raw-teacher-feature", "feature-only",
                    "--seeds", "0", "1", "2", "--group-size", "32", "--weight-init", "minmax", "--act-granularity",
                    "tensor", "--act-modules", *LAST_MLP_INPUTS, "--act-step-lr", "1e-3", "--distillation-layers",
                    "1", "--steps", "3", "--out", str(tmp_path)]) == 0
    base = seen["base"]
    assert (base.activation_modules, base.activation_step_learning_rate, base.distillation_layers) == (
        LAST_MLP_INPUTS, 1e-3, [1])
    assert (base.group_size, base.weight_init, base.symmetric, base.activation_granularity) == (
        32, "minmax", False, "tensor")  # asymmetric min-max groups of 32: the default model's Q4_1 grid
    assert seen["arms"] == ["squat", "raw-teacher-feature", "feature-only"] and seen["seeds"] == [0, 1, 2]
    capsys.readouterr()
    # nothing to choose at A16: an error, not a silent float run
    assert cli.run(["bench", "squat", "--settings", "W4A16", "--act-modules", "mlp.gate_proj", "--out",
                    str(tmp_path)]) != 0
    assert "activation bits 2 to 8" in capsys.readouterr().err


def tiny_bench_inputs():
    """A tiny random Llama (seeded) and a token stream: the first 3,000 tokens train, the rest evaluate."""
    torch.manual_seed(0)
    loaded = SimpleNamespace(model=LlamaForCausalLM(tiny_llama_config()), tokenizer=None, description="tiny")
    return loaded, torch.randint(3, 128, (4000,), generator=torch.Generator().manual_seed(3))


def test_bench_squat_keeps_the_mechanism_and_pairs_windows_over_seeds(tmp_path):
    from hf_kvcodecs.bench.squat import run_squat_bench
    from hf_kvcodecs.training.run import SQuaTRunSettings

    loaded, stream = tiny_bench_inputs()
    base = SQuaTRunSettings(group_size=16, steps=3, sequence_tokens=32, batch_size=2, eval_windows=3, eval_tokens=64,
                            activation_granularity="tensor", activation_modules=LAST_MLP_INPUTS,
                            activation_step_learning_rate=1e-2, distillation_layers=[1])
    arms = ["squat", "raw-teacher-feature", "feature-only"]
    results = run_squat_bench(loaded, stream[:3000], stream[3000:], settings=["W4A2"], arms=arms, seeds=[0, 1],
                              base=base, out=tmp_path, train_description="a", eval_description="b", progress=False)
    runs = results["runs"]
    assert set(runs) == {"W4A2/squat/seed0", "W4A2/squat/seed1", "W4A2/raw-teacher-feature/seed0",
                         "W4A2/raw-teacher-feature/seed1", "W4A2/feature-only/seed0"}
    for run in runs.values():
        assert run["settings"]["activation_modules"] == LAST_MLP_INPUTS and run["settings"]["distillation_layers"] == [1]
        mechanism = run["mechanism"]
        for name in ("step_drift", "clip_fraction", "feature_floor", "feature"):
            assert [step for step, _ in mechanism[f"squat_layer1_{name}"]] == [1, 2, 3], name
        assert mechanism["squat_layer1_step_drift"][0][1] == 0.0  # measured before the first update
        assert len(run["trained"]["window_kl"]) == 3
    # the activation steps learn at their own rate: the first step's learning rate is 0 (warm-up), so they have
    # moved by the third step's log
    assert runs["W4A2/squat/seed0"]["mechanism"]["squat_layer1_step_drift"][2][1] != 0.0
    assert "squat_kd" not in runs["W4A2/feature-only/seed0"]["mechanism"]  # no logit term
    assert "squat_kd" in runs["W4A2/squat/seed0"]["mechanism"]
    pooled = results["over_seeds"]["W4A2"]
    assert pooled["seeds"] == ["seed0", "seed1"]
    for metric in ("nll", "kl"):
        per_seed = pooled[metric]["per_seed_window_difference"]
        assert len(per_seed["seed0"]) == 3 and pooled[metric]["per_window_mean"] == pytest.approx(
            [(a + b) / 2 for a, b in zip(per_seed["seed0"], per_seed["seed1"])])
        assert pooled[metric]["se_over_seeds"] is not None
    assert results["comparisons"]["W4A2/seed0"]["kl_se"] >= 0
    table = (tmp_path / "squat.md").read_text()
    assert "| W4A2 | feature-only | 0 | 1 | 0 → " in table  # the mechanism table: drift starts at 0
    assert "per-window NLL (nats/token), paired per evaluation window over seeds 0, 1" in table
    assert "at the inputs of `model.layers.1.mlp.gate_proj`, `model.layers.1.mlp.up_proj` only, learning rate 0.01; " \
           "distilled feature at decoder layer(s) 1" in table
    assert (tmp_path / "squat_mechanism.png").stat().st_size > 1000

    # continuing: the same settings add only what is missing; a file that predates distillation_layers (its runs
    # without the key) continues with the default, and refuses other layers
    path = tmp_path / "squat.json"
    again = run_squat_bench(loaded, stream[:3000], stream[3000:], settings=["W4A2"], arms=arms, seeds=[0, 1],
                            base=base, out=tmp_path, train_description="a", eval_description="b", progress=False)
    assert again["runs"] == json.loads(path.read_text())["runs"] == json.loads(json.dumps(runs))
    old = json.loads(path.read_text())
    for run in old["runs"].values():
        del run["settings"]["distillation_layers"]
    path.write_text(json.dumps(old))
    run_squat_bench(loaded, stream[:3000], stream[3000:], settings=["W4A2"], arms=["squat"], seeds=[0],
                    base=replace(base, distillation_layers=None), out=tmp_path, train_description="a",
                    eval_description="b", progress=False)
    with pytest.raises(ValueError, match=r"distillation_layers: None there, \[1\] now"):
        run_squat_bench(loaded, stream[:3000], stream[3000:], settings=["W4A2"], arms=["squat"], seeds=[0],
                        base=base, out=tmp_path, train_description="a", eval_description="b", progress=False)


def test_bench_squat_seeds_the_reference_arms_and_pairs_squat_with_each(tmp_path):
    from hf_kvcodecs.bench.squat import run_squat_bench
    from hf_kvcodecs.training.run import SQuaTRunSettings

    loaded, stream = tiny_bench_inputs()
    base = SQuaTRunSettings(group_size=16, steps=2, sequence_tokens=32, batch_size=2, eval_windows=3, eval_tokens=64,
                            activation_granularity="tensor", activation_modules=LAST_MLP_INPUTS,
                            distillation_layers=[1])
    results = run_squat_bench(loaded, stream[:3000], stream[3000:], settings=["W4A2"], arms=["squat", "logit-kd"],
                              seeds=[0, 1], reference_seeds=[0, 1], base=base, out=tmp_path, train_description="a",
                              eval_description="b", progress=False)
    assert set(results["runs"]) == {"W4A2/squat/seed0", "W4A2/squat/seed1", "W4A2/logit-kd/seed0",
                                    "W4A2/logit-kd/seed1"}
    assert results["over_seeds"] == {}  # no raw-teacher arm ran
    pooled = results["over_seeds_against"]["logit-kd"]["W4A2"]
    assert pooled["seeds"] == ["seed0", "seed1"]
    runs = results["runs"]
    expected = [statistics.mean(runs[f"W4A2/squat/{seed}"]["trained"]["window_nll"][window]
                                - runs[f"W4A2/logit-kd/{seed}"]["trained"]["window_nll"][window]
                                for seed in ("seed0", "seed1")) for window in range(3)]
    assert pooled["nll"]["per_window_mean"] == pytest.approx(expected)
    assert "W4A2: SQuaT minus logit-kd, per-window NLL" in (tmp_path / "squat.md").read_text()
