"""`bench kv` options that choose its rows (learners, codec layout, layout variants, baselines) and its
long-context tasks."""

import inspect
import json
import shlex
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from hf_kvcodecs import GSRQCodebooks, cli
from hf_kvcodecs.bench import harness, kv
from hf_kvcodecs.bench.harness import BASELINE_IDS, shipped_baselines
from hf_kvcodecs.cli import defaults
from hf_kvcodecs.cli.bench.kv import _task_suite_options
from hf_kvcodecs.evaluation import TaskSuiteOptions
from hf_kvcodecs.evaluation.tasks import TASKS
from hf_kvcodecs.gsrq import GSRQCache
from hf_kvcodecs.models import LoadedModel

from .conftest import TINY_BITS, _tiny_codebooks, tiny_llama_config
from .test_long_context_tasks import _byte_tokenizer


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
    task_options = []  # the long-context suite each run asks for
    monkeypatch.setattr(kv, "generate_task_items", lambda tokenizer, options: task_options.append(options) or [])
    monkeypatch.setattr(kv, "long_context_tasks", lambda *args, **settings: {})

    def run(command):
        assert cli.main(shlex.split(command)[1:]) == 0
        rows, recorded = measured[-2:]
        return rows, recorded

    run.protocols = protocols
    run.task_options = task_options
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


def test_long_context_tasks_are_chosen_and_recorded(runs):
    rows, recorded = runs("hf-kvcodecs bench kv --baselines quanto-4 --learners l2 --no-layout-variants "
                          "--tasks niah_single vt --task-lengths 2K 4096 --task-items 2")
    assert runs.task_options == [TaskSuiteOptions(tasks=("niah_single", "vt"), lengths=(2048, 4096), items_per_cell=2)]
    assert "--tasks niah_single vt --task-lengths 2048 4096 --task-items 2 --baselines quanto-4" in recorded
    assert runs(recorded) == (rows, recorded) and runs.task_options[-1] == runs.task_options[0]
    _, recorded = runs("hf-kvcodecs bench kv --baselines --learners l2 --tasks all")
    assert runs.task_options[-1] == TaskSuiteOptions()  # every task at the library's lengths and items per cell
    assert f"--tasks {' '.join(TASKS)} --baselines" in recorded and "--task-" not in recorded
    _, recorded = runs("hf-kvcodecs bench kv --baselines --learners l2 --tasks none")
    assert len(runs.task_options) == 3 and "--tasks" not in recorded


def test_bad_long_context_options_are_refused_before_the_model_loads(runs, monkeypatch, capsys, tiny_model, tmp_path):
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit):  # argparse: not a task
        runs("hf-kvcodecs bench kv --tasks niah_single needle")
    assert "invalid choice: 'needle'" in capsys.readouterr().err
    for command, message in (("--tasks none vt", "give task names, or 'none' alone"),
                             ("--tasks all cwe", "give task names, or 'all' alone"),
                             ("--task-items 2", "name them with --tasks"),
                             ("--tasks vt vt", "name a task twice"),
                             ("--tasks vt --task-lengths four", "4K")):
        with pytest.raises(ValueError, match=message):
            runs(f"hf-kvcodecs bench kv {command}")
    assert runs.task_options == []
    with pytest.raises(TypeError, match="long_context must be a TaskSuiteOptions"):
        kv.run_kv_benchmark(LoadedModel(tiny_model, None, "tiny", "tiny"), out=tmp_path, long_context=("vt",))


def test_the_task_options_mirror_the_library():
    library = TaskSuiteOptions()
    assert defaults.TASK_NAMES == tuple(TASKS) == library.tasks
    assert (defaults.TASK_LENGTHS, defaults.TASK_ITEMS) == (library.lengths, library.items_per_cell)
    parser = cli.build_parser()
    assert _task_suite_options(parser.parse_args(["bench", "kv"])) is None
    assert inspect.signature(kv.run_kv_benchmark).parameters["long_context"].default is None
    assert _task_suite_options(parser.parse_args(["bench", "kv", "--tasks", "all"])) == library


