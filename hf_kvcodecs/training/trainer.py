"""``SQuaTTrainer``: label-free quantization-aware distillation inside the ordinary ``transformers.Trainer`` loop.

Loss per batch (no labels needed), over the positions the attention mask keeps:

    kd_weight * T^2 * KL(teacher || student)  +  feature_weight * MSE(Q_s(f_s), Q_s(f_t)) / E||f_t||^2

where ``f`` is the input of ``distillation_module`` (by default the last block's ``mlp.gate_proj``, i.e. the output
of its ``post_attention_layernorm``) and ``Q_s`` the student's activation quantizer there with its *current* step,
applied to the teacher's feature without gradient. Switches in :class:`SQuaTConfig` give the ablations with the same
code: ``quantize_teacher_features=False`` (feature KD against the raw teacher), ``feature_loss=False`` (logit-only
KD), and no teacher with ``use_labels=True`` (next-token cross-entropy QAT).

Besides the loss terms, every ``logging_steps`` the trainer logs the mechanism at each distilled layer ``i`` (see
:meth:`SQuaTTrainer.log`): the drift ``log(s_t / s_0)`` of the student's activation step, the fraction of the
teacher's feature values outside the student's quantizer range, the bound ``E||Q_s(f_t) - f_t||^2 / E||f_t||^2``
and the layer's feature term.
"""

from __future__ import annotations

import copy
import logging
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer

from ..codecs.learnable import LSQActivationQuantizer
from ..quantization import KVCodecsConfig, pack_fake_quantized, quantize_model
from .losses import chunked_kl, chunked_nll, clip_fraction, feature_terms

logger = logging.getLogger(__name__)
WEIGHT_GRID_SUFFIXES = ("weight_scale", "weight_offset")
ACTIVATION_STEP_SUFFIXES = ("input_quantizer.step",)
QUANTIZER_PARAMETER_SUFFIXES = WEIGHT_GRID_SUFFIXES + ACTIVATION_STEP_SUFFIXES


@dataclass
class SQuaTConfig:
    """What SQuaT optimises (see the module docstring).

    Args:
        kd_weight: ``beta``, the weight of the logit KL term.
        feature_weight: ``gamma``, the weight of the feature term.
        temperature: ``T`` of the logit KL.
        distillation_layers: decoder layers (negative counts from the end) whose ``distillation_module`` input is
            distilled; their terms are averaged.
        distillation_module: the module, relative to a decoder layer, whose input is the feature.
        quantize_teacher_features: target ``Q_s(f_t)`` (SQuaT) or the raw ``f_t`` (the ablation).
        feature_loss: ``False`` drops the feature term (logit-only KD-QAT).
        kd_loss: ``False`` drops the logit term.
        use_labels: train on the batch's ``labels`` too (next-token cross-entropy with weight ``label_weight``);
            otherwise labels in a batch are ignored with a warning.
        label_weight: weight of that cross-entropy term.
        chunk_tokens: rows of logits made at once for the KL and cross-entropy terms.
        quantizer_learning_rate: learning rate of the weight scales/offsets and activation steps (no weight decay);
            ``None`` uses ``TrainingArguments.learning_rate``.
        activation_step_learning_rate: learning rate of the activation steps alone, in an optimizer group of their
            own (no weight decay, same schedule as the others); ``None`` keeps them in the quantizer group at
            ``quantizer_learning_rate``. ``0`` freezes them at their data-based start.
    """

    kd_weight: float = 1.0
    feature_weight: float = 1.0
    temperature: float = 1.0
    distillation_layers: tuple[int, ...] = (-1,)
    distillation_module: str = "mlp.gate_proj"
    quantize_teacher_features: bool = True
    feature_loss: bool = True
    kd_loss: bool = True
    use_labels: bool = False
    label_weight: float = 1.0
    chunk_tokens: int = 512
    quantizer_learning_rate: float | None = None
    activation_step_learning_rate: float | None = None

    def __post_init__(self):
        for name in ("quantizer_learning_rate", "activation_step_learning_rate"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"SQuaTConfig.{name} must be a learning rate >= 0 or None, got {value!r}.")

    def to_dict(self) -> dict:
        return {**asdict(self), "distillation_layers": list(self.distillation_layers)}


