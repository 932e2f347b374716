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
