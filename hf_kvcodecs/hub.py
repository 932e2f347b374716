"""Hugging Face Hub helpers every method shares: what a Hub id looks like, the default model's Hub id, the card
templates shipped in ``model_cards/`` and the library versions a card or report records."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import platform
from pathlib import Path

from .models import DEFAULT_MODEL_NAME

# Hub id of the model the default GGUF was converted from (the card's base_model links to it).
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_LICENSE = "apache-2.0"
VERSIONED_PACKAGES = ("hf-kvcodecs", "transformers", "torch", "huggingface_hub", "safetensors", "tokenizers")


def looks_like_repo_id(source: str) -> bool:
    """Whether ``source`` can name a Hub repository (``name`` or ``owner/name``) rather than only a local path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if source.startswith((".", "/", "~")) or "\\" in source:
        return False
    try:
        validate_repo_id(source)
    except HFValidationError:
        return False
    return True


def is_owner_name(source: str) -> bool:
    """Whether ``source`` has the form of a Hub repo id ``owner/name`` (what a pushed artifact is named by); a bare
    ``name`` is not looked up on the Hub."""
    return source.count("/") == 1 and looks_like_repo_id(source)


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """None when the Hub endpoint answers within ``timeout`` seconds; else why it cannot be reached (offline mode, or
    the connection error), found in one request instead of the minute of retries a download spends on it."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as error:  # the HTTP client's own transport errors: DNS, refused connection, timeout, proxy
        return f"{constants.ENDPOINT} did not answer: {error}"
    return None


def model_hub_id(name: str) -> str | None:
    """The Hub id of the model a command was given: the repo the default GGUF was converted from, or ``owner/name``
    that is not a local path; ``None`` for a local folder."""
    if name == DEFAULT_MODEL_NAME:
        return DEFAULT_MODEL_HUB_ID
    return name if name.count("/") == 1 and not Path(name).exists() else None


def templates_dir() -> Path:
    """The card templates: the repository's top-level ``model_cards/``, installed as ``hf_kvcodecs.model_cards``."""
    return Path(str(importlib.resources.files("hf_kvcodecs.model_cards")))


def library_versions() -> dict[str, str | None]:
    versions = {}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package.replace("-", "_")] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package.replace("-", "_")] = None
    versions["python"] = platform.python_version()
    return versions

