"""KVCodecsConfig / the hf_kvcodecs quantizer: packing, RTN, save → fresh-process load, KV codebooks, errors."""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, LlamaForCausalLM

import hf_kvcodecs
from hf_kvcodecs import GSRQCache
from hf_kvcodecs.codecs.weight_quantization import codes_for, mse_clipped_parameters, packed_width, rtn_parameters
from hf_kvcodecs.gsrq.codebooks import METADATA_FILE, TENSORS_FILE, CodebookFileError
from hf_kvcodecs.quantization import (
    KV_CODEBOOKS_FOLDER,
    FakeQuantLinear,
    KVCodecsConfig,
    KVCodecsHfQuantizer,
    PackedLinear,
    attach_kv_codebooks,
    dequantize_weight,
    dequantized_weight_cache,
    pack_codes,
    pack_fake_quantized,
    quantize_model,
    quantize_weight,
    register,
    unpack_codes,
)
from hf_kvcodecs.quantization.quantizer import resolve_codebooks_dir

from .conftest import tiny_llama_config

ROUND_TRIP_BITS = (1, 2, 3, 4, 8)
GROUP = 16
KV_BITS = 2.0
PROMPT = torch.tensor([[5, 17, 33, 9, 81, 64, 2, 99, 45, 12, 7, 70]])
REPO_ROOT = Path(__file__).resolve().parents[1]


def _fresh_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}


def _run_fresh(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], capture_output=True,
                          text=True, env=_fresh_env(), timeout=300)


