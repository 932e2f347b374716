"""One SQuaT (or ablation) training run on real text, with the evaluation a user reads before trusting the student:
the float teacher, the round-to-nearest student before training and the trained student, paired per window on a
held-out text, in one process. Behind ``hf-kvcodecs squat``."""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ..evaluation import fixed_windows, kl_divergence
from ..evaluation.paired import perplexity_metrics
from ..quantization import KVCodecsConfig, quantize_model
from .trainer import SQuaTConfig, SQuaTTrainer, quantized_linear_modules

# The training objectives compared by the benchmark; every one runs through SQuaTTrainer.
ARMS = {
    "squat": dict(),
    "raw-teacher-feature": dict(quantize_teacher_features=False),
    "logit-kd": dict(feature_loss=False),
    "cross-entropy": dict(kd_loss=False, feature_loss=False, use_labels=True),
}
# Objectives `bench squat` runs besides ARMS (which `hf-kvcodecs squat --arm` mirrors): the feature term alone, on
# SQuaT's target, with no logit term.
BENCH_ARMS = {**ARMS, "feature-only": dict(kd_loss=False)}


@dataclass
class SQuaTRunSettings:
    weight_bits: int = 4
    activation_bits: int | None = None
    activation_granularity: str = "channel"
    # KVCodecsConfig.activation_modules: the layers whose inputs are quantized (None: every quantized layer)
    activation_modules: list[str] | None = None
    # SQuaTConfig.distillation_layers: decoder layers whose feature is distilled (None: its default, the last)
    distillation_layers: list[int] | None = None
    group_size: int = 64
    symmetric: bool = False
    weight_init: str = "minmax"
    zero_point: str = "float"  # KVCodecsConfig.zero_point
    arm: str = "squat"
    steps: int = 100
    sequence_tokens: int = 512
    batch_size: int = 4
    learning_rate: float = 1e-4
    quantizer_learning_rate: float = 1e-5
    activation_step_learning_rate: float | None = None  # None: quantizer_learning_rate
    eval_windows: int = 8
    eval_tokens: int = 1024
    seed: int = 0


class _Windows(Dataset):
    def __init__(self, windows: torch.Tensor, labels: bool):
        self.windows, self.labels = windows, labels

    def __len__(self):
        return self.windows.shape[0]

    def __getitem__(self, index):
        ids = self.windows[index]
        item = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.labels:
            item["labels"] = ids.clone()
        return item


def training_windows(token_ids: torch.Tensor, count: int, length: int, seed: int) -> torch.Tensor:
    """``count`` windows of ``length`` tokens at seeded random offsets (the same for every arm with one seed)."""
    if token_ids.numel() <= length:
        raise ValueError(f"The training text has {token_ids.numel()} tokens, fewer than one window of {length}.")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, token_ids.numel() - length, (count,), generator=generator)
    return torch.stack([token_ids[start:start + length] for start in starts.tolist()])


@torch.no_grad()
def paired_scores(model, teacher, windows: list[torch.Tensor], progress: bool = True, description: str = "eval"):
    """Per window: the model's per-token NLL and its KL(teacher || model), both over every token after the first."""
    nlls, kls = [], []
    for window in tqdm(windows, desc=description, disable=not progress, leave=False):
        ids = window[None]
        logprobs = model(input_ids=ids, use_cache=False).logits[0, :-1].float().log_softmax(-1)
        reference = logprobs if teacher is None else teacher(input_ids=ids, use_cache=False).logits[0, :-1].float().log_softmax(-1)
        nlls.append(-logprobs.gather(-1, ids[0, 1:, None])[:, 0].double())
        kls.append(kl_divergence(reference, logprobs).double())
    return nlls, kls


def evaluation_row(nlls, kls, reference_nlls) -> dict:
    metrics = perplexity_metrics(nlls, reference_nlls)
    window_kl = torch.stack([kl.mean() for kl in kls])
    return {"perplexity": metrics["ppl"], "delta_ppl_pct": metrics["delta_ppl_pct"],
            "delta_ppl_pct_se": metrics["delta_ppl_pct_se"], "kl_mean": float(window_kl.mean()),
            "kl_se": float(window_kl.std() / math.sqrt(len(kls))) if len(kls) > 1 else None,
            "window_nll": [float(n.mean()) for n in nlls], "window_kl": window_kl.tolist()}