@pytest.fixture
def byte_model():
    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=257, bos_token_id=256, eos_token_id=256, pad_token_id=256,
                               max_position_embeddings=2048)
    return LoadedModel(LlamaForCausalLM(config).eval(), _byte_tokenizer(), "tiny byte model", "tiny random Llama")


def test_every_method_runs_the_long_context_tasks_and_is_reported(byte_model, monkeypatch, tmp_path):
    gsrq_settings = []
    monkeypatch.setattr(kv, "gsrq_methods", lambda loaded, **settings: gsrq_settings.append(settings) or [])
    options = TaskSuiteOptions(tasks=("niah_single",), lengths=(1024,), items_per_cell=1)
    results = kv.run_kv_benchmark(byte_model, out=tmp_path, quick=True, baselines=["quanto-4"], speed=False,
                                  progress=False, long_context=options)
    suite = json.loads((tmp_path / "results.json").read_text())["long_context"]
    fp, quanto = "fp32 DynamicCache", "quanto 4-bit (per-channel keys)"
    assert list(suite["methods"]) == [fp, quanto] and list(suite["vs_reference"]) == [quanto]
    assert suite["reference"] == fp and suite["not_run"] == {} and suite["options"] == options.to_dict()
    # quanto quantizes 32-token multiples of this model's KV: every method prefills that much, decodes the rest
    assert suite["prefill_alignment"] == 32
    (item,) = suite["methods"][quanto]["items"]
    assert item["prompt_sha256"] == suite["methods"][fp]["items"][0]["prompt_sha256"] and item["generated_tokens"] >= 1
    difference = suite["vs_reference"][quanto]["lengths"]["1024"]["score"]
    assert difference["n"] == 1 and difference["se"] is None and -1 <= difference["mean"] <= 1
    markdown = (tmp_path / "results.md").read_text()
    assert "## Long-context tasks (RULER-style)" in markdown
    assert "| method | niah_single 1024 | mean 1024 |" in markdown and f"| {quanto} | " in markdown
    assert "| method | Δ 1024 | Δ overall |" in markdown
    assert results["files"]["long_context_plot"] == str(tmp_path / "long_context_vs_length.png")
    assert (tmp_path / "long_context_vs_length.png").stat().st_size > 0
    assert "--tasks niah_single --task-lengths 1024 --task-items 1 --baselines quanto-4" in results["command"]


def test_a_context_length_too_short_for_a_task_fails_before_any_calibration(byte_model, monkeypatch, tmp_path):
    monkeypatch.setattr(kv, "gsrq_methods", lambda loaded, **settings: pytest.fail("calibrated"))
    with pytest.raises(ValueError, match="'cwe' is too short"):
        kv.run_kv_benchmark(byte_model, out=tmp_path, quick=True, baselines=[], progress=False,
                            long_context=TaskSuiteOptions(tasks=("cwe",), lengths=(1024,), items_per_cell=1))


def test_aligned_prefill_feeds_the_rest_of_a_prompt_in_decode_mode(tiny_model):
    calls = []

    def recorded(input_ids, **settings):
        calls.append(input_ids.shape[-1])
        return tiny_model(input_ids, **settings)

    prompt = torch.randint(3, 128, (1, 77), generator=torch.Generator().manual_seed(0))
    runner = harness._AlignedPrefill(recorded, 32)
    with torch.no_grad():
        split = runner(prompt, cache=DynamicCache(config=tiny_model.config), use_cache=True, logits_to_keep=1)
        whole = tiny_model(prompt, cache=DynamicCache(config=tiny_model.config), use_cache=True, logits_to_keep=1)
    assert calls == [64] + [1] * 13
    torch.testing.assert_close(split.logits, whole.logits, rtol=1e-4, atol=1e-4)
    assert harness._AlignedPrefill(tiny_model, 32).config is tiny_model.config