@pytest.fixture(scope="module")
def float_dir(tiny_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_float")
    tiny_model.save_pretrained(directory)
    return directory


def _copy_of(model):
    """A separate model with the same weights (the session fixture and its config must not be modified)."""
    copy = LlamaForCausalLM(model.config.__class__.from_dict(model.config.to_dict()))
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def _kv_config(bits, codebooks, **overrides):
    settings = dict(weight_bits=bits, group_size=GROUP, kv_cache_implementation="gsrq",
                    kv_cache_config={"codebooks": str(codebooks), "bits": KV_BITS})
    settings.update(overrides)
    return KVCodecsConfig(**settings)


@pytest.fixture(scope="module")
def saved(float_dir, tiny_codebooks_dir, tmp_path_factory):
    """Per bit width: the model quantized while loading the float checkpoint, its outputs, and its saved folder."""
    root = tmp_path_factory.mktemp("tiny_quantized")
    results = {}
    for bits in ROUND_TRIP_BITS:
        model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=_kv_config(bits, tiny_codebooks_dir))
        with torch.no_grad():
            logits = model(PROMPT).logits
        generated = model.generate(PROMPT, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        model.save_pretrained(root / f"w{bits}")
        results[bits] = {"model": model, "logits": logits, "tokens": generated.sequences, "cache": generated.cache,
                         "dir": root / f"w{bits}"}
    return results


# ---- packing and RTN math -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [32, 64, 40, 576])
def test_pack_unpack_round_trip_is_exact_and_uses_exactly_bits_per_code(bits, count):
    codes = torch.randint(0, 2**bits, (7, count), generator=torch.Generator().manual_seed(bits * 1000 + count))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.int32
    assert packed.shape == (7, math.ceil(count / 32) * bits)
    if count % 32 == 0:
        assert packed.numel() * 32 == codes.numel() * bits  # no padding, no spare bits
    assert torch.equal(unpack_codes(packed, bits, count).long(), codes)


def test_packed_rows_never_have_the_float_shape():
    for bits in range(1, 9):
        for in_features in range(8, 4097, 8):
            if (in_features, bits) != (8, 8):
                assert packed_width(in_features, bits) != in_features
    with pytest.raises(ValueError, match="would have the float weight's shape"):
        PackedLinear(8, 4, bits=8, group_size=8)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_rtn_asymmetric_is_within_half_a_step_and_inside_each_group(bits):
    weight = torch.randn(24, 128, generator=torch.Generator().manual_seed(bits))
    quantized = quantize_weight(weight, bits, 32, scale_dtype=torch.float32)
    restored = dequantize_weight(quantized.packed, quantized.scale, quantized.offset, bits, 32, 128)
    groups, restored_groups = weight.reshape(24, 4, 32), restored.reshape(24, 4, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / (2**bits - 1)
    assert torch.all((groups - restored_groups).abs() <= step[..., None] / 2 + 1e-5)
    assert torch.all(restored_groups >= groups.amin(-1, keepdim=True) - 1e-5)
    assert torch.all(restored_groups <= groups.amax(-1, keepdim=True) + 1e-5)


def test_rtn_error_shrinks_with_bits_and_symmetric_one_bit_is_plus_minus_half_scale():
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    errors = []
    for bits in (2, 3, 4, 8):
        q = quantize_weight(weight, bits, 64)
        errors.append(float((dequantize_weight(q.packed, q.scale, q.offset, bits, 64, 256) - weight).norm() / weight.norm()))
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.01 and errors[1] < 0.25
    q = quantize_weight(weight, 1, 64, symmetric=True)
    assert q.offset is None
    restored = dequantize_weight(q.packed, q.scale, None, 1, 64, 256).reshape(64, 4, 64)
    half_scale = q.scale.float()[..., None] / 2
    assert torch.allclose(restored.abs(), half_scale.expand_as(restored))
    assert torch.equal(restored.sign(), weight.reshape(64, 4, 64).sign())


def test_constant_group_is_exact_and_scales_overflowing_fp16_are_an_error():
    weight = torch.full((4, 32), 0.25)
    q = quantize_weight(weight, 3, 32)
    assert torch.equal(dequantize_weight(q.packed, q.scale, q.offset, 3, 32, 32), weight)
    with pytest.raises(ValueError, match="does not fit in float16.*scale_dtype='float32'"):
        quantize_weight(torch.tensor([[-1e6] * 16 + [1e6] * 16]), 4, 32)
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_weight(torch.tensor([[float("nan")] * 32]), 4, 32)


def test_fake_quant_layer_trains_its_grid_and_exports_to_the_same_function():
    torch.manual_seed(0)
    linear = nn.Linear(64, 8)
    fake = FakeQuantLinear.from_linear(linear, bits=3, group_size=16, scale_dtype=torch.float32)
    x = torch.randn(5, 64)
    fake(x).pow(2).sum().backward()
    assert fake.weight.grad.abs().sum() > 0 and fake.weight_scale.grad.abs().sum() > 0 and fake.weight_offset.grad.abs().sum() > 0
    packed = fake.to_packed()
    with torch.no_grad():
        assert torch.allclose(packed(x), fake(x), atol=1e-5)
        # a layer trained for float16 storage computes on the float16 grid: its export is the same function
        half = FakeQuantLinear.from_linear(linear, bits=3, group_size=16)
        assert half.to_packed().weight_scale.dtype == torch.float16
        assert torch.equal(half.to_packed().dequantized_weight(), half.quantized_weight())
        # min-max initialisation: the fake-quant forward equals RTN packing of the same layer
        assert torch.allclose(PackedLinear.from_linear(linear, bits=3, group_size=16, scale_dtype=torch.float32)(x), fake(x), atol=1e-5)


# ---- integer zero points ----------------------------------------------------------------------------------------
def test_the_default_zero_point_is_float_and_gives_the_min_max_codes_as_before():
    assert KVCodecsConfig().zero_point == "float" and "zero_point" not in KVCodecsConfig().to_dict()
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(3))
    groups = weight.reshape(16, 4, 32)
    # the float-offset min-max grid, written out: scale and offset rounded to float16, codes on that grid
    scale = ((groups.amax(-1) - groups.amin(-1)) / 15).half()
    offset = groups.amin(-1).half()
    codes = torch.round((groups - offset.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    layer = PackedLinear.from_linear(_linear(weight), bits=4, group_size=32)
    for packed, stored_scale, stored_offset in (
            (layer.weight, layer.weight_scale, layer.weight_offset),
            *((q.packed, q.scale, q.offset) for q in (quantize_weight(weight, 4, 32),
                                                       quantize_weight(weight, 4, 32, zero_point="float")))):
        assert torch.equal(unpack_codes(packed, 4, 128).reshape(16, 4, 32).float(), codes)
        assert torch.equal(stored_scale, scale) and torch.equal(stored_offset, offset)
    fake = FakeQuantLinear.from_linear(_linear(weight), bits=4, group_size=32)
    assert fake.zero_point == "float" and torch.equal(fake.weight_offset.detach(), groups.amin(-1))


def _linear(weight):
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    return linear


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_integer_zero_points_are_held_exactly_by_the_stored_scale_and_offset(bits, scale_dtype):
    weight = torch.randn(32, 256, generator=torch.Generator().manual_seed(bits)) * 0.02
    weight[0, :32] = weight[0, :32].abs() + 0.01  # a group of one sign: its grid still has a level at 0
    weight[1, :32] = 0.0  # a constant group
    levels = 2**bits - 1
    errors = {}
    for zero_point in ("float", "integer"):
        q = quantize_weight(weight, bits, 32, zero_point=zero_point, scale_dtype=scale_dtype)
        restored = dequantize_weight(q.packed, q.scale, q.offset, bits, 32, 256)
        errors[zero_point] = float((restored - weight).norm() / weight.norm())
    zero = -q.offset.double() / q.scale.double()
    assert torch.equal(zero, zero.round()) and zero.min() >= 0 and zero.max() <= levels
    codes = unpack_codes(q.packed, bits, 256).reshape(32, 8, 32).double()
    # code * scale + offset, in float32, is (code - zero) * scale exactly: the grid compressed-tensors stores
    assert torch.equal(restored.double().reshape(32, 8, 32), (codes - zero[..., None]) * q.scale.double()[..., None])
    assert torch.equal(restored[1, :32], weight[1, :32])
    # the grid is min-max's up to a zero on an integer and a scale the offset can hold: within 10 % of its error
    assert errors["float"] < errors["integer"] < 1.1 * errors["float"], errors
    # MSE clipping with integer zero points: exact grids again, each group's error at most the min-max one's
    clipped = mse_clipped_parameters(weight, bits, 32, False, candidates=8, zero_point="integer",
                                     scale_dtype=scale_dtype)
    minmax = rtn_parameters(weight, bits, 32, False, zero_point="integer", scale_dtype=scale_dtype)
    assert all(torch.equal(t.to(scale_dtype).float(), t) for t in (*clipped, *minmax))
    zero = -clipped[1].double() / clipped[0].double()
    assert torch.equal(zero, zero.round())

    def group_errors(scale, offset):
        codes = codes_for(weight, scale, offset, bits, 32).reshape(32, 8, 32).float()
        return (codes * scale[..., None] + offset[..., None] - weight.reshape(32, 8, 32)).square().sum(-1)

    assert (group_errors(*clipped) <= group_errors(*minmax) * (1 + 1e-5) + 1e-12).all()


def test_fake_quant_learns_integer_zero_points_and_packs_to_the_same_function():
    torch.manual_seed(0)
    linear = nn.Linear(64, 8)
    fake = FakeQuantLinear.from_linear(linear, bits=4, group_size=16, zero_point="integer")
    packed = PackedLinear.from_linear(linear, bits=4, group_size=16, zero_point="integer")
    x = torch.randn(5, 64)
    with torch.no_grad():  # starts on the packed min-max grid with integer zero points
        assert torch.equal(fake.quantized_weight(), packed.dequantized_weight())
    fake(x).pow(2).sum().backward()
    assert fake.weight_scale.grad.abs().sum() > 0 and fake.weight_offset.grad.abs().sum() > 0
    with torch.no_grad():  # a learned latent grid, off every exact one
        fake.weight_scale.mul_(1 + 0.05 * torch.rand_like(fake.weight_scale))
        fake.weight_offset.add_(0.3 * fake.weight_scale * torch.randn_like(fake.weight_offset))
        scale, offset = fake.stored_grid()
        zero = -offset.double() / scale.double()
        assert torch.equal(zero, zero.round()) and torch.equal(scale.half().float(), scale)
        # the forward pass runs on the grid the export stores
        exported = fake.to_packed()
        assert exported.zero_point == "integer" and "integer zero points" in repr(exported)
        assert torch.equal(exported.dequantized_weight(), fake.quantized_weight())
        assert torch.equal(exported(x), fake(x))


# ---- config -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, message", [
    ({"weight_bits": 0}, "weight_bits must be an integer from 1 to 8"),
    ({"weight_bits": 9}, "weight_bits must be an integer from 1 to 8"),
    ({"weight_bits": 2.5}, "weight_bits must be an integer from 1 to 8"),
    ({"weight_bits": True}, "weight_bits must be an integer from 1 to 8"),
    ({"group_size": 48}, "group_size must be a power of two from 8 to 8192"),
    ({"group_size": 4}, "group_size must be a power of two"),
    ({"group_size": "64"}, "group_size must be a power of two"),
    ({"mode": "int4"}, "mode must be one of"),
    ({"weight_bits": None, "mode": "fake"}, "needs weight_bits"),
    ({"scale_dtype": "float8"}, "scale_dtype must be one of"),
    ({"kv_cache_implementation": "quantized"}, "kv_cache_implementation must be one of"),
    ({"kv_cache_implementation": "gsrq"}, "needs kv_cache_config=\\{'codebooks': DIR\\}"),
    ({"kv_cache_config": {"bits": 2}}, "without kv_cache_implementation"),
    ({"kv_cache_implementation": "gsrq", "kv_cache_config": {"codebooks": "x", "bitz": 2}}, "Unknown kv_cache_config option"),
    ({"weight_bitz": 4}, "Unknown KVCodecsConfig option.*newer hf_kvcodecs"),
    ({"zero_point": "int"}, "zero_point must be one of"),
    ({"zero_point": "integer", "symmetric": True}, "needs weight_bits and symmetric=False"),
    ({"zero_point": "integer", "weight_bits": None}, "needs weight_bits and symmetric=False"),
    ({"quant_method": "bitsandbytes"}, "quant_method='hf_kvcodecs'"),
    ({"format_version": 99}, "format version 99.*pip install -U hf-kvcodecs"),
])
def test_bad_config_values_are_clear_errors(settings, message):
    with pytest.raises(ValueError, match=message):
        KVCodecsConfig(**settings)


def test_config_round_trips_through_its_dict_and_registration_is_idempotent():
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
        AutoQuantizationConfig,
    )

    config = KVCodecsConfig(weight_bits=3, group_size=32, symmetric=True, modules_to_not_convert=["mlp"])
    assert AutoQuantizationConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    integer = KVCodecsConfig(weight_bits=4, group_size=32, zero_point="integer")
    assert integer.to_dict()["zero_point"] == "integer"
    assert AutoQuantizationConfig.from_dict(json.loads(json.dumps(integer.to_dict()))).zero_point == "integer"
    register()
    register()
    import importlib

    importlib.reload(hf_kvcodecs)  # a second import-time registration must not raise
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["hf_kvcodecs"].__name__ == "KVCodecsConfig"
    assert AUTO_QUANTIZER_MAPPING["hf_kvcodecs"].__name__ == "KVCodecsHfQuantizer"


