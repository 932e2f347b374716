"""RULER's common-word extraction (``cwe``): a numbered list of words in which ten words appear many times and the
rest few times; the question asks for the ten most frequent.

The words are real lower-case words of the corpus (RULER draws from an English word list). RULER's frequencies are
kept: below 4K tokens the common words appear 6 times and the others once, from 4K on 30 and 3 times; a one-shot
example of the same form (its own words) comes first. The list is filled with uncommon entries until the prompt takes
its budget.
"""

from __future__ import annotations

import random
import re

import torch

from .item import ItemRequest, TaskItem
from .prompt import fit_prompt

TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n{context}\nQuestion: What are the {count} most common words in the above "
            "list?")
ANSWER_PREFIX = " Answer: The top {count} words that appear most often in the list are:"
COMMON_WORDS = 10
SHORT_CONTEXT = 4096  # below: RULER's short-context frequencies
# (example words, example common, example uncommon, common, uncommon) repetitions
_FREQUENCIES = {True: (20, 3, 1, 6, 1), False: (40, 10, 3, 30, 3)}


def numbered(words: list[str]) -> str:
    return " ".join(f"{position + 1}. {word}" for position, word in enumerate(words))


def _entries(common: list[str], common_times: int, uncommon: list[str], uncommon_times: int, count: int,
             seed: float) -> list[str]:
    """``common`` words ``common_times`` each and the first ``count`` uncommon entries (each uncommon word
    ``uncommon_times`` in a row, the last maybe fewer), in a seeded random order."""
    entries = common * common_times + [word for word in uncommon for _ in range(uncommon_times)][:count]
    random.Random(seed).shuffle(entries)
    return entries


def common_words_item(request: ItemRequest) -> TaskItem:
    rng = request.rng
    template_words = set(re.findall(r"[a-z]+", (TEMPLATE + ANSWER_PREFIX).lower()))
    pool = [word for word in request.haystack.vocabulary if word not in template_words]
    rng.shuffle(pool)
    example_count, example_common, example_uncommon, common_times, uncommon_times = _FREQUENCIES[
        request.length < SHORT_CONTEXT]
    common, example, uncommon = (pool[:COMMON_WORDS], pool[COMMON_WORDS:COMMON_WORDS + example_count],
                                 pool[COMMON_WORDS + example_count:])
    if len(uncommon) < COMMON_WORDS:
        raise ValueError(f"The corpus has {len(pool)} distinct lower-case words; common-word extraction needs more. "
                         "Use a larger corpus.")
    example_list = _entries(example[:COMMON_WORDS], example_common, example[COMMON_WORDS:], example_uncommon,
                            len(example) * example_uncommon, rng.random())
    shot = (TEMPLATE.format(context=numbered(example_list), count=COMMON_WORDS)
            + ANSWER_PREFIX.format(count=COMMON_WORDS) + " " + numbered(example[:COMMON_WORDS]))
    seed = rng.random()

    def build(count: int):
        entries = _entries(common, common_times, uncommon, uncommon_times, count, seed)
        user = shot + "\n\n" + TEMPLATE.format(context=numbered(entries), count=COMMON_WORDS)
        return request.renderer.render(user, ANSWER_PREFIX.format(count=COMMON_WORDS)), entries

    maximum = len(uncommon) * uncommon_times
    count, text, ids, entries = fit_prompt(build, request.renderer.encode, request.target_tokens, COMMON_WORDS,
                                           maximum, request.what, request.answer_tokens)
    if count == maximum and len(ids) < 0.95 * request.target_tokens:
        raise ValueError(f"{request.what}: the corpus's {len(pool)} distinct lower-case words fill only {len(ids)} of "
                         f"{request.target_tokens} prompt tokens; use a corpus with more words or a shorter length.")
    return TaskItem(task=request.task, length=request.length, index=request.index, text=text,
                    input_ids=torch.tensor(ids, dtype=torch.long), expected=list(common),
                    answer_tokens=request.answer_tokens, vocabulary=frozenset(common + example + uncommon),
                    details={"common_frequency": common_times, "uncommon_frequency": uncommon_times,
                             "list_entries": len(entries), "distinct_words": len(set(entries))})
