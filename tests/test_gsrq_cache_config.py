"""GSRQCacheConfig is the one source of GSRQ's cache options: the cache, generate()'s cache_config, a checkpoint's
kv_cache_config and the command line take the names it lists, with its defaults and its checks."""

import argparse
import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

import hf_kvcodecs
from hf_kvcodecs import GSRQCache, GSRQCacheConfig, cli
from hf_kvcodecs.cli import demo
from hf_kvcodecs.gsrq.artifact import GSRQ_CODEBOOKS
from hf_kvcodecs.gsrq.layer import GSRQLayer
from hf_kvcodecs.integrations.attention import attention_implementation

from .conftest import tiny_llama_config

NAMES = GSRQCacheConfig.option_names()
DEFAULTS = GSRQCacheConfig.defaults()
# every option but where the codebooks are and the model's RoPE frequencies, away from its default
NOT_DEFAULT = {"bits": 1.0, "key_bits": 1.5, "value_bits": 1.0, "window_length": 6, "flush_interval": 3,
               "num_sink_tokens": 1, "attention": "dequantize", "beam_width": 2, "gain": "rms"}


def test_the_options_and_their_defaults():
    assert NAMES == tuple(field.name for field in dataclasses.fields(GSRQCacheConfig))
    assert set(NOT_DEFAULT) == set(NAMES) - {"codebooks", "codebooks_revision", "codebooks_subfolder", "rope_inv_freq"}
    assert all(NOT_DEFAULT[name] != DEFAULTS[name] for name in NOT_DEFAULT)
    assert GSRQCacheConfig() == GSRQCacheConfig(**DEFAULTS)
    assert GSRQCacheConfig(bits=None).bits == DEFAULTS["bits"] == 2.0  # GSRQCache(bits=None) meant the default
    assert hf_kvcodecs.GSRQCacheConfig is hf_kvcodecs.gsrq.GSRQCacheConfig is GSRQCacheConfig


def test_the_defaults_are_what_a_cache_built_without_options_does(tiny_model, tiny_codebooks_dir):
    cache = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir)
    assert (cache.bits, cache.key_bits, cache.value_bits) == (DEFAULTS["bits"],) * 3
    assert (cache.window_length, cache.flush_interval, cache.num_sink_tokens, cache.attention) == (
        DEFAULTS["window_length"], DEFAULTS["flush_interval"], DEFAULTS["num_sink_tokens"], DEFAULTS["attention"])
    layer = cache.layers[0]
    assert (layer.beam_width, layer.gain, layer.window_length) == (DEFAULTS["beam_width"], DEFAULTS["gain"],
                                                                  DEFAULTS["window_length"])
    torch.testing.assert_close(layer.rope_inv_freq, cache.codebooks.rope_inv_freq)  # default: the calibrated ones
    layer_defaults = {name: p.default for name, p in inspect.signature(GSRQLayer).parameters.items()
                      if p.default is not inspect.Parameter.empty}
    assert layer_defaults == {"beam_width": DEFAULTS["beam_width"], "gain": DEFAULTS["gain"]}


