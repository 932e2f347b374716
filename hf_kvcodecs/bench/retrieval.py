"""Retrieval prompts built from real text: pass-key needles in real passages, RULER-style multi-key needles, and fact
look-up over a real record set.

Multi-key needles follow RULER's ``niah_multikey`` task: several sentences "One of the special magic numbers for
KEY is: NNNNNNN." are spread through a real passage, each with its own key (a distinct word of the passage itself) and
a random seven-digit number, and the question asks for one key's number, so the answer must be read from the right
needle among look-alike distractors.

Fact look-up uses Debian's package database (``/var/lib/dpkg/status``), the records of the software installed on the
machine: each record is cut to its one-line fields (name, version, architecture, maintainer, installed size), a
contiguous run of real records fills the context, and the question repeats one record's ``Package:`` line and asks for
its ``Version:``. The answer is that record's real version string, which no model can know without reading the
passage, and every package name occurs once in the database, so the question has exactly one answer.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..evaluation.passkey import PASSKEY_QUESTION, passkey_case, random_key, token_ids

PACKAGE_DATABASE = Path("/var/lib/dpkg/status")
RECORD_FIELDS = ("Package", "Version", "Architecture", "Maintainer", "Installed-Size")
FACT_QUESTION = "\n\nThe record of the package {name} above reads:\nPackage: {name}\nVersion:"


def token_f1(prediction: str, answer: str) -> float:
    """SQuAD-style token F1 over word characters (punctuation splits tokens)."""
    predicted, expected = re.findall(r"\w+", prediction.lower()), re.findall(r"\w+", answer.lower())
    common = sum(min(predicted.count(word), expected.count(word)) for word in set(expected))
    if not predicted or not common:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def _ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]


def passkey_prompts(tokenizer, text_ids: torch.Tensor, trials: int, context_tokens: int, seed: int):
    """The shared pass-key protocol (:mod:`hf_kvcodecs.evaluation.passkey`) in one context length: real passages
    (a different one each trial) with the needle at a depth that varies by trial, the question appended to the
    prompt. Returns (prompt ids, answer) pairs."""
    generator = torch.Generator().manual_seed(seed)
    question = token_ids(tokenizer, PASSKEY_QUESTION)
    prompts = []
    for trial in range(trials):
        key = random_key(generator)
        length = context_tokens - question.numel()
        start = trial * max(text_ids.numel() - length, 0) // max(trials, 1)
        case = passkey_case(tokenizer, text_ids, length, (trial + 0.5) / trials, key, start)
        prompts.append((torch.cat((case.prompt_ids, question)), key))
    return prompts


NEEDLE = " One of the special magic numbers for {key} is: {value}. "
NEEDLE_QUESTION = ("\nWhat is the special magic number for {key} mentioned in the provided text? The special magic "
                   "number for {key} mentioned in the provided text is")


def _needle_keys(tokenizer, passage: torch.Tensor, count: int, generator: torch.Generator) -> list[str]:
    """``count`` distinct lower-case words of six or more letters from the passage, in a seeded random order."""
    words = sorted({word.lower() for word in re.findall(r"[A-Za-z]{6,}", tokenizer.decode(passage))})
    if len(words) < count:
        raise ValueError(f"The passage holds {len(words)} distinct words of six or more letters; {count} needle keys "
                         "need more (use a longer context or fewer needles).")
    order = torch.randperm(len(words), generator=generator)[:count]
    return [words[int(i)] for i in order]


def multikey_needle_prompts(tokenizer, text_ids: torch.Tensor, trials: int, context_tokens: int, seed: int,
                            needles: int = 4):
    """RULER ``niah_multikey``-style prompts: ``needles`` key/number sentences at evenly spread depths of a real
    passage (shifted each trial), the question asks for the number of one of them (a different position each trial).
    Returns (prompt ids, seven-digit number) pairs."""
    if needles < 1:
        raise ValueError(f"needles must be at least 1, got {needles}.")
    generator = torch.Generator().manual_seed(seed + 1)
    prompts = []
    for trial in range(trials):
        start = trial * max(text_ids.numel() - context_tokens, 0) // max(trials, 1)
        passage = text_ids[start:start + context_tokens]
        keys = _needle_keys(tokenizer, passage, needles, generator)
        values = [str(int(torch.randint(1_000_000, 9_999_999, (1,), generator=generator))) for _ in keys]
        asked = trial % needles
        inserts = [_ids(tokenizer, NEEDLE.format(key=key, value=value)) for key, value in zip(keys, values)]
        question = _ids(tokenizer, NEEDLE_QUESTION.format(key=keys[asked]))
        filler = context_tokens - sum(insert.numel() for insert in inserts) - question.numel()
        if filler < 16 * needles:
            raise ValueError(f"A context of {context_tokens} tokens leaves almost no passage around {needles} "
                             "needles; use a longer context or fewer needles.")
        passage = passage[:filler]
        pieces, previous = [], 0
        for index, insert in enumerate(inserts):
            depth = int(filler * (index + 0.5 + 0.3 * ((trial % 3) - 1)) / needles)
            pieces += [passage[previous:depth], insert]
            previous = depth
        pieces += [passage[previous:], question]
        prompts.append((torch.cat(pieces), values[asked]))
    return prompts


def package_records(path: Path | str = PACKAGE_DATABASE) -> list[dict[str, str]]:
    """The package database's records with every field of :data:`RECORD_FIELDS` present, in file order."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Fact look-up reads Debian's package database at {path}, which is missing here; "
                                "run on a Debian-based machine or pass fact_trials=0 (--fact-trials 0).")
    records = []
    for block in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(" "))
        if all(fields.get(name) for name in RECORD_FIELDS):
            records.append({name: fields[name].strip() for name in RECORD_FIELDS})
    return records


