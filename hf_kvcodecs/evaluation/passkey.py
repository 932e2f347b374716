"""The one pass-key protocol every benchmark uses: a sentence "The pass key is NNNNN. Remember it." inserted at a
chosen depth of a real passage, the question "What is the pass key? The pass key is", and an answer that is correct
only when its first number is the key.

Benchmarks differ in how the question reaches the model (``bench kv`` feeds it one token per decode step after the
haystack's prefill, to exercise the coded history; ``bench scd`` prefills it with the prompt a payload covers, and
also pools the answers with its other retrieval questions by exact match and F1), not in the prompts or the key.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PASSKEY_NEEDLE = "\nThe pass key is {key}. Remember it.\n"
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyCase:
    length: int  # haystack plus needle, in tokens (the question not included)
    depth: float  # where the needle starts, as a fraction of the haystack
    key: str
    prompt_ids: torch.Tensor


def token_ids(tokenizer, text: str) -> torch.Tensor:
    """``text`` as a 1-D tensor of token ids, no special tokens added."""
    return torch.as_tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long).flatten()


def random_key(generator: torch.Generator) -> str:
    """A five-digit key."""
    return str(int(torch.randint(10_000, 100_000, (1,), generator=generator)))


def passkey_case(tokenizer, token_ids_of_text: torch.Tensor, length: int, depth: float, key: str,
                 offset: int) -> PasskeyCase:
    """The needle with ``key`` at ``depth`` of the passage starting at token ``offset``, ``length`` tokens in all."""
    needle = token_ids(tokenizer, PASSKEY_NEEDLE.format(key=key))
    filler_length = length - len(needle)
    if filler_length < 1 or offset + filler_length > len(token_ids_of_text):
        raise ValueError(f"A pass-key prompt of {length} tokens needs {filler_length} tokens of passage from offset "
                         f"{offset}; the text has {len(token_ids_of_text)} (use a shorter length or a longer text).")
    filler = token_ids_of_text[offset:offset + filler_length]
    insert_at = round(depth * filler_length)
    return PasskeyCase(length=length, depth=float(depth), key=key,
                       prompt_ids=torch.cat([filler[:insert_at], needle, filler[insert_at:]]))


def passkey_cases(tokenizer, token_ids_of_text: torch.Tensor, lengths: Sequence[int], depths: Sequence[float],
                  trials: int, generator: torch.Generator) -> list[PasskeyCase]:
    """``trials`` random keys and passage offsets per (length, depth) cell."""
    cases = []
    for length in lengths:
        for depth in depths:
            for _ in range(trials):
                key = random_key(generator)
                needle_length = len(token_ids(tokenizer, PASSKEY_NEEDLE.format(key=key)))
                offset = int(torch.randint(0, len(token_ids_of_text) - (length - needle_length) + 1, (1,),
                                           generator=generator))
                cases.append(passkey_case(tokenizer, token_ids_of_text, length, depth, key, offset))
    return cases


def answer_has_key(answer: str, key: str) -> bool:
    """Correct when the first number in the answer is the key (a longer or different number is wrong)."""
    number = re.search(r"\d+", answer)
    return number is not None and number.group() == key


def passkey_scores(cases: list[PasskeyCase], answers: list[str]) -> dict:
    """Accuracy overall, by length and by depth, and every answer with its verdict."""
    correct = [answer_has_key(answer, case.key) for case, answer in zip(cases, answers)]

    def accuracy_by(attribute):
        groups: dict = {}
        for case, ok in zip(cases, correct):
            groups.setdefault(str(getattr(case, attribute)), []).append(ok)
        return {value: sum(oks) / len(oks) for value, oks in groups.items()}

    return {
        "accuracy": sum(correct) / len(correct),
        "correct": sum(correct),
        "trials": len(correct),
        "accuracy_by_length": accuracy_by("length"),
        "accuracy_by_depth": accuracy_by("depth"),
        "answers": [
            {"length": case.length, "depth": case.depth, "key": case.key, "answer": answer, "correct": ok}
            for case, answer, ok in zip(cases, answers, correct)
        ],
    }