# ---- save → load ---------------------------------------------------------------------------------------------------
FRESH_LOAD = """
    import json, sys
    import torch
    import hf_kvcodecs  # the only extra line a user writes
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    prompt = torch.tensor(json.loads(sys.argv[1]))
    outputs, report = {}, {}
    for directory in sys.argv[2:]:
        model = AutoModelForCausalLM.from_pretrained(directory)
        with torch.no_grad():
            outputs[directory + "|logits"] = model(prompt).logits.contiguous()
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        outputs[directory + "|tokens"] = generated.sequences.contiguous()
        q_proj = model.model.layers[0].self_attn.q_proj
        report[directory] = {
            "config": model.config.quantization_config.to_dict(),
            "module": type(q_proj).__name__, "weight_dtype": str(q_proj.weight.dtype),
            "cache": type(generated.cache).__name__, "cache_bits": generated.cache.bits,
            "cache_config": model.generation_config.cache_config,
        }
    save_file(outputs, sys.argv[2] + "/../fresh_outputs.safetensors")
    print(json.dumps(report))
"""


def test_round_trip_in_a_fresh_process_gives_identical_logits_config_and_gsrq_generation(saved):
    directories = [str(saved[bits]["dir"]) for bits in ROUND_TRIP_BITS]
    result = _run_fresh(FRESH_LOAD, json.dumps(PROMPT.tolist()), *directories)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    outputs = load_file(str(Path(directories[0]).parent / "fresh_outputs.safetensors"))
    for bits, directory in zip(ROUND_TRIP_BITS, directories):
        original = saved[bits]
        assert torch.equal(outputs[directory + "|logits"], original["logits"]), bits
        assert torch.equal(outputs[directory + "|tokens"], original["tokens"]), bits
        entry = report[directory]
        assert entry["module"] == "PackedLinear" and entry["weight_dtype"] == "torch.int32"
        assert entry["config"] == {**original["model"].config.quantization_config.to_dict(),
                                   "kv_cache_config": {"codebooks": KV_CODEBOOKS_FOLDER, "bits": KV_BITS}}
        assert entry["cache"] == "GSRQCache" and entry["cache_bits"] == KV_BITS
        # the default cache reads the checkpoint's own copy of the codebooks
        assert entry["cache_config"]["codebooks"] == str((Path(directory) / KV_CODEBOOKS_FOLDER).resolve())
    assert type(saved[4]["cache"]).__name__ == "GSRQCache"  # in-process generate() picked it up too