EVAL_COUNTS = ("nll", "tokens", "sequences")  # evaluation sums that are no loss term


def _to_floats(terms: dict[str, torch.Tensor]) -> list[float]:
    """The terms' values as floats, read from the device at once."""
    if not terms:
        return []
    device = next(iter(terms.values())).device
    return torch.stack([value.detach().float().reshape(()).to(device) for value in terms.values()]).tolist()


def _base(model: nn.Module) -> nn.Module:
    """The transformers model under DDP / accelerate and peft wrappers."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def _decoder_layers(model: nn.Module, role: str) -> nn.ModuleList:
    decoder = _base(model).get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"The {role} model's decoder ({type(decoder).__name__}) has no `layers` list; SQuaTTrainer "
                         "supports decoder-only transformers models (Llama, Mistral, Qwen2, ...).")
    return layers


def quantized_linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules with a fake-quantized weight (a learnable ``weight_scale`` and a ``quantized_weight`` method)."""
    return {name: module for name, module in _base(model).named_modules()
            if isinstance(getattr(module, "weight_scale", None), nn.Parameter) and hasattr(module, "quantized_weight")}


TOKENIZE_FIRST = (
    "Tokenize the text first, e.g.\n"
    "    dataset = [tokenizer(t, truncation=True, max_length=256) for t in texts]\n"
    "or, for a datasets.Dataset with a 'text' column,\n"
    "    dataset = dataset.map(lambda row: tokenizer(row['text'], truncation=True, max_length=256), "
    "remove_columns=dataset.column_names)\n"
    "and pass processing_class=tokenizer, so that rows of different lengths are padded into batches."
)


def check_tokenized(dataset, role: str = "train_dataset") -> None:
    """Refuse a dataset whose rows are not tokenized (raw strings, or mappings without ``input_ids``) with the fix,
    instead of the ``TypeError`` transformers' data collator raises deep inside the first batch. Its first row is
    looked at (datasets that cannot be indexed, e.g. iterable ones, are left to the Trainer); a dict of evaluation
    datasets is checked dataset by dataset."""
    if dataset is None:
        return
    if isinstance(dataset, dict) and all(isinstance(name, str) for name in dataset) and "input_ids" not in dataset:
        for name, part in dataset.items():
            check_tokenized(part, f"{role}[{name!r}]")
        return
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        return
    try:
        row = dataset[0] if len(dataset) else None
    except Exception:  # a dataset that cannot be peeked at this way: the Trainer reads it as it can
        return
    if isinstance(row, (str, bytes)):
        problem = f"its rows are raw text ({type(row).__name__}: {row[:40]!r}...)"
    elif isinstance(row, Mapping) and "input_ids" not in row:
        problem = f"its rows have no input_ids (keys: {sorted(map(str, row))[:8]})"
    else:
        return
    raise ValueError(f"SQuaTTrainer's {role} is not tokenized: {problem}. {TOKENIZE_FIRST}")


