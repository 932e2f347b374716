"""The `hf-kvcodecs` command line: every sub-command's help, the library values its parser mirrors, what building the
parser imports, and that each command's deferred imports resolve."""

import argparse
import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import pkgutil
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hf_kvcodecs import cli
from hf_kvcodecs.cli import defaults
from hf_kvcodecs.cli._common import HelpFormatter

COMMANDS = {("demo",), ("calibrate",), ("push-codebooks",), ("compress",), ("bench", "kv"), ("bench", "memory"),
            ("bench", "codec"), ("bench", "weights"), ("bench", "split"), ("bench", "decode"), ("bench", "scd"),
            ("bench", "squat"), ("bench", "scd-mismatch"), ("bench", "scd-transport"), ("bench", "scd-serving"), ("squat",), ("scd", "make-consumer"), ("scd", "make-draft"),
            ("scd", "fit"), ("export",)}
# the SCD commands name two models (--producer, --consumer) instead of one --model
PAIR_COMMANDS = {("bench", "scd"), ("bench", "scd-mismatch"), ("bench", "scd-transport"), ("bench", "scd-serving"), ("scd", "fit")}
# Imported by commands when they run, never by building the parser or printing --help: `import hf_kvcodecs` imports
# none of them either (it registers with transformers once transformers loads its model code).
HEAVY_MODULES = ["torch", "transformers", "numpy", "matplotlib", "hf_kvcodecs.gsrq", "hf_kvcodecs.scd",
                 "hf_kvcodecs.quantization", "hf_kvcodecs.bench.harness", "hf_kvcodecs.bench.kv", "hf_kvcodecs.bench.decode",
                 "hf_kvcodecs.bench.bit_split", "hf_kvcodecs.bench.weights", "hf_kvcodecs.bench.codec_ablation",
                 "hf_kvcodecs.quantization.compress", "hf_kvcodecs.gsrq.store", "hf_kvcodecs.evaluation.paired",
                 "hf_kvcodecs.bench.scd", "hf_kvcodecs.scd.consumer", "hf_kvcodecs.bench.scd_transport",
                 "hf_kvcodecs.transport"]


