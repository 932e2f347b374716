"""Prompts: rendering through the chat template, and fitting a prompt to a token budget measured with the model's own
tokenizer.

An Instruct model asked without its chat template often answers nothing at all (SmolLM2-135M-Instruct emits
``<|im_end|>`` at once), so prompts are rendered as one user turn when the tokenizer has a template, and the task's
answer prefix (RULER's, e.g. "The special magic numbers for ... are") starts the assistant's reply.
"""

from __future__ import annotations

from collections.abc import Callable

_CONTENT = "<<hf_kvcodecs user content>>"


class PromptRenderer:
    """Renders a user message and the start of the reply; counts and encodes prompts with the same tokenizer."""

    def __init__(self, tokenizer, chat_template: bool | None = None):
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if chat_template and not has_template:
            raise ValueError("chat_template=True, but the tokenizer has no chat template; pass chat_template=None "
                             "(use it when there is one) or False.")
        self.tokenizer = tokenizer
        self.chat = has_template if chat_template is None else chat_template
        self._before = self._after = None
        if self.chat:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": _CONTENT}],
                                                     add_generation_prompt=True, tokenize=False)
            if rendered.count(_CONTENT) == 1:  # else the template transforms the content: render every prompt
                self._before, self._after = rendered.split(_CONTENT)

    def render(self, user: str, answer_prefix: str) -> str:
        if not self.chat:
            return user + answer_prefix.rstrip()
        if self._before is None:
            head = self.tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                                      tokenize=False)
        else:
            head = self._before + user + self._after
        return head + answer_prefix.strip()

    def encode(self, text: str) -> list[int]:
        # a rendered template carries its own special tokens (a BOS among them where the model wants one)
        return self.tokenizer(text, add_special_tokens=not self.chat)["input_ids"]


def fit_prompt(build: Callable[[int], tuple[str, object]], encode: Callable[[str], list[int]], target: int,
               minimum: int, maximum: int, what: str, reserved: int = 0) -> tuple[int, str, list[int], object]:
    """The largest ``n`` in ``[minimum, maximum]`` whose prompt ``build(n)`` (text, payload) encodes to at most
    ``target`` tokens, by binary search (token counts grow with ``n``); returns ``(n, text, ids, payload)``.
    Raises ValueError naming ``what`` and the length it needs (its smallest prompt plus the ``reserved`` answer
    tokens) when even ``build(minimum)`` is too long."""
    text, payload = build(minimum)
    ids = encode(text)
    if len(ids) > target:
        needed = len(ids) + reserved
        raise ValueError(f"{what} is too short: its smallest prompt (template, question, and the task's needles or "
                         f"list with minimal filler) takes {len(ids)} tokens, which with {reserved} answer tokens "
                         f"needs a length of {needed}, more than {target + reserved}. Use a length of at least "
                         f"{_suggest(needed)}, or drop the task.")
    best = (minimum, text, ids, payload)
    low, high = minimum + 1, maximum
    while low <= high:
        middle = (low + high) // 2
        text, payload = build(middle)
        ids = encode(text)
        if len(ids) <= target:
            best, low = (middle, text, ids, payload), middle + 1
        else:
            high = middle - 1
    return best


def _suggest(tokens: int) -> int:
    """The next power of two at or above ``tokens`` (lengths are usually 2K, 4K, 8K, ...)."""
    return 1 << max(tokens - 1, 1).bit_length()
