"""A consumer for SCD: a fine-tuned variant of the producer model, made with a LoRA adapter or a full fine-tune on
real text.

SCD sends a producer's prefill state to a consumer that shares its tokenizer and shapes but not its weights. A LoRA
adapter on every attention and MLP projection changes both the KV projections and the residual stream, so the
consumer's caches differ from the producer's in the way a real fine-tune's do, while the pair stays cheap to make on
a CPU and to store (the adapter is a few MB next to the base model it names). A LoRA fine-tune of a CPU budget moves
the model too little for some pairs (raw producer KV costs such a consumer a few percent); ``method="full"`` trains
every weight and saves a whole model directory instead, as a real domain expert is shipped.

:func:`make_consumer` fine-tunes, measures how far the fine-tune moved the model (perplexity of base and consumer on
held-out windows of the fine-tuning text and of every evaluation text, paired per window), and saves the adapter, a
sidecar naming the base model (read by :func:`hf_kvcodecs.models.load_model`) and the report. The steps are
separable: :func:`fit_consumer` works on token ids, :func:`save_consumer` writes a directory.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..evaluation import fixed_windows, forward_nll, paired_comparison
from ..models import CONSUMER_SIDECAR_FILE, CONSUMER_SIDECAR_VERSION, DEFAULT_MODEL_NAME, LoadedModel
from ..text import Corpus, tokenize_corpus
from ..version import __version__

logger = logging.getLogger(__name__)

REPORT_FORMAT_VERSION = 1
REPORT_FILE = "report.json"
REPORT_MARKDOWN_FILE = "report.md"
# Llama-family names of every attention and MLP projection: adapting only q/v (the common default) would leave the
# residual stream, and with it every later layer's keys and values, closer to the base than a real fine-tune does.
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FIT_METHODS = ("lora", "full")


@dataclass
class ConsumerFitSettings:
    """How the consumer is fine-tuned and measured.

    The defaults take about 20 minutes for the default model on 2 CPU threads. ``holdout_fraction`` of the fine-tuning
    token stream (its end) is never trained on; the fine-tuning domain's perplexity is measured there.
    ``warmup_fraction`` of the steps ramp the learning rate up linearly, the rest decay it linearly to zero.
    """

    steps: int = 150
    method: str = "lora"  # "lora": an adapter on target_modules; "full": every weight trained, a whole model saved
    sequence_tokens: int = 256
    batch_size: int = 4
    learning_rate: float = 2e-4
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default=LLAMA_PROJECTIONS)
    seed: int = 0
    eval_windows: int = 32
    eval_window_tokens: int = 256
    holdout_fraction: float = 0.1
    warmup_fraction: float = 0.05
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        self.target_modules = tuple(self.target_modules)
        if self.method not in FIT_METHODS:
            raise ValueError(f"ConsumerFitSettings.method is {self.method!r}; pick one of {', '.join(FIT_METHODS)}.")
        for name in ("steps", "sequence_tokens", "batch_size", "lora_rank", "eval_windows"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ConsumerFitSettings.{name} must be at least 1, got {getattr(self, name)}.")
        if self.sequence_tokens < 2 or self.eval_window_tokens < 2:
            raise ValueError("sequence_tokens and eval_window_tokens must be at least 2 (one token predicts the next).")
        if not 0.0 < self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must lie strictly between 0 and 1, got {self.holdout_fraction}.")
        if not 0.0 <= self.warmup_fraction < 1.0 or not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError("warmup_fraction and lora_dropout must lie in [0, 1).")
        if self.learning_rate <= 0.0:
            raise ValueError(f"learning_rate must be positive, got {self.learning_rate}.")
        if not self.target_modules:
            raise ValueError("target_modules is empty: name the projections the adapter goes on, e.g. "
                             f"{', '.join(LLAMA_PROJECTIONS)}.")

    def to_dict(self) -> dict:
        facts = asdict(self)
        facts["target_modules"] = list(self.target_modules)
        return facts


def check_consumer_directory(out: str | Path, *, overwrite: bool) -> None:
    """``out`` can receive a consumer: not a file, and (unless ``overwrite``) missing or empty."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; a consumer is saved as a directory: pass a directory path.")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; pass another directory, or --overwrite (Python: overwrite=True) "
                              "to write the consumer over what is there.")