def _parsers(parser, path=()):
    """(command path, parser) of the top-level parser and every sub-command, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _leaf_parsers():
    parsers = dict(_parsers(cli.build_parser()))
    return {path: parser for path, parser in parsers.items() if path and not any(
        isinstance(action, argparse._SubParsersAction) for action in parser._actions)}


def _option(path, dest):
    parser = _leaf_parsers()[path]
    return next(action for action in parser._actions if action.dest == dest)


def _default(path, dest):
    return _leaf_parsers()[path].get_default(dest)


def test_every_sub_command_is_there_and_its_help_exits_0(capsys):
    assert set(_leaf_parsers()) == COMMANDS
    for path, _ in _parsers(cli.build_parser()):
        with pytest.raises(SystemExit) as exit_:
            cli.run([*path, "--help"])
        assert exit_.value.code == 0, path
        assert capsys.readouterr().out.startswith(f"usage: hf-kvcodecs {' '.join(path)}".rstrip())


def test_every_option_has_help_that_shows_its_default():
    for path, parser in _parsers(cli.build_parser()):
        assert parser.formatter_class is HelpFormatter, path
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue  # each sub-command has its own help line, checked as a parser of its own
            text = formatter._expand_help(action)
            assert text.strip(), (path, action.dest)  # every option and positional says what it is
            if action.nargs == 0 or action.required or not action.option_strings:
                continue  # flags are off unless given; required options and positionals have no default
            assert "(default" in text and "(default: None)" not in text, (path, action.dest, text)
            if action.default is not None:
                default = action.default
                shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
                assert shown in text, (path, action.dest, text)


def test_help_shows_list_defaults_as_they_are_typed(capsys):
    with pytest.raises(SystemExit):
        cli.run(["demo", "--help"])
    assert "(default: 2.0 1.0)" in " ".join(capsys.readouterr().out.split())


def test_the_mirrored_library_values_are_the_library_values(monkeypatch, tmp_path):
    from hf_kvcodecs import models, text
    from hf_kvcodecs.bench import bit_split, decode, harness, kv, weights
    from hf_kvcodecs.codecs import joint, kmeans
    from hf_kvcodecs.codecs.weight_quantization import ZERO_POINTS
    from hf_kvcodecs.gsrq import codebooks, store
    from hf_kvcodecs.quantization import KVCodecsConfig

    assert defaults.DEFAULT_MODEL_NAME == models.DEFAULT_MODEL_NAME
    assert defaults.ZERO_POINTS == ZERO_POINTS and ZERO_POINTS[0] == KVCodecsConfig().zero_point
    assert (defaults.CALIBRATION_TEXT, defaults.EVALUATION_TEXT) == (text.CALIBRATION_DEFAULT, text.EVALUATION_DEFAULT)
    assert defaults.GSRQ_CALIBRATION_TEXT == text.GSRQ_CALIBRATION_DEFAULT
    assert defaults.CODEBOOK_LEARNERS == tuple(sorted(kmeans.CODEBOOK_LEARNERS))
    assert defaults.DEFAULT_LEARNER == kmeans.DEFAULT_LEARNER
    assert (defaults.KEY_LAYOUTS, defaults.VALUE_LAYOUTS) == (codebooks.LAYOUTS["keys"], codebooks.LAYOUTS["values"])
    assert (defaults.DEFAULT_KEY_LAYOUT, defaults.DEFAULT_VALUE_LAYOUT) == (joint.DEFAULT_KEY_LAYOUT,
                                                                           joint.DEFAULT_VALUE_LAYOUT)
    assert (defaults.POST_ROPE_KEY_LAYOUT, defaults.POST_ROPE_VALUE_LAYOUT) == (joint.POST_ROPE_KEY_LAYOUT,
                                                                               joint.POST_ROPE_VALUE_LAYOUT)
    fit_defaults = store.calibration_defaults()
    assert defaults.CALIBRATION == {name: fit_defaults[name] for name in defaults.CALIBRATION}
    assert defaults.GSRQ_LEARNERS == tuple(kv.GSRQ_LEARNERS) and defaults.GSRQ_RATES == kv.GSRQ_RATES
    assert defaults.BASELINE_IDS == tuple(harness.BASELINE_IDS)
    assert defaults.KV_WINDOWS == {"full": kv.FULL["n_windows"], "quick": kv.QUICK["n_windows"]}
    assert defaults.KV_PASSKEY_TRIALS == {"full": kv.FULL["passkey_trials"], "quick": kv.QUICK["passkey_trials"]}
    depths = kv.FULL.get("passkey_depths", inspect.signature(harness.evaluate_methods).parameters["passkey_depths"].default)
    assert defaults.KV_PASSKEY_CELLS == len(kv.FULL["passkey_lengths"]) * len(depths)
    assert defaults.SPLIT_LAYOUTS == tuple(bit_split.SPLIT_LAYOUTS) and defaults.SPLIT_OFFSETS == bit_split.DEFAULT_OFFSETS
    assert (defaults.DECODE_CONTEXTS, defaults.DECODE_STEPS) == (decode.DECODE_CONTEXTS, decode.DECODE_STEPS)
    assert defaults.WEIGHT_METHODS == weights.METHOD_NAMES
    # the codebook store the help describes
    monkeypatch.setenv("HF_KVCODECS_CACHE", str(tmp_path))
    assert store.default_store() == tmp_path / "codebooks"
    monkeypatch.delenv("HF_KVCODECS_CACHE")
    assert store.default_store() == Path.home() / ".cache" / "hf_kvcodecs" / "codebooks"
    assert defaults.CODEBOOK_STORE.startswith("$HF_KVCODECS_CACHE/codebooks,") and "~/.cache/hf_kvcodecs" in defaults.CODEBOOK_STORE


def test_the_gsrq_cache_options_are_gsrq_cache_config_s():
    """defaults.GSRQ_CACHE_OPTIONS is GSRQCacheConfig's command-line options as the parser needs them; on a change to
    the dataclass, the assertion message is the table to paste."""
    import typing

    from hf_kvcodecs.gsrq.config import GSRQCacheConfig

    def value_type(name):
        kinds = [kind for kind in typing.get_args(typing.get_type_hints(GSRQCacheConfig)[name]) if kind is not type(None)]
        return kinds[0] if kinds else typing.get_type_hints(GSRQCacheConfig)[name]

    library = {name: {"type": value_type(name), "default": GSRQCacheConfig.defaults()[name],
                      "choices": GSRQCacheConfig.metadata(name)["choices"], "help": GSRQCacheConfig.metadata(name)["help"]}
               for name in GSRQCacheConfig.option_names(cli=True)}
    assert defaults.GSRQ_CACHE_OPTIONS == library, library
    assert list(defaults.GSRQ_CACHE_OPTIONS) == list(library)  # the order --help lists them in
    demo = _leaf_parsers()[("demo",)]
    for name, option in library.items():
        if name == "bits":
            continue  # the demo's own --bits takes several rates
        action = next(action for action in demo._actions if action.dest == name)
        assert (action.type, action.default, action.choices, action.help) == (
            option["type"], option["default"], option["choices"], option["help"]), name


def _signature_defaults(function):
    return {name: p.default for name, p in inspect.signature(function).parameters.items() if p.default is not p.empty}


def test_the_parser_defaults_are_the_library_defaults():
    import dataclasses

    from hf_kvcodecs.bench import bit_split, codec_ablation, decode, harness, kv, weights
    from hf_kvcodecs.codecs import kmeans
    from hf_kvcodecs.gsrq import codebooks, store
    from hf_kvcodecs.quantization.compress import CompressSettings

    # export takes a quantized checkpoint: no default model
    for path in COMMANDS - {("push-codebooks",), ("export",)} - PAIR_COMMANDS:
        assert _default(path, "model") == defaults.DEFAULT_MODEL_NAME
    for path in PAIR_COMMANDS:
        assert _default(path, "producer") == defaults.DEFAULT_MODEL_NAME
    fit = store.calibration_defaults()
    calibrate = {"bits": "bits", "learner": "learner", "transform": "transform", "metric": "metric",
                 "key_space": "key_space", "key_layout": "key_layout", "value_layout": "value_layout",
                 "group_dim": "group_dim", "scale_bits": "scale_bits", "windows": "num_windows", "seed": "seed"}
    assert {dest: _default(("calibrate",), dest) for dest in calibrate} == {dest: fit[name] for dest, name in calibrate.items()}
    assert _default(("calibrate",), "unweighted") is (not fit["weighted"])
    assert tuple(_option(("calibrate",), "learner").choices) == tuple(sorted(kmeans.CODEBOOK_LEARNERS))
    for command in (("calibrate",), ("bench", "kv")):
        assert tuple(_option(command, "key_layout").choices) == codebooks.LAYOUTS["keys"]
        assert tuple(_option(command, "value_layout").choices) == codebooks.LAYOUTS["values"]

    settings = {field.name: field.default for field in dataclasses.fields(CompressSettings)}
    renamed = {"eval_text": "evaluation_text"}
    for dest in ("weight_bits", "group_size", "symmetric", "zero_point", "mode", "kv", "kv_bits", "calibration_text",
                 "calibration_windows", "calibration_window_tokens", "eval_text", "eval_windows", "eval_context_tokens",
                 "eval_decoded_tokens", "seed"):
        assert _default(("compress",), dest) == settings[renamed.get(dest, dest)], dest
    command = CompressSettings(model="m", zero_point="integer", kv="none").command("out")
    assert cli.build_parser().parse_args(shlex.split(command)[1:]).zero_point == "integer"

    assert tuple(_option(("bench", "kv"), "learners").choices) == tuple(kv.GSRQ_LEARNERS)
    assert tuple(_option(("bench", "kv"), "baselines").choices) == tuple(harness.BASELINE_IDS)
    assert tuple(_default(("bench", "kv"), "seeds")) == _signature_defaults(kv.run_kv_benchmark)["seeds"]
    memory = _signature_defaults(kv.measure_memory)
    assert (tuple(_default(("bench", "memory"), "contexts")), _default(("bench", "memory"), "decode_steps")) == (
        memory["contexts"], memory["decode_steps"])
    speed = _signature_defaults(decode.run_decode_benchmark)
    assert tuple(_default(("bench", "decode"), "contexts")) == speed["contexts"]
    assert (_default(("bench", "decode"), "steps"), _default(("bench", "decode"), "repeats")) == (speed["steps"],
                                                                                                  speed["repeats"])
    split = _signature_defaults(bit_split.run_bit_split_benchmark)
    for dest in ("average_bits", "offsets", "layouts"):
        assert tuple(_default(("bench", "split"), dest)) == tuple(split[dest]), dest
    assert tuple(_option(("bench", "split"), "layouts").choices) == tuple(bit_split.SPLIT_LAYOUTS)
    measured = _signature_defaults(weights.run_weights_benchmark)
    for dest in ("model", "windows", "window_tokens", "group_size"):
        assert _default(("bench", "weights"), dest) == measured[dest], dest
    assert tuple(_option(("bench", "weights"), "methods").choices) == weights.METHOD_NAMES
    assert tuple(_default(("bench", "codec"), "seeds")) == _signature_defaults(codec_ablation.run_codec_ablation)["seeds"]


def test_building_the_parser_and_printing_help_imports_no_heavy_module():
    """In a fresh interpreter: `hf-kvcodecs --help`, every sub-command's --help and `python -m hf_kvcodecs.cli --help`
    import neither torch nor transformers, and of the package only the cli and what `import hf_kvcodecs` loads."""
    script = f"""
