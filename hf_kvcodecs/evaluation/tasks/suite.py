"""The task suite: its tasks (:data:`TASKS`), its options (:class:`TaskSuiteOptions`) and the generation of every item
(:func:`generate_task_items`)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial

from ...text import EVALUATION_DEFAULT, load_corpus
from .common_words import common_words_item
from .haystack import Haystack
from .item import ItemRequest, TaskItem
from .needles import NeedleSpec, needle_item
from .prompt import PromptRenderer
from .variables import ChainSpec, variable_item


@dataclass(frozen=True)
class TaskSpec:
    generate: Callable[[ItemRequest], TaskItem]
    answer_tokens: int  # greedy tokens decoded for an answer (RULER's budget where it is not wasteful)
    description: str


TASKS: dict[str, TaskSpec] = {
    "niah_single": TaskSpec(partial(needle_item, NeedleSpec()), 32, "one needle, its number asked"),
    "niah_multikey": TaskSpec(partial(needle_item, NeedleSpec(keys=4)), 32,
                              "four keys with a number each, one asked"),
    "niah_multivalue": TaskSpec(partial(needle_item, NeedleSpec(values=4)), 64,
                                "one key with four numbers, all asked"),
    "niah_multiquery": TaskSpec(partial(needle_item, NeedleSpec(keys=4, queries=4)), 64,
                                "four keys with a number each, all asked"),
    "vt": TaskSpec(partial(variable_item, ChainSpec()), 30,
                   "a chain of five variable assignments; every variable holding the number asked"),
    "cwe": TaskSpec(common_words_item, 120, "the ten most frequent words of a numbered word list"),
}


def parse_length(length: int | str) -> int:
    """``4096``, ``"4096"``, ``"4K"`` or ``"4k"`` -> 4096."""
    if isinstance(length, int) and not isinstance(length, bool):
        value = length
    else:
        match = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", str(length))
        if match is None:
            raise ValueError(f"Cannot read the context length {length!r}; give tokens as 4096 or '4K'.")
        value = int(match[1]) * (1024 if match[2] else 1)
    if value < 1:
        raise ValueError(f"Context lengths must be positive, got {length!r}.")
    return value


@dataclass
class TaskSuiteOptions:
    """What the long-context suite runs: each task of ``tasks`` at each length of ``lengths`` (tokens of prompt plus
    answer, measured with the model's tokenizer), ``items_per_cell`` items per task and length, drawn from ``seed``.

    ``answer_tokens`` None gives each task its own decode budget (:data:`TASKS`); ``corpus`` is the haystack text
    (a name of :func:`hf_kvcodecs.text.load_corpus`, or files); ``chat_template`` None renders prompts through the
    tokenizer's chat template when it has one."""

    tasks: Sequence[str] = tuple(TASKS)
    lengths: Sequence[int | str] = (2048, 4096, 8192)
    items_per_cell: int = 8
    seed: int = 0
    answer_tokens: int | None = None
    corpus: str | Sequence[str] = EVALUATION_DEFAULT
    chat_template: bool | None = None

    def __post_init__(self):
        tasks = self.tasks.split(",") if isinstance(self.tasks, str) else list(self.tasks)
        tasks = [task.strip() for task in tasks if task.strip()]
        unknown = [task for task in tasks if task not in TASKS]
        if unknown or not tasks:
            raise ValueError(f"Unknown long-context task(s) {unknown or tasks}; choose from {', '.join(TASKS)}.")
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"Tasks {tasks} name a task twice; name each once.")
        lengths = [parse_length(length) for length in ([self.lengths] if isinstance(self.lengths, (int, str))
                                                       else self.lengths)]
        if not lengths or len(set(lengths)) != len(lengths):
            raise ValueError(f"Give one or more distinct context lengths, got {self.lengths!r}.")
        if self.items_per_cell < 1:
            raise ValueError(f"items_per_cell must be at least 1, got {self.items_per_cell}.")
        if self.answer_tokens is not None and self.answer_tokens < 1:
            raise ValueError(f"answer_tokens must be at least 1 (or None for each task's own), got {self.answer_tokens}.")
        self.tasks, self.lengths = tuple(tasks), tuple(lengths)

    def answer_budget(self, task: str) -> int:
        return self.answer_tokens if self.answer_tokens is not None else TASKS[task].answer_tokens

    def to_dict(self) -> dict:
        values = asdict(self)
        values["tasks"], values["lengths"] = list(self.tasks), list(self.lengths)
        values["corpus"] = self.corpus if isinstance(self.corpus, str) else list(self.corpus)
        return values


def generate_task_items(tokenizer, options: TaskSuiteOptions) -> list[TaskItem]:
    """Every item of the suite, task by task, length by length. Each item draws from its own generator seeded by
    ``(seed, task, length, index)``, so an item does not change when other tasks or lengths are added."""
    haystack = Haystack(load_corpus(options.corpus, default=EVALUATION_DEFAULT))
    renderer = PromptRenderer(tokenizer, options.chat_template)
    items = []
    for task in options.tasks:
        for length in options.lengths:
            for index in range(options.items_per_cell):
                request = ItemRequest(task=task, length=length, index=index, items=options.items_per_cell,
                                      answer_tokens=options.answer_budget(task),
                                      rng=random.Random(f"{options.seed}/{task}/{length}/{index}"),
                                      haystack=haystack, renderer=renderer)
                if request.target_tokens < 1:
                    raise ValueError(f"{request.what} leaves no prompt tokens after {request.answer_tokens} answer "
                                     "tokens; use a longer length or fewer answer tokens.")
                items.append(TASKS[task].generate(request))
    return items
