"""Run a function just before or just after chosen modules are imported, without importing anything up front.

``import hf_kvcodecs`` stays light (``hf-kvcodecs --help`` must not pay for torch) and still wires the package up
before it is used: the methods are imported before a layer that reads their registrations, and the registration with
transformers runs once transformers' model code has loaded, whichever import gets there (``from transformers import
AutoModelForCausalLM``, a model module, another library). Python has no import hook of this kind, so a finder placed
first on ``sys.meta_path`` hands each watched module to the loader that would have loaded it anyway, wrapped so that
the hooks run around the module's code. The module itself sees its own loader; nothing else about the import changes.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from collections.abc import Callable

BEFORE, AFTER = "before", "after"
# hook -> (when it runs, the predicate choosing the module names it runs for)
_HOOKS: dict[Callable[[str], None], tuple[str, Callable[[str], bool]]] = {}


def add_import_hook(watches: Callable[[str], bool], hook: Callable[[str], None], *, when: str) -> None:
    """Call ``hook(name)`` for each module ``name`` imported from now on for which ``watches(name)`` is true.

    ``when="before"``: once the module exists (in ``sys.modules``, empty) and before its code runs; an exception fails
    the import, as one raised by the module's own first line would. ``when="after"``: once its code has run (it is
    still marked as being imported, see :func:`is_being_imported`); the import succeeded, so an exception is reported
    as a ``RuntimeWarning`` instead of failing it.
    """
    if when not in (BEFORE, AFTER):
        raise ValueError(f"when must be {BEFORE!r} or {AFTER!r}, got {when!r}")
    _HOOKS[hook] = (when, watches)
    if not any(isinstance(finder, _HookingFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _HookingFinder())


def remove_import_hook(hook: Callable[[str], None]) -> None:
    """Stop calling ``hook``; once no hook is left the finder leaves ``sys.meta_path`` too."""
    _HOOKS.pop(hook, None)
    if not _HOOKS:
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _HookingFinder)]


def is_being_imported(name: str) -> bool:
    """Whether module ``name`` has started importing and not finished (its code may still be running)."""
    module = sys.modules.get(name)
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _hooks_for(name: str, when: str) -> list[Callable[[str], None]]:
    return [hook for hook, (hook_when, watches) in list(_HOOKS.items()) if hook_when == when and watches(name)]


class _HookingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not any(watches(fullname) for _, watches in list(_HOOKS.values())):
            return None
        for finder in sys.meta_path:  # the spec the import system would have found without this finder
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # a namespace package or a legacy loader: imported as usual, without hooks
        spec.loader = _HookedLoader(spec.loader)
        return spec


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name: str):
        # what else is asked of a loader found through find_spec (runpy's get_code, get_source, get_resource_reader)
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        # the module sees the loader that was found for it (inspect, importlib.resources and reload ask it)
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        name = module.__name__
        for hook in _hooks_for(name, BEFORE):
            hook(name)
        self.loader.exec_module(module)
        for hook in _hooks_for(name, AFTER):
            try:
                hook(name)
            except Exception as error:  # raising here would fail an import that itself succeeded
                warnings.warn(f"{getattr(hook, '__qualname__', hook)} failed after {name} was imported: {error!r}",
                              RuntimeWarning, stacklevel=2)
