"""`bench kv` options that choose its rows: learners, codec layout, layout variants, baselines."""

import shlex
from types import SimpleNamespace

import pytest
import torch

from hf_kvcodecs import GSRQCodebooks, cli
from hf_kvcodecs.bench import kv
from hf_kvcodecs.bench.harness import BASELINE_IDS, shipped_baselines
from hf_kvcodecs.gsrq import GSRQCache
from hf_kvcodecs.models import LoadedModel

from .conftest import TINY_BITS, _tiny_codebooks


def test_baselines_can_be_chosen_and_the_reference_always_runs(tiny_model):
    every = shipped_baselines(tiny_model)
    assert [m.name for m in every[1:]] == list(BASELINE_IDS.values())
    chosen = shipped_baselines(tiny_model, only=["hqq-2", "quanto-4"])
    assert [m.name for m in chosen] == [every[0].name, "quanto 4-bit (per-channel keys)", "hqq 2-bit (axis 1)"]
    assert [m.name for m in shipped_baselines(tiny_model, only=[])] == [every[0].name]
    with pytest.raises(ValueError, match="quanto-3.*choose from"):
        shipped_baselines(tiny_model, only=["quanto-3"])
    turboquant = shipped_baselines(tiny_model, only=["turboquant-2.5", "turboquant-3-protected"])[1:]
    assert [m.name for m in turboquant] == ["turboquant 2.5-bit (rotation + Lloyd-Max)",
                                            "turboquant 3-bit (rotation + Lloyd-Max, first and last layer exact)"]
    assert [(m.family, m.nominal_bits, m.extra["protected_layers"]) for m in turboquant] == [
        ("turboquant", 2.5, 0), ("turboquant", 3.0, 1)]
    assert all(m.skip_reason is None and m.prefill_multiple == 1 for m in turboquant)


def test_turboquant_baselines_through_the_cli(runs):
    rows, recorded = runs("hf-kvcodecs bench kv --baselines turboquant-2 turboquant-3.5 turboquant-2-protected "
                          "--learners l2 --no-layout-variants")
    assert rows == ["fp32 DynamicCache", "turboquant 2-bit (rotation + Lloyd-Max)",
                    "turboquant 3.5-bit (rotation + Lloyd-Max)",
                    "turboquant 2-bit (rotation + Lloyd-Max, first and last layer exact)"] + [
        f"same codec, l2 k-means codebooks {bits}-bit" for bits in (1, 2)]
    assert "--baselines turboquant-2 turboquant-3.5 turboquant-2-protected" in recorded
    assert runs(recorded) == (rows, recorded)


def test_codec_layout_names_only_what_differs_from_the_default():
    assert kv.codec_layout() == ("", {})
    assert kv.codec_layout("per_head_codebooks", "given_keys") == ("", {})  # the defaults, spelled out
    assert kv.codec_layout(value_layout="joint_heads") == (", values joint over heads", {"value_layout": "joint_heads"})
    assert kv.codec_layout("per_head") == (", keys per head", {"key_layout": "per_head"})  # shared codebooks
    assert kv.codec_layout("conditional_heads") == (", keys conditional on earlier heads",
                                                    {"key_layout": "conditional_heads"})
    assert kv.codec_layout("joint_heads", "per_head") == (", keys joint over heads, values per head",
                                                          {"key_layout": "joint_heads", "value_layout": "per_head"})
    with pytest.raises(ValueError, match="value_layout must be one of"):
        kv.codec_layout(value_layout="conditional_heads")  # values have no conditional layout


@pytest.fixture
def calibrations(monkeypatch, tiny_model, tiny_codebooks_dir):
    """Stands in for the codebook store: records the settings of every calibration bench kv asks for."""
    asked = []
    codebooks = GSRQCodebooks.load(tiny_codebooks_dir)

    def fake_ensure(loaded, *, store=None, text=None, progress=True, **settings):
        asked.append(settings)
        return codebooks, tiny_codebooks_dir, True

    monkeypatch.setattr(kv, "ensure_codebooks", fake_ensure)
    return asked


def test_gsrq_rows_follow_learners_seeds_and_layout(calibrations, tiny_model):
    loaded = LoadedModel(tiny_model, None, "tiny", "tiny random model")
    methods = kv.gsrq_methods(loaded, learners=("l2",), seeds=(0, 1), layout=kv.codec_layout("conditional_heads"),
                              progress=False)
    assert calibrations == [{"learner": "l2", "bits": 2.0, "seed": seed, "key_layout": "conditional_heads"}
                            for seed in (0, 1)]
    assert [m.name for m in methods] == [
        f"same codec, l2 k-means codebooks, seed {seed}, keys conditional on earlier heads {bits}-bit"
        for seed in (0, 1) for bits in (1, 2)]
    assert {m.family for m in methods} == {"l2-rvq (keys conditional-heads)"}
    assert [(m.extra["seed"], m.extra["bits"]) for m in methods] == [(0, 1.0), (0, 2.0), (1, 1.0), (1, 2.0)]


