"""RULER's variable tracking (``vt``): chains of assignments "VAR QWERT = 12345.", "VAR ASDFG = VAR QWERT.", ... spread
through a real passage in order; the question gives the number and asks for every variable that holds it.

Names are five random capital letters and numbers five digits (RULER's), none occurring anywhere in the corpus. With
several chains (each its own number), the first is asked and the others are distractors; statements of all chains are
interleaved hop by hop, so each chain reads in order.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

import torch

from .item import ItemRequest, TaskItem

TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
            "Question: Find all variables that are assigned the value {query} in the text above.")
ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {count} variables are "
                 "assigned the value {query}, they are:")
NAME_PATTERN = r"\b[A-Z]{5}\b"  # what strict exact match reads as a variable name of an answer
_STATEMENT = re.compile(r"VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d+))\.")


@dataclass(frozen=True)
class ChainSpec:
    chains: int = 1
    hops: int = 4  # assignments after the first: hops + 1 variables per chain

    def __post_init__(self):
        if self.chains < 1 or self.hops < 0:
            raise ValueError(f"Variable tracking needs at least one chain and no negative hops, got {self}.")


def chain_statements(names: list[str], value: str) -> list[str]:
    return [f"VAR {names[0]} = {value}."] + [f"VAR {later} = VAR {earlier}." for earlier, later in zip(names, names[1:])]


def resolve(text: str) -> dict[str, str]:
    """Every variable assigned in ``text`` and the number it holds, following the chains (read in text order)."""
    values: dict[str, str] = {}
    for name, source, number in _STATEMENT.findall(text):
        values[name] = number or values[source]
    return values


def variable_item(spec: ChainSpec, request: ItemRequest) -> TaskItem:
    taken: set[str] = set()
    chains = []
    for _ in range(spec.chains):
        value = request.fresh(lambda r: str(r.randint(10_000, 99_999)), taken)
        names = [request.fresh(lambda r: "".join(r.choices(string.ascii_uppercase, k=5)), taken)
                 for _ in range(spec.hops + 1)]
        chains.append((names, value))
    statements = [chain_statements(names, value) for names, value in chains]
    order = [(chain, hop) for hop in range(spec.hops + 1) for chain in range(spec.chains)]
    depths = request.spread_depths(len(order))
    insertions = [(depth, statements[chain][hop]) for depth, (chain, hop) in zip(depths, order)]
    names, value = chains[0]
    text, ids, placed = request.fit_haystack(insertions, lambda context: TEMPLATE.format(context=context, query=value),
                                             ANSWER_PREFIX.format(count=len(names), query=value))
    return TaskItem(task=request.task, length=request.length, index=request.index, text=text,
                    input_ids=torch.tensor(ids, dtype=torch.long), expected=list(names),
                    answer_tokens=request.answer_tokens, depths=placed.depths, requested_depths=depths,
                    candidates=NAME_PATTERN,
                    details={"value": value, "chains": [chain_statements(n, v) for n, v in chains]})