def split_training_stream(token_ids: torch.Tensor, settings: ConsumerFitSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(training part, held-out end) of a token stream: the held-out part is the last ``holdout_fraction``, so no
    training window (drawn from the first part only) overlaps a held-out window."""
    total = token_ids.numel()
    held_out = max(int(round(total * settings.holdout_fraction)), settings.eval_window_tokens)
    train = total - held_out
    if train < settings.sequence_tokens + 1:
        raise ValueError(f"The fine-tuning text has {total} tokens; holding out {held_out} leaves {train}, fewer than "
                         f"one training window of {settings.sequence_tokens}. Use more text or shorter windows.")
    return token_ids[:train], token_ids[train:]


def training_starts(train_tokens: int, settings: ConsumerFitSettings) -> torch.Tensor:
    """Start offsets ``[steps, batch_size]`` of the training windows: uniform over the training part, from a generator
    seeded with ``settings.seed`` (the same settings draw the same windows)."""
    generator = torch.Generator().manual_seed(settings.seed)
    return torch.randint(0, train_tokens - settings.sequence_tokens + 1, (settings.steps, settings.batch_size),
                         generator=generator)


def _learning_rate_factor(step: int, settings: ConsumerFitSettings) -> float:
    warmup = max(1, round(settings.warmup_fraction * settings.steps))
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (settings.steps - step) / max(1, settings.steps - warmup))


def _lora_model(model: torch.nn.Module, settings: ConsumerFitSettings):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ImportError("Making a consumer needs peft: `pip install peft`.") from error
    config = LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
                        target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM")
    # get_peft_model rewires the module tree in place; the caller's model stays the untouched base (the producer).
    base = copy.deepcopy(model)
    for parameter in base.parameters():
        parameter.requires_grad_(False)
    try:
        return get_peft_model(base, config)
    except ValueError as error:
        raise ValueError(f"{error}\nSet ConsumerFitSettings.target_modules to the projection names of this model "
                         f"(the default names Llama's: {', '.join(LLAMA_PROJECTIONS)}).") from error


def _full_model(model: torch.nn.Module) -> torch.nn.Module:
    # a copy, so the caller's model stays the untouched base (the producer)
    copied = copy.deepcopy(model)
    for parameter in copied.parameters():
        parameter.requires_grad_(True)
    return copied


def fine_tune(model: torch.nn.Module, train_ids: torch.Tensor, settings: ConsumerFitSettings, *,
              progress: bool = True):
    """Fine-tune a copy of ``model`` on windows of ``train_ids`` (next-token cross-entropy, AdamW), with a LoRA
    adapter or, for ``settings.method == "full"``, every weight: the model (a ``peft.PeftModel`` or a plain copy) in
    eval mode, and the training log."""
    if type(model).__name__.startswith("PeftModel") or hasattr(model, "peft_config"):
        raise ValueError("The model already carries a peft adapter. Fine-tune a plain model: load an adapter with "
                         "load_model(directory, merge_adapter=True) to merge it first.")
    device = next(model.parameters()).device
    starts = training_starts(train_ids.numel(), settings)
    offsets = torch.arange(settings.sequence_tokens)
    losses: list[float] = []
    began = time.perf_counter()
    # the adapter's random initialisation (and dropout, when set) draw from torch's global generator: seeded here and
    # restored after, so a run is reproducible and leaves the caller's random state as it was
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        consumer_model = _full_model(model) if settings.method == "full" else _lora_model(model, settings)
        trainable = [parameter for parameter in consumer_model.parameters() if parameter.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=settings.learning_rate, weight_decay=settings.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _learning_rate_factor(step, settings))
        consumer_model.train()
        bar = tqdm(range(settings.steps), desc="fine-tuning the consumer", disable=not progress)
        for step in bar:
            ids = train_ids[starts[step][:, None] + offsets].to(device)
            logits = consumer_model(input_ids=ids, use_cache=False).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            if not torch.isfinite(loss):
                raise FloatingPointError(f"The fine-tuning loss is {loss.item()} at step {step}; lower the learning "
                                         f"rate (now {settings.learning_rate}).")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, settings.max_grad_norm)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        bar.close()
    consumer_model.eval()
    seconds = time.perf_counter() - began
    head = max(1, min(10, len(losses) // 4))
    log = {
        "steps": settings.steps,
        "tokens_seen": settings.steps * settings.batch_size * settings.sequence_tokens,
        "train_tokens_available": int(train_ids.numel()),
        "seconds": seconds,
        "trainable_parameters": sum(parameter.numel() for parameter in trainable),
        "base_parameters": sum(parameter.numel() for parameter in model.parameters()),
        "loss_first": sum(losses[:head]) / head,  # means over the first / last steps: one batch's loss is noisy
        "loss_last": sum(losses[-head:]) / head,
        "losses": losses,
    }
    return consumer_model, log


def perplexity_shift(base_model, consumer_model, texts: dict[str, torch.Tensor], settings: ConsumerFitSettings, *,
                     progress: bool = True, base_scores: dict | None = None) -> dict[str, dict]:
    """Per text: the perplexity of base and consumer on the same ``eval_windows`` windows and the consumer's change
    against the base (in %, ± the standard error of the paired per-window NLL differences)."""
    rows = {}
    for name, token_ids in texts.items():
        windows = fixed_windows(token_ids, settings.eval_windows, settings.eval_window_tokens)
        base = (base_scores or {}).get(name)
        if base is None:
            base = forward_nll(base_model, windows, progress=progress, description=f"base perplexity: {name}")
        consumer = forward_nll(consumer_model, windows, progress=progress, description=f"consumer perplexity: {name}")
        paired = paired_comparison(consumer, base)
        rows[name] = {
            "windows": paired["windows"],
            "window_tokens": settings.eval_window_tokens,
            "scored_tokens": paired["scored_tokens"],
            "base_ppl": base.perplexity,
            "consumer_ppl": paired["perplexity"],
            "delta_ppl_pct": paired["delta_ppl_pct"],
            "delta_ppl_pct_se": paired["delta_ppl_pct_se"],
        }
    return rows


def fit_consumer(model: torch.nn.Module, train_ids: torch.Tensor, *, settings: ConsumerFitSettings | None = None,
                 eval_ids: dict[str, torch.Tensor] | None = None, train_name: str = "fine-tuning text",
                 progress: bool = True):
    """Fine-tune a LoRA consumer of ``model`` on the token stream ``train_ids`` and measure the perplexity shift on
    the stream's held-out end (``train_name``) and on every stream of ``eval_ids``: the ``peft.PeftModel`` (eval mode;
    ``model`` itself is not changed) and ``{"training": log, "perplexity": {name: row}}``."""
    settings = settings or ConsumerFitSettings()
    eval_ids = dict(eval_ids or {})
    if train_name in eval_ids:
        raise ValueError(f"An evaluation text is named {train_name!r}, like the fine-tuning text; rename one.")
    train_part, held_out = split_training_stream(train_ids.reshape(-1).long(), settings)
    texts = {train_name: held_out, **eval_ids}
    for name, token_ids in texts.items():  # before the minutes of fine-tuning: a text too short fails now
        try:
            fixed_windows(token_ids, settings.eval_windows, settings.eval_window_tokens)
        except ValueError as error:
            part = "the held-out end of " if name == train_name else ""
            raise ValueError(f"Measuring {part}{name!r}: {error}") from error
    # the base is scored before the adapter exists, so nothing of it can leak into the reference
    base_scores = {name: forward_nll(model, fixed_windows(token_ids, settings.eval_windows, settings.eval_window_tokens),
                                     progress=progress, description=f"base perplexity: {name}")
                   for name, token_ids in texts.items()}
    consumer_model, log = fine_tune(model, train_part, settings, progress=progress)
    log["held_out_tokens"] = int(held_out.numel())
    rows = perplexity_shift(model, consumer_model, texts, settings, progress=progress, base_scores=base_scores)
    rows[train_name]["role"] = f"fine-tuning domain, held-out last {100 * settings.holdout_fraction:g} % of its tokens"
    for name in eval_ids:
        rows[name]["role"] = "evaluation"
    return consumer_model, {"training": log, "perplexity": rows}


def base_model_reference(loaded: LoadedModel) -> str:
    """How :func:`hf_kvcodecs.models.load_model` finds ``loaded`` again: its name, a local path made absolute (so the
    adapter loads from any working directory)."""
    if loaded.name != DEFAULT_MODEL_NAME and Path(loaded.name).exists():
        return str(Path(loaded.name).resolve())
    return loaded.name


def make_consumer(loaded: LoadedModel, train_corpus: Corpus, *, settings: ConsumerFitSettings | None = None,
                  out: str | Path, eval_corpora: dict[str, Corpus] | None = None, progress: bool = True,
                  overwrite: bool = False, train_name: str = "fine-tuning text") -> dict:
    """Fine-tune a LoRA consumer of ``loaded`` on ``train_corpus``, measure the perplexity shift (held-out end of the
    fine-tuning text, and each of ``eval_corpora``), and save it to ``out``: the adapter, the sidecar naming the base
    model (so ``load_model(out)`` loads the consumer) and ``report.json`` / ``report.md``. Returns the report.

    An evaluation corpus identical to the fine-tuning text is skipped (its held-out end is measured already).
    ``out`` must be missing or empty unless ``overwrite``.
    """
    settings = settings or ConsumerFitSettings()
    check_consumer_directory(out, overwrite=overwrite)  # before the minutes of fine-tuning
    began = time.perf_counter()
    eval_corpora = dict(eval_corpora or {})
    for name, corpus in list(eval_corpora.items()):
        if corpus.sha256 == train_corpus.sha256:
            logger.warning("Skipping the evaluation text %s: it is the fine-tuning text.", name)
            del eval_corpora[name]
    train_ids = tokenize_corpus(loaded.tokenizer, train_corpus)
    eval_ids = {name: tokenize_corpus(loaded.tokenizer, corpus) for name, corpus in eval_corpora.items()}
    consumer_model, fit = fit_consumer(loaded.model, train_ids, settings=settings, eval_ids=eval_ids,
                                   train_name=train_name, progress=progress)
    texts = {train_name: {**train_corpus.to_dict(), "tokens": int(train_ids.numel())},
             **{name: {**corpus.to_dict(), "tokens": int(eval_ids[name].numel())} for name, corpus in eval_corpora.items()}}
    for name, row in fit["perplexity"].items():
        row["text"] = texts[name]["description"]
    report = {
        "format_version": REPORT_FORMAT_VERSION,
        "hf_kvcodecs_version": __version__,
        "adapter": str(Path(out).resolve()),
        "base_model": {"name": base_model_reference(loaded), "description": loaded.description},
        "train_text": texts[train_name],
        "eval_texts": {name: texts[name] for name in eval_corpora},
        "settings": settings.to_dict(),
        "training": fit["training"],
        "perplexity": fit["perplexity"],
        "threads": torch.get_num_threads(),
        "seconds_total": time.perf_counter() - began,
    }
    save_consumer(consumer_model, out, report, overwrite=overwrite, tokenizer=loaded.tokenizer)
    return report


def consumer_sidecar(report: dict) -> dict:
    """What the sidecar next to the adapter records: the base model as load_model names it, and how it was made."""
    training = report["training"]
    return {
        "format_version": CONSUMER_SIDECAR_VERSION,
        "base_model": report["base_model"]["name"],
        "base_description": report["base_model"]["description"],
        "hf_kvcodecs_version": report["hf_kvcodecs_version"],
        "train_text": {key: report["train_text"][key] for key in ("description", "sha256", "characters", "tokens")},
        "settings": report["settings"],
        "steps": training["steps"],
        "tokens_seen": training["tokens_seen"],
        "wall_seconds": training["seconds"],
    }


def save_consumer(consumer_model, out: str | Path, report: dict, *, overwrite: bool = False, tokenizer=None) -> None:
    """Write the adapter or, for a full fine-tune, the whole model and its tokenizer (``save_pretrained``: then
    ``load_model(out)`` loads it like any local model), the sidecar, ``report.json`` and ``report.md`` into ``out``."""
    out = Path(out)
    full = report["settings"].get("method") == "full"
    if full and tokenizer is None:
        raise ValueError("A fully fine-tuned consumer is saved as a model directory with its tokenizer: pass "
                         "tokenizer=.")
    check_consumer_directory(out, overwrite=overwrite)
    out.mkdir(parents=True, exist_ok=True)
    consumer_model.save_pretrained(str(out))
    if full:
        tokenizer.save_pretrained(str(out))
    (out / CONSUMER_SIDECAR_FILE).write_text(json.dumps(consumer_sidecar(report), indent=2) + "\n")
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    (out / REPORT_MARKDOWN_FILE).write_text(report_markdown(report))


def _percent(value: float | None, standard_error: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:+.2f} %" + ("" if standard_error is None else f" ± {standard_error:.2f}")


def report_markdown(report: dict) -> str:
    """The report as markdown: what was fine-tuned on what, and the perplexity shift table."""
    training, settings = report["training"], report["settings"]
    full = settings.get("method") == "full"
    what = (f"- weights: every weight trained ({training['trainable_parameters']} parameters), saved as a whole model"
            if full else
            f"- adapter: LoRA rank {settings['lora_rank']}, alpha {settings['lora_alpha']}, dropout "
            f"{settings['lora_dropout']} on {', '.join(settings['target_modules'])} "
            f"({training['trainable_parameters']} trainable parameters over {training['base_parameters']} frozen)")
    lines = [
        f"# SCD consumer: {'full' if full else 'LoRA'} fine-tune of the producer",
        "",
        f"- base model (producer): {report['base_model']['description']}",
        f"- fine-tuning text: {report['train_text']['description']} ({report['train_text']['tokens']} tokens, "
        f"sha256 {report['train_text']['sha256'][:12]}...)",
        what,
        f"- training: {training['steps']} steps of {settings['batch_size']} x {settings['sequence_tokens']} tokens "
        f"({training['tokens_seen']} tokens seen), AdamW lr {settings['learning_rate']:g} (linear warmup "
        f"{100 * settings['warmup_fraction']:g} %, linear decay), seed {settings['seed']}; {training['seconds']:.0f} s "
        f"on {report['threads']} threads",
        f"- loss (mean of the first / last steps): {training['loss_first']:.3f} -> {training['loss_last']:.3f}",
        "",
        "Perplexity of base and consumer on the same windows; Δ is paired per window (± standard error).",
        "",
        "| text | role | windows x tokens | base ppl | consumer ppl | Δ ppl |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in report["perplexity"].items():
        lines.append(f"| {name} | {row['role']} | {row['windows']} x {row['window_tokens']} | {row['base_ppl']:.3f} | "
                     f"{row['consumer_ppl']:.3f} | {_percent(row['delta_ppl_pct'], row['delta_ppl_pct_se'])} |")
    lines += ["", "Texts:", ""]
    lines += [f"- {name}: {row['text']}" for name, row in report["perplexity"].items()]
    return "\n".join(lines) + "\n"