@pytest.fixture
def runs(monkeypatch, calibrations, tiny_model, tmp_path):
    """`hf-kvcodecs bench kv ...` through the CLI with the model load, text and measurements stubbed out: returns a
    function from a command line to (the rows it would measure, the command it records)."""
    loaded = LoadedModel(tiny_model, None, "tiny model dir", "tiny random model")
    monkeypatch.setattr(cli, "_load", lambda args: loaded)
    monkeypatch.setattr(kv, "load_corpus", lambda text, default: SimpleNamespace(description=str(text or default)))
    monkeypatch.setattr(kv, "tokenize_corpus", lambda tokenizer, corpus: torch.arange(100))
    measured, protocols = [], []

    def fake_evaluate(model, tokenizer, methods, **settings):
        protocols.append(settings)
        measured.append([method.name for method in methods])
        return {"methods": []}

    def fake_reports(results, out):
        measured.append(results["command"])
        (tmp_path / "results.md").write_text("table")
        return {"markdown": tmp_path / "results.md"}

    monkeypatch.setattr(kv, "evaluate_methods", fake_evaluate)
    monkeypatch.setattr(kv, "write_reports", fake_reports)

    def run(command):
        assert cli.main(shlex.split(command)[1:]) == 0
        rows, recorded = measured[-2:]
        return rows, recorded

    run.protocols = protocols
    return run


def test_the_recorded_command_reproduces_the_run(runs):
    threads = torch.get_num_threads()
    rows, recorded = runs(f"hf-kvcodecs bench kv --model 'tiny model dir' --threads {threads} --seeds 0 1 "
                          "--learners l2 --key-layout conditional_heads --baselines quanto-4 quanto-2 "
                          "--text a.txt 'b c.txt' --out somewhere")
    assert rows == ["fp32 DynamicCache", "quanto 4-bit (per-channel keys)", "quanto 2-bit (per-channel keys)"] + [
        f"same codec, l2 k-means codebooks, seed {seed}, keys conditional on earlier heads {bits}-bit"
        for seed in (0, 1) for bits in (1, 2)]
    assert recorded == (f"hf-kvcodecs bench kv --threads {threads} --seeds 0 1 --learners l2 --key-layout "
                        "conditional_heads --baselines quanto-4 quanto-2 --text a.txt 'b c.txt' --model 'tiny model dir'")
    assert runs(recorded) == (rows, recorded)  # the recorded command measures the same rows and records itself


def test_layout_variants_run_only_next_to_default_l2_rows(runs):
    rows, recorded = runs("hf-kvcodecs bench kv --baselines")
    assert rows[0] == "fp32 DynamicCache" and len(rows) == 1 + 2 * 2 + 2 * len(kv.LAYOUT_VARIANTS)
    assert any(row.endswith(", keys conditional on earlier heads 2-bit") for row in rows)
    assert recorded.endswith(f"bench kv --threads {torch.get_num_threads()} --baselines --model 'tiny model dir'")
    rows, _ = runs("hf-kvcodecs bench kv --baselines --learners gskm-principal")  # no l2 rows: no variants
    assert rows == ["fp32 DynamicCache"] + [f"GSRQ (gskm-principal codebooks) {bits}-bit" for bits in (1, 2)]
    rows, recorded = runs("hf-kvcodecs bench kv --baselines --no-layout-variants --learners l2")
    assert rows == ["fp32 DynamicCache"] + [f"same codec, l2 k-means codebooks {bits}-bit" for bits in (1, 2)]
    assert "--no-layout-variants" in recorded


def test_bit_rates_can_be_chosen_and_are_recorded(runs, calibrations):
    rows, recorded = runs("hf-kvcodecs bench kv --baselines --learners l2 --no-layout-variants --bits 2.5")
    assert rows == ["fp32 DynamicCache", "same codec, l2 k-means codebooks 2.5-bit"]
    assert "--bits 2.5 " in recorded and runs(recorded) == (rows, recorded)
    assert calibrations[-1]["bits"] == 2.5  # calibrated at the highest rate asked for
    # a joint code over both heads pays one index for 32 elements: 0.75 bits is one stage
    rows, _ = runs("hf-kvcodecs bench kv --baselines --learners l2 --key-layout joint_heads --bits 0.75 2")
    assert rows[1:] == [f"same codec, l2 k-means codebooks, keys joint over heads {bits}-bit" for bits in ("0.75", "2")]