def bits_per_weight(model) -> dict:
    """Bits per weight of the quantized linear layers (their 16-bit scales and offsets included) and over every
    parameter, with the floating-point ones (embeddings, the tied head, norms) counted at 16 bits."""
    quantized = list(quantized_linear_modules(model).values())
    linear_bits = sum(m.weight.numel() * m.bits + 16 * sum(p.numel() for p in (m.weight_scale, m.weight_offset)
                                                              if p is not None) for m in quantized)
    linear_count = sum(m.weight.numel() for m in quantized)
    quantizer_ids = {id(p) for m in quantized for p in m.parameters() if p is not m.bias}
    other = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if id(p) not in quantizer_ids)
    return {"quantized_linear_layers": linear_bits / linear_count,
            "all_parameters": (linear_bits + 16 * other) / (linear_count + other)}


def run_squat(loaded, train_ids: torch.Tensor, eval_ids: torch.Tensor, settings: SQuaTRunSettings, out: Path, *,
              train_description: str, eval_description: str, progress: bool = True, push_to_hub: str | None = None,
              export: bool = True):
    """Train one arm, evaluate teacher / RTN / trained student on held-out windows, export the packed student to
    ``out/model`` (unless ``export`` is False) and write ``out/report.{json,md}`` and ``out/loss.png``. Returns the
    report."""
    from transformers import TrainingArguments

    if settings.arm not in BENCH_ARMS:
        raise ValueError(f"arm must be one of {sorted(BENCH_ARMS)}, got {settings.arm!r}.")
    started = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    teacher = loaded.model.eval()
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
    config = KVCodecsConfig(weight_bits=settings.weight_bits, group_size=settings.group_size, mode="fake",
                            symmetric=settings.symmetric, weight_init=settings.weight_init,
                            zero_point=settings.zero_point,
                            activation_bits=settings.activation_bits,
                            activation_granularity=settings.activation_granularity,
                            activation_modules=settings.activation_modules if settings.activation_bits else None)
    student = quantize_model(copy.deepcopy(teacher), config)
    for parameter in student.parameters():
        parameter.requires_grad_(True)
    objective = dict(BENCH_ARMS[settings.arm])
    if settings.distillation_layers is not None:
        objective["distillation_layers"] = tuple(settings.distillation_layers)
    if settings.activation_bits is None and objective.get("feature_loss", True):
        # no student lattice at the distillation point: Q_s is the identity and SQuaT is feature KD on the raw teacher
        objective["quantize_teacher_features"] = False
    squat_config = SQuaTConfig(quantizer_learning_rate=settings.quantizer_learning_rate,
                               activation_step_learning_rate=settings.activation_step_learning_rate, **objective)
    windows = training_windows(train_ids, settings.steps * settings.batch_size, settings.sequence_tokens, settings.seed)
    args = TrainingArguments(
        output_dir=str(out / "checkpoints"), max_steps=settings.steps, per_device_train_batch_size=settings.batch_size,
        learning_rate=settings.learning_rate, lr_scheduler_type="cosine", warmup_steps=max(1, settings.steps // 20),
        weight_decay=0.0, logging_steps=max(1, settings.steps // 50), save_strategy="no", report_to=[],
        seed=settings.seed, data_seed=settings.seed, use_cpu=not torch.cuda.is_available(),
        disable_tqdm=not progress, dataloader_num_workers=0)
    trainer = SQuaTTrainer(model=student, teacher_model=None if settings.arm == "cross-entropy" else teacher,
                           args=args, train_dataset=_Windows(windows, squat_config.use_labels),
                           squat_config=squat_config, processing_class=loaded.tokenizer)
    trainer.initialize_activation_quantizers(trainer.get_train_dataloader())
    eval_windows = fixed_windows(eval_ids, settings.eval_windows, settings.eval_tokens)
    fp_nlls, fp_kls = paired_scores(teacher, None, eval_windows, progress, "eval fp teacher")
    student.eval()
    rtn = evaluation_row(*paired_scores(student, teacher, eval_windows, progress, "eval RTN student"), fp_nlls)
    train_started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - train_started
    student.eval()
    trained = evaluation_row(*paired_scores(student, teacher, eval_windows, progress, "eval trained student"), fp_nlls)
    report = {
        "model": loaded.description, "settings": asdict(settings), "squat_config": squat_config.to_dict(),
        "train_text": train_description, "eval_text": eval_description,
        "tokens_seen": settings.steps * settings.batch_size * settings.sequence_tokens,
        "train_seconds": train_seconds, "bits_per_weight": bits_per_weight(student),
        "fp": evaluation_row(fp_nlls, fp_kls, None), "rtn": rtn, "trained": trained,
        "log_history": trainer.state.log_history,
    }
    card = report_markdown(report)
    if export:
        trainer.export(out / "model", card=card, push_to_hub=push_to_hub)
    report["seconds"] = time.perf_counter() - started
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(card)
    loss_plot(report, out / "loss.png")
    return report


def report_markdown(report: dict) -> str:
    settings = report["settings"]
    activation = settings["activation_bits"] or 16
    zero_points = ", integer zero points" if settings.get("zero_point") == "integer" else ""
    lines = [f"# SQuaT student: W{settings['weight_bits']}A{activation} g{settings['group_size']}{zero_points}, arm "
             f"{settings['arm']}",
             "", f"Base model: {report['model']}. Training text: {report['train_text']}; evaluation text: "
             f"{report['eval_text']} ({settings['eval_windows']} windows of {settings['eval_tokens']} tokens, paired "
             "per window with the float teacher).", "",
             f"{settings['steps']} steps x {settings['batch_size']} x {settings['sequence_tokens']} tokens "
             f"({report['tokens_seen']:,} tokens seen), {report['train_seconds']:.0f} s of training. Bits per weight: "
             f"{report['bits_per_weight']['quantized_linear_layers']:.2f} in the quantized layers (scales "
             f"included), {report['bits_per_weight']['all_parameters']:.2f} over all parameters (embeddings and "
             "the tied head in 16-bit)." + (
                 f" Activations: static {settings['activation_bits']}-bit steps per "
                 f"{settings.get('activation_granularity', 'tensor')} at "
                 + (f"the inputs of the layers matching {settings['activation_modules']}"
                    if settings.get("activation_modules") else "every quantized layer's input")
                 + (f", learning rate {settings['activation_step_learning_rate']:g}"
                    if settings.get("activation_step_learning_rate") is not None else "") + "."
                 if settings["activation_bits"] else "")
             + (f" Distilled features: decoder layers {settings['distillation_layers']}."
                if settings.get("distillation_layers") is not None else ""), "",
             "| model | perplexity | Δppl % ± se | KL to fp ± se |", "|---|---:|---:|---:|"]
    for name, key in (("fp teacher", "fp"), ("RTN (before training)", "rtn"), (f"{settings['arm']} (trained)", "trained")):
        row = report[key]
        lines.append(f"| {name} | {row['perplexity']:.3f} | {row['delta_ppl_pct']:+.2f} ± {row['delta_ppl_pct_se'] or 0:.2f}"
                     f" | {row['kl_mean']:.4f} ± {row['kl_se'] or 0:.4f} |")
    lines += ["", "Made with `hf-kvcodecs squat` (hf_kvcodecs.training.SQuaTTrainer); load with "
              "`AutoModelForCausalLM.from_pretrained(...)` after `import hf_kvcodecs`.", ""]
    return "\n".join(lines)


def loss_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = [entry for entry in report["log_history"] if "loss" in entry]
    figure, axis = plt.subplots(figsize=(6, 4))
    for key, label in (("loss", "total"), ("squat_kd", "KD"), ("squat_feature", "feature"),
                       ("squat_feature_floor", "floor E|Q_s(f_t) - f_t|^2"), ("squat_ce", "cross-entropy")):
        points = [(entry["step"], entry[key]) for entry in history if key in entry]
        if points:
            axis.plot(*zip(*points), label=label)
    axis.set_xlabel("step")
    axis.set_yscale("log")
    axis.set_title(f"{report['settings']['arm']} W{report['settings']['weight_bits']}A"
                   f"{report['settings']['activation_bits'] or 16}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
