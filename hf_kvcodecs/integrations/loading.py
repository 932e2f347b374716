"""transformers' loading and saving internals that hf_kvcodecs relies on (kept here, beside the other private-symbol
uses).

``_is_hf_initialized``: transformers 5.24 marks every parameter it filled from a checkpoint with this attribute and
only *warns* about missing keys, leaving their memory uninitialised. For packed low-bit codes that would be silent
garbage, so the quantizer checks the mark. The supported transformers range is enforced in ``transformers_patch``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from pathlib import Path
from typing import Protocol

import torch

LOADED_MARK = "_is_hf_initialized"


def was_loaded_from_checkpoint(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, LOADED_MARK, False))


def loaded_from(config) -> str | None:
    """The Hub id or local path a model was loaded from (transformers keeps it in a private config attribute)."""
    return getattr(config, "_name_or_path", None)


def keep_in_fp32_modules(model) -> list[str] | None:
    """The module names a model class keeps in float32 whatever the dtype (transformers' private class attribute),
    which quantizers leave unconverted."""
    return getattr(model, "_keep_in_fp32_modules", None)


# ---- save_pretrained that writes more than transformers does ------------------------------------------------------
class SaveExtension(Protocol):
    """What an instance-level ``save_pretrained`` adds to transformers' own (see :func:`install_save_extension`)."""

    def saving(self, model) -> contextlib.AbstractContextManager:
        """Entered around transformers' ``save_pretrained`` (e.g. to make the configs name files by their place in
        the checkpoint rather than by this machine's path)."""

    def write(self, model, save_directory: Path) -> None:
        """Write the extra files into the saved folder (main process only)."""


def install_save_extension(model, extension: SaveExtension) -> None:
    """Give ``model`` an instance-level ``save_pretrained`` that also runs ``extension`` (idempotent).

    transformers' ``save_pretrained`` only writes config, generation config and weights, and uploads inside itself
    when ``push_to_hub=True``, before anything written afterwards exists: the wrapper saves without pushing, writes the
    extension's files, then pushes the complete folder. ``push_to_hub`` and ``Trainer`` checkpoints call
    ``save_pretrained``, so the files travel with every copy of the model.
    """
    model.save_pretrained = types.MethodType(functools.partial(_save_pretrained_with, extension), model)


def remove_save_extension(model) -> None:
    if "save_pretrained" in model.__dict__:
        del model.save_pretrained


def _save_pretrained_with(extension: SaveExtension, self, save_directory, *args, **kwargs):
    save = type(self).save_pretrained
    bound = inspect.signature(save).bind(self, save_directory, *args, **kwargs)
    extra = next((bound.arguments.setdefault(p.name, {}) for p in inspect.signature(save).parameters.values()
                  if p.kind is inspect.Parameter.VAR_KEYWORD), {})
    push_to_hub = bound.arguments.get("push_to_hub", False)
    bound.arguments["push_to_hub"] = False
    hub_options = {key: extra.pop(key) for key in ("repo_id", "commit_message", "commit_description", "create_pr",
                                                   "private", "revision", "tags") if key in extra}
    with extension.saving(self):
        result = save(*bound.args, **bound.kwargs)
    if bound.arguments.get("is_main_process", True):
        extension.write(self, Path(save_directory))
    if push_to_hub:
        repo_id = hub_options.pop("repo_id", Path(save_directory).name)
        self.push_to_hub(repo_id, token=bound.arguments.get("token"), **hub_options)
    return result
