"""SQuaT's activation-quantization options on tiny random Llama models: which layers' inputs are quantized
(``KVCodecsConfig.activation_modules``), per-tensor / per-channel steps at 2, 3 and 4 bits, the activation steps' own
learning rate, and the mechanism the trainer logs per distilled layer (step drift, clipped fraction, bound, feature
term)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.quantizers.auto import AutoQuantizationConfig

from hf_kvcodecs.codecs.learnable import LSQActivationQuantizer
from hf_kvcodecs.quantization import KVCodecsConfig, quantize_model
from hf_kvcodecs.quantization.modules import activation_quantized_layers, module_name_matches
from hf_kvcodecs.training import SQuaTConfig, SQuaTTrainer, clip_fraction

from .conftest import tiny_llama_config
from .test_squat import FAKE_W4A4, TokenWindows, arguments

LAST_MLP_INPUTS = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]


def tiny_teacher(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def student_of(teacher, **config):
    student = quantize_model(copy.deepcopy(teacher), KVCodecsConfig(**{**FAKE_W4A4, **config}))
    for parameter in student.parameters():  # a teacher given to a trainer before is frozen
        parameter.requires_grad_(True)
    return student


def with_input_quantizer(model) -> set[str]:
    return {name for name, module in model.named_modules()
            if isinstance(getattr(module, "input_quantizer", None), LSQActivationQuantizer)}


def logged(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


# ---- 1. which layers' inputs are quantized ------------------------------------------------------------------------


@pytest.mark.parametrize("patterns, expected", [
    (None, "all"),
    (LAST_MLP_INPUTS, set(LAST_MLP_INPUTS)),
    (["mlp.gate_proj"], {"model.layers.0.mlp.gate_proj", "model.layers.1.mlp.gate_proj"}),  # suffix, as peft
    (["model.layers.1.mlp.*_proj"], {*LAST_MLP_INPUTS, "model.layers.1.mlp.down_proj"}),  # shell glob
    ([r"model\.layers\.1\.mlp\.(gate|up)_proj"], set(LAST_MLP_INPUTS)),  # regular expression
    ("model.layers.0.self_attn.o_proj", {"model.layers.0.self_attn.o_proj"}),  # one string
])
def test_activation_modules_choose_the_quantized_inputs(patterns, expected):
    teacher = tiny_teacher()
    student = student_of(teacher, activation_modules=patterns)
    quantized = {name for name, module in student.named_modules() if hasattr(module, "quantized_weight")}
    assert len(quantized) == 14  # every linear of the two blocks is weight-quantized either way
    assert with_input_quantizer(student) == (quantized if expected == "all" else expected)
    ids = torch.randint(3, 128, (2, 16))
    student.train()(input_ids=ids)  # initialises the chosen steps; the others stay floating point
    assert torch.isfinite(student.eval()(input_ids=ids).logits).all()


def test_a_pattern_matching_nothing_is_an_error_naming_the_layers():
    teacher = tiny_teacher()
    with pytest.raises(ValueError, match=r"'mlp\.gate_prj' matches none of the quantized linear layers.*"
                                         r"model\.layers\.0\.self_attn\.q_proj.*'gate_proj'"):
        student_of(teacher, activation_modules=["mlp.gate_proj", "mlp.gate_prj"])
    with pytest.raises(ValueError, match="matches none"):  # lm_head stays in floating point: nothing to quantize
        student_of(teacher, activation_modules=["lm_head"])
    with pytest.raises(ValueError, match="set activation_bits"):
        KVCodecsConfig(weight_bits=4, mode="fake", activation_modules=["gate_proj"])
    with pytest.raises(ValueError, match="non-empty list"):
        KVCodecsConfig(weight_bits=4, mode="fake", activation_bits=4, activation_modules=[])
    with pytest.raises(ValueError, match="non-empty list"):
        KVCodecsConfig(weight_bits=4, mode="fake", activation_bits=4, activation_modules=["gate_proj", 3])
    assert module_name_matches("model.layers.10.mlp.gate_proj", "gate_proj")
    assert not module_name_matches("model.layers.10.mlp.gate_proj", "ate_proj")  # a suffix at a "." only
    assert not module_name_matches("model.layers.10.mlp.gate_proj", "layers.1")  # no prefixes
    assert activation_quantized_layers(["a.b", "a.c"], None) == {"a.b", "a.c"}


def test_activation_modules_survive_to_dict_from_dict_and_json():
    config = KVCodecsConfig(**FAKE_W4A4, activation_modules=LAST_MLP_INPUTS)
    saved = json.loads(json.dumps(config.to_dict()))
    assert saved["activation_modules"] == LAST_MLP_INPUTS
    restored = AutoQuantizationConfig.from_dict(saved)
    assert restored == config and restored.activation_modules == LAST_MLP_INPUTS
    assert "activation_modules" not in KVCodecsConfig(**FAKE_W4A4).to_dict()  # older readers keep reading defaults


def test_packed_export_and_reload_keep_the_chosen_quantizers(tmp_path):
    teacher = tiny_teacher()
    student = student_of(teacher, activation_modules=LAST_MLP_INPUTS)
    trainer = SQuaTTrainer(model=student, teacher_model=teacher, args=arguments(tmp_path, max_steps=2),
                           train_dataset=TokenWindows())
    trainer.train()
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = student.eval()(input_ids=ids).logits
    out = trainer.export(tmp_path / "packed")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["activation_modules"] == LAST_MLP_INPUTS
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded.model.layers[1].mlp.gate_proj).__name__ == "PackedLinear"
    assert with_input_quantizer(loaded) == set(LAST_MLP_INPUTS)
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
    # a float checkpoint quantized while loading takes the same path (the empty modules built before the weights)
    teacher.save_pretrained(tmp_path / "float")
    fake = AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=KVCodecsConfig(**FAKE_W4A4, activation_modules=["mlp.up_proj"]))
    assert with_input_quantizer(fake) == {"model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"}
    with pytest.raises(ValueError, match="matches none"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "float",
                                             quantization_config=KVCodecsConfig(**FAKE_W4A4, activation_modules=["nope"]))


# ---- 2. per-tensor and per-channel steps at 2, 3 and 4 bits --------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_activation_steps_per_tensor_and_per_channel_at_2_3_4_bits(bits, granularity):
    torch.manual_seed(0)
    x = torch.randn(8, 16, 24) * torch.linspace(0.1, 4.0, 24)
    quantizer = LSQActivationQuantizer(bits, 24, granularity).train()
    quantized = quantizer(x)
    assert quantizer.step.shape == ((24,) if granularity == "channel" else (1,))
    codes = (quantized / quantizer.step).detach()
    assert torch.allclose(codes, codes.round(), atol=1e-4)
    codes = codes.round()
    assert codes.min() == -(2 ** (bits - 1)) and codes.max() == 2 ** (bits - 1) - 1  # the whole signed grid is used
    assert len(codes.unique()) == 2**bits
    quantized.square().sum().backward()
    assert torch.isfinite(quantizer.step.grad).all() and quantizer.step.grad.abs().sum() > 0


@pytest.mark.parametrize("bits, granularity", [(2, "tensor"), (3, "channel")])
def test_squat_trains_at_a2_and_a3(tmp_path, bits, granularity):
    teacher = tiny_teacher()
    student = student_of(teacher, activation_bits=bits, activation_granularity=granularity,
                         activation_modules=LAST_MLP_INPUTS)
    trainer = SQuaTTrainer(model=student, teacher_model=teacher, args=arguments(tmp_path, max_steps=2),
                           train_dataset=TokenWindows())
    trainer.train()
    entries = logged(trainer)
    assert all(math.isfinite(entry["loss"]) for entry in entries)
    assert student.model.layers[1].mlp.gate_proj.input_quantizer.bits == bits


# ---- 3. the activation steps' own learning rate -------------------------------------------------------------------


def test_activation_steps_get_their_own_optimizer_group(tmp_path):
    teacher = tiny_teacher()
    student = student_of(teacher)
    trainer = SQuaTTrainer(model=student, teacher_model=teacher, args=arguments(tmp_path, max_steps=1),
                           train_dataset=TokenWindows(),
                           squat_config=SQuaTConfig(quantizer_learning_rate=1e-5, activation_step_learning_rate=3e-3))
    trainer.create_optimizer()
    groups = trainer.optimizer.param_groups
    assert len(groups) == 4
    by_id = {id(p): index for index, group in enumerate(groups) for p in group["params"]}
    steps = [m.input_quantizer.step for m in student.modules() if hasattr(m, "quantized_weight")]
    scales = [p for name, p in student.named_parameters() if name.endswith(("weight_scale", "weight_offset"))]
    assert len(steps) == 14 and len(scales) == 28
    step_group, scale_group = groups[by_id[id(steps[0])]], groups[by_id[id(scales[0])]]
    assert {by_id[id(p)] for p in steps} == {3} and {by_id[id(p)] for p in scales} == {2}
    assert step_group["lr"] == 3e-3 and step_group["weight_decay"] == 0.0
    assert scale_group["lr"] == 1e-5 and scale_group["weight_decay"] == 0.0
    latent = student.model.layers[0].mlp.gate_proj.weight
    assert by_id[id(latent)] in (0, 1)
    assert len(by_id) == sum(p.requires_grad for p in student.parameters())  # every trained parameter, once
    # the default keeps the steps with the weight grids, at quantizer_learning_rate (three groups, as before)
    default = SQuaTTrainer(model=student_of(teacher), teacher_model=teacher, args=arguments(tmp_path, max_steps=1),
                           train_dataset=TokenWindows(), squat_config=SQuaTConfig(quantizer_learning_rate=1e-5))
    default.create_optimizer()
    assert len(default.optimizer.param_groups) == 3 and default.optimizer.param_groups[2]["lr"] == 1e-5
    with pytest.raises(ValueError, match="activation_step_learning_rate must be a learning rate"):
        SQuaTConfig(activation_step_learning_rate=-1.0)


# ---- 4. the mechanism in the logs ----------------------------------------------------------------------------------


MECHANISM = ("step_drift", "clip_fraction", "feature_floor", "feature")


def train_logging(tmp_path, activation_step_learning_rate, steps=4, **squat):
    teacher = tiny_teacher()
    student = student_of(teacher, activation_modules=LAST_MLP_INPUTS)
    trainer = SQuaTTrainer(model=student, teacher_model=teacher, train_dataset=TokenWindows(),
                           eval_dataset=TokenWindows(4, seed=1), args=arguments(tmp_path, max_steps=steps),
                           squat_config=SQuaTConfig(quantizer_learning_rate=1e-5,
                                                    activation_step_learning_rate=activation_step_learning_rate,
                                                    **squat))
    trainer.train()
    return trainer


def test_the_trainer_logs_drift_clipping_bound_and_feature_term_per_layer(tmp_path):
    trainer = train_logging(tmp_path, activation_step_learning_rate=0.05)
    entries = logged(trainer)
    assert len(entries) == 4  # logging_steps=1
    for entry in entries:
        for name in MECHANISM:
            assert math.isfinite(entry[f"squat_layer1_{name}"]), (name, entry)
        assert 0.0 <= entry["squat_layer1_clip_fraction"] <= 1.0
        # one distilled layer: its bound and term are the averaged ones
        assert entry["squat_layer1_feature_floor"] == pytest.approx(entry["squat_feature_floor"])
        assert entry["squat_layer1_feature"] == pytest.approx(entry["squat_feature"])
    assert entries[0]["squat_layer1_step_drift"] == 0.0  # measured in step 1's forward, before any update
    assert abs(entries[-1]["squat_layer1_step_drift"]) > 0.01
    step = trainer.model.model.layers[1].mlp.gate_proj.input_quantizer.step.detach()
    assert torch.log(step / trainer._initial_steps[1]).item() != 0.0
    metrics = trainer.evaluate()
    assert {f"eval_squat_layer1_{name}" for name in MECHANISM} <= set(metrics)


def test_drift_follows_the_activation_learning_rate(tmp_path):
    frozen = logged(train_logging(tmp_path / "frozen", activation_step_learning_rate=0.0))
    slow = logged(train_logging(tmp_path / "slow", activation_step_learning_rate=1e-5))
    fast = logged(train_logging(tmp_path / "fast", activation_step_learning_rate=0.05))
    assert all(entry["squat_layer1_step_drift"] == 0.0 for entry in frozen)
    assert abs(fast[-1]["squat_layer1_step_drift"]) > 20 * abs(slow[-1]["squat_layer1_step_drift"])


def test_several_layers_per_channel_steps_and_logit_only_kd_are_logged(tmp_path):
    teacher = tiny_teacher()
    student = student_of(teacher, activation_granularity="channel")
    trainer = SQuaTTrainer(model=student, teacher_model=teacher, train_dataset=TokenWindows(),
                           args=arguments(tmp_path, max_steps=2),
                           squat_config=SQuaTConfig(distillation_layers=(0, -1), activation_step_learning_rate=0.05))
    trainer.train()
    last = logged(trainer)[-1]
    for layer in (0, 1):
        for name in (*MECHANISM, "step_drift_abs"):
            assert math.isfinite(last[f"squat_layer{layer}_{name}"])
        assert last[f"squat_layer{layer}_step_drift_abs"] > 0
    # logit-only KD: the feature term is not in the loss, but the distilled layer is still watched
    student = student_of(teacher)
    logit_only = SQuaTTrainer(model=student, teacher_model=teacher, train_dataset=TokenWindows(),
                              args=arguments(tmp_path, max_steps=2), squat_config=SQuaTConfig(feature_loss=False))
    logit_only.train()
    first = logged(logit_only)[0]
    assert "squat_feature" not in first and math.isfinite(first["squat_layer1_clip_fraction"])


def test_clip_fraction_counts_values_outside_the_grid():
    values = torch.tensor([[-2.5, -2.0, 0.0, 1.0, 1.2]])
    assert clip_fraction(values, torch.tensor([1.0]), 2).item() == pytest.approx(2 / 5)  # grid -2 .. 1
    per_channel = torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0])  # the last value is inside its channel's range
    assert clip_fraction(values, per_channel, 2).item() == pytest.approx(1 / 5)


# ---- the command line ----------------------------------------------------------------------------------------------


def test_squat_command_passes_the_activation_options(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import hf_kvcodecs.text
    import hf_kvcodecs.training.run
    from hf_kvcodecs import cli
    from hf_kvcodecs.cli import squat as squat_cli

    seen = {}

    def fake_run(loaded, train, evaluation, settings, out, **kwargs):
        seen["settings"] = settings
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "report.md").write_text("report")
        return {"seconds": 0.0}

    corpora = iter([SimpleNamespace(sha256="a", description="a"), SimpleNamespace(sha256="b", description="b")])
    monkeypatch.setattr(hf_kvcodecs.text, "load_corpus", lambda *args, **kwargs: next(corpora))
    monkeypatch.setattr(hf_kvcodecs.text, "tokenize_corpus", lambda tokenizer, corpus: None)
    monkeypatch.setattr(squat_cli, "load_model", lambda args: SimpleNamespace(tokenizer=None))
    monkeypatch.setattr(hf_kvcodecs.training.run, "run_squat", fake_run)
    assert cli.main(["squat", "--act-bits", "3", "--act-modules", "mlp.gate_proj", "mlp.up_proj", "--act-step-lr",
                     "0.002", "--act-granularity", "tensor", "--out", str(tmp_path / "o")]) == 0
    settings = seen["settings"]
    assert settings.activation_bits == 3 and settings.activation_granularity == "tensor"
    assert settings.activation_modules == ["mlp.gate_proj", "mlp.up_proj"]
    assert settings.activation_step_learning_rate == 0.002
    args = cli.build_parser().parse_args(["squat", "--out", "x"])
    assert args.act_modules is None and args.act_step_lr is None
    with pytest.raises(ValueError, match="--act-bits 2 to 8"):
        squat_cli.run(cli.build_parser().parse_args(["squat", "--act-modules", "gate_proj", "--out", "x"]))
