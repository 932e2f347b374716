"""A Markdown table of long-context results: one row per method, one column per task and length."""

from __future__ import annotations


def _format(mean, se, strict=None) -> str:
    if mean is None:
        return "–"
    text = f"{100 * mean:.1f}" + (f" ± {100 * se:.1f}" if se is not None else "")
    return text + (f" ({100 * strict:.0f})" if strict is not None else "")


def task_suite_table(results: dict[str, dict]) -> list[str]:
    """Markdown lines for ``{method: run_task_suite result}`` (as ``run_task_suite_methods(...)["methods"]``): RULER
    score in % ± standard error over items, strict exact match in % in brackets, and per length the mean over tasks."""
    first = next(iter(results.values()))
    tasks = list(first["cells"])
    lengths = list(first["lengths"])
    header = [f"{task} {length}" for task in tasks for length in lengths] + [f"mean {length}" for length in lengths]
    lines = ["| method | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
    for name, result in results.items():
        cells = [_format(result["cells"][task][length]["mean"], result["cells"][task][length]["se"],
                         result["cells"][task][length]["strict_mean"])
                 if length in result["cells"].get(task, {}) else "–" for task in tasks for length in lengths]
        means = [_format(result["lengths"][length]["mean"], result["lengths"][length]["se"]) for length in lengths]
        lines.append(f"| {name} | " + " | ".join(cells + means) + " |")
    return lines
