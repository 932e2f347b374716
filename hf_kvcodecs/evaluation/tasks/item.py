"""One task instance (:class:`TaskItem`) and what a generator gets to build one (:class:`ItemRequest`)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

import torch

from .haystack import Haystack
from .prompt import PromptRenderer, fit_prompt


@dataclass
class TaskItem:
    """One prompt of one task at one length, with what a correct answer must contain.

    ``candidates`` (a regular expression) or ``vocabulary`` (a word set) say which strings of an answer count as
    answers for strict exact match (:func:`.scoring.extract_answers`)."""

    task: str
    length: int
    index: int
    text: str  # the rendered prompt, special tokens included
    input_ids: torch.Tensor  # [T]
    expected: list[str]
    answer_tokens: int
    depths: list[float] = field(default_factory=list)  # where each inserted sentence landed (fraction of the haystack)
    requested_depths: list[float] = field(default_factory=list)
    candidates: str = r"\d+"
    vocabulary: frozenset[str] | None = None
    details: dict = field(default_factory=dict)  # JSON-able task specifics (keys, chain, frequencies, ...)

    @property
    def prompt_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def prompt_sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def to_dict(self) -> dict:
        return {"task": self.task, "length": self.length, "index": self.index, "prompt_tokens": self.prompt_tokens,
                "prompt_sha256": self.prompt_sha256, "expected": list(self.expected),
                "depths": [round(d, 4) for d in self.depths],
                "requested_depths": [round(d, 4) for d in self.requested_depths], **self.details}


@dataclass
class ItemRequest:
    """Item ``index`` of ``items`` of one task at one length: the prompt must take at most ``length - answer_tokens``
    tokens, so prompt and answer fit the length together (RULER's budget)."""

    task: str
    length: int
    index: int
    items: int
    answer_tokens: int
    rng: random.Random
    haystack: Haystack
    renderer: PromptRenderer

    @property
    def target_tokens(self) -> int:
        return self.length - self.answer_tokens

    @property
    def what(self) -> str:
        return f"Length {self.length} for task {self.task!r}"

    def spread_depths(self, count: int) -> list[float]:
        """``count`` depths, one in each of ``count`` equal strata of the haystack, shifted from item to item so the
        items of a cell together cover every depth evenly."""
        shift = (self.index + 0.5) / self.items
        return [(stratum + shift) / count for stratum in range(count)]

    def fit_haystack(self, insertions: list[tuple[float, str]], user, answer_prefix: str):
        """The prompt ``user(passage)`` + ``answer_prefix`` with the longest passage (from a random sentence start,
        ``insertions`` at their depths) that fits the budget: ``(text, ids, placed passage)``."""
        start = self.haystack.random_start(self.rng)

        def build(words: int):
            placed = self.haystack.place(start, words, insertions)
            return self.renderer.render(user(placed.text), answer_prefix), placed

        minimum = max(32, 16 * len(insertions))
        _, text, ids, placed = fit_prompt(build, self.renderer.encode, self.target_tokens, minimum,
                                          max(2 * self.target_tokens, minimum), self.what, self.answer_tokens)
        return text, ids, placed

    def fresh(self, make, taken: set[str]) -> str:
        """A string from ``make(rng)`` that is new to ``taken`` and occurs nowhere in the corpus (so an answer can
        only come from the inserted text); added to ``taken``."""
        for _ in range(1000):
            value = make(self.rng)
            if value not in taken and not self.haystack.occurs(value):
                taken.add(value)
                return value
        raise ValueError("Could not draw a string absent from the haystack corpus in 1000 tries; use another corpus.")