def test_the_group_size_of_the_gsrq_rows_can_be_chosen(runs, calibrations):
    rows, recorded = runs("hf-kvcodecs bench kv --baselines --learners l2 --group-dim 16")
    assert rows == ["fp32 DynamicCache"] + [f"same codec, l2 k-means codebooks, 16-dim groups {bits}-bit" for bits in (1, 2)]
    assert calibrations[-1] == {"learner": "l2", "bits": 2.0, "seed": 0, "group_dim": 16}  # and no layout variants
    assert "--group-dim 16" in recorded and runs(recorded) == (rows, recorded)
    assert kv.codec_layout(group_dim=8) == ("", {})  # the default, spelled out
    assert kv.codec_layout("conditional_heads", group_dim=16) == (", keys conditional on earlier heads, 16-dim groups",
                                                                  {"key_layout": "conditional_heads", "group_dim": 16})
    assert kv.layout_family({"group_dim": 16, "key_layout": "per_head"}) == "(groups 16, keys per-head)"


def test_bad_row_choices_are_refused_before_any_calibration(runs, calibrations):
    with pytest.raises(ValueError, match="at most once"):
        runs("hf-kvcodecs bench kv --learners l2 l2")
    with pytest.raises(ValueError, match="at most once"):
        runs("hf-kvcodecs bench kv --bits 2 2")
    with pytest.raises(ValueError, match="bits must be a positive"):
        runs("hf-kvcodecs bench kv --bits 0")
    # tiny model: head_dim 16, 2 KV heads; one 8-bit index + an 8-bit scale per head vector = 1 bit per element
    with pytest.raises(ValueError, match=r"--bits 0.8 is below the lowest rate .* keys coded per head, own codebooks \(1.000 bits"):
        runs("hf-kvcodecs bench kv --bits 0.8 2")
    with pytest.raises(ValueError, match=r"--bits 0.7 is below .* keys coded joint over heads \(0.750 bits"):
        runs("hf-kvcodecs bench kv --bits 0.7 --key-layout joint_heads")
    # per head: 1 bit, then whole 8-bit stages of 16 elements (0.5 bits): 1.1 would be served at 1
    with pytest.raises(ValueError, match=r"--bits 1.1 falls between two rates .* Pass 1 or 1.5"):
        runs("hf-kvcodecs bench kv --bits 1.1 2")
    with pytest.raises(SystemExit):  # argparse: not a choice
        runs("hf-kvcodecs bench kv --baselines quanto-8")
    with pytest.raises(ValueError, match=r"--plain-rvq 6: a group size must be .* divides the model's head_dim \(16\)"):
        runs("hf-kvcodecs bench kv --plain-rvq 8 6")
    with pytest.raises(ValueError, match="given once"):
        runs("hf-kvcodecs bench kv --plain-rvq 8 8")
    with pytest.raises(SystemExit):  # argparse: not a positive integer
        runs("hf-kvcodecs bench kv --plain-rvq 0")
    with pytest.raises(ValueError, match=r"--group-dim 3: a group size must be"):
        runs("hf-kvcodecs bench kv --group-dim 3")
    assert calibrations == []


def test_the_console_script_reports_bad_input_in_one_line(runs, capsys):
    assert cli.run(["bench", "kv", "--learners", "l2", "l2"]) == 2
    assert capsys.readouterr().err == (f"error: learners must name each of {list(kv.GSRQ_LEARNERS)} at most once, got "
                                       "['l2', 'l2'].\n")
    with pytest.raises(ValueError, match="at most once"):  # --verbose: the traceback, for a bug report
        cli.run(["--verbose", "bench", "kv", "--learners", "l2", "l2"])
    with pytest.raises(SystemExit):  # argparse: usage and exit status 2
        cli.run(["bench", "kv", "--threads", "-2"])
    assert "expected a positive integer, got '-2'" in capsys.readouterr().err


def test_windows_pass_key_trials_and_speed_can_be_chosen_and_are_recorded(runs, tiny_model, tmp_path):
    rows, recorded = runs("hf-kvcodecs bench kv --baselines quanto-4 --learners l2 --no-layout-variants "
                          "--windows 28 --passkey-trials 4 --no-speed")
    protocol = runs.protocols[-1]
    assert (protocol["n_windows"], protocol["passkey_trials"], protocol["speed_contexts"]) == (28, 4, ())
    assert protocol["context_len"] == kv.FULL["context_len"]  # the rest of the protocol is unchanged
    assert "--windows 28 --passkey-trials 4 --no-speed" in recorded and runs(recorded) == (rows, recorded)
    runs("hf-kvcodecs bench kv --baselines --learners l2 --no-layout-variants")
    default = runs.protocols[-1]
    assert (default["n_windows"], default["passkey_trials"]) == (kv.FULL["n_windows"], kv.FULL["passkey_trials"])
    assert default["speed_contexts"] == kv.FULL["speed_contexts"]
    for bad in ("--windows 0", "--passkey-trials -1"):
        with pytest.raises(SystemExit):
            runs(f"hf-kvcodecs bench kv {bad}")
    loaded = LoadedModel(tiny_model, None, "tiny", "tiny random model")
    with pytest.raises(ValueError, match="windows must be an integer of at least 1, got 0"):
        kv.run_kv_benchmark(loaded, out=tmp_path, windows=0)
    with pytest.raises(ValueError, match="passkey_trials must be an integer of at least 0, got 1.5"):
        kv.run_kv_benchmark(loaded, out=tmp_path, passkey_trials=1.5)


