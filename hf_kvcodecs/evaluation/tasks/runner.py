"""Running the suite on a model with a cache method, and comparing two methods item by item.

Each item gets a fresh cache from ``make_cache()``; the whole prompt is prefilled into it in one call and the answer is
decoded greedily one token per call through the same cache, so every answer token attends to what the method kept of
the prompt, until an end-of-turn token or the task's answer budget.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from ..paired import decode_step, paired_difference
from .item import TaskItem
from .scoring import mean_se, score_answer, summarize
from .suite import TaskSuiteOptions, generate_task_items

logger = logging.getLogger(__name__)


def stop_token_ids(model, tokenizer) -> set[int]:
    """End-of-sequence ids of the tokenizer and the model's generation config (an Instruct model's end of turn)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    return {int(i) for i in ids if i is not None}


@torch.no_grad()  # not inference_mode: quanto's tensor subclasses cannot run under it
def greedy_answer(model, cache, input_ids: torch.Tensor, max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Prefill ``input_ids`` into ``cache`` (None: the model's default cache), then greedy-decode at most
    ``max_new_tokens`` tokens, the stop token included when one comes."""
    output = model(input_ids[None].to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
    cache = output.cache if cache is None else cache
    token = int(output.logits[0, -1].argmax())
    tokens = [token]
    while token not in stop_ids and len(tokens) < max_new_tokens:
        token = int(decode_step(model, cache, torch.tensor(token, device=model.device)).argmax())
        tokens.append(token)
    return tokens


def run_task_suite(model, tokenizer, make_cache: Callable[[], object] | None, options: TaskSuiteOptions | None = None,
                   progress: bool = True, *, items: list[TaskItem] | None = None,
                   description: str = "long-context tasks") -> dict:
    """Every item of ``options`` (or the given ``items``, from :func:`generate_task_items`, to reuse them across
    methods) answered by ``model`` through a fresh ``make_cache()`` each (``make_cache`` None or returning None: the
    model's default cache). Returns a JSON-able dict: ``options``, ``cells[task][str(length)]`` (RULER score and
    strict exact match, mean ± se over items, n), ``lengths`` (mean over tasks), ``overall`` and ``items`` (each
    answer with its scores)."""
    if items is None:
        options = options or TaskSuiteOptions()
        items = generate_task_items(tokenizer, options)
    longest = max(item.prompt_tokens + item.answer_tokens for item in items)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and longest > limit:
        logger.warning("Long-context prompts reach %d tokens, beyond the model's max_position_embeddings (%d); its "
                       "answers there measure extrapolation as well as the cache.", longest, limit)
    stop_ids = stop_token_ids(model, tokenizer)
    rows = []
    bar = tqdm(items, desc=description, disable=not progress)
    for item in bar:
        bar.set_postfix_str(f"{item.task} {item.length}")
        started = time.perf_counter()
        cache = make_cache() if make_cache is not None else None
        tokens = greedy_answer(model, cache, item.input_ids, item.answer_tokens, stop_ids)
        answer = tokenizer.decode(tokens, skip_special_tokens=True)
        rows.append({**item.to_dict(), **score_answer(item, answer), "answer_budget": item.answer_tokens,
                     "generated_tokens": len(tokens), "seconds": time.perf_counter() - started})
    summary = summarize(rows)
    return {"options": options.to_dict() if options is not None else None, "cells": summary["cells"],
            "lengths": summary["lengths"], "overall": {"score": mean_se([row["score"] for row in rows]),
                        "strict": mean_se([row["strict"] for row in rows])},
            "items": rows}


def _item_key(row: dict) -> tuple:
    return row["task"], row["length"], row["index"]


def compare_task_results(results: dict, reference: dict) -> dict:
    """``results`` minus ``reference`` (two :func:`run_task_suite` results on the same items), paired item by item:
    per cell and overall, the mean difference of the RULER score and of strict exact match with its standard error
    (:func:`hf_kvcodecs.evaluation.paired.paired_difference`)."""
    own = {_item_key(row): row for row in results["items"]}
    base = {_item_key(row): row for row in reference["items"]}
    if own.keys() != base.keys() or any(own[key]["prompt_sha256"] != base[key]["prompt_sha256"] for key in own):
        raise ValueError("The two long-context results hold different items; run both with the same TaskSuiteOptions "
                         "and tokenizer (or the same items).")
    cells: dict[tuple, list] = {}
    for key in own:
        cells.setdefault(key[:2], []).append(key)

    def difference(keys: list[tuple], metric: str) -> dict:
        paired = paired_difference([own[k][metric] for k in keys], [base[k][metric] for k in keys])
        return {"mean": paired["mean"], "se": paired["se"], "n": paired["windows"]}

    table: dict[str, dict[str, dict]] = {}
    for (task, length), keys in cells.items():
        table.setdefault(task, {})[str(length)] = {"score": difference(keys, "score"),
                                                   "strict": difference(keys, "strict")}
    everything = list(own)
    return {"cells": table, "overall": {"score": difference(everything, "score"),
                                        "strict": difference(everything, "strict")}}


def run_task_suite_methods(model, tokenizer, methods: dict[str, Callable[[], object] | None],
                           options: TaskSuiteOptions | None = None, reference: str | None = None,
                           progress: bool = True) -> dict:
    """The suite for several cache methods on the same items (generated once): ``methods`` maps a name to its
    ``make_cache`` (None: the model's default cache). Returns ``{"options", "reference", "methods": {name: results},
    "vs_reference": {name: paired differences}}``; ``reference`` (a name of ``methods``, e.g. the full-precision
    cache) is what the others are compared with, item by item."""
    if reference is not None and reference not in methods:
        raise ValueError(f"The reference method {reference!r} is not among the methods ({', '.join(methods)}); "
                         "name one of them, or pass reference=None.")
    options = options or TaskSuiteOptions()
    items = generate_task_items(tokenizer, options)
    results = {name: run_task_suite(model, tokenizer, make_cache, options, progress, items=items,
                                    description=f"long-context tasks: {name}")
               for name, make_cache in methods.items()}
    compared = {} if reference is None else {name: compare_task_results(result, results[reference])
                                             for name, result in results.items() if name != reference}
    return {"options": options.to_dict(), "reference": reference, "methods": results, "vs_reference": compared}
