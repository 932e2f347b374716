"""Hooks around the import of chosen modules (hf_kvcodecs.integrations.import_hooks), on throwaway modules."""

import importlib
import importlib.util
import inspect
import sys
import warnings

import pytest

from hf_kvcodecs.integrations import import_hooks
from hf_kvcodecs.integrations.import_hooks import add_import_hook, is_being_imported, remove_import_hook


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``hooked_pkg`` with modules ``first`` and ``second``, importable for this test only."""
    root = tmp_path / "hooked_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "first.py").write_text("VALUE = 1\n")
    (root / "second.py").write_text("from . import first\nVALUE = first.VALUE + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "hooked_pkg"
    for name in [name for name in sys.modules if name.split(".")[0] == "hooked_pkg"]:
        del sys.modules[name]


def _finders():
    return [finder for finder in sys.meta_path if isinstance(finder, import_hooks._HookingFinder)]


def test_hooks_run_around_the_module_code_of_watched_modules_only(package):
    calls = []

    def before(name):
        module = sys.modules[name]
        calls.append(("before", name, hasattr(module, "VALUE"), is_being_imported(name)))

    def after(name):
        module = sys.modules[name]
        calls.append(("after", name, module.VALUE, is_being_imported(name)))

    watches = lambda name: name.endswith(".second")  # noqa: E731
    add_import_hook(watches, before, when="before")
    add_import_hook(watches, after, when="after")
    try:
        second = importlib.import_module(f"{package}.second")
    finally:
        remove_import_hook(before)
        remove_import_hook(after)
    assert calls == [("before", f"{package}.second", False, True), ("after", f"{package}.second", 2, True)]
    assert not is_being_imported(f"{package}.second") and second.VALUE == 2
    # the module keeps the loader that was found for it: its source and a reload work as without hooks
    assert type(second.__loader__) is type(sys.modules[f"{package}.first"].__loader__)
    assert second.__spec__.loader is second.__loader__
    assert "VALUE = first.VALUE + 1" in inspect.getsource(second)
    assert importlib.reload(second).VALUE == 2


def test_modules_imported_before_the_hook_are_not_reported(package):
    importlib.import_module(f"{package}.first")
    calls = []
    add_import_hook(lambda name: name.startswith(package), calls.append, when="after")
    try:
        importlib.import_module(f"{package}.first")
        importlib.import_module(f"{package}.second")
    finally:
        remove_import_hook(calls.append)
    assert calls == [f"{package}.second"]


def test_a_failing_before_hook_fails_the_import_and_leaves_no_half_module(package):
    def refuse(name):
        raise RuntimeError(f"not yet: {name}")

    add_import_hook(lambda name: name.endswith(".first"), refuse, when="before")
    try:
        with pytest.raises(RuntimeError, match="not yet"):
            importlib.import_module(f"{package}.first")
        assert f"{package}.first" not in sys.modules
    finally:
        remove_import_hook(refuse)
    assert importlib.import_module(f"{package}.first").VALUE == 1


def test_a_failing_after_hook_warns_and_the_import_succeeds(package):
    def broken(name):
        raise KeyError(name)

    add_import_hook(lambda name: name.endswith(".first"), broken, when="after")
    try:
        with pytest.warns(RuntimeWarning, match=r"broken failed after hooked_pkg\.first was imported: KeyError"):
            first = importlib.import_module(f"{package}.first")
    finally:
        remove_import_hook(broken)
    assert first.VALUE == 1 and sys.modules[f"{package}.first"] is first


def test_the_finder_leaves_with_the_last_hook_and_unknown_phases_are_refused(package):
    hook = lambda name: None  # noqa: E731
    add_import_hook(lambda name: False, hook, when="after")
    assert len(_finders()) == 1
    remove_import_hook(hook)
    assert len(_finders()) == (1 if import_hooks._HOOKS else 0)  # hooks of the package itself may still wait
    with pytest.raises(ValueError, match="when must be 'before' or 'after'"):
        add_import_hook(lambda name: True, hook, when="during")


def test_a_spec_found_outside_an_import_still_serves_its_loader(package):
    """runpy, pkgutil and importlib.util.find_spec ask the loader for more than exec_module."""
    seen = []
    add_import_hook(lambda name: name.endswith(".first"), seen.append, when="after")
    try:
        spec = importlib.util.find_spec(f"{package}.first")
        assert type(spec.loader).__name__ == "_HookedLoader"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            code = spec.loader.get_code(f"{package}.first")
        assert "VALUE" in code.co_names and spec.loader.get_source(f"{package}.first") == "VALUE = 1\n"
    finally:
        remove_import_hook(seen.append)
    assert seen == []  # nothing was imported