def test_saved_files_hold_packed_weights_only_and_the_codebooks(saved, tiny_codebooks_dir):
    for bits in ROUND_TRIP_BITS:
        directory = saved[bits]["dir"]
        with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
            keys = set(handle.keys())
            metadata = handle.metadata()
            q_proj = handle.get_slice("model.layers.0.self_attn.q_proj.weight")
            assert q_proj.get_dtype() == "I32" and q_proj.get_shape() == [64, 64 // 32 * bits]
            for key in keys:
                if key.endswith("proj.weight"):  # every converted layer: packed, never a float copy
                    assert handle.get_slice(key).get_dtype() == "I32", key
        assert metadata["quant_method"] == "hf_kvcodecs" and metadata["hf_kvcodecs_format_version"] == "1"
        assert "model.layers.0.self_attn.q_proj.weight_scale" in keys and "model.layers.0.self_attn.q_proj.weight_offset" in keys
        assert not any("float" in key or key.endswith("weight_fp") for key in keys)
        state = saved[bits]["model"].state_dict()
        projections = [value for key, value in state.items() if key.endswith("proj.weight")]
        assert len(projections) == 14 and all(value.dtype == torch.int32 for value in projections)
        assert sorted(p.name for p in (directory / KV_CODEBOOKS_FOLDER).iterdir()) == sorted([METADATA_FILE, TENSORS_FILE])
        copied, original = load_file(str(directory / KV_CODEBOOKS_FOLDER / TENSORS_FILE)), load_file(str(tiny_codebooks_dir / TENSORS_FILE))
        assert copied.keys() == original.keys() and all(torch.equal(copied[k], original[k]) for k in original)
        generation = json.loads((directory / "generation_config.json").read_text())
        assert generation["cache_implementation"] == "gsrq"
        assert generation["cache_config"] == {"codebooks": KV_CODEBOOKS_FOLDER, "bits": KV_BITS}
        assert "gsrq" not in json.loads((directory / "config.json").read_text()).get("_attn_implementation", "")
    # the in-memory model keeps pointing at the codebooks it was given; saving did not rewrite them
    assert saved[4]["model"].generation_config.cache_config["codebooks"] == str(tiny_codebooks_dir)
    sizes = {bits: (saved[bits]["dir"] / "model.safetensors").stat().st_size for bits in ROUND_TRIP_BITS}
    assert sizes[1] < sizes[2] < sizes[3] < sizes[4] < sizes[8]


NO_PACKAGE = """
    import importlib.abc, json, sys

    class BlockHfKvcodecs(importlib.abc.MetaPathFinder):  # as if hf_kvcodecs were not installed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "hf_kvcodecs":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, BlockHfKvcodecs())
    from transformers import AutoModelForCausalLM

    results = {}
    for directory in sys.argv[1:]:
        try:
            AutoModelForCausalLM.from_pretrained(directory)
            results[directory] = "LOADED"
        except Exception as error:
            results[directory] = type(error).__name__ + ": " + str(error)[:300]
    print(json.dumps({"results": results, "hf_kvcodecs_imported": "hf_kvcodecs" in sys.modules}))
"""


def test_loading_without_the_package_fails_loudly_instead_of_loading_garbage(saved, float_dir, tmp_path):
    weights_only = tmp_path / "w8_weights_only"
    AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=KVCodecsConfig(weight_bits=8, group_size=GROUP)).save_pretrained(weights_only)
    directories = [str(saved[bits]["dir"]) for bits in ROUND_TRIP_BITS] + [str(weights_only)]
    result = _run_fresh(NO_PACKAGE, *directories)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["hf_kvcodecs_imported"] is False
    for directory in directories:
        # packed int32 rows never have the float shape: transformers refuses the mismatched weights
        assert report["results"][directory].startswith("RuntimeError") and "mismatched" in report["results"][directory], directory
    assert "Unknown quantization type, got hf_kvcodecs" in result.stderr


