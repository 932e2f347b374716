"""RULER-style long-context tasks over real text, for comparing KV-cache methods at 2K-8K+ tokens.

Tasks (:data:`TASKS`): needle in a haystack with one needle (``niah_single``), several keys one asked
(``niah_multikey``), one key with several numbers (``niah_multivalue``), several keys asked at once
(``niah_multiquery``), variable tracking (``vt``) and common-word extraction (``cwe``). Haystacks are real text
(:func:`hf_kvcodecs.text.load_corpus`), each prompt fits its length exactly as the model's tokenizer counts it, and is
rendered through the chat template when the tokenizer has one. Scores are RULER's (fraction of expected strings in
the answer) and a strict exact match, per task and length with standard errors over items.

    options = TaskSuiteOptions(lengths=("2K", "4K"), items_per_cell=8)
    suite = run_task_suite_methods(model, tokenizer, {"fp": None, "gsrq": make_gsrq_cache}, options, reference="fp")
    suite["methods"]["gsrq"]["cells"]["niah_multikey"]["4096"]   # mean, se, n, strict_mean, ...
    suite["vs_reference"]["gsrq"]["overall"]["score"]            # mean difference ± se, paired by item
    print("\n".join(task_suite_table(suite["methods"])))

:func:`run_task_suite` runs one method (``make_cache`` returns a fresh ``transformers`` Cache, or None for the
model's default) and :func:`compare_task_results` pairs two of its results.
"""

from .item import TaskItem
from .report import task_suite_table
from .runner import compare_task_results, greedy_answer, run_task_suite, run_task_suite_methods
from .scoring import extract_answers, score_answer, strict_match, string_match_all
from .suite import TASKS, TaskSuiteOptions, generate_task_items, parse_length

__all__ = ["TASKS", "TaskItem", "TaskSuiteOptions", "compare_task_results", "extract_answers", "generate_task_items",
           "greedy_answer", "parse_length", "run_task_suite", "run_task_suite_methods", "score_answer", "strict_match",
           "string_match_all", "task_suite_table"]