class SQuaTTrainer(Trainer):
    """``Trainer`` for label-free quantization-aware distillation (SQuaT) of a fake-quantized student.

    ``model`` is the student: a model quantized with ``KVCodecsConfig(mode="fake", ...)`` (``from_pretrained`` or
    :func:`~hf_kvcodecs.quantization.quantize_model`), optionally with peft LoRA adapters on it; or a float model plus
    ``quantization_config``, which the trainer quantizes (then the float model, copied first, is the teacher unless
    ``teacher_model`` is given). The teacher is frozen, in eval mode, placed with
    ``accelerator.prepare_model(teacher, evaluation_mode=True)``, and never part of the student's checkpoints.
    Everything else (arguments, datasets, callbacks, ``train(resume_from_checkpoint=...)``, ``evaluate()``,
    ``accelerate launch`` / ``torchrun``) is ``Trainer``'s. :meth:`export` writes the packed low-bit model.
    """

    def __init__(self, model=None, teacher_model=None, args=None, *, squat_config: SQuaTConfig | None = None,
                 quantization_config: KVCodecsConfig | dict | None = None, **kwargs):
        self.squat_config = squat_config or SQuaTConfig()
        config = self.squat_config
        if model is None:
            raise ValueError("SQuaTTrainer needs model= (the student, or a float model with quantization_config=).")
        for role in ("train_dataset", "eval_dataset"):  # before the collator meets raw text deep inside a batch
            check_tokenized(kwargs.get(role), role)
        if quantization_config is not None:
            if quantized_linear_modules(model):
                raise ValueError("quantization_config was given but the model is already quantized; pass either a "
                                 "float model with quantization_config or a quantized student without it.")
            if isinstance(quantization_config, dict):
                quantization_config = KVCodecsConfig(**quantization_config)
            if quantization_config.mode != "fake":
                raise ValueError("Training needs learnable quantizers: use KVCodecsConfig(mode='fake', ...).")
            if teacher_model is None and (config.kd_loss or config.feature_loss):
                teacher_model = copy.deepcopy(model)
            model = quantize_model(model, quantization_config)
        needs_teacher = config.kd_loss or config.feature_loss
        if needs_teacher and teacher_model is None:
            raise ValueError("SQuaT distils from a teacher: pass teacher_model= (the full-precision model), or turn "
                             "both kd_loss and feature_loss off and set use_labels=True for cross-entropy QAT.")
        if not needs_teacher and not config.use_labels:
            raise ValueError("With kd_loss and feature_loss off, nothing is trained: set use_labels=True.")
        self._check_student(model)
        self._distillation_points = self._check_pair(model, teacher_model) if teacher_model is not None else []
        super().__init__(model=model, args=args, **kwargs)
        # compute_loss returns a per-batch mean: the Trainer divides it by the accumulation steps.
        self.loss_is_scaled_for_ga = False
        self.teacher = None
        if teacher_model is not None:
            teacher_model.eval()
            for parameter in teacher_model.parameters():
                parameter.requires_grad_(False)
            self.teacher = self.accelerator.prepare_model(teacher_model, evaluation_mode=True)
        self._captured: dict = {}
        self._hooks = self._install_hooks(model, teacher_model)
        self._terms: dict[str, list[float]] = defaultdict(list)
        # s_0 of each distilled layer's activation step, for the logged drift log(s_t / s_0)
        self._initial_steps: dict[int, torch.Tensor] = {}
        self._eval_sums: dict[str, float] = defaultdict(float)
        self._warned_labels = False

    # ---- checks -------------------------------------------------------------------------------------------------
    def _check_student(self, model) -> None:
        if not quantized_linear_modules(model):
            raise ValueError("The student has no fake-quantized linear layer. Quantize it first: "
                             "quantize_model(model, KVCodecsConfig(mode='fake', weight_bits=..., ...)), or pass "
                             "quantization_config= to SQuaTTrainer.")

    def _check_pair(self, student, teacher) -> list[tuple[int, nn.Module, nn.Module]]:
        config = self.squat_config
        student_head, teacher_head = _base(student).get_output_embeddings(), _base(teacher).get_output_embeddings()
        if student_head.weight.shape[0] != teacher_head.weight.shape[0]:
            raise ValueError(f"The student's vocabulary has {student_head.weight.shape[0]} tokens and the teacher's "
                             f"{teacher_head.weight.shape[0]}; distillation needs the same tokenizer and vocabulary.")
        student_layers, teacher_layers = _decoder_layers(student, "student"), _decoder_layers(teacher, "teacher")
        if len(student_layers) != len(teacher_layers):
            raise ValueError(f"The student has {len(student_layers)} decoder layers and the teacher "
                             f"{len(teacher_layers)}; SQuaT distils a quantized copy of the teacher's architecture.")
        # With feature_loss=False the distillation points are only watched (drift, clipping, bound: see log), where
        # they exist and have an activation quantizer; nothing about them is an error then.
        strict = config.feature_loss
        points = []
        count = len(student_layers)
        for layer in config.distillation_layers:
            if not -count <= layer < count:
                if not strict:
                    continue
                raise ValueError(f"distillation layer {layer} does not exist: the model has {count} decoder layers "
                                 f"(valid: {-count} to {count - 1}).")
            index = layer % count
            try:
                student_module = student_layers[index].get_submodule(config.distillation_module)
                teacher_module = teacher_layers[index].get_submodule(config.distillation_module)
            except AttributeError as error:
                if not strict:
                    continue
                raise ValueError(f"Decoder layer {index} has no module {config.distillation_module!r} "
                                 "(SQuaTConfig.distillation_module).") from error
            quantizer = getattr(student_module, "input_quantizer", None)
            if not strict and not (isinstance(quantizer, LSQActivationQuantizer)
                                   and hasattr(student_module, "quantize_input")):
                continue
            if config.quantize_teacher_features and not isinstance(quantizer, LSQActivationQuantizer):
                raise ValueError(
                    f"The student's layer {index} {config.distillation_module} has no activation quantizer, so there "
                    "is no student lattice to quantize the teacher's feature on. Quantize activations "
                    "(KVCodecsConfig(activation_bits=4, ...)), or set quantize_teacher_features=False (plain feature "
                    "KD) or feature_loss=False.")
            points.append((index, student_module, teacher_module))
        return points

    # ---- capture ------------------------------------------------------------------------------------------------
    def _install_hooks(self, student, teacher) -> list:
        hooks = []

        def keep(key):
            def hook(module, args, output):
                if self._captured.get("active"):
                    self._captured[key] = args[0] if key[0] != "final" else output[0]
            return hook

        hooks.append(_base(student).get_decoder().register_forward_hook(keep(("final", "student"))))
        if teacher is not None:
            hooks.append(_base(teacher).get_decoder().register_forward_hook(keep(("final", "teacher"))))
        for index, student_module, teacher_module in self._distillation_points:
            hooks.append(student_module.register_forward_hook(keep(("feature", "student", index))))
            hooks.append(teacher_module.register_forward_hook(keep(("feature", "teacher", index))))
        return hooks

    def _forward(self, model, inputs) -> None:
        self._captured["active"] = True
        try:
            model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"), use_cache=False,
                  logits_to_keep=1)
        finally:
            self._captured["active"] = False

    # ---- loss ---------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        config = self.squat_config
        labels = inputs.get("labels")
        if labels is not None and not config.use_labels and not self._warned_labels:
            logger.warning("SQuaTTrainer is label-free: the batch's labels are ignored (set "
                           "SQuaTConfig(use_labels=True) to add their cross-entropy).")
            self._warned_labels = True
        if config.use_labels and labels is None:
            raise ValueError("SQuaTConfig(use_labels=True) but the batch has no labels; use "
                             "DataCollatorForLanguageModeling(tokenizer, mlm=False) or drop use_labels.")
        terms, loss, _ = self._losses(model, inputs, labels if config.use_labels else None)
        if model.training:
            for name, value in zip(terms, _to_floats(terms)):
                self._terms[name].append(value)
        return (loss, {"loss": loss}) if return_outputs else loss

    def _losses(self, model, inputs, labels):
        config = self.squat_config
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        self._forward(model, inputs)
        captured = dict(self._captured)
        if self.teacher is not None:
            with torch.no_grad():
                self._forward(self.teacher, inputs)
            captured.update(self._captured)
        terms: dict[str, torch.Tensor] = {}
        loss = ids.new_zeros((), dtype=torch.float32)
        student_hidden = captured[("final", "student")]
        valid = mask.bool()
        if config.kd_loss:
            kd = chunked_kl(student_hidden[valid], captured[("final", "teacher")][valid],
                            _base(model).get_output_embeddings(), _base(self.teacher).get_output_embeddings(),
                            temperature=config.temperature, chunk_tokens=config.chunk_tokens)
            terms["kd"] = kd.detach()
            loss = loss + config.kd_weight * kd
        if self._distillation_points:
            features, floors = [], []
            for index, student_module, _ in self._distillation_points:
                raw_student = captured[("feature", "student", index)]
                if not config.feature_loss:  # only watched: no graph
                    raw_student = raw_student.detach()
                raw_teacher = captured[("feature", "teacher", index)].detach()
                quantizer = getattr(student_module, "input_quantizer", None)
                student_feature = student_module.quantize_input(raw_student)
                teacher_quantized = quantizer.quantize_detached(raw_teacher) if quantizer is not None else None
                term, floor = feature_terms(student_feature, raw_teacher, teacher_quantized, mask,
                                            quantized_target=config.quantize_teacher_features)
                features.append(term)
                terms[f"layer{index}_feature"] = term.detach()
                if floor is not None:
                    floors.append(floor)
                    terms[f"layer{index}_feature_floor"] = floor
                if quantizer is not None:
                    terms.update(self._step_metrics(index, quantizer, raw_teacher[valid]))
            if floors:
                terms["feature_floor"] = torch.stack(floors).mean()
            if config.feature_loss:
                feature = torch.stack(features).mean()
                terms["feature"] = feature.detach()
                loss = loss + config.feature_weight * feature
        if labels is not None:
            shifted = labels[:, 1:]
            keep = shifted.ne(-100) & valid[:, 1:]
            nll = chunked_nll(student_hidden[:, :-1][keep], _base(model).get_output_embeddings(), shifted[keep],
                              chunk_tokens=config.chunk_tokens)
            ce = nll / keep.sum().clamp_min(1)
            terms["ce"] = ce.detach()
            loss = loss + config.label_weight * ce
        self._captured.clear()
        return terms, loss, student_hidden

    def _step_metrics(self, index: int, quantizer: LSQActivationQuantizer, teacher_values: torch.Tensor) -> dict:
        """Layer ``index``'s activation step against its start ``s_0`` and the teacher's values it clips."""
        step = quantizer.step.detach().float()
        initial = self._initial_steps.setdefault(index, step.clone())
        drift = torch.log(step / initial)
        metrics = {f"layer{index}_step_drift": drift.mean(),
                   f"layer{index}_clip_fraction": clip_fraction(teacher_values, step, quantizer.bits)}
        if drift.numel() > 1:  # per-channel steps: channels may move both ways
            metrics[f"layer{index}_step_drift_abs"] = drift.abs().mean()
        return metrics

    def _remember_initial_steps(self) -> None:
        """``s_0`` := the distilled layers' activation steps now (when training starts, before a checkpoint it
        resumes from is loaded); a step not initialised yet is remembered at its first use instead."""
        self._initial_steps = {
            index: module.input_quantizer.step.detach().float().clone()
            for index, module, _ in self._distillation_points
            if isinstance(getattr(module, "input_quantizer", None), LSQActivationQuantizer)
            and module.input_quantizer.is_initialized}

    # ---- activation steps ---------------------------------------------------------------------------------------
    def initialize_activation_quantizers(self, dataloader) -> int:
        """Give every activation quantizer without a step its data-based one, from the first batch of
        ``dataloader`` (the mean over processes under distributed training). Runs before training and evaluation;
        quantizers restored from a checkpoint keep their steps. Returns how many were initialised."""
        model = self.model
        pending = [m for m in _base(model).modules() if isinstance(m, LSQActivationQuantizer) and not m.is_initialized]
        if not pending:
            return 0
        inputs = self._prepare_inputs(next(iter(dataloader)))
        was_training = model.training
        model.train()
        with torch.no_grad():
            model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"), use_cache=False,
                  logits_to_keep=1)
        model.train(was_training)
        return len(pending)

    def train(self, *args, **kwargs):
        if self.train_dataset is not None:
            self.initialize_activation_quantizers(self.get_train_dataloader())
        self._remember_initial_steps()
        return super().train(*args, **kwargs)

    # ---- logging and evaluation ---------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds to the training logs, as ``squat_<name>``, the means since the last log of the loss terms (``kd``,
        ``feature``, ``feature_floor``, ``ce``) and, per distilled decoder layer ``i``, of what the feature term
        does there: ``layer{i}_feature`` (its feature term), ``layer{i}_feature_floor`` (the bound
        ``E||Q_s(f_t) - f_t||^2 / E||f_t||^2``), ``layer{i}_clip_fraction`` (the fraction of the teacher's feature
        values outside the student's range ``[-Q_n s, Q_p s]``) and ``layer{i}_step_drift`` (``log(s_t / s_0)`` of
        the student's activation step, its mean over channels for per-channel steps, with ``_step_drift_abs`` the
        mean absolute value). Each is measured in the training forward passes, so with the step before that
        optimizer step's update: a log of step 1 alone (``logging_steps=1`` or ``logging_first_step=True``) has
        drift 0."""
        if "loss" in logs and self._terms:
            for name, values in self._terms.items():
                logs[f"squat_{name}"] = sum(values) / len(values)
            self._terms.clear()
        super().log(logs, start_time)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            terms, loss, hidden = self._losses(model, inputs, None)
            ids = inputs["input_ids"]
            mask = inputs.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask
            # the student's own next-token likelihood of the evaluation text: its perplexity, no labels needed
            keep = mask[:, 1:].bool() & mask[:, :-1].bool()
            nll = chunked_nll(hidden[:, :-1][keep], _base(model).get_output_embeddings(), ids[:, 1:][keep],
                              chunk_tokens=self.squat_config.chunk_tokens)
        self._eval_sums["nll"] += float(nll)
        self._eval_sums["tokens"] += float(keep.sum())
        for name, value in zip(terms, _to_floats(terms)):
            self._eval_sums[name] += value * ids.shape[0]
        self._eval_sums["sequences"] += ids.shape[0]
        if self.teacher is None:  # cross-entropy QAT: the evaluation loss is the student's next-token loss
            loss = nll / keep.sum().clamp_min(1)
        return loss.detach(), None, None

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        self._eval_sums.clear()
        self.initialize_activation_quantizers(dataloader)
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        names = sorted(self._eval_sums)
        totals = torch.tensor([self._eval_sums[name] for name in names], dtype=torch.float64,
                              device=self.args.device)
        totals = self.accelerator.reduce(totals, reduction="sum") if self.accelerator.num_processes > 1 else totals
        sums = dict(zip(names, totals.tolist()))
        if sums.get("tokens"):
            output.metrics[f"{metric_key_prefix}_perplexity"] = math.exp(sums["nll"] / sums["tokens"])
        for name in names:
            if name not in EVAL_COUNTS and sums.get("sequences"):
                output.metrics[f"{metric_key_prefix}_squat_{name}"] = sums[name] / sums["sequences"]
        return output

    # ---- optimizer ----------------------------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        """Groups: weights with and without decay at ``learning_rate``; weight scales/offsets (and the activation
        steps) at ``quantizer_learning_rate``; with ``activation_step_learning_rate``, the activation steps in a
        fourth group at that rate. No decay on quantizer parameters; one schedule scales every group."""
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        config = self.squat_config
        quantizer_lr = config.quantizer_learning_rate or self.args.learning_rate
        # activation steps get a group of their own only when asked to: checkpoints keep three groups otherwise
        separate_steps = config.activation_step_learning_rate is not None
        groups = {"decay": [], "no_decay": [], "quantizer": [], "activation_step": []}
        for name, parameter in opt_model.named_parameters():
            if not parameter.requires_grad:
                continue
            if separate_steps and name.endswith(ACTIVATION_STEP_SUFFIXES):
                groups["activation_step"].append(parameter)
            elif name.endswith(QUANTIZER_PARAMETER_SUFFIXES):
                groups["quantizer"].append(parameter)
            else:
                groups["decay" if name in decay else "no_decay"].append(parameter)
        parameter_groups = [
            {"params": groups["decay"], "weight_decay": self.args.weight_decay},
            {"params": groups["no_decay"], "weight_decay": 0.0},
            {"params": groups["quantizer"], "weight_decay": 0.0, "lr": quantizer_lr},
            {"params": groups["activation_step"], "weight_decay": 0.0, "lr": config.activation_step_learning_rate},
        ]
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        self.optimizer = optimizer_cls([group for group in parameter_groups if group["params"]], **optimizer_kwargs)
        return self.optimizer

    # ---- export -------------------------------------------------------------------------------------------------
    def export(self, output_dir: str | Path, *, card: str | None = None, push_to_hub: str | None = None):
        """Write the trained student as a packed low-bit checkpoint (learned weight grids, learned activation steps)
        that ``from_pretrained`` loads in a fresh process; optionally with a model card and pushed to the Hub.
        The trainer's student stays fake-quantized (training can go on)."""
        output_dir = Path(output_dir)
        student = copy.deepcopy(self.accelerator.unwrap_model(self.model))
        if hasattr(student, "merge_and_unload"):  # peft adapters: merged into the latent weights first
            student = student.merge_and_unload()
        pack_fake_quantized(student)
        student.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        if card is not None:
            (output_dir / "README.md").write_text(card)
        if push_to_hub:
            from ..quantization.hub import push_compressed_model

            push_compressed_model(output_dir, push_to_hub)
        return output_dir