def test_quantizing_in_memory_equals_quantizing_while_loading(saved, tiny_model, tiny_codebooks_dir):
    model = _copy_of(tiny_model)
    quantize_model(model, _kv_config(3, tiny_codebooks_dir))
    assert model.state_dict().keys() == saved[3]["model"].state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved[3]["model"].state_dict().values()))
    assert type(model.lm_head) is nn.Linear  # tied output embedding kept in floating point
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, KVCodecsConfig())


def test_dequantize_returns_a_plain_model_with_the_same_function(saved, float_dir, tiny_codebooks_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(saved[4]["dir"])
    model.dequantize()
    assert not any(isinstance(m, (PackedLinear, FakeQuantLinear)) for m in model.modules())
    assert not hasattr(model, "hf_quantizer") and getattr(model.config, "quantization_config", None) is None
    assert model.generation_config.cache_implementation is None  # no dangling default to a checkpoint's codebooks
    with torch.no_grad():
        assert torch.allclose(model(PROMPT).logits, saved[4]["logits"], atol=1e-5)
    model.save_pretrained(tmp_path / "dequantized")
    assert not (tmp_path / "dequantized" / KV_CODEBOOKS_FOLDER).exists()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized")
    assert reloaded.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32


def test_fake_mode_is_trainable_by_trainer_and_packs_for_deployment(float_dir, tmp_path):
    from transformers.trainer_utils import validate_quantization_for_training

    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=KVCodecsConfig(weight_bits=2, group_size=GROUP, mode="fake"))
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, FakeQuantLinear) and layer.weight.dtype == torch.float32
    assert model.hf_quantizer.is_trainable and model.hf_quantizer.is_qat_trainable
    validate_quantization_for_training(model)  # what Trainer checks; raises for models it cannot train
    model.train()
    loss = model(PROMPT, labels=PROMPT).loss
    loss.backward()
    assert layer.weight_scale.grad is not None and layer.weight_scale.grad.abs().sum() > 0
    model.eval()
    model.save_pretrained(tmp_path / "fake")  # latent float weights + learned grid: training can resume
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fake")
    assert isinstance(reloaded.model.layers[0].mlp.down_proj, FakeQuantLinear)
    with torch.no_grad():
        fake_logits = reloaded(PROMPT).logits
        assert torch.equal(model(PROMPT).logits, fake_logits)
    pack_fake_quantized(reloaded)
    assert isinstance(reloaded.model.layers[0].mlp.down_proj, PackedLinear)
    assert reloaded.config.quantization_config.mode == "packed" and not reloaded.hf_quantizer.is_trainable
    with torch.no_grad():
        # the trained codes are kept; only the grid is rounded to fp16
        assert torch.allclose(reloaded(PROMPT).logits, fake_logits, atol=1e-3)
    packed = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=KVCodecsConfig(weight_bits=4, group_size=GROUP))
    with pytest.raises(ValueError, match="cannot perform fine-tuning on purely quantized models"):
        validate_quantization_for_training(packed)


