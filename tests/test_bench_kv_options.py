"""`bench kv` options that choose its rows: learners, codec layout, layout variants, baselines."""

import shlex

import pytest

from hf_kvcodecs import GSRQCodebooks
from hf_kvcodecs.bench import kv
from hf_kvcodecs.bench.harness import BASELINE_IDS, shipped_baselines
from hf_kvcodecs.cli import build_parser
from hf_kvcodecs.models import LoadedModel


def test_baselines_can_be_chosen_and_the_reference_always_runs(tiny_model):
    every = shipped_baselines(tiny_model)
    assert [m.name for m in every[1:]] == list(BASELINE_IDS.values())
    chosen = shipped_baselines(tiny_model, only=["hqq-2", "quanto-4"])
    assert [m.name for m in chosen] == [every[0].name, "quanto 4-bit (per-channel keys)", "hqq 2-bit (axis 1)"]
    assert [m.name for m in shipped_baselines(tiny_model, only=[])] == [every[0].name]
    with pytest.raises(ValueError, match="quanto-3.*choose from"):
        shipped_baselines(tiny_model, only=["quanto-3"])


def test_codec_layout_names_only_what_differs_from_the_default():
    assert kv.codec_layout() == ("", {})
    assert kv.codec_layout("per_head", "joint_heads") == ("", {})  # the defaults, spelled out
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


def test_the_recorded_command_reproduces_the_run():
    layout = kv.codec_layout("conditional_heads")[1]
    command = kv.kv_command("default", quick=False, seeds=(0, 1), learners=("l2",), layout=layout,
                            layout_variants=True, baselines=["quanto-4", "quanto-2"])
    assert command == ("hf-kvcodecs bench kv --seeds 0 1 --learners l2 --key-layout conditional_heads "
                       "--baselines quanto-4 quanto-2 --model default")
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert (args.seeds, args.learners, args.key_layout, args.value_layout, args.baselines, args.layout_variants) == (
        [0, 1], ["l2"], "conditional_heads", None, ["quanto-4", "quanto-2"], True)
    default = kv.kv_command("default", quick=False, seeds=(0,), learners=tuple(kv.GSRQ_LEARNERS), layout={},
                            layout_variants=True, baselines=None)
    assert default == "hf-kvcodecs bench kv --model default"
    bare = kv.kv_command("m", quick=True, seeds=(0,), learners=tuple(kv.GSRQ_LEARNERS), layout={},
                         layout_variants=False, baselines=[])
    assert bare == "hf-kvcodecs bench kv --quick --no-layout-variants --baselines --model m"
    args = build_parser().parse_args(shlex.split(bare)[1:])
    assert args.baselines == [] and not args.layout_variants
