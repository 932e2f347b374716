"""The haystack: real text cut to a number of words, with sentences inserted at chosen depths.

The corpus is normalized the way RULER normalizes its essays (runs of whitespace become one space), except that
paragraph breaks stay, so prose reads as prose. Passages are read cyclically from a sentence start, so any length can
be cut from any corpus (a long passage from a short corpus repeats it).
"""

from __future__ import annotations

import bisect
import random
import re
from dataclasses import dataclass

from ...text import Corpus

# A needle lands on the sentence boundary nearest its requested depth; when none lies within this fraction of the
# passage (long legal sentences, code), on the nearest word boundary instead, so a depth is never off by more.
SNAP_TOLERANCE = 0.025
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")
_WORD = re.compile(r"(?<![A-Za-z])[a-z]{4,12}(?![A-Za-z])")


@dataclass(frozen=True)
class Placed:
    """A passage with its insertions: the text, and each insertion's depth (characters of passage before it over the
    passage's characters, insertions excluded), in the order they were given."""

    text: str
    depths: list[float]


class Haystack:
    def __init__(self, corpus: Corpus):
        words, ends = [], []
        for paragraph in re.split(r"\n\s*\n", corpus.text):
            tokens = paragraph.split()
            for position, token in enumerate(tokens):
                last = position == len(tokens) - 1
                words.append(token + ("\n\n" if last else " "))
                ends.append(last or bool(_SENTENCE_END.search(token)))
        if len(words) < 100:
            raise ValueError(f"The haystack corpus ({corpus.description}) has {len(words)} words; long-context tasks "
                             "need real text of at least a few thousand words. Pass a longer corpus.")
        self.corpus = corpus
        self.words = words
        self.sentence_end = ends
        self.starts = [0] + [index + 1 for index, end in enumerate(ends[:-1]) if end]
        # lower-case words of 4-12 letters (no capitals, no digits): real words for needle keys and word lists
        self.vocabulary = sorted(set(_WORD.findall(corpus.text)))

    def random_start(self, rng: random.Random) -> int:
        """A sentence start, drawn by ``rng``."""
        return self.starts[rng.randrange(len(self.starts))]

    def passage(self, start: int, count: int) -> tuple[list[str], list[bool]]:
        """``count`` words from word ``start`` on (cyclically), and whether each ends a sentence."""
        total = len(self.words)
        indices = [(start + offset) % total for offset in range(count)]
        return [self.words[i] for i in indices], [self.sentence_end[i] for i in indices]

    def occurs(self, text: str) -> bool:
        return text in self.corpus.text

    def place(self, start: int, count: int, insertions: list[tuple[float, str]]) -> Placed:
        """The passage of ``count`` words from ``start`` with each ``(depth, sentence)`` inserted at the sentence
        boundary nearest ``depth`` (a fraction of the passage; see :data:`SNAP_TOLERANCE`). Insertions that land on
        the same boundary keep their given order."""
        words, ends = self.passage(start, count)
        offsets = [0]
        for word in words:
            offsets.append(offsets[-1] + len(word))
        total = offsets[-1]
        sentence_bounds = [0] + [index + 1 for index, end in enumerate(ends) if end]
        if sentence_bounds[-1] != count:
            sentence_bounds.append(count)
        sentence_offsets = [offsets[b] for b in sentence_bounds]
        chosen = []
        for depth, _ in insertions:
            target = depth * total
            boundary = _nearest(sentence_bounds, sentence_offsets, target)
            if abs(offsets[boundary] - target) > SNAP_TOLERANCE * total:
                boundary = _nearest(range(count + 1), offsets, target)
            chosen.append(boundary)
        order = sorted(range(len(insertions)), key=lambda i: (chosen[i], i))
        pieces, previous = [], 0
        for i in order:
            pieces += words[previous:chosen[i]]
            pieces.append(insertions[i][1] + " ")
            previous = chosen[i]
        pieces += words[previous:]
        return Placed("".join(pieces).strip(), [offsets[b] / total for b in chosen])


def _nearest(bounds, offsets: list[int], target: float) -> int:
    """The boundary of ``bounds`` (ascending, with character ``offsets``) nearest the character offset ``target``."""
    position = bisect.bisect_left(offsets, target)
    candidates = [p for p in (position - 1, position) if 0 <= p < len(offsets)]
    best = min(candidates, key=lambda p: abs(offsets[p] - target))
    return bounds[best]