def test_plain_residual_vq_rows_are_calibrated_and_encoded_plainly(runs, calibrations, tiny_model):
    rows, recorded = runs("hf-kvcodecs bench kv --baselines --no-layout-variants --learners l2 --plain-rvq")
    plain = [f"plain l2 residual VQ (VQLLM-like, 8-dim groups) {bits}-bit" for bits in (1, 2)]
    assert rows == ["fp32 DynamicCache"] + [f"same codec, l2 k-means codebooks {bits}-bit" for bits in (1, 2)] + plain
    assert calibrations[-1] == {"learner": "l2", "bits": 2.0, "seed": 0, "transform": "none", "key_layout": "per_head",
                                "value_layout": "per_head", "weighted": False, "group_dim": 8}
    assert "--no-layout-variants --plain-rvq 8 --baselines" in recorded
    assert runs(recorded)[0] == rows
    rows, recorded = runs("hf-kvcodecs bench kv --baselines --no-layout-variants --learners l2 --plain-rvq 8 16")
    assert rows[-2:] == [f"plain l2 residual VQ (VQLLM-like, 16-dim groups) {bits}-bit" for bits in (1, 2)]
    assert calibrations[-1]["group_dim"] == 16 and "--plain-rvq 8 16 --baselines" in recorded
    assert "--plain-rvq" not in runs("hf-kvcodecs bench kv --baselines --no-layout-variants")[1]
    rows, _ = runs("hf-kvcodecs bench kv --baselines --learners gskm-principal l2 --no-layout-variants --plain-rvq")
    assert rows[-4:] == [f"plain residual VQ, gskm-principal codebooks (VQLLM-like, 8-dim groups) {bits}-bit"
                         for bits in (1, 2)] + plain  # the paper's swap: GSKM within the plain pipeline
    assert [(c["learner"], c.get("transform")) for c in calibrations[-4:]] == [
        ("gskm-principal", None), ("l2", None), ("gskm-principal", "none"), ("l2", "none")]
    loaded = LoadedModel(tiny_model, None, "tiny", "tiny random model")
    plain = kv.gsrq_methods(loaded, learners=("l2",), seeds=(3, 4), plain_rvq=(16,), progress=False)[-1]
    assert plain.name == "plain l2 residual VQ (VQLLM-like, 16-dim groups), seed 3 2-bit"
    assert plain.family == "plain-rvq (16-dim groups)"
    assert plain.extra["encoder"] == {"gain": "rms", "beam_width": 1} and plain.extra["seed"] == 3
    cache = plain.make_cache(tiny_model)
    assert (cache.layers[0].gain, cache.layers[0].beam_width) == ("rms", 1)
    with pytest.raises(ValueError, match="positive integers, got 0"):
        kv.gsrq_methods(loaded, plain_rvq=(0,), progress=False)


def test_plain_residual_vq_codebooks_decode_close_to_the_full_precision_cache(tiny_model, tiny_token_stream, tmp_path):
    """The plain settings calibrate for real (no transform, shared per-head codebooks, unweighted) and the cache
    built from them generates; its logits track the full-precision cache's."""
    directory = _tiny_codebooks(tiny_model, tiny_token_stream, tmp_path / "plain", **kv.plain_rvq_row(8)[2])
    codebooks = GSRQCodebooks.load(directory)
    assert codebooks.layout("keys") == "per_head" and codebooks.layout("values") == "per_head"
    prompt = tiny_token_stream[:200][None]
    with torch.no_grad():
        reference = tiny_model(prompt).logits[0, -1]
        cache = GSRQCache(tiny_model.config, codebooks=codebooks, bits=TINY_BITS, window_length=8, flush_interval=8,
                          num_sink_tokens=2, **kv.PLAIN_RVQ_ENCODER)
        tiny_model(prompt[:, :-1], cache=cache)  # prefill; the next token attends over the coded history
        coded = tiny_model(prompt[:, -1:], cache=cache).logits[0, -1]
    assert cache.get_seq_length() == 200
    relative = float((coded - reference).norm() / reference.norm())
    assert 0 < relative < 0.5
