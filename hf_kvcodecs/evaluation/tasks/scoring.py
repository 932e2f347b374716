"""Scoring answers the way RULER does, plus a strict exact match, and the per-cell summaries.

- :func:`string_match_all` is RULER's metric: the fraction of expected strings found in the answer (case-insensitive
  substring), so naming two of four numbers scores 0.5;
- :func:`strict_match` is 1 only when the answer names exactly the expected strings: every candidate the answer holds
  (a seven-digit number, a five-letter variable name, a word of the list; :func:`extract_answers`) is expected and
  every expected one is named. An answer that lists every number of the haystack passes RULER's metric and fails this.
"""

from __future__ import annotations

import math
import re
import statistics

from .item import TaskItem

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean_answer(answer: str) -> str:
    """RULER's post-processing: control characters become line breaks, surrounding space goes."""
    return _CONTROL.sub("\n", answer).strip()


def string_match_all(answer: str, expected: list[str]) -> float:
    lowered = answer.lower()
    return sum(value.lower() in lowered for value in expected) / len(expected)


def extract_answers(answer: str, item: TaskItem) -> list[str]:
    """The candidate answers an answer names, in order, each once: words of the item's vocabulary when it has one,
    else the matches of its candidate pattern."""
    if item.vocabulary is not None:
        found = [word for word in re.findall(r"[a-z]+", answer.lower()) if word in item.vocabulary]
    else:
        found = re.findall(item.candidates, answer)
    return list(dict.fromkeys(found))


def strict_match(answer: str, item: TaskItem) -> float:
    return float(set(extract_answers(answer, item)) == set(item.expected))


def score_answer(item: TaskItem, answer: str) -> dict:
    answer = clean_answer(answer)
    return {"answer": answer, "score": string_match_all(answer, item.expected), "strict": strict_match(answer, item),
            "extracted": extract_answers(answer, item)}


def mean_se(values: list[float]) -> dict:
    """Mean, standard error of the mean over items (None for one item) and count."""
    count = len(values)
    if not count:
        return {"mean": None, "se": None, "n": 0}
    se = statistics.stdev(values) / math.sqrt(count) if count > 1 else None
    return {"mean": statistics.fmean(values), "se": se, "n": count}


def summarize(rows: list[dict]) -> dict:
    """Per task and length (``cells[task][str(length)]``): RULER score and strict exact match, mean ± se over items,
    n, and the mean prompt length; per length, the mean over tasks (RULER's headline number per length) with the
    standard error of that mean (cells independent)."""
    cells: dict[str, dict[str, dict]] = {}
    for row in rows:
        cells.setdefault(row["task"], {}).setdefault(str(row["length"]), []).append(row)
    summary = {}
    for task, by_length in cells.items():
        for length, members in by_length.items():
            score, strict = mean_se([r["score"] for r in members]), mean_se([r["strict"] for r in members])
            summary.setdefault(task, {})[length] = {
                "n": score["n"], "mean": score["mean"], "se": score["se"], "strict_mean": strict["mean"],
                "strict_se": strict["se"], "prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in members),
                "seconds": sum(r.get("seconds", 0.0) for r in members)}
    lengths = {}
    for length in dict.fromkeys(str(row["length"]) for row in rows):
        present = [cell[length] for cell in summary.values() if length in cell]
        ses = [cell["se"] for cell in present]
        lengths[length] = {
            "tasks": len(present), "n": sum(cell["n"] for cell in present),
            "mean": statistics.fmean(cell["mean"] for cell in present),
            "se": None if None in ses else math.sqrt(sum(se * se for se in ses)) / len(present),
            "strict_mean": statistics.fmean(cell["strict_mean"] for cell in present)}
    return {"cells": summary, "lengths": lengths}
