"""RULER's needle-in-a-haystack family: sentences "One of the special magic numbers for KEY is: NNNNNNN." in a real
passage, and a question for the numbers of one or more keys.

- ``niah_single``: one key, one number, asked;
- ``niah_multikey``: four keys with a number each, one asked (the others are look-alike distractors);
- ``niah_multivalue``: one key with four numbers, all asked;
- ``niah_multiquery``: four keys with a number each, all asked at once.

Keys are two real words of the corpus joined by a hyphen (RULER draws adjective-noun pairs), numbers have seven
digits, and neither occurs anywhere in the corpus, so the answer can only come from the needles. The needles sit in
equal strata of the passage, shifted from item to item (:meth:`.item.ItemRequest.spread_depths`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .item import ItemRequest, TaskItem

TEMPLATE = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz "
            "you about the numbers afterwards.\n{context}\nWhat are all the special magic numbers for {query} "
            "mentioned in the provided text?")
ANSWER_PREFIX = " The special magic numbers for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic numbers for {key} is: {value}."
VALUE_PATTERN = r"(?<!\d)\d{7}(?!\d)"  # what strict exact match reads as a number of an answer


@dataclass(frozen=True)
class NeedleSpec:
    keys: int = 1  # distinct keys in the haystack
    values: int = 1  # needles (numbers) per key
    queries: int = 1  # keys asked; all of their numbers are expected

    def __post_init__(self):
        if min(self.keys, self.values, self.queries) < 1 or self.queries > self.keys:
            raise ValueError(f"A needle task needs keys, values, queries >= 1 and queries <= keys, got {self}.")


def join_keys(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def needle_item(spec: NeedleSpec, request: ItemRequest) -> TaskItem:
    rng, vocabulary, taken = request.rng, request.haystack.vocabulary, set()
    keys = [request.fresh(lambda r: "-".join(r.sample(vocabulary, 2)), taken) for _ in range(spec.keys)]
    values = [[request.fresh(lambda r: str(r.randint(1_000_000, 9_999_999)), taken) for _ in range(spec.values)]
              for _ in keys]
    if spec.queries == spec.keys:  # every key asked, in a random order
        asked = rng.sample(range(spec.keys), spec.keys)
    else:  # the asked key moves through the strata from item to item
        asked = [(request.index + offset) % spec.keys for offset in range(spec.queries)]
    needles = [(key, value) for key, key_values in zip(keys, values) for value in key_values]
    depths = request.spread_depths(len(needles))
    insertions = [(depth, NEEDLE.format(key=key, value=value)) for depth, (key, value) in zip(depths, needles)]
    query = join_keys([keys[k] for k in asked])
    text, ids, placed = request.fit_haystack(insertions, lambda context: TEMPLATE.format(context=context, query=query),
                                             ANSWER_PREFIX.format(query=query))
    return TaskItem(task=request.task, length=request.length, index=request.index, text=text,
                    input_ids=torch.tensor(ids, dtype=torch.long), expected=[v for k in asked for v in values[k]],
                    answer_tokens=request.answer_tokens, depths=placed.depths, requested_depths=depths,
                    candidates=VALUE_PATTERN,
                    details={"keys": keys, "asked_keys": [keys[k] for k in asked],
                             "needles": [{"key": key, "value": value} for key, value in needles]})