def test_integer_zero_points_while_loading_equal_quantizing_in_memory(float_dir, tiny_model, tmp_path):
    config = KVCodecsConfig(weight_bits=4, group_size=GROUP, zero_point="integer")
    loaded = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=config)
    state, expected = loaded.state_dict(), quantize_model(_copy_of(tiny_model), config).state_dict()
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    assert loaded.model.layers[0].mlp.down_proj.zero_point == "integer"
    # a fake-quant layer quantized while loading starts from its weight_init's grid, as one made in memory
    config = KVCodecsConfig(weight_bits=3, group_size=GROUP, zero_point="integer", mode="fake", weight_init="mse")
    loaded = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=config)
    layer = loaded.model.layers[0].mlp.down_proj
    reference = FakeQuantLinear.from_linear(tiny_model.model.layers[0].mlp.down_proj, bits=3, group_size=GROUP,
                                            zero_point="integer", weight_init="mse")
    assert layer.zero_point == "integer"
    assert all(torch.equal(getattr(layer, name), getattr(reference, name))
               for name in ("weight", "weight_scale", "weight_offset"))
    zero = -layer.weight_offset.double() / layer.weight_scale.double()
    assert torch.equal(zero, zero.round())
    loaded.save_pretrained(tmp_path / "fake")  # the option travels with the checkpoint
    assert json.loads((tmp_path / "fake" / "config.json").read_text())["quantization_config"]["zero_point"] == "integer"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "fake").model.layers[0].mlp.down_proj.zero_point == "integer"


def test_dequantized_weight_cache_is_bit_identical_and_released(saved):
    model = saved[3]["model"]
    with torch.no_grad():
        plain = model(PROMPT).logits
        with dequantized_weight_cache(model):
            cached = model(PROMPT).logits
            assert model.model.layers[0].mlp.up_proj._cached_weight is not None
    assert torch.equal(plain, cached)
    assert model.model.layers[0].mlp.up_proj._cached_weight is None