import json, runpy, sys
sys.argv = ["hf-kvcodecs", "--help"]
import hf_kvcodecs
package = sorted(name for name in sys.modules if name.startswith("hf_kvcodecs"))
from hf_kvcodecs import cli
codes = []
for argv in {[[], *[list(path) for path in sorted(COMMANDS)], ["bench"]]!r}:
    try:
        cli.run(argv + ["--help"])
    except SystemExit as exit_:
        codes.append(exit_.code)
sys.argv = ["hf_kvcodecs.cli", "--help"]
try:
    runpy.run_module("hf_kvcodecs.cli", run_name="__main__")
except SystemExit as exit_:
    codes.append(exit_.code)
print(json.dumps({{"codes": codes, "package": package,
                  "new": sorted(name for name in sys.modules if name.startswith("hf_kvcodecs") and name not in package),
                  "heavy": [name for name in {HEAVY_MODULES!r} if name in sys.modules]}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["codes"] == [0] * (len(COMMANDS) + 3)
    assert report["heavy"] == [], "imported by --help: by the cli package, or by `import hf_kvcodecs` itself"
    assert report["package"] == ["hf_kvcodecs", "hf_kvcodecs.integrations", "hf_kvcodecs.integrations.import_hooks",
                                 "hf_kvcodecs.version"]
    assert [name for name in report["new"] if not name.startswith("hf_kvcodecs.cli")] == []


def test_the_console_script_is_cli_run():
    (script,) = [entry for entry in importlib.metadata.entry_points(group="console_scripts") if entry.name == "hf-kvcodecs"]
    assert script.value == "hf_kvcodecs.cli:run" and script.load() is cli.run


def _deferred_imports():
    """(module, imported module, names) of every import inside a function of the cli package."""
    for info in pkgutil.walk_packages(cli.__path__, prefix="hf_kvcodecs.cli."):
        if info.name.endswith(".__main__"):
            continue  # importing it runs the command line
        module = importlib.import_module(info.name)
        package = module.__name__ if info.ispkg else module.__name__.rpartition(".")[0]
        for function in ast.walk(ast.parse(Path(module.__file__).read_text())):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom):
                    target = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                        if node.level else node.module
                    yield info.name, target, [alias.name for alias in node.names]
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        yield info.name, alias.name, []


def test_every_import_a_command_defers_resolves():
    seen = 0
    for module, target, names in _deferred_imports():
        imported = importlib.import_module(target)
        for name in names:  # a name may be an attribute or a submodule
            assert hasattr(imported, name) or importlib.util.find_spec(f"{target}.{name}"), (module, target, name)
        seen += 1
    assert seen > 20


COMMANDS_THAT_LOAD = [["demo"], ["calibrate", "--out", "{tmp}/new"], ["bench", "kv"], ["bench", "memory"],
                      ["bench", "codec"], ["bench", "split"], ["bench", "decode"]]


@pytest.mark.parametrize("argv", COMMANDS_THAT_LOAD, ids=lambda argv: " ".join(argv[:2]))
def test_commands_load_the_model_through_cli_load(argv, monkeypatch, tmp_path, capsys):
    def refuse(args):
        raise ValueError(f"stub load of {args.model}")

    monkeypatch.setattr(cli, "_load", refuse)
    assert cli.run([word.format(tmp=tmp_path) for word in argv] + ["--model", "some/model"]) == 2
    assert capsys.readouterr().err == "error: stub load of some/model\n"


def test_calibrate_checks_its_output_directory_before_loading(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("the model was loaded"))
    (tmp_path / "file").write_text("keep me")
    assert cli.run(["calibrate", "--out", str(tmp_path / "file")]) == 2
    assert "is a file; codebooks are saved as a directory" in capsys.readouterr().err


def test_the_scd_fit_parser_defaults_are_the_library_defaults():
    import dataclasses

    from hf_kvcodecs.cli import scd as scd_cli
    from hf_kvcodecs.scd import fit

    library = dataclasses.asdict(fit.SCDFitSettings())
    assert scd_cli.SCD_FIT == {name: library[name] for name in scd_cli.SCD_FIT}
    assert scd_cli.SCD_ENCODERS == fit.ENCODERS
    for dest in ("budget_kl", "windows", "holdout_prompts", "encoder", "max_patch_layers", "exact_tokens",
                 "patch_mode", "max_recompute_layers", "code_format", "code_gain"):
        assert _default(("scd", "fit"), dest) == library[dest]
    assert tuple(_default(("scd", "fit"), "code_bits")) == library["code_bits"]
    assert tuple(_default(("scd", "fit"), "recompute_depths")) == library["recompute_depths"]
    from hf_kvcodecs.scd.knowledge_base import CODE_FORMATS, PATCH_MODES

    assert scd_cli.SCD_PATCH_MODES == PATCH_MODES
    assert scd_cli.SCD_CODE_FORMATS == CODE_FORMATS


def test_squat_cli_mirrors_the_library():
    import dataclasses

    from hf_kvcodecs.cli import squat
    from hf_kvcodecs.codecs.learnable import ACTIVATION_GRANULARITIES
    from hf_kvcodecs.training.run import ARMS, SQuaTRunSettings

    assert tuple(sorted(ARMS)) == squat.SQUAT_ARMS
    assert squat.ACTIVATION_GRANULARITIES == ACTIVATION_GRANULARITIES
    defaults = {field.name: field.default for field in dataclasses.fields(SQuaTRunSettings)}
    assert {name: defaults[name] for name in squat.SQUAT_RUN} == squat.SQUAT_RUN
    from hf_kvcodecs.quantization.modules import WEIGHT_INITS

    assert squat.WEIGHT_INITS == WEIGHT_INITS
    from hf_kvcodecs.codecs.weight_quantization import ZERO_POINTS

    for command in (("squat",), ("compress",)):
        assert tuple(_option(command, "zero_point").choices) == ZERO_POINTS
    assert _default(("squat",), "zero_point") == defaults["zero_point"] == "float"
    assert squat.weight_grid("stretched") == {"weight_init": "stretched", "symmetric": True}
    assert _default(("squat",), "weight_init") == defaults["weight_init"] == "minmax"
    assert _default(("bench", "squat"), "weight_init") == "minmax"
