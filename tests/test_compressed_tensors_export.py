"""Export to compressed-tensors: tiny random Llamas quantized by hf_kvcodecs (W2/W3/W4/W8 min-max, W3/W4/W8 with
integer zero points, a widened stretched W3 grid, SQuaT-trained W4 students with float and integer zero points)
written with ``export_compressed_tensors`` and loaded by plain transformers in a process that never imports
hf_kvcodecs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import Dataset
from transformers import LlamaForCausalLM, TrainingArguments

pytest.importorskip("compressed_tensors")

from hf_kvcodecs.codecs.weight_quantization import dequantize_weight  # noqa: E402
from hf_kvcodecs.quantization import (  # noqa: E402
    KVCodecsConfig,
    PackedLinear,
    pack_fake_quantized,
    quantize_model,
)
from hf_kvcodecs.quantization.compressed_tensors_export import REPORT_FILE, export_compressed_tensors  # noqa: E402
from hf_kvcodecs.training import SQuaTConfig, SQuaTTrainer  # noqa: E402

from .conftest import tiny_llama_config  # noqa: E402

GROUP = 32  # divides the tiny Llama's hidden size (64) and intermediate size (128)
IDS = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(5))
# The widened symmetric grid and integer-zero-point grids are exact: the checkpoint's dequantized weights are ours bit
# for bit, and the loaded logits equal ours to float32 rounding (logits of this tiny model are ~0.6 in magnitude).
EXACT_ATOL = 1e-5
INTEGER_CASES = {"w4_integer": 4, "w8_integer": 8, "w3_integer": 3}


class TokenWindows(Dataset):
    def __init__(self, count=8, length=32):
        self.ids = torch.randint(3, 128, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "attention_mask": torch.ones_like(self.ids[index])}


def tiny_float_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


@torch.no_grad()
def logits_of(model):
    model.eval()
    return model(input_ids=IDS, use_cache=False).logits.float()


def squat_student(tmp_path, zero_point="float"):
    teacher = tiny_float_model()
    student = quantize_model(copy.deepcopy(teacher), KVCodecsConfig(weight_bits=4, group_size=GROUP, mode="fake",
                                                                    zero_point=zero_point))
    args = TrainingArguments(output_dir=str(tmp_path / f"squat_{zero_point}"), per_device_train_batch_size=4,
                             max_steps=3, learning_rate=3e-4, save_strategy="no", report_to=[], seed=0, use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0)
    # no activation quantizer at the distillation point: feature KD on the raw teacher, as run_squat sets it
    trainer = SQuaTTrainer(model=student, teacher_model=teacher, args=args, train_dataset=TokenWindows(),
                           squat_config=SQuaTConfig(quantize_teacher_features=False, quantizer_learning_rate=1e-4))
    trainer.train()
    return student.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (report, our logits, float logits, logits of the checkpoint loaded by plain transformers)."""
    root = tmp_path_factory.mktemp("ct_export")
    cases = {}
    for name, bits in (("w4", 4), ("w8", 8), ("w3", 3), ("w2", 2)):
        model = quantize_model(tiny_float_model(), KVCodecsConfig(weight_bits=bits, group_size=GROUP))
        cases[name] = (model, {})
    for name, bits in INTEGER_CASES.items():
        config = KVCodecsConfig(weight_bits=bits, group_size=GROUP, zero_point="integer")
        cases[name] = (quantize_model(tiny_float_model(), config), {})
    stretched = quantize_model(tiny_float_model(), KVCodecsConfig(weight_bits=3, group_size=GROUP, symmetric=True,
                                                                  mode="fake", weight_init="stretched"))
    cases["w3_stretched"] = (stretched, {"widen_symmetric": True})
    cases["squat_w4"] = (squat_student(root), {})
    cases["squat_w4_integer"] = (squat_student(root, "integer"), {})

    float_logits = logits_of(tiny_float_model())
    results = {}
    for name, (model, options) in cases.items():
        report = export_compressed_tensors(model, None, root / name, check_input_ids=IDS, **options)
        results[name] = [report, logits_of(model), float_logits, model]
    save_file({"ids": IDS}, root / "ids.safetensors")
    script = textwrap.dedent(f"""
        import sys
        import torch
        from safetensors.torch import load_file, save_file
        from transformers import AutoModelForCausalLM
        ids = load_file({str(root / 'ids.safetensors')!r})["ids"]
        logits = {{}}
        for name in {sorted(cases)!r}:
            model = AutoModelForCausalLM.from_pretrained({str(root)!r} + "/" + name).eval()
            with torch.no_grad():
                logits[name] = model(input_ids=ids, use_cache=False).logits.float().contiguous()
        assert "hf_kvcodecs" not in sys.modules, sorted(m for m in sys.modules if m.startswith("hf_kvcodecs"))
        save_file(logits, {str(root / 'loaded.safetensors')!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    loaded = load_file(root / "loaded.safetensors")
    for name in cases:
        results[name].insert(3, loaded[name])
    return root, results


def check_loaded_as_reported(name, report, ours, loaded):
    """The fresh process's logits differ from ours exactly as the export measured in this process."""
    difference = (loaded - ours).abs().max().item()
    print(f"{name}: loaded vs ours max |d logits| {difference:.3e}, reported {report['logits_difference']['max_abs']:.3e}")
    assert abs(difference - report["logits_difference"]["max_abs"]) <= 1e-5
    return difference


@pytest.mark.parametrize("name, bits", [("w4", 4), ("w8", 8), ("w3", 3), ("w2", 2)])
def test_min_max_grids_load_in_plain_transformers_refitted_to_integer_zero_points(exported, name, bits):
    root, results = exported
    report, ours, float_logits, loaded, _ = results[name]
    config = json.loads((root / name / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]["weights"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    assert group == {**group, "num_bits": bits, "group_size": GROUP, "symmetric": False, "strategy": "group",
                     "type": "int"}
    assert config["ignore"] == ["lm_head"] and config["dequantize"] is True
    assert json.loads((root / name / REPORT_FILE).read_text()) == report
    # min-max offsets are continuous: hardly any group has an integer zero point, the others are re-fitted
    assert report["exact_groups"] + sum(report["refit_groups"].values()) == report["groups"]
    assert report["exact_groups"] < report["groups"] and not report["exact_grid"] and not report["exact"]
    assert report["source"]["zero_point"] == "float"
    steps = report["weight_difference"]
    print(f"W{bits}: {report['exact_groups']}/{report['groups']} groups exact, refits {report['refit_groups']}, "
          f"weight error mean {steps['mean_in_steps']:.3f} / max {steps['max_in_steps']:.3f} steps, "
          f"relative RMS {steps['relative_rms']:.4f}")
    assert 0.1 < steps["mean_in_steps"] < 0.3
    difference = check_loaded_as_reported(name, report, ours, loaded)
    # Not exact, so no float tolerance applies. The re-fit moves a weight by about as much as the first rounding did
    # (a quarter of a step on average, as round-to-nearest does), so the checkpoint should be about as far from our
    # model as our model is from the float one; twice that leaves room for how the two errors add up.
    quantization = (ours - float_logits).abs().max().item()
    print(f"W{bits}: our quantized vs float max |d logits| {quantization:.3e}")
    assert difference <= 2 * quantization


@pytest.mark.parametrize("name", [*INTEGER_CASES, "squat_w4_integer"])
def test_integer_zero_point_grids_export_exactly(exported, name):
    root, results = exported
    report, ours, float_logits, loaded, _ = results[name]
    print(f"{name}: {report['exact_groups']}/{report['groups']} groups exact, weight difference max "
          f"{report['weight_difference']['max_abs']}")
    assert report["exact_grid"] and report["exact_groups"] == report["groups"] == 2304
    assert report["exact"] and report["weight_difference"]["max_abs"] == 0.0
    assert report["source"]["zero_point"] == "integer"
    assert report["refit_groups"] == {"nearest_zero_point": 0, "least_squares_scale": 0, "min_max_refit": 0}
    bits = INTEGER_CASES.get(name, 4)
    config = json.loads((root / name / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"]["num_bits"] == bits and "zero_point" not in config
    assert check_loaded_as_reported(name, report, ours, loaded) <= EXACT_ATOL
    assert report["logits_difference"]["max_abs"] <= EXACT_ATOL


@torch.no_grad()
def test_the_quality_cost_of_integer_zero_points_is_small(exported):
    """Relative weight error (all quantized layers) of min-max grids with float and with integer zero points: integer
    zero points give the grid a level at 0 and a scale the float16 offset can hold, which costs a little."""
    _, results = exported
    float_weights = dict(tiny_float_model().named_modules())

    def relative_error(model):
        error = reference = 0.0
        for name, module in model.named_modules():
            if isinstance(module, PackedLinear):
                ours = dequantize_weight(module.weight, module.weight_scale, module.weight_offset, module.bits,
                                         module.group_size, module.in_features).double()
                weight = float_weights[name].weight.double()
                error += float((ours - weight).square().sum())
                reference += float(weight.square().sum())
        return (error / reference) ** 0.5

    for name, bits in INTEGER_CASES.items():
        float_error, integer_error = relative_error(results[f"w{bits}"][4]), relative_error(results[name][4])
        logits = [(results[key][1] - results[key][2]).abs().max().item() for key in (f"w{bits}", name)]
        print(f"W{bits} relative weight error: float offsets {float_error:.5f}, integer zero points "
              f"{integer_error:.5f} ({integer_error / float_error - 1:+.1%}); max |d logits| vs float "
              f"{logits[0]:.3e} / {logits[1]:.3e}")
        assert float_error < integer_error < 1.1 * float_error


def test_stretched_w3_student_exports_exactly_as_symmetric_w4(exported):
    root, results = exported
    report, ours, _, loaded, _ = results["w3_stretched"]
    config = json.loads((root / "w3_stretched" / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert weights["num_bits"] == 4 and weights["symmetric"] is True and "dequantize" not in config
    assert report["exact_grid"] and report["weight_difference"]["max_abs"] == 0.0
    assert report["scheme"]["num_bits"] == 4 and report["source"] == {"bits": 3, "symmetric": True, "layers": 14,
                                                                      "zero_point": None}
    tensors = load_file(root / "w3_stretched" / "model.safetensors")
    assert "model.layers.0.mlp.up_proj.weight_zero_point" not in tensors
    assert check_loaded_as_reported("w3_stretched", report, ours, loaded) <= EXACT_ATOL


def test_squat_student_exports_from_its_fake_quant_layers_as_from_its_packed_form(exported, tmp_path):
    root, results = exported
    report, ours, float_logits, loaded, _ = results["squat_w4"]
    difference = check_loaded_as_reported("squat_w4", report, ours, loaded)
    assert difference <= 2 * (ours - float_logits).abs().max().item()  # as for the min-max grids above
    assert report["source"]["layers"] == 14 and report["groups"] == report["exact_groups"] + sum(
        report["refit_groups"].values())


@pytest.mark.parametrize("zero_point", ["float", "integer"])
def test_fake_and_packed_forms_of_a_student_export_the_same_tensors(tmp_path, zero_point):
    student = quantize_model(tiny_float_model(), KVCodecsConfig(weight_bits=4, group_size=GROUP, mode="fake",
                                                                zero_point=zero_point))
    with torch.no_grad():
        for module in student.modules():
            if hasattr(module, "weight_offset") and module.weight_offset is not None:
                module.weight_offset.add_(0.01 * torch.randn_like(module.weight_offset))  # a "learned" grid
    packed = copy.deepcopy(student)
    pack_fake_quantized(packed)
    reports = [export_compressed_tensors(model, None, tmp_path / name, check_logits=False)
               for name, model in (("fake", student), ("packed", packed))]
    assert all(report["exact"] == (zero_point == "integer") for report in reports)
    fake_tensors, packed_tensors = (load_file(tmp_path / name / "model.safetensors") for name in ("fake", "packed"))
    assert fake_tensors.keys() == packed_tensors.keys()
    assert all(torch.equal(fake_tensors[key], packed_tensors[key]) for key in fake_tensors)


def test_blocks_of_rows_map_as_whole_layers(tmp_path, monkeypatch):
    from hf_kvcodecs.quantization import compressed_tensors_export

    model = quantize_model(tiny_float_model(), KVCodecsConfig(weight_bits=4, group_size=GROUP))
    whole = export_compressed_tensors(model, None, tmp_path / "whole", check_logits=False)
    monkeypatch.setattr(compressed_tensors_export, "ROWS_PER_BLOCK_TIMES_INPUTS", 128 * 5)  # 5 or 10 rows a block
    blocks = export_compressed_tensors(model, None, tmp_path / "blocks", check_logits=False)
    assert blocks.pop("weight_difference") == pytest.approx(whole.pop("weight_difference"), rel=1e-12)  # sum order
    assert whole == blocks
    tensors = [load_file(tmp_path / name / "model.safetensors") for name in ("whole", "blocks")]
    assert all(torch.equal(tensors[0][key], tensors[1][key]) for key in tensors[0])


def test_the_source_model_is_left_as_it_was(tmp_path):
    model = quantize_model(tiny_float_model(), KVCodecsConfig(weight_bits=4, group_size=GROUP))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    logits = logits_of(model)
    export_compressed_tensors(model, None, tmp_path / "out")
    assert model.hf_quantizer is not None and model.config.quantization_config.weight_bits == 4
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    assert torch.equal(logits_of(model), logits)
    assert isinstance(model.model.layers[0].mlp.up_proj, PackedLinear)


def test_unsupported_models_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="no layer quantized by hf_kvcodecs"):
        export_compressed_tensors(tiny_float_model(), None, tmp_path / "a")
    symmetric = quantize_model(tiny_float_model(), KVCodecsConfig(weight_bits=4, group_size=GROUP, symmetric=True))
    with pytest.raises(ValueError, match="widen_symmetric=True"):
        export_compressed_tensors(symmetric, None, tmp_path / "b")
    symmetric8 = quantize_model(tiny_float_model(), KVCodecsConfig(weight_bits=8, group_size=GROUP, symmetric=True))
    with pytest.raises(ValueError, match="beyond compressed-tensors' 8"):
        export_compressed_tensors(symmetric8, None, tmp_path / "c", widen_symmetric=True)
    activations = quantize_model(tiny_float_model(), KVCodecsConfig(weight_bits=4, group_size=GROUP, mode="fake",
                                                                    activation_bits=8))
    with torch.no_grad():
        activations.train()(input_ids=IDS)  # sets the activation steps
    with pytest.raises(ValueError, match="drop_activation_quantization=True"):
        export_compressed_tensors(activations, None, tmp_path / "d")
    report = export_compressed_tensors(activations, None, tmp_path / "e", drop_activation_quantization=True)
    assert report["dropped"]["activation_quantization"] is True
    with pytest.raises(ValueError, match="needs out_dir"):
        export_compressed_tensors(activations)



def test_export_command_writes_the_checkpoint_and_imports_nothing_heavy_to_parse(monkeypatch, tmp_path, capsys):
    import argparse
    import ast

    from hf_kvcodecs import cli
    from hf_kvcodecs.cli import export as export_cli
    from hf_kvcodecs.models import LoadedModel

    # the parser's module imports only the standard library and the CLI's own helpers at import time
    tree = ast.parse(open(export_cli.__file__).read())
    top_level = {node.module or "" for node in tree.body if isinstance(node, ast.ImportFrom)} | {
        alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    assert top_level == {"__future__", "json", "pathlib", "_common"}

    model = quantize_model(tiny_float_model(), KVCodecsConfig(weight_bits=4, group_size=GROUP))
    monkeypatch.setattr(cli, "_load", lambda args: LoadedModel(model, None, args.model, "a tiny W4 model"))
    parser = argparse.ArgumentParser()
    export_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["export", "--model", "tiny", "--out", str(tmp_path / "out")])
    assert args.func(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["scheme"]["num_bits"] == 4 and summary["model"] == "a tiny W4 model"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    with pytest.raises(FileExistsError, match="not empty"):
        args.func(args)
    symmetric = quantize_model(tiny_float_model(), KVCodecsConfig(weight_bits=4, group_size=GROUP, symmetric=True))
    monkeypatch.setattr(cli, "_load", lambda args: LoadedModel(symmetric, None, args.model, "symmetric"))
    args = parser.parse_args(["export", "--model", "tiny", "--widen-symmetric", "--out", str(tmp_path / "sym")])
    assert args.func(args) == 0 and json.loads(capsys.readouterr().out)["scheme"]["num_bits"] == 5