# ---- KV codebooks and errors -------------------------------------------------------------------------------------
def test_codebooks_for_another_model_are_rejected_at_load(tiny_codebooks_dir, tmp_path):
    other = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3)).eval()
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="KV cache settings of this hf_kvcodecs model do not work with it.*num_hidden_layers=2"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "other", quantization_config=_kv_config(4, tiny_codebooks_dir))


def test_saved_checkpoint_whose_codebooks_do_not_fit_is_a_clear_error(saved, tmp_path):
    import shutil

    from hf_kvcodecs.gsrq import fit_gsrq_codebooks

    checkpoint = tmp_path / "mismatched"
    shutil.copytree(saved[4]["dir"], checkpoint)
    wrong = LlamaForCausalLM(tiny_llama_config(num_key_value_heads=4)).eval()
    ids = torch.randint(3, 128, (1200,), generator=torch.Generator().manual_seed(3))
    fit_gsrq_codebooks(wrong, ids, text_info={"description": "random ids"}, bits=2.0, window_tokens=128,
                       sampled_tokens_per_window=32, num_windows=4, holdout_windows=1, n_iter=1, fit_rows=256,
                       out=checkpoint / KV_CODEBOOKS_FOLDER, overwrite=True, progress=False)
    with pytest.raises(ValueError, match="do not work with it.*num_key_value_heads=4"):
        AutoModelForCausalLM.from_pretrained(checkpoint)
    shutil.rmtree(checkpoint / KV_CODEBOOKS_FOLDER)
    with pytest.raises(CodebookFileError, match="KV codebooks of this hf_kvcodecs model .'kv_codebooks'. are missing"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_kv_bits_above_the_calibrated_rate_is_rejected_at_load(float_dir, tiny_codebooks_dir):
    config = KVCodecsConfig(weight_bits=4, group_size=GROUP, kv_cache_implementation="gsrq",
                            kv_cache_config={"codebooks": str(tiny_codebooks_dir), "bits": 8})
    with pytest.raises(ValueError, match="do not work with it.*needs .* residual stages"):
        AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=config)


def test_layers_whose_in_features_do_not_divide_the_group_size(tmp_path):
    model = LlamaForCausalLM(tiny_llama_config(intermediate_size=96)).eval()  # down_proj.in_features = 96
    model.save_pretrained(tmp_path / "odd")
    with pytest.raises(ValueError, match=r"group_size=64 does not divide.*down_proj \(in_features=96\).*modules_to_not_convert"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "odd", quantization_config=KVCodecsConfig(group_size=64))
    kept = AutoModelForCausalLM.from_pretrained(
        tmp_path / "odd", quantization_config=KVCodecsConfig(group_size=64, modules_to_not_convert=["down_proj", "lm_head"]))
    assert type(kept.model.layers[0].mlp.down_proj) is nn.Linear and isinstance(kept.model.layers[0].mlp.up_proj, PackedLinear)


