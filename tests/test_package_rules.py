"""Rules of the package's layout that import-linter cannot see."""

import ast
from pathlib import Path

import hf_kvcodecs

PACKAGE = Path(hf_kvcodecs.__file__).parent
# transformers' private symbols hf_kvcodecs relies on; a transformers upgrade that moves them must break one folder
TRANSFORMERS_PRIVATE = {
    "_attn_implementation", "_keep_in_fp32_modules", "_name_or_path", "_prepare_cache_for_generation",
    "_supports_default_dynamic_cache", "_is_hf_initialized", "ALL_CACHE_IMPLEMENTATIONS",
}


def _package_files():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] != "kernels":  # the symlinked top-level kernels/, read once below
            yield relative, path
    for path in sorted((PACKAGE.parent / "kernels").glob("*.py")):
        yield Path("kernels") / path.name, path


def _private_uses(tree: ast.AST) -> set[str]:
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in TRANSFORMERS_PRIVATE:
            used.add(node.attr)
        elif isinstance(node, ast.Constant) and node.value in TRANSFORMERS_PRIVATE:  # getattr(x, "_name")
            used.add(node.value)
    return used


def test_only_integrations_touches_transformers_private_symbols():
    offenders = {}
    for relative, path in _package_files():
        used = _private_uses(ast.parse(path.read_text(encoding="utf-8")))
        if used and relative.parts[0] != "integrations":
            offenders[str(relative)] = sorted(used)
    assert offenders == {}
    integrations = set().union(*(_private_uses(ast.parse(path.read_text(encoding="utf-8")))
                                 for relative, path in _package_files() if relative.parts[0] == "integrations"))
    assert {"_attn_implementation", "_prepare_cache_for_generation", "_is_hf_initialized"} <= integrations


def test_no_dates_or_issue_numbers_in_library_code():
    import re

    pattern = re.compile(r"20\d\d-[01]\d-[0-3]\d|\bissue\s+#?\d", re.IGNORECASE)
    offenders = [f"{relative}:{number}" for relative, path in _package_files()
                 for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    cpp = PACKAGE.parent / "kernels" / "cpu_native.cpp"
    offenders += [f"kernels/cpu_native.cpp:{number}" for number, line in enumerate(cpp.read_text().splitlines(), 1)
                  if pattern.search(line)]
    assert offenders == []


# ---- KV artifacts: the registry below the methods holds no entry; each method registers its own --------------------
METHODS = ("gsrq", "scd")
# the quantization modules that are GSRQ's own entry points (attach_kv_codebooks, the compress pipeline)
QUANTIZATION_USES_GSRQ = {"quantization/compress.py", "quantization/quantizer.py"}


def _imported_parts(relative: Path, tree: ast.AST) -> set[str]:
    """The first-level parts of hf_kvcodecs a file imports (absolute or relative, module- or function-level)."""
    package = ["hf_kvcodecs", *relative.parent.parts]
    parts = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            modules = [module] if node.module else [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        parts.update(name.split(".")[1] for name in modules
                     if name.startswith("hf_kvcodecs.") and len(name.split(".")) > 1)
    return parts


def _calls(tree: ast.AST, name: str) -> int:
    return sum(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name
               for node in ast.walk(tree))


def test_kv_artifact_entries_live_in_their_method():
    entries, registrations, method_imports = {}, {}, {}
    for relative, path in _package_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if made := _calls(tree, "KVArtifact"):
            entries[str(relative)] = made
        if registered := _calls(tree, "register_kv_artifact"):
            registrations[str(relative)] = registered
        if relative.parts[0] in ("quantization", "integrations"):
            if used := _imported_parts(relative, tree) & set(METHODS):
                method_imports[relative.as_posix()] = sorted(used)
    assert entries == {"gsrq/artifact.py": 1, "scd/artifact.py": 1}
    assert registrations == {"gsrq/__init__.py": 1, "scd/__init__.py": 1}
    assert set(method_imports) <= QUANTIZATION_USES_GSRQ and all(used == ["gsrq"] for used in method_imports.values())


def test_importing_the_package_registers_every_kv_artifact():
    from hf_kvcodecs.gsrq.artifact import GSRQ_CODEBOOKS
    from hf_kvcodecs.integrations.kv_artifacts import KV_ARTIFACTS, kv_artifact
    from hf_kvcodecs.quantization import kv_artifacts
    from hf_kvcodecs.scd.artifact import SCD_KNOWLEDGE_BASE

    assert KV_ARTIFACTS == {"gsrq": GSRQ_CODEBOOKS, "scd": SCD_KNOWLEDGE_BASE}
    assert kv_artifact("scd") is SCD_KNOWLEDGE_BASE and kv_artifacts.GSRQ_CODEBOOKS is GSRQ_CODEBOOKS
    assert kv_artifacts.kv_artifact is kv_artifact
    # importing only the quantization layer imports both methods first (hf_kvcodecs' __init__ sees to it)
    import subprocess
    import sys

    script = "import hf_kvcodecs.quantization.kv_artifacts as k; print(sorted(k.KV_ARTIFACTS))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == "['gsrq', 'scd']"


def test_squat_trainer_is_exported_at_the_top_level_without_importing_it_with_the_package():
    import subprocess
    import sys

    script = ("import sys, hf_kvcodecs; before = 'hf_kvcodecs.training' in sys.modules; "
              "from hf_kvcodecs import SQuaTTrainer, SQuaTConfig; from hf_kvcodecs.training import trainer; "
              "print(before, SQuaTTrainer is trainer.SQuaTTrainer, SQuaTConfig is trainer.SQuaTConfig)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False True True"
    assert {"SQuaTTrainer", "SQuaTConfig"} <= set(hf_kvcodecs.__all__)
    try:
        hf_kvcodecs.NoSuchName  # noqa: B018
    except AttributeError as error:
        assert "NoSuchName" in str(error)
    else:
        raise AssertionError("an unknown attribute must raise AttributeError")
