"""Bad input gets a clear error naming the problem and the fix."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_kvcodecs import GSRQCache, GSRQCodebooks
from hf_kvcodecs.gsrq.codebooks import METADATA_FILE, TENSORS_FILE, CodebookFileError

from .conftest import resave_codebook_tensors, tiny_llama_config


def _copy(directory, tmp_path):
    target = tmp_path / "codebooks"
    shutil.copytree(directory, target)
    return target


def test_no_codebooks_is_an_error_not_a_silent_fallback(tiny_model):
    with pytest.raises(ValueError, match="needs fitted codebooks.*hf-kvcodecs calibrate"):
        tiny_model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache_implementation="gsrq")


def test_unknown_cache_config_key(tiny_model, tiny_codebooks_dir):
    with pytest.raises(ValueError, match=r"Unknown GSRQCache option\(s\) \['windowlength'\].*valid cache_config keys"):
        tiny_model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache_implementation="gsrq",
                            cache_config={"codebooks": str(tiny_codebooks_dir), "windowlength": 3})


@pytest.mark.parametrize("option, value, message", [
    ("beam_width", 0, "beam_width must be an integer from 1 \\(greedy\\) to 64, got 0"),
    ("beam_width", "8", "beam_width must be an integer"),
    ("gain", "l2", "gain must be one of \\('norm', 'least_squares', 'rms'\\)"),
])
def test_bad_encoder_options_in_cache_config(tiny_model, tiny_codebooks_dir, option, value, message):
    with pytest.raises(ValueError, match=message):
        tiny_model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache_implementation="gsrq",
                            cache_config={"codebooks": str(tiny_codebooks_dir), option: value})


@pytest.mark.parametrize("overrides, field", [
    ({"num_hidden_layers": 3}, "num_hidden_layers"),
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"head_dim": 32}, "head_dim"),
])
def test_codebooks_for_another_model(tiny_codebooks_dir, overrides, field):
    other = LlamaForCausalLM(tiny_llama_config(**overrides)).eval()
    with pytest.raises(ValueError, match=f"calibrated for a model with {field}=.*Calibrate codebooks for this model"):
        other.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache_implementation="gsrq",
                       cache_config={"codebooks": str(tiny_codebooks_dir)})


def test_layer_checks_head_shape_without_a_config(tiny_codebooks_dir):
    other = LlamaForCausalLM(tiny_llama_config(num_key_value_heads=4)).eval()
    with pytest.warns(UserWarning, match="without the model's config"):  # no config given: the first update catches the mismatch
        cache = GSRQCache(codebooks=tiny_codebooks_dir)
    with pytest.raises(ValueError, match="expect 2 KV heads of size 16"):
        other(torch.tensor([[5, 6, 7]]), cache=cache)


def test_rate_above_what_was_calibrated(tiny_model, tiny_codebooks_dir):
    with pytest.raises(ValueError, match="calibrated with 5.*hf-kvcodecs calibrate --bits 8"):
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, bits=8)
    with pytest.raises(ValueError, match="below the lowest rate"):
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, bits=0.5)


def test_wrong_dtype_mid_sequence(tiny_model, tiny_codebooks_dir):
    cache = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir)
    layer = cache.layers[0]
    cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 0)
    with pytest.raises(ValueError, match="filled with torch.float32 states and now received torch.float16"):
        layer.update(torch.randn(1, 2, 1, 16).half(), torch.randn(1, 2, 1, 16).half())


@pytest.mark.parametrize("attention", ["dequantize", "codes"])
@pytest.mark.parametrize("tensor, bad", [("keys", float("nan")), ("values", float("inf"))])
def test_non_finite_states_are_refused_before_they_are_coded(tiny_model, tiny_codebooks_dir, attention, tensor, bad):
    cache = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, window_length=2, flush_interval=1,
                      num_sink_tokens=1, attention=attention)
    layer = cache.layers[0]
    first = {"keys": torch.randn(1, 2, 3, 16), "values": torch.randn(1, 2, 3, 16)}
    first[tensor][0, 1, 1, 3] = bad  # the first token after the sink: the first one a flush codes
    cache.update(first["keys"], first["values"], 0)  # 1 sink + 2 window tokens: nothing coded yet
    if attention == "codes":
        layer.mark_attended()
    more_keys, more_values = torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16)

    def add_two_tokens():
        cache.update(more_keys, more_values, 0)
        if attention == "codes":
            layer.finish_attention()

    with pytest.raises(ValueError, match=f"cannot code non-finite {tensor}: 1 of 64 elements.*bfloat16 or float32"):
        add_two_tokens()
    # nothing was coded and nothing was lost: every token is still held exact
    assert layer.region_lengths() == {"sinks": 1, "codes": 0, "window": 4}
    held_values = torch.cat([layer.sink_values, layer.window_values], dim=-2)
    assert torch.equal(held_values[..., 3:, :], more_values)
    assert torch.equal(held_values[..., :3, :].nan_to_num(), first["values"].nan_to_num())


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(CodebookFileError, match="does not exist.*hf-kvcodecs calibrate"):
        GSRQCodebooks.load(tmp_path / "nowhere")


def test_corrupt_metadata(tiny_codebooks_dir, tmp_path):
    target = _copy(tiny_codebooks_dir, tmp_path)
    (target / METADATA_FILE).write_text("{ not json")
    with pytest.raises(CodebookFileError, match="not valid JSON.*corrupt"):
        GSRQCodebooks.load(target)


def test_future_format_version(tiny_codebooks_dir, tmp_path):
    target = _copy(tiny_codebooks_dir, tmp_path)
    metadata = json.loads((target / METADATA_FILE).read_text())
    metadata["format_version"] = 99
    (target / METADATA_FILE).write_text(json.dumps(metadata))
    with pytest.raises(CodebookFileError, match="format_version=99"):
        GSRQCodebooks.load(target)


def test_truncated_tensor_file(tiny_codebooks_dir, tmp_path):
    target = _copy(tiny_codebooks_dir, tmp_path)
    data = (target / TENSORS_FILE).read_bytes()
    (target / TENSORS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CodebookFileError, match="corrupt or truncated"):
        GSRQCodebooks.load(target)


def test_inconsistent_tensors(tiny_codebooks_dir, tmp_path):
    from safetensors.torch import load_file

    target = _copy(tiny_codebooks_dir, tmp_path)
    tensors = load_file(str(target / TENSORS_FILE))
    tensors["layers.1.values.residual.shape.codebooks"] = tensors["layers.1.values.residual.shape.codebooks"][:, :100].contiguous()
    resave_codebook_tensors(target, tensors)
    with pytest.raises(CodebookFileError, match="inconsistent codebooks"):
        GSRQCodebooks.load(target)
    del tensors["layers.1.values.residual.shape.codebooks"]
    resave_codebook_tensors(target, tensors)
    with pytest.raises(CodebookFileError, match="lacks tensor"):
        GSRQCodebooks.load(target)


def test_round_trip_preserves_codecs(tiny_codebooks_dir):
    codebooks = GSRQCodebooks.load(tiny_codebooks_dir)
    x = torch.randn(2, 10, 16)
    again = GSRQCodebooks.load(tiny_codebooks_dir)
    torch.testing.assert_close(codebooks.key_codecs[1].reconstruct(x), again.key_codecs[1].reconstruct(x))
    assert codebooks.calibration["text"]["description"].startswith("random token ids")


def test_scale_bits_that_disagree_with_the_tensors(tiny_codebooks_dir, tmp_path):
    from safetensors.torch import load_file

    target = _copy(tiny_codebooks_dir, tmp_path)
    tensors = load_file(str(target / TENSORS_FILE))
    resave_codebook_tensors(target, {k: v for k, v in tensors.items() if not k.endswith("log_scale_range")})
    with pytest.raises(CodebookFileError, match="16-bit scales where the config says 8.*re-run calibrate"):
        GSRQCodebooks.load(target)


def test_version_1_files_with_fp16_scales_still_load_and_run(tiny_model, tiny_token_stream, tmp_path):
    from hf_kvcodecs.gsrq.calibrate import fit_gsrq_codebooks

    directory = tmp_path / "v1"
    fit_gsrq_codebooks(
        tiny_model, tiny_token_stream, text_info={"description": "random token ids (unit test, not an evaluation)"},
        bits=2.0, window_tokens=128, sampled_tokens_per_window=64, num_windows=4, holdout_windows=1, n_iter=2,
        fit_rows=512, scale_bits=16, out=directory, progress=False,
    )
    metadata = json.loads((directory / METADATA_FILE).read_text())
    metadata["format_version"] = 1  # written before 8-bit scales existed: no scale_bits in the config
    del metadata["config"]["scale_bits"]
    (directory / METADATA_FILE).write_text(json.dumps(metadata))
    codebooks = GSRQCodebooks.load(directory)
    assert codebooks.scale_bits == 16 and codebooks.stages_for_bits(2.0) == (2 * 16 - 16) // 8
    cache = GSRQCache(tiny_model.config, codebooks=codebooks, window_length=1, flush_interval=1, num_sink_tokens=0)
    tiny_model(torch.tensor([[5, 6, 7, 8, 9]]), cache=cache)
    assert cache.layers[0].key_scales.dtype == torch.float16 and cache.layers[0].key_codes.shape[-2] > 0


def test_joint_layout_round_trips_and_its_files_are_checked(tiny_joint_codebooks_dir, tmp_path):
    from safetensors.torch import load_file

    codebooks = GSRQCodebooks.load(tiny_joint_codebooks_dir)
    assert codebooks.layout("keys") == codebooks.layout("values") == "joint_heads"
    assert codebooks.key_codecs[0].code_heads == 1
    # one code for both 16-dim heads: (3 * 32 - 2 * 8) / 8 = 10 stages at 3 bits, (2 * 32 - 16) / 8 = 6 at 2
    assert codebooks.stages_for_bits(3.0, "keys") == 10 and codebooks.stages_for_bits(2.0, "values") == 6
    x = torch.randn(2, 10, 16)
    again = GSRQCodebooks.load(tiny_joint_codebooks_dir)
    torch.testing.assert_close(codebooks.value_codecs[1].reconstruct(x), again.value_codecs[1].reconstruct(x))

    target = _copy(tiny_joint_codebooks_dir, tmp_path)
    metadata = json.loads((target / METADATA_FILE).read_text())
    metadata["config"]["value_layout"] = "per_token"
    (target / METADATA_FILE).write_text(json.dumps(metadata))
    with pytest.raises(CodebookFileError, match="value_layout must be one of"):
        GSRQCodebooks.load(target)
    metadata["config"]["value_layout"] = "joint_heads"
    (target / METADATA_FILE).write_text(json.dumps(metadata))
    tensors = load_file(str(target / TENSORS_FILE))
    tensors["layers.0.keys.log_scale_range"] = tensors["layers.0.keys.log_scale_range"][:1].contiguous()
    resave_codebook_tensors(target, tensors)
    with pytest.raises(CodebookFileError, match="log_scale_range .* is not \\[2, 2\\]"):
        GSRQCodebooks.load(target)


# ---- found by a review of bad-input paths (2026-12-01) ------------------------------------------------------------
def _edit_metadata(directory, tmp_path, edit):
    target = _copy(directory, tmp_path)
    metadata = json.loads((target / METADATA_FILE).read_text())
    edit(metadata)
    (target / METADATA_FILE).write_text(json.dumps(metadata))
    return target


def _set(*path_and_value):
    *path, value = path_and_value

    def edit(metadata):
        node = metadata
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return edit


_DELETE = object()


@pytest.mark.parametrize("edit, message", [
    (_set("config", _DELETE), "KeyError: 'config'"),
    (_set("num_layers", "two"), "num_layers='two'"),
    (_set("num_layers", 0), "num_layers=0"),
    (_set("num_layers", 1), r"num_layers=1 \(fingerprint: 2 layers\)"),
    (_set("config", "group_dim", 0), "group_dim=0"),
    (_set("stats", "x"), "config and stats objects"),
    (_set("format_version", True), "format_version=True"),
    (_set("format_version", "4"), "format_version='4'"),
    (_set("rope_attention_scaling", float("nan")), "rope_attention_scaling must be a positive finite number"),
    (_set("rope_attention_scaling", 0), "rope_attention_scaling must be a positive finite number"),
    (_set("config", "key_space", "post_rope"), "per_head_codebooks keys need keys coded before RoPE"),
], ids=["no-config", "layers-text", "no-layers", "fewer-layers", "group-dim-0", "stats-text", "version-bool",
        "version-text", "scaling-nan", "scaling-0", "key-space-edited"])
def test_damaged_descriptions_are_codebook_file_errors(tiny_codebooks_dir, tmp_path, edit, message):
    with pytest.raises(CodebookFileError, match=message):
        GSRQCodebooks.load(_edit_metadata(tiny_codebooks_dir, tmp_path, edit))


def test_key_space_edited_on_shared_codebooks_is_refused(tiny_per_head_codebooks_dir, tmp_path):
    """Keys per head with shared codebooks may be coded after RoPE: the stored rotary frequencies give the edit away."""
    edited = _edit_metadata(tiny_per_head_codebooks_dir, tmp_path, _set("config", "key_space", "post_rope"))
    with pytest.raises(CodebookFileError, match="says keys are coded after RoPE"):
        GSRQCodebooks.load(edited)


def test_deeply_nested_or_huge_descriptions_are_refused_without_parsing(tiny_codebooks_dir, tmp_path):
    target = _copy(tiny_codebooks_dir, tmp_path)
    (target / METADATA_FILE).write_text("[" * 100_000)
    with pytest.raises(CodebookFileError, match="nests too deeply"):
        GSRQCodebooks.load(target)
    with open(target / METADATA_FILE, "wb") as handle:
        handle.truncate(65 * 2**20)  # sparse: no memory or disk spent
    with pytest.raises(CodebookFileError, match="more than a codebook description ever needs"):
        GSRQCodebooks.load(target)


@pytest.mark.parametrize("corrupt", ["nan", "short", "2-d"])
def test_rotary_frequencies_are_checked_on_load(tiny_codebooks_dir, tmp_path, corrupt):
    from safetensors.torch import load_file

    target = _copy(tiny_codebooks_dir, tmp_path)
    tensors = load_file(str(target / TENSORS_FILE))
    inv_freq = tensors["rope.inv_freq"]
    tensors["rope.inv_freq"] = {"nan": torch.full_like(inv_freq, float("nan")), "short": inv_freq[:3].clone(),
                                "2-d": inv_freq[None].clone()}[corrupt]
    resave_codebook_tensors(target, tensors)
    with pytest.raises(CodebookFileError, match="rope.inv_freq must hold 8 positive finite rotary frequencies"):
        GSRQCodebooks.load(target)


def test_codebooks_for_a_model_with_other_rope(tiny_codebooks_dir):
    other = LlamaForCausalLM(tiny_llama_config(rope_theta=500000.0)).eval()
    with pytest.raises(ValueError, match=r"RoPE default \(theta 10000.0\).*theta 500000.0.*wrong frequencies"):
        GSRQCache(other.config, codebooks=tiny_codebooks_dir)


@pytest.mark.parametrize("option, value", [("bits", "two"), ("bits", float("nan")), ("bits", True), ("bits", [2]),
                                           ("key_bits", float("inf")), ("value_bits", 0)])
def test_bit_rates_must_be_positive_numbers(tiny_model, tiny_codebooks_dir, option, value):
    with pytest.raises(ValueError, match=f"{option} must be a positive number of bits per KV element"):
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, **{option: value})


def test_other_option_types(tiny_model, tiny_codebooks_dir):
    with pytest.raises(ValueError, match="window_length must be a non-negative integer, got True"):
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, window_length=True)
    with pytest.raises(ValueError, match="config must be the model's transformers config"):
        GSRQCache({"num_hidden_layers": 2}, codebooks=tiny_codebooks_dir)


def test_code_attention_requested_for_a_model_that_does_not_read_codes(tiny_codebooks_dir):
    model = LlamaForCausalLM(tiny_llama_config()).eval()  # plain SDPA: would get placeholders, not keys
    with pytest.raises(ValueError, match=r"attention='codes' needs .*hf_kvcodecs.enable_code_attention\(model\)"):
        GSRQCache(model.config, codebooks=tiny_codebooks_dir, attention="codes")


def test_meta_device_models_are_refused_clearly(tiny_codebooks_dir):
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_llama_config()).eval()
    with pytest.raises(ValueError, match="'meta' device"):
        model(torch.tensor([[5, 6, 7]], device="meta"), cache=GSRQCache(model.config, codebooks=tiny_codebooks_dir))


@pytest.mark.parametrize("settings, message", [
    (dict(bits=0), "bits must be a positive number"),
    (dict(bits=float("nan")), "bits must be a positive number"),
    (dict(group_dim=0), "group_dim must be a positive integer"),
    (dict(group_dim=5), "group_dim=5 must divide the model's head_dim=16"),
    (dict(num_windows=0), "num_windows must be a positive integer"),
], ids=["bits-0", "bits-nan", "group-dim-0", "group-dim-5", "no-windows"])
def test_calibration_settings_are_checked_before_any_activation_is_collected(tiny_model, monkeypatch, settings,
                                                                             message):
    from hf_kvcodecs.gsrq import calibrate as calibration

    def collected(*args, **kwargs):
        raise AssertionError("activations were collected before the settings were checked")

    monkeypatch.setattr(calibration, "collect_kv_samples", collected)
    with pytest.raises(ValueError, match=message):
        calibration.fit_gsrq_codebooks(tiny_model, torch.arange(10_000) % 100, text_info={}, **settings)


def test_calibration_out_must_not_be_a_file(tiny_model, tmp_path):
    from hf_kvcodecs.gsrq import fit_gsrq_codebooks

    (tmp_path / "file").write_text("keep me")
    with pytest.raises(ValueError, match="is a file; codebooks are saved as a directory"):
        fit_gsrq_codebooks(tiny_model, torch.arange(10_000) % 100, text_info={}, out=tmp_path / "file")
    assert (tmp_path / "file").read_text() == "keep me"


def test_calibration_does_not_overwrite_saved_codebooks_unless_asked(tiny_model, tiny_codebooks_dir, tmp_path,
                                                                     monkeypatch):
    from hf_kvcodecs.cli import run
    from hf_kvcodecs.gsrq import calibrate as calibration

    target = _copy(tiny_codebooks_dir, tmp_path)
    before = {name: (target / name).read_bytes() for name in (TENSORS_FILE, METADATA_FILE)}

    def collected(*args, **kwargs):
        raise AssertionError("activations were collected before --out was checked")

    monkeypatch.setattr(calibration, "collect_kv_samples", collected)
    with pytest.raises(FileExistsError, match="already holds GSRQ codebooks.*--overwrite"):
        calibration.fit_gsrq_codebooks(tiny_model, torch.arange(10_000) % 100, text_info={}, out=target)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        GSRQCodebooks.load(tiny_codebooks_dir).save(target, overwrite=False)
    assert {name: (target / name).read_bytes() for name in before} == before
    monkeypatch.setattr("hf_kvcodecs.cli._load", lambda args: pytest.fail("the model was loaded"))
    assert run(["calibrate", "--out", str(target)]) == 2
    assert {name: (target / name).read_bytes() for name in before} == before


def test_saves_are_atomic_and_a_mixed_pair_of_files_is_refused(tiny_codebooks_dir, tmp_path, monkeypatch):
    codebooks = GSRQCodebooks.load(tiny_codebooks_dir)
    target = codebooks.save(tmp_path / "codebooks")
    first = {name: (target / name).read_bytes() for name in (TENSORS_FILE, METADATA_FILE)}
    assert sorted(path.name for path in target.iterdir()) == sorted(first)  # no temporary files left behind

    import hf_kvcodecs.fileio as module

    real_replace, moves = module.os.replace, []

    def crash_after_first_move(source, destination):  # the process dies between the two files of a save
        if moves:
            raise KeyboardInterrupt
        moves.append(destination)
        real_replace(source, destination)

    monkeypatch.setattr(module.os, "replace", crash_after_first_move)
    with pytest.raises(KeyboardInterrupt):
        codebooks.save(target)
    monkeypatch.setattr(module.os, "replace", real_replace)
    assert sorted(path.name for path in target.iterdir()) == sorted(first)  # the staged file was removed
    assert (target / METADATA_FILE).read_bytes() == first[METADATA_FILE]
    assert (target / TENSORS_FILE).read_bytes() != first[TENSORS_FILE]  # (same tensors, another save_id)
    with pytest.raises(CodebookFileError, match="two different saves"):
        GSRQCodebooks.load(target)
    codebooks.save(target)
    GSRQCodebooks.load(target)


def test_saved_files_reach_the_disk_before_they_are_moved_into_place(tiny_codebooks_dir, tmp_path, monkeypatch):
    import hf_kvcodecs.fileio as module

    codebooks, events = GSRQCodebooks.load(tiny_codebooks_dir), []
    real_fsync, real_replace, real_open = module.os.fsync, module.os.replace, module.os.open
    opened = {}

    def recording_open(path, flags, *args):
        descriptor = real_open(path, flags, *args)
        opened[descriptor] = Path(path).name
        return descriptor

    monkeypatch.setattr(module.os, "open", recording_open)
    monkeypatch.setattr(module.os, "fsync", lambda fd: (events.append(("fsync", opened[fd])), real_fsync(fd)))
    monkeypatch.setattr(module.os, "replace", lambda a, b: (events.append(("replace", Path(b).name)), real_replace(a, b)))
    target = codebooks.save(tmp_path / "codebooks")
    kinds = [kind for kind, _ in events]
    assert kinds == ["fsync", "fsync", "replace", "replace", "fsync"]
    assert all(name.endswith(".partial") for _, name in events[:2]) and events[-1] == ("fsync", target.name)
    GSRQCodebooks.load(target)


@pytest.mark.parametrize("name, dtype", [("layers.0.keys.head.0.stage_groups", torch.float32),
                                         ("layers.0.keys.head.1.codebooks", torch.int32),
                                         ("layers.0.keys.head.0.mean", torch.bool),
                                         ("layers.1.values.residual.shape.codebooks", torch.int64)])
def test_tensors_of_the_wrong_dtype_are_refused(tiny_codebooks_dir, tmp_path, name, dtype):
    from safetensors.torch import load_file

    target = _copy(tiny_codebooks_dir, tmp_path)
    tensors = load_file(str(target / TENSORS_FILE))
    assert name in tensors
    tensors[name] = tensors[name].to(dtype)
    resave_codebook_tensors(target, tensors)
    with pytest.raises(CodebookFileError, match=f"tensor {name} is {dtype}"):
        GSRQCodebooks.load(target)


def test_codebooks_that_are_empty_an_empty_string_or_a_file_get_errors_that_name_the_mistake(tiny_model, tiny_codebooks_dir,
                                                                                            tmp_path):
    ids = torch.tensor([[5, 6, 7]])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CodebookFileError, match=f"{METADATA_FILE} does not exist.*hf-kvcodecs calibrate"):
        tiny_model.generate(ids, max_new_tokens=2, cache_implementation="gsrq", cache_config={"codebooks": str(empty)})
    with pytest.raises(ValueError, match="codebooks is an empty string"):
        tiny_model.generate(ids, max_new_tokens=2, cache_implementation="gsrq", cache_config={"codebooks": ""})
    with pytest.raises(CodebookFileError, match=f"is a file; pass the directory that holds.*{tiny_codebooks_dir.name}"):
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir / METADATA_FILE)


@pytest.mark.parametrize("cache_config", ["some/dir", ["some/dir"], ("bits", 2)])
def test_cache_config_that_is_not_a_dict(tiny_model, cache_config):
    with pytest.raises(TypeError, match="cache_config must be a dict, got .*cache_config=\\{'codebooks': DIR"):
        tiny_model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache_implementation="gsrq",
                            cache_config=cache_config)


def test_a_cache_built_without_the_model_config_warns_that_nothing_was_checked(tiny_codebooks_dir):
    with pytest.warns(UserWarning, match="without the model's config.*GSRQCache\\(model.config, codebooks="):
        GSRQCache(codebooks=tiny_codebooks_dir)