def test_every_place_takes_the_names_the_dataclass_lists():
    # the cache's keyword arguments (its signature is built from the dataclass)
    parameters = inspect.signature(GSRQCache).parameters
    assert tuple(parameters) == ("config", *NAMES)
    assert {name: p.default for name, p in parameters.items() if name != "config"} == DEFAULTS
    # generate(cache_config=...) reaches GSRQCache.for_generate, which reads it through GSRQCacheConfig.from_dict
    assert "GSRQCacheConfig.from_dict(cache_config)" in inspect.getsource(GSRQCache.for_generate)
    # a compressed checkpoint's kv_cache_config, and the keys that locate its codebooks
    assert GSRQ_CODEBOOKS.cache_options == GSRQCacheConfig.option_names(checkpoint=True)
    assert GSRQCache.artifact_options == GSRQCacheConfig.option_names(locates_codebooks=True) == (
        "codebooks", "codebooks_revision", "codebooks_subfolder")
    assert GSRQ_CODEBOOKS.location_key == GSRQCache.artifact_options[0]
    # the command line: `demo` has one option per name meant for it, and its own --bits (several rates)
    parser = argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    demo_parser = parser._subparsers._group_actions[0].choices["demo"]
    group = next(group for group in demo_parser._action_groups if group.title == "GSRQ cache options")
    assert tuple(action.dest for action in group._group_actions) == tuple(
        name for name in GSRQCacheConfig.option_names(cli=True) if name not in demo.OWN_OPTIONS)
    assert set(demo.OWN_OPTIONS) <= set(GSRQCacheConfig.option_names(cli=True))
    assert {action.dest for action in demo_parser._actions} >= set(GSRQCacheConfig.option_names(cli=True))
    for action in group._group_actions:
        assert action.default == DEFAULTS[action.dest], action.dest
        assert action.option_strings == [f"--{action.dest.replace('_', '-')}"]
        assert tuple(action.choices or ()) == tuple(GSRQCacheConfig.metadata(action.dest)["choices"] or ())


def test_generate_cache_config_and_the_constructor_set_the_same_options(tiny_model, tiny_codebooks_dir):
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    out = tiny_model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                              cache_implementation="gsrq", cache_config={"codebooks": str(tiny_codebooks_dir),
                                                                         **NOT_DEFAULT})
    by_hand = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **NOT_DEFAULT)
    from_config = GSRQCache.from_cache_config(tiny_model.config,
                                              GSRQCacheConfig(codebooks=tiny_codebooks_dir, **NOT_DEFAULT))
    for cache in (out.past_key_values, by_hand, from_config):
        assert (cache.bits, cache.key_bits, cache.value_bits) == (1.0, 1.5, 1.0)
        assert (cache.window_length, cache.flush_interval, cache.num_sink_tokens) == (6, 3, 1)
        assert cache.attention_path == "dequantize"
        assert (cache.layers[0].beam_width, cache.layers[0].gain) == (2, "rms")


def test_an_unknown_option_is_refused_with_the_valid_names(tiny_model, tiny_codebooks_dir):
    listed = re.escape(str(list(NAMES)))
    with pytest.raises(ValueError, match=rf"Unknown GSRQCache option\(s\) \['windowlength'\].*{listed}.*"
                                         r"did you mean 'windowlength' -> 'window_length'"):
        GSRQCacheConfig.from_dict({"windowlength": 3})
    with pytest.raises(ValueError, match=rf"\['sinks'\].*{listed}"):
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, sinks=2)
    with pytest.raises(ValueError, match=rf"\['bitz'\].*{listed}"):
        tiny_model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=1, cache_implementation="gsrq",
                            cache_config={"codebooks": str(tiny_codebooks_dir), "bitz": 1})
    with pytest.raises(TypeError, match="must be a dict"):
        GSRQCacheConfig.from_dict([("bits", 2)])


@pytest.mark.parametrize("options, message", [
    ({"window_length": -1}, r"window_length must be a non-negative integer, got -1: give a whole number of tokens "
                            r"\(default 32\)"),
    ({"num_sink_tokens": 2.5}, "num_sink_tokens must be a non-negative integer, got 2.5"),
    ({"flush_interval": 0}, "flush_interval must be at least 1"),
    ({"bits": 0}, "bits must be a positive number of bits per KV element"),
    ({"key_bits": "1"}, "key_bits must be a positive number"),
    ({"attention": "fast"}, r"attention must be one of \('auto', 'codes', 'dequantize'\)"),
    ({"beam_width": 0}, r"beam_width must be an integer from 1 \(greedy\) to 64"),
    ({"gain": "l2"}, "gain must be one of"),
    ({"codebooks_revision": 3}, "codebooks_revision must be a string"),
])
def test_bad_values_are_refused_by_the_dataclass_and_so_by_the_cache(tiny_codebooks_dir, options, message):
    with pytest.raises(ValueError, match=message):
        GSRQCacheConfig(**options)
    with pytest.raises(ValueError, match=message):
        GSRQCache(codebooks=tiny_codebooks_dir, **options)


