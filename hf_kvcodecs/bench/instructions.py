"""Chat-templated instructions over real text, for measuring what a user of an Instruct model sees after a transferred
cache: the model's greedy answer, compared with the answer it gives after its own prefill.

Each prompt is one paragraph of a Debian licence text (``/usr/share/common-licenses``) followed by an instruction
about it, wrapped in the tokenizer's chat template with the generation prompt, so the consumer answers as a chat
model does. Teacher-forced perplexity cannot see a cache that turns a sensible answer into repeated garbage; the
token F1 between an answer and the oracle's answer to the same prompt can.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

LICENCE_DIRECTORY = Path("/usr/share/common-licenses")
INSTRUCTIONS = (
    "Summarize the text above in one sentence.",
    "What does the text above allow or require? Answer briefly.",
    "Which terms does the text above define or rely on? List them.",
    "Explain the text above to a new developer in two sentences.",
)


def licence_paragraphs(directory: Path | str = LICENCE_DIRECTORY, *, min_words: int = 60,
                       max_words: int = 220) -> list[tuple[str, str]]:
    """``(file name, paragraph)`` of every licence paragraph of a useful length, in a stable order."""
    found = []
    for path in sorted(Path(directory).iterdir()):
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for paragraph in text.split("\n\n"):
            words = paragraph.split()
            if min_words <= len(words) <= max_words:
                found.append((path.name, " ".join(words)))
    if not found:
        raise FileNotFoundError(f"No licence paragraphs of {min_words}-{max_words} words under {directory}; the "
                                "instruction prompts need Debian's base-files licences (/usr/share/common-licenses).")
    return found


def instruction_prompts(tokenizer, trials: int, seed: int = 0,
                        directory: Path | str = LICENCE_DIRECTORY) -> list[tuple[torch.Tensor, str]]:
    """``trials`` chat-templated prompts (token ids ``[T]``, a description of the paragraph and instruction)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("The consumer's tokenizer has no chat template; instruction prompts are for chat models.")
    paragraphs = licence_paragraphs(directory)
    chooser = random.Random(seed)
    prompts = []
    for trial in range(trials):
        name, paragraph = paragraphs[chooser.randrange(len(paragraphs))]
        instruction = INSTRUCTIONS[trial % len(INSTRUCTIONS)]
        messages = [{"role": "user", "content": f"{paragraph}\n\n{instruction}"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"][0]
        prompts.append((ids, f"{name}: {instruction}"))
    return prompts
