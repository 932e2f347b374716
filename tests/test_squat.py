"""SQuaT on tiny random Llama models: the bound it removes, training, resume, two processes, LoRA, export, bad input."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
from torch.utils.data import Dataset
from transformers import LlamaForCausalLM, TrainingArguments

from hf_kvcodecs.codecs.learnable import (
    LSQActivationQuantizer,
    lsq_quantize,
    mse_optimal_step,
    stretched_symmetric_scale,
)
from hf_kvcodecs.quantization import FakeQuantLinear, KVCodecsConfig, quantize_model
from hf_kvcodecs.training import SQuaTConfig, SQuaTTrainer, feature_terms

from .conftest import tiny_llama_config

FAKE_W4A4 = dict(weight_bits=4, group_size=16, mode="fake", activation_bits=4, scale_dtype="float32")


class TokenWindows(Dataset):
    def __init__(self, count=16, length=32, seed=0, labels=False):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, 128, (count, length), generator=generator)
        self.labels = labels

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, index):
        item = {"input_ids": self.ids[index], "attention_mask": torch.ones_like(self.ids[index])}
        if self.labels:
            item["labels"] = self.ids[index].clone()
        return item


def tiny_pair(seed=0, initialize=False, **config):
    """A tiny random teacher and its fake-quantized copy; ``initialize`` sets the activation steps from the first
    four training windows (so runs that split that batch differently start from the same steps)."""
    torch.manual_seed(seed)
    teacher = LlamaForCausalLM(tiny_llama_config()).eval()
    student = quantize_model(copy.deepcopy(teacher), KVCodecsConfig(**{**FAKE_W4A4, **config}))
    if initialize:
        with torch.no_grad():
            student.train()(input_ids=TokenWindows().ids[:4])
    return teacher, student


def arguments(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-4,
                    logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
                    disable_tqdm=True, dataloader_num_workers=0)
    settings.update(overrides)
    return TrainingArguments(**settings)


def losses(history):
    return [entry["loss"] for entry in history if "loss" in entry]


# ---- the bound ----------------------------------------------------------------------------------------------------


def test_feature_loss_against_the_raw_teacher_has_a_floor_the_quantized_teacher_removes():
    torch.manual_seed(0)
    teacher_feature = torch.randn(4, 32, 24) * torch.linspace(0.2, 3.0, 24)
    quantizer = LSQActivationQuantizer(2, 24, "tensor")
    quantizer.initialize(teacher_feature)
    mask = torch.ones(4, 32)
    quantized_teacher = quantizer.quantize_detached(teacher_feature)
    _, floor = feature_terms(quantized_teacher, teacher_feature, quantized_teacher, mask, quantized_target=True)
    assert floor > 0.01

    def optimise(quantized_target: bool) -> float:
        student = torch.nn.Parameter(torch.zeros_like(teacher_feature))  # inside the clamp range: gradients flow
        optimizer = torch.optim.Adam([student], lr=0.05)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 400)
        for _ in range(400):
            loss, _ = feature_terms(quantizer(student), teacher_feature, quantized_teacher, mask,
                                    quantized_target=quantized_target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
        with torch.no_grad():
            return float(feature_terms(quantizer(student), teacher_feature, quantized_teacher, mask,
                                       quantized_target=quantized_target)[0])

    against_raw, against_quantized = optimise(False), optimise(True)
    assert against_raw >= float(floor) - 1e-6  # no student on the lattice gets below it
    assert against_quantized < 1e-3  # the student-quantized target is reachable
    # every point of the lattice is at least the floor away from the raw teacher
    for _ in range(5):
        lattice_point = quantizer.quantize_detached(teacher_feature + torch.randn_like(teacher_feature))
        assert feature_terms(lattice_point, teacher_feature, quantized_teacher, mask, quantized_target=False)[0] >= floor


def test_lsq_step_gradient_and_initialisation():
    x = torch.randn(1000)
    step = torch.tensor([0.1], requires_grad=True)
    lsq_quantize(x, step, 4).sum().backward()
    scaled = x / 0.1
    inside = (scaled >= -8) & (scaled <= 7)
    # LSQ: d/ds = round(x/s) - x/s inside the grid, the clipped code outside; times 1/sqrt(N * Q_p)
    expected = torch.where(inside, torch.round(scaled) - scaled, scaled.clamp(-8, 7)).sum() / (1000 * 7) ** 0.5
    assert step.grad.item() == pytest.approx(expected.item(), rel=1e-4)
    best = mse_optimal_step(x, 4, None)
    for ratio in (0.5, 0.8, 1.25):
        def error(s):
            return (torch.round(torch.clamp(x / s, -8, 7)) * s - x).square().mean()
        assert error(best) <= error(best * ratio) + 1e-9
    groups = torch.tensor([[[-1.0, 0.2, 0.6, 0.9]]])
    assert stretched_symmetric_scale(groups, 2).item() == pytest.approx(0.5)  # levels ±0.25, ±0.75


def test_activation_quantizer_refuses_to_run_uninitialised_in_eval():
    quantizer = LSQActivationQuantizer(4, 8).eval()
    with pytest.raises(RuntimeError, match="no step yet"):
        quantizer(torch.randn(2, 8))
    quantizer.train()(torch.randn(2, 8))
    assert quantizer.is_initialized


def test_stretched_grid_has_no_zero_level():
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 4)
    layer = FakeQuantLinear.from_linear(linear, bits=2, group_size=16, symmetric=True, weight_init="stretched")
    values = (layer.quantized_weight() / layer.stored_grid()[0].repeat_interleave(16, dim=1)).detach()
    assert set(values.flatten().round(decimals=4).tolist()) <= {-1.5, -0.5, 0.5, 1.5}
    with pytest.raises(ValueError, match="symmetric=True"):
        KVCodecsConfig(weight_bits=2, mode="fake", weight_init="stretched")


@pytest.mark.parametrize("symmetric", [False, True])
def test_mse_clipped_grid_has_the_least_rounding_error_of_its_ratios(symmetric):
    from hf_kvcodecs.codecs.weight_quantization import mse_clipped_parameters, rtn_parameters

    torch.manual_seed(0)
    weight = torch.randn(8, 64)
    weight[:, 5] *= 8  # one outlier per row: min-max spends its levels on it
    linear = torch.nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    errors = {}
    for init in ("minmax", "mse"):
        layer = FakeQuantLinear.from_linear(linear, bits=2, group_size=32, symmetric=symmetric, weight_init=init)
        errors[init] = (layer.quantized_weight() - weight).square().sum(dim=1).detach()
        assert (layer.weight_offset is None) == symmetric
    assert (errors["mse"] <= errors["minmax"] + 1e-6).all()
    assert errors["mse"].sum() < 0.7 * errors["minmax"].sum()
    scale, offset = mse_clipped_parameters(weight, 2, 32, symmetric)
    full_scale, _ = rtn_parameters(weight, 2, 32, symmetric)
    assert (scale <= full_scale * (1 + 1e-6)).all() and (scale >= 0.2 * full_scale * (1 - 1e-6)).all()
    # a group already on its min-max grid keeps it (ratio 1 has zero error)
    on_grid = torch.tensor([[-1.5, -0.5, 0.5, 1.5] * 8])
    scale, offset = mse_clipped_parameters(on_grid, 2, 32, symmetric)
    assert scale.item() == pytest.approx(1.0)
    if not symmetric:
        assert offset.item() == pytest.approx(-1.5)


# ---- training -----------------------------------------------------------------------------------------------------


def test_squat_trains_logs_its_terms_and_leaves_the_teacher_alone(tmp_path):
    teacher, student = tiny_pair(weight_bits=2)
    before = {name: p.clone() for name, p in teacher.state_dict().items()}
    trainer = SQuaTTrainer(model=student, teacher_model=teacher, args=arguments(tmp_path, max_steps=12, learning_rate=3e-4),
                           train_dataset=TokenWindows(), eval_dataset=TokenWindows(8, seed=1),
                           squat_config=SQuaTConfig(quantizer_learning_rate=1e-5))
    metrics_before = trainer.evaluate()
    trainer.train()
    history = trainer.state.log_history
    logged = [entry for entry in history if "loss" in entry]
    assert {"squat_kd", "squat_feature", "squat_feature_floor"} <= set(logged[0])
    assert sum(losses(history)[-3:]) < sum(losses(history)[:3])
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] < metrics_before["eval_loss"] and metrics["eval_perplexity"] > 1
    assert all(torch.equal(before[name], p) for name, p in teacher.state_dict().items())
    assert not any(name.startswith("teacher") for name in trainer.model.state_dict())
    quantizer_group = trainer.optimizer.param_groups[-1]
    assert quantizer_group["weight_decay"] == 0.0 and quantizer_group["initial_lr"] == 1e-5
    assert any(p is student.model.layers[0].self_attn.q_proj.input_quantizer.step for p in quantizer_group["params"])


def test_ablation_switches_and_cross_entropy_qat(tmp_path):
    teacher, student = tiny_pair()
    raw = SQuaTTrainer(model=student, teacher_model=teacher, args=arguments(tmp_path, max_steps=2),
                       train_dataset=TokenWindows(), squat_config=SQuaTConfig(quantize_teacher_features=False))
    raw.train()
    assert "squat_feature" in raw.state.log_history[0]
    _, student = tiny_pair()
    logit_only = SQuaTTrainer(model=student, teacher_model=teacher, args=arguments(tmp_path, max_steps=2),
                              train_dataset=TokenWindows(), squat_config=SQuaTConfig(feature_loss=False))
    logit_only.train()
    assert "squat_feature" not in logit_only.state.log_history[0]
    _, student = tiny_pair()
    ce = SQuaTTrainer(model=student, args=arguments(tmp_path, max_steps=4), train_dataset=TokenWindows(labels=True),
                      eval_dataset=TokenWindows(4, seed=1),
                      squat_config=SQuaTConfig(kd_loss=False, feature_loss=False, use_labels=True))
    ce.train()
    assert "squat_ce" in ce.state.log_history[0]
    assert ce.evaluate()["eval_perplexity"] == pytest.approx(torch.exp(torch.tensor(ce.evaluate()["eval_loss"])).item(),
                                                             rel=1e-4)


def test_float_model_and_config_build_the_student(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    trainer = SQuaTTrainer(model=model, args=arguments(tmp_path, max_steps=1), train_dataset=TokenWindows(),
                           quantization_config=KVCodecsConfig(**FAKE_W4A4))
    assert isinstance(trainer.model.model.layers[0].mlp.gate_proj, FakeQuantLinear)
    assert type(trainer.teacher.model.layers[0].mlp.gate_proj) is torch.nn.Linear
    trainer.train()


def test_resume_from_checkpoint_gives_the_same_next_losses(tmp_path):
    teacher, student = tiny_pair()
    args = arguments(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    straight = SQuaTTrainer(model=student, teacher_model=teacher, args=args, train_dataset=TokenWindows())
    straight.train()
    teacher, student = tiny_pair()
    resumed = SQuaTTrainer(model=student, teacher_model=teacher, args=args, train_dataset=TokenWindows())
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert losses(resumed.state.log_history)[-2:] == pytest.approx(losses(straight.state.log_history)[-2:], rel=1e-5)
    state = torch.load(tmp_path / "out" / "checkpoint-2" / "optimizer.pt", weights_only=True)
    assert len(state["param_groups"]) == 3


def test_gradient_accumulation_matches_one_large_batch(tmp_path):
    results = []
    for batch, accumulation in ((4, 1), (2, 2)):
        teacher, student = tiny_pair(initialize=True)
        trainer = SQuaTTrainer(model=student, teacher_model=teacher, train_dataset=TokenWindows(),
                               args=arguments(tmp_path, max_steps=1, per_device_train_batch_size=batch,
                                              gradient_accumulation_steps=accumulation))
        trainer.train()
        results.append((losses(trainer.state.log_history)[0],
                        student.model.layers[1].mlp.down_proj.weight.detach().clone()))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)


def test_lora_on_a_quantized_student_trains_only_the_adapters(tmp_path):
    from peft import LoraConfig, get_peft_model

    teacher, student = tiny_pair()
    student(input_ids=torch.randint(3, 128, (2, 16)))  # initialise the activation steps before freezing them
    lora = get_peft_model(student, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    before = {name: p.detach().clone() for name, p in lora.named_parameters()}
    trainer = SQuaTTrainer(model=lora, teacher_model=teacher, args=arguments(tmp_path, max_steps=3),
                           train_dataset=TokenWindows())
    trainer.train()
    changed = {name for name, p in lora.named_parameters() if not torch.equal(before[name], p.detach())}
    assert changed and all("lora_" in name for name in changed)


@pytest.mark.parametrize("scales, granularity", [("float32", "tensor"), ("float32", "channel"), ("float16", "channel")])
def test_export_round_trip_in_a_fresh_process(tmp_path, scales, granularity, fake_hub):
    teacher, student = tiny_pair(scale_dtype=scales, activation_granularity=granularity)
    trainer = SQuaTTrainer(model=student, teacher_model=teacher, args=arguments(tmp_path, max_steps=3),
                           train_dataset=TokenWindows())
    trainer.train()
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(5))
    student.eval()
    with torch.no_grad():
        expected = student(input_ids=ids).logits
    out = trainer.export(tmp_path / "packed", card="# tiny SQuaT student\n", push_to_hub="someone/tiny-squat")
    (kwargs, uploaded), = fake_hub["upload_folder"]
    assert kwargs["repo_id"] == "someone/tiny-squat" and uploaded["README.md"].startswith(b"# tiny SQuaT")
    assert json.loads(uploaded["config.json"])["quantization_config"]["format_version"] == 2
    assert uploaded["model.safetensors"] == (out / "model.safetensors").read_bytes()
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["mode"] == "packed" and config["activation_bits"] == 4 and config["format_version"] == 2
    assert (out / "README.md").read_text().startswith("# tiny SQuaT")
    torch.save(ids, tmp_path / "ids.pt")
    script = textwrap.dedent(f"""
        import torch, hf_kvcodecs
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}).eval()
        layer = model.model.layers[0].mlp.gate_proj
        assert type(layer).__name__ == "PackedLinear" and layer.input_quantizer is not None, type(layer)
        with torch.no_grad():
            torch.save(model(input_ids=torch.load({str(tmp_path / 'ids.pt')!r})).logits, {str(tmp_path / 'logits.pt')!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    loaded = torch.load(tmp_path / "logits.pt")
    assert layer_granularity(out) == granularity
    assert torch.allclose(loaded, expected, atol=1e-5, rtol=1e-5), (loaded - expected).abs().max()


def layer_granularity(checkpoint) -> str:
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    return config.get("activation_granularity", "tensor")


def test_bf16_autocast_trains_close_to_fp32(tmp_path):
    runs = {}
    for precision in ("fp32", "bf16"):
        teacher, student = tiny_pair(initialize=True)
        trainer = SQuaTTrainer(model=student, teacher_model=teacher, train_dataset=TokenWindows(),
                               args=arguments(tmp_path / precision, max_steps=3, bf16=precision == "bf16"))
        trainer.train()
        runs[precision] = losses(trainer.state.log_history)
        # autocast computes in bf16, the trained parameters stay fp32
        assert student.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    assert all(torch.isfinite(torch.tensor(run)).all() for run in runs.values())
    assert runs["bf16"][0] == pytest.approx(runs["fp32"][0], rel=0.1)
    assert runs["bf16"] != runs["fp32"]  # autocast was on


TWO_PROCESS_SCRIPT = """
import json, os, sys, torch
sys.path.insert(0, {root!r})
from tests.test_squat import TokenWindows, arguments, losses, tiny_pair
from pathlib import Path
from hf_kvcodecs.training import SQuaTTrainer
teacher, student = tiny_pair(initialize=True)
trainer = SQuaTTrainer(model=student, teacher_model=teacher, train_dataset=TokenWindows(),
                       args=arguments(Path({out!r}), max_steps=1, per_device_train_batch_size={batch}))
trainer.train()
if int(os.environ.get("RANK", "0")) == 0:
    Path({result!r}).write_text(json.dumps(losses(trainer.state.log_history)))
# gloo's worker threads abort the interpreter at exit ("terminate called without an active exception") when the
# process group outlives the script
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
"""


def free_port() -> int:
    """A port no process listens on now (a fixed one may be taken on a shared machine)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_processes_over_gloo_match_one(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = {}
    for processes, batch in ((1, 4), (2, 2)):
        result = tmp_path / f"loss{processes}.json"
        script = tmp_path / f"run{processes}.py"
        script.write_text(TWO_PROCESS_SCRIPT.format(root=root, out=str(tmp_path / f"o{processes}"), batch=batch,
                                                    result=str(result)))
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_port", str(free_port()), str(script)]
        run = subprocess.run(command, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=root,
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        results[processes] = json.loads(result.read_text())[0]
    assert results[2] == pytest.approx(results[1], rel=1e-5)


# ---- bad input ----------------------------------------------------------------------------------------------------


def test_bad_input_is_refused_clearly(tmp_path, caplog):
    teacher, student = tiny_pair()
    args = arguments(tmp_path, max_steps=1)
    other_vocabulary = LlamaForCausalLM(tiny_llama_config(vocab_size=256))
    with pytest.raises(ValueError, match="vocabulary has 128 tokens and the teacher's 256"):
        SQuaTTrainer(model=student, teacher_model=other_vocabulary, args=args)
    with pytest.raises(ValueError, match="2 decoder layers and the teacher 3"):
        SQuaTTrainer(model=student, teacher_model=LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3)), args=args)
    with pytest.raises(ValueError, match="no fake-quantized linear layer"):
        SQuaTTrainer(model=copy.deepcopy(teacher), teacher_model=teacher, args=args)
    with pytest.raises(ValueError, match="distillation layer 5 does not exist"):
        SQuaTTrainer(model=student, teacher_model=teacher, args=args,
                     squat_config=SQuaTConfig(distillation_layers=(5,)))
    _, weight_only = tiny_pair(activation_bits=None)
    with pytest.raises(ValueError, match="no activation quantizer"):
        SQuaTTrainer(model=weight_only, teacher_model=teacher, args=args)
    SQuaTTrainer(model=weight_only, teacher_model=teacher, args=args,
                 squat_config=SQuaTConfig(quantize_teacher_features=False))  # plain feature KD is fine
    with pytest.raises(ValueError, match="pass teacher_model"):
        SQuaTTrainer(model=student, args=args)
    trainer = SQuaTTrainer(model=student, teacher_model=teacher, args=args, train_dataset=TokenWindows(labels=True))
    with caplog.at_level(logging.WARNING, logger="hf_kvcodecs.training.trainer"):
        trainer.train()
    assert "labels are ignored" in caplog.text


def test_run_squat_reports_teacher_rtn_and_trained_student(tmp_path):
    from types import SimpleNamespace

    from hf_kvcodecs.training.run import SQuaTRunSettings, run_squat

    torch.manual_seed(0)
    teacher = LlamaForCausalLM(tiny_llama_config())
    stream = torch.randint(3, 128, (4000,), generator=torch.Generator().manual_seed(3))
    settings = SQuaTRunSettings(weight_bits=2, activation_bits=4, group_size=16, steps=4, sequence_tokens=32,
                                batch_size=2, learning_rate=3e-4, eval_windows=3, eval_tokens=64)
    loaded = SimpleNamespace(model=teacher, tokenizer=None, description="tiny random Llama")
    report = run_squat(loaded, stream[:3000], stream[3000:], settings, tmp_path, train_description="random ids",
                       eval_description="other random ids", progress=False)
    assert report["fp"]["kl_mean"] == 0.0 and report["rtn"]["kl_mean"] > 0 and report["trained"]["kl_mean"] > 0
    assert report["tokens_seen"] == 4 * 2 * 32
    assert 2 < report["bits_per_weight"]["quantized_linear_layers"] < 4.5
    assert report["bits_per_weight"]["all_parameters"] > report["bits_per_weight"]["quantized_linear_layers"]
    assert (tmp_path / "loss.png").stat().st_size > 1000 and (tmp_path / "model" / "config.json").is_file()
    assert "| RTN (before training) |" in (tmp_path / "report.md").read_text()


def test_bench_squat_runs_every_arm_and_pairs_squat_with_its_ablation(tmp_path):
    from types import SimpleNamespace

    from hf_kvcodecs.bench.squat import parse_setting, run_squat_bench
    from hf_kvcodecs.training.run import ARMS, SQuaTRunSettings

    assert parse_setting("W2A16") == (2, None) and parse_setting("W4A4") == (4, 4)
    with pytest.raises(ValueError, match="WxAy"):
        parse_setting("4-bit")
    torch.manual_seed(0)
    loaded = SimpleNamespace(model=LlamaForCausalLM(tiny_llama_config()), tokenizer=None, description="tiny")
    stream = torch.randint(3, 128, (4000,), generator=torch.Generator().manual_seed(3))
    base = SQuaTRunSettings(group_size=16, steps=2, sequence_tokens=32, batch_size=2, eval_windows=3, eval_tokens=64)
    results = run_squat_bench(loaded, stream[:3000], stream[3000:], settings=["W2A4"], arms=sorted(ARMS),
                              seeds=[0, 1], base=base, out=tmp_path, train_description="a", eval_description="b",
                              progress=False)
    assert len(results["runs"]) == 6 and set(results["comparisons"]) == {"W2A4/seed0", "W2A4/seed1"}
    runs = results["runs"]
    assert runs["W2A4/squat/seed0"]["rtn"] == runs["W2A4/logit-kd/seed0"]["rtn"]  # same RTN start for every arm
    assert runs["W2A4/squat/seed0"]["trained"] != runs["W2A4/squat/seed1"]["trained"]
    table = (tmp_path / "squat.md").read_text()
    assert "| W2A4 | RTN |" in table and "| W2A4 | cross-entropy | 0 |" in table
    assert "| squat (seed 1) |" in table and "| RTN | " in table
    assert "Training: 2 steps x 2 x 32 tokens" in table and "groups of 16, minmax start; channel activation" in table
    assert (tmp_path / "squat.png").stat().st_size > 1000
    # continuing the table with other training settings would compare unequal runs: refused, naming the difference
    with pytest.raises(ValueError, match="steps: 2 there, 3 now"):
        run_squat_bench(loaded, stream[:3000], stream[3000:], settings=["W4A4"], arms=["squat"], seeds=[0],
                        base=replace(base, steps=3), out=tmp_path, train_description="a", eval_description="b",
                        progress=False)