def test_bits_the_codebooks_do_not_offer_are_refused_with_what_they_do(tiny_model, tiny_codebooks_dir):
    with pytest.raises(ValueError, match=r"bits=0.3 is below the lowest rate .* they serve"):
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, bits=0.3)
    with pytest.raises(ValueError, match=r"bits=8 needs .* Re-run `hf-kvcodecs calibrate --bits 8`"):
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, bits=8)


def test_a_bad_cache_config_leaves_the_model_as_it_was(tiny_codebooks_dir):
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    before = attention_implementation(model.config)
    with pytest.raises(ValueError, match="window_length must be"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=1, cache_implementation="gsrq",
                       cache_config={"codebooks": str(tiny_codebooks_dir), "window_length": -4})
    assert attention_implementation(model.config) == before  # not switched to the code-reading attention


def test_to_dict_and_from_dict_round_trip():
    config = GSRQCacheConfig(codebooks="some/codebooks", codebooks_subfolder="kv_codebooks", **NOT_DEFAULT)
    options = config.to_dict()
    assert tuple(options) == NAMES and options["window_length"] == 6
    assert GSRQCacheConfig.from_dict(options) == config
    assert GSRQCacheConfig.from_dict(GSRQCacheConfig().to_dict()) == GSRQCacheConfig()
    checkpoint = {name: options[name] for name in GSRQCacheConfig.option_names(checkpoint=True)}
    assert GSRQCacheConfig.from_dict(json.loads(json.dumps(checkpoint))) == GSRQCacheConfig(
        codebooks="some/codebooks", **NOT_DEFAULT)
    frequencies = torch.rand(8)
    held = GSRQCacheConfig(rope_inv_freq=frequencies).to_dict()
    assert held["rope_inv_freq"] is frequencies  # held as given, not copied
    assert GSRQCacheConfig.from_dict(held).rope_inv_freq is frequencies


def test_the_command_line_checks_the_options_before_loading_the_model(monkeypatch, capsys):
    def no_load(args):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(cli, "_load", no_load)
    assert cli.run(["demo", "--window-length", "-1"]) == 2
    assert "window_length must be a non-negative integer" in capsys.readouterr().err
    assert cli.run(["demo", "--bits", "2", "0"]) == 2
    assert "bits must be a positive number" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["demo", "--flush-interval", "8", "--attention", "dequantize"])
    from hf_kvcodecs.cli._gsrq_options import gsrq_cache_options

    given = gsrq_cache_options(args, skip=demo.OWN_OPTIONS)
    assert given == {**{name: DEFAULTS[name] for name in given}, "flush_interval": 8, "attention": "dequantize"}
    assert "key_bits" not in given  # left at None: each run's --bits


def test_the_usage_guide_lists_every_option_with_its_default():
    """docs/usage.md's table of cache_config keys: the dataclass's names, and its defaults where it states them."""
    text = (Path(__file__).parents[1] / "docs" / "usage.md").read_text()
    table = text.split("### `cache_config` keys", 1)[1].split("\n### ", 1)[0]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| `")]
    listed = {}
    for keys, default in rows:
        for key in re.findall(r"`(\w+)`", keys):
            listed[key] = default.strip().strip("`").strip('"')
    assert tuple(sorted(listed)) == tuple(sorted(NAMES))
    for name, default in listed.items():
        if isinstance(DEFAULTS[name], (int, float, str)) and not isinstance(DEFAULTS[name], bool):
            assert default == str(DEFAULTS[name]), name