def test_checkpoint_missing_quantized_tensors_is_an_error(saved, tmp_path):
    import shutil

    from safetensors.torch import save_file

    checkpoint = tmp_path / "incomplete"
    shutil.copytree(saved[4]["dir"], checkpoint)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight_offset"]
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks quantized tensors.*model.layers.1.mlp.up_proj.weight_offset"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_attach_kv_codebooks_to_a_float_model_saves_a_kv_only_checkpoint(tiny_model, tiny_codebooks_dir, tmp_path):
    from hf_kvcodecs.gsrq.codebooks import GSRQCodebooks

    model = _copy_of(tiny_model)
    attach_kv_codebooks(model, GSRQCodebooks.load(tiny_codebooks_dir), bits=1.5, window_length=8)
    assert model.config.quantization_config.weight_bits is None and model.hf_quantizer.is_trainable
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    model.save_pretrained(tmp_path / "kv_only")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "kv_only")
    out = reloaded.generate(PROMPT, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert type(out.cache).__name__ == "GSRQCache" and out.cache.bits == 1.5 and out.cache.window_length == 8
    with pytest.raises(ValueError, match="below the lowest rate"):
        attach_kv_codebooks(reloaded, tiny_codebooks_dir, bits=0.1)
    assert reloaded.generation_config.cache_config["bits"] == 1.5  # a failed attach changes nothing


def test_user_choice_of_cache_wins_and_generate_arguments_override(saved):
    model = saved[2]["model"]
    prompt_tokens = PROMPT.shape[1]
    out = model.generate(PROMPT, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, cache_implementation="dynamic")
    assert type(out.cache).__name__ == "DynamicCache"
    # a cache passed to generate() wins over the model's default cache_implementation (no need to unset it)
    explicit = model.generate(PROMPT, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                              cache=GSRQCache(model.config, **model.generation_config.cache_config))
    default = model.generate(PROMPT, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(explicit.sequences, default.sequences) and default.sequences.shape[1] == prompt_tokens + 3
    dynamic = model.generate(PROMPT, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                             cache=DynamicCache(config=model.config))
    assert type(dynamic.cache).__name__ == "DynamicCache"
    assert model.generation_config.cache_implementation == "gsrq"  # the default itself is untouched


def test_a_per_call_cache_config_overrides_the_checkpoint_default_key_by_key(saved, tiny_codebooks_dir):
    model = saved[2]["model"]
    default = dict(model.generation_config.cache_config)
    assert default["bits"] == KV_BITS and "codebooks" in default

    def cache_of(**kwargs):
        return model.generate(PROMPT, max_new_tokens=2, do_sample=False, return_dict_in_generate=True, **kwargs).cache

    # transformers replaces the default cache_config with the per-call one; the checkpoint's codebooks must survive
    cache = cache_of(cache_config={"bits": 1.0})
    assert isinstance(cache, GSRQCache) and cache.bits == 1.0
    cache = cache_of(cache_config={"attention": "dequantize", "beam_width": 1})
    assert (cache.attention_path, cache.beam_width, cache.bits) == ("dequantize", 1, KV_BITS)
    cache = cache_of(cache_config={"codebooks": str(tiny_codebooks_dir), "window_length": 5})
    assert (cache.window_length, cache.bits) == (5, KV_BITS)
    assert model.generation_config.cache_config == default  # the default itself is untouched


def test_codebooks_are_found_next_to_hub_snapshots_and_downloaded_from_the_same_commit(tiny_codebooks_dir, tmp_path, monkeypatch):
    import shutil

    import huggingface_hub

    snapshot = tmp_path / "models--user--repo" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    calls = []

    def fake_download(repo_id, filename, revision=None, **kwargs):
        calls.append((repo_id, filename, revision))
        target = snapshot / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tiny_codebooks_dir / Path(filename).name, target)
        return str(target)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    directory = resolve_codebooks_dir(KV_CODEBOOKS_FOLDER, pre_quantized=True, name_or_path="user/repo",
                                      checkpoint_files=[str(snapshot / "model.safetensors")])
    assert directory == (snapshot / KV_CODEBOOKS_FOLDER).resolve()
    assert calls == [("user/repo", f"{KV_CODEBOOKS_FOLDER}/{METADATA_FILE}", "a" * 40),
                     ("user/repo", f"{KV_CODEBOOKS_FOLDER}/{TENSORS_FILE}", "a" * 40)]
    calls.clear()  # now present locally: no second download
    assert resolve_codebooks_dir(KV_CODEBOOKS_FOLDER, pre_quantized=True, name_or_path="user/repo",
                                 checkpoint_files=[str(snapshot / "model.safetensors")]) == directory
    assert calls == []


def test_quantizer_surface_transformers_relies_on():
    quantizer = KVCodecsHfQuantizer(KVCodecsConfig(weight_bits=3), pre_quantized=True)
    assert quantizer.is_serializable() and not quantizer.is_trainable and quantizer.quantized_element_size == 3 / 8
    fake = KVCodecsHfQuantizer(KVCodecsConfig(weight_bits=3, mode="fake"), pre_quantized=False)
    assert fake.is_trainable and fake.is_qat_trainable and fake.quantized_element_size is None


def test_a_checkpoint_saved_before_the_layout_refactor_still_loads_and_decodes_the_same():
    """tests/data/pre_refactor_checkpoint: a tiny W4 g16 model with GSRQ codebooks, saved by the code before the
    package moved into its layered layout, with its logits then (``expected.json``)."""
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    folder = Path(__file__).parent / "data" / "pre_refactor_checkpoint"
    expected = json.loads((folder / "expected.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = torch.tensor([expected["prompt"]])
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits[0, -1], torch.tensor(expected["last_logits"]),
                                   rtol=1e-4, atol=1e-4)
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    assert isinstance(out.cache, GSRQCache) and out.cache.attention_path == "codes"
    assert out.cache.layers[0].region_lengths()["codes"] > 0  # the saved codebooks coded the prompt
    for step, scores in enumerate(out.scores):
        torch.testing.assert_close(scores[0], torch.tensor(expected["step_logits"][step]), rtol=1e-3, atol=1e-3)
    assert out.sequences[0, prompt.shape[1]:].tolist() == expected["generated"]