def format_record(record: dict[str, str]) -> str:
    return "".join(f"{name}: {record[name]}\n" for name in RECORD_FIELDS) + "\n"


def fact_lookup_prompts(tokenizer, records: list[dict[str, str]], trials: int, context_tokens: int):
    """Prompts of at most ``context_tokens`` tokens: a contiguous run of real records (the run starts further into the
    database each trial), the asked record at a depth that varies by trial, then :data:`FACT_QUESTION`.
    Returns (prompt ids, version) pairs."""
    names = [record["Package"] for record in records]
    if len(set(names)) != len(names):
        raise ValueError("The package database repeats a package name; a fact look-up question would be ambiguous.")
    encoded = [_ids(tokenizer, format_record(record)) for record in records]
    prompts = []
    for trial in range(trials):
        start = trial * len(records) // max(trials, 1)
        chosen, used = [], 0
        for index in range(start, start + len(records)):
            length = encoded[index % len(records)].numel()
            if used + length > context_tokens * 0.85:  # leaves room for the question
                break
            chosen.append(index % len(records))
            used += length
        if len(chosen) < 2:
            raise ValueError(f"A context of {context_tokens} tokens holds fewer than two package records; use a "
                             "longer context for fact look-up.")
        target = chosen[int(len(chosen) * (trial + 0.5) / trials)]
        question = _ids(tokenizer, FACT_QUESTION.format(name=records[target]["Package"]))
        ids = torch.cat([encoded[index] for index in chosen] + [question])
        if ids.numel() > context_tokens:
            raise ValueError(f"A fact look-up prompt needs {ids.numel()} tokens, more than the context of "
                             f"{context_tokens}; use a longer context.")
        prompts.append((ids, records[target]["Version"]))
    return prompts


def first_line(answer: str) -> str:
    return answer.strip().split("\n", 1)[0].strip()


def exact_match(answer: str, expected: str) -> float:
    """The answer's first whitespace-separated word (trailing punctuation stripped) equals the expected string."""
    words = first_line(answer).split()
    return float(bool(words) and words[0].rstrip(".,;") == expected)
