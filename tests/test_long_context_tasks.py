"""RULER-style long-context tasks (hf_kvcodecs.evaluation.tasks): generation, scoring and the runner, with a
one-token-per-byte tokenizer (the default model's GGUF tokenizer takes too long to load for a unit test) and a tiny
random Llama."""

import json
import re
from collections import Counter

import pytest
import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import DynamicCache, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_kvcodecs.evaluation import tasks
from hf_kvcodecs.evaluation.tasks import (
    TASKS,
    TaskSuiteOptions,
    compare_task_results,
    generate_task_items,
    parse_length,
    run_task_suite,
    run_task_suite_methods,
    score_answer,
    task_suite_table,
)
from hf_kvcodecs.evaluation.tasks.haystack import SNAP_TOLERANCE
from hf_kvcodecs.evaluation.tasks.needles import NEEDLE
from hf_kvcodecs.evaluation.tasks.variables import resolve

from .conftest import tiny_llama_config

NEEDLE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
CHAT_TEMPLATE = "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}<|assistant|>"
# The binary search stops within one haystack word (or list entry) of the budget; a word is a few bytes here.
LENGTH_TOLERANCE = 32


def _byte_tokenizer(chat: bool = False) -> PreTrainedTokenizerFast:
    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return _byte_tokenizer()


@pytest.fixture(scope="module")
def options():
    # cwe's list at RULER's long-context frequencies needs ~8K bytes; every other task fits far less
    return TaskSuiteOptions(lengths=(8192,), items_per_cell=2, seed=0)


@pytest.fixture(scope="module")
def items(tokenizer, options):
    return generate_task_items(tokenizer, options)


def _by_task(items, task):
    return [item for item in items if item.task == task]


def _context(item, start: str, end: str) -> str:
    return item.text[item.text.index(start) + len(start):item.text.rindex(end)]


def test_every_task_generates_items_per_cell(items, options):
    assert [item.task for item in items] == [task for task in TASKS for _ in range(options.items_per_cell)]
    assert all(item.expected and item.length == 8192 for item in items)


def test_generation_is_deterministic_per_seed(tokenizer, items, options):
    again = generate_task_items(tokenizer, options)
    assert [item.text for item in again] == [item.text for item in items]
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(again, items))
    other = generate_task_items(tokenizer, TaskSuiteOptions(tasks=("niah_single", "vt"), lengths=(8192,),
                                                            items_per_cell=2, seed=1))
    assert all(a.text != b.text and a.expected != b.expected
               for a, b in zip(other, _by_task(items, "niah_single") + _by_task(items, "vt")))
    # an item does not depend on which other tasks run beside it
    alone = generate_task_items(tokenizer, TaskSuiteOptions(tasks=("vt",), lengths=(8192,), items_per_cell=2))
    assert [item.text for item in alone] == [item.text for item in _by_task(items, "vt")]


def test_prompts_fit_their_length(tokenizer, items):
    for item in items:
        target = item.length - item.answer_tokens
        assert target - LENGTH_TOLERANCE <= item.prompt_tokens <= target, (item.task, item.prompt_tokens, target)
        assert item.input_ids.tolist() == tokenizer(item.text, add_special_tokens=False)["input_ids"]


def test_needles_sit_at_the_requested_depths_and_answers_occur_once(items):
    needle = re.compile(re.escape(NEEDLE).replace(r"\{key\}", r"(\S+)").replace(r"\{value\}", r"(\d{7})") + " ")
    for item in (item for task in NEEDLE_TASKS for item in _by_task(items, task)):
        context = _context(item, "afterwards.\n", "\nWhat are all the special magic numbers")
        found, haystack, previous = [], "", 0
        for match in needle.finditer(context):
            haystack += context[previous:match.start()]
            found.append((len(haystack), match[1], match[2]))
            previous = match.end()
        haystack += context[previous:]
        count = len(item.details["needles"])
        assert len(found) == count and len(item.requested_depths) == count
        for (position, key, value), requested, needle_spec in zip(found, item.requested_depths, item.details["needles"]):
            assert (key, value) == (needle_spec["key"], needle_spec["value"])
            assert abs(position / len(haystack) - requested) <= SNAP_TOLERANCE + 0.005
        for value in item.expected:
            assert item.text.count(value) == 1
        asked = item.details["asked_keys"]
        assert [v for (_, key, v) in found if key in asked] == sorted(item.expected, key=[v for _, _, v in found].index)
        question = item.text[item.text.rindex("What are all"):]
        assert all(key in question for key in asked) and not any(key in question for key in item.details["keys"]
                                                                   if key not in asked)
    # the items of a cell spread the single needle over the haystack
    assert [item.requested_depths for item in _by_task(items, "niah_single")] == [[0.25], [0.75]]
    assert len(set(_by_task(items, "niah_multikey")[0].details["keys"])) == 4


def test_variable_tracking_answers_are_correct_by_construction(items):
    for item in _by_task(items, "vt"):
        context = _context(item, "hidden in the following text.\n\n", "\nQuestion: Find all variables")
        values = resolve(context)
        holding = sorted(name for name, value in values.items() if value == item.details["value"])
        assert holding == sorted(item.expected) and len(item.expected) == 5
        assert context.count(item.details["value"]) == 1
        assert all(context.count(f"VAR {name} =") == 1 for name in item.expected)
        positions = [context.index(f"VAR {name} =") for name in item.expected]
        assert positions == sorted(positions)  # the chain reads in order
        assert all(abs(a - b) <= SNAP_TOLERANCE + 0.005 for a, b in zip(item.depths, item.requested_depths))


def test_common_words_are_the_most_frequent(items):
    for item in _by_task(items, "cwe"):
        main = item.text[item.text.rindex("Below is a numbered list"):item.text.rindex("\nQuestion:")]
        entries = re.findall(r"(\d+)\. ([a-z]+)", main)
        assert [int(number) for number, _ in entries] == list(range(1, len(entries) + 1))
        counts = Counter(word for _, word in entries)
        assert all(counts[word] == item.details["common_frequency"] == 30 for word in item.expected)
        assert max(count for word, count in counts.items() if word not in item.expected) <= 3
        assert len(entries) == item.details["list_entries"]


def test_scorer_full_partial_and_wrong_answers(items):
    single = _by_task(items, "niah_single")[0]
    assert score_answer(single, f" {single.expected[0]}.")["score"] == 1.0
    assert score_answer(single, f" {single.expected[0]}.")["strict"] == 1.0
    assert score_answer(single, " 1234567.") == {"answer": "1234567.", "score": 0.0, "strict": 0.0,
                                                 "extracted": ["1234567"]}
    multivalue = _by_task(items, "niah_multivalue")[0]
    values = multivalue.expected
    assert score_answer(multivalue, ", ".join(reversed(values)))["strict"] == 1.0
    half = score_answer(multivalue, f"{values[0]} and {values[2]}")
    assert half["score"] == 0.5 and half["strict"] == 0.0
    extra = score_answer(multivalue, ", ".join(values) + ", 7654321")
    assert extra["score"] == 1.0 and extra["strict"] == 0.0  # RULER's metric ignores extras; strict does not
    vt = _by_task(items, "vt")[0]
    assert score_answer(vt, " ".join(vt.expected))["strict"] == 1.0
    assert score_answer(vt, " ".join(vt.expected[:4]) + " VAR")["score"] == 0.8
    cwe = _by_task(items, "cwe")[0]
    listed = " ".join(f"{n + 1}. {word}" for n, word in enumerate(cwe.expected))
    assert score_answer(cwe, listed)["score"] == score_answer(cwe, listed)["strict"] == 1.0
    assert score_answer(cwe, "I do not know.")["score"] == 0.0


def test_chat_template_renders_one_user_turn_with_the_answer_prefix():
    tokenizer = _byte_tokenizer(chat=True)
    (item,) = generate_task_items(tokenizer, TaskSuiteOptions(tasks=("niah_single",), lengths=(1024,),
                                                              items_per_cell=1))
    assert item.text.startswith("<|user|>Some special magic numbers")
    assert item.text.endswith("<|end|><|assistant|>The special magic numbers for "
                              f"{item.details['asked_keys'][0]} mentioned in the provided text are")
    assert 1024 - 32 - LENGTH_TOLERANCE <= item.prompt_tokens <= 1024 - 32
    with pytest.raises(ValueError, match="no chat template"):
        generate_task_items(_byte_tokenizer(), TaskSuiteOptions(tasks=("vt",), lengths=(1024,), chat_template=True))


def test_bad_options_raise_clear_errors(tokenizer):
    with pytest.raises(ValueError, match="Unknown long-context task.*niah_single"):
        TaskSuiteOptions(tasks=("niah_single", "needle"))
    with pytest.raises(ValueError, match="items_per_cell"):
        TaskSuiteOptions(items_per_cell=0)
    with pytest.raises(ValueError, match="4K"):
        TaskSuiteOptions(lengths=("four thousand",))
    assert TaskSuiteOptions(tasks="vt,cwe", lengths=("2K", 4096)).lengths == (2048, 4096)
    assert parse_length("8k") == 8192
    with pytest.raises(ValueError, match=r"'niah_multiquery' is too short.*needs a length of 1168.*at least 2048"):
        generate_task_items(tokenizer, TaskSuiteOptions(tasks=("niah_multiquery",), lengths=(256,), items_per_cell=1))
    with pytest.raises(ValueError, match=r"'cwe' is too short.*at least 8192"):
        generate_task_items(tokenizer, TaskSuiteOptions(tasks=("cwe",), lengths=(4096,), items_per_cell=1))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=257, bos_token_id=256, eos_token_id=256, pad_token_id=256,
                               max_position_embeddings=2048)
    return LlamaForCausalLM(config).eval()


def test_runner_end_to_end_on_a_tiny_llama(tokenizer, model):
    options = TaskSuiteOptions(tasks=("niah_single", "niah_multivalue", "vt"), lengths=(1024, 1536), items_per_cell=2,
                               answer_tokens=4)
    items = generate_task_items(tokenizer, options)
    made = []

    def make_cache():
        made.append(DynamicCache(config=model.config))
        return made[-1]

    results = run_task_suite(model, tokenizer, make_cache, options, progress=False, items=items)
    assert len(made) == len(items) == 12 and made[0].get_seq_length() > 0
    assert set(results) == {"options", "cells", "lengths", "overall", "items"}
    assert results["options"]["tasks"] == list(options.tasks)
    for task in options.tasks:
        for length in ("1024", "1536"):
            cell = results["cells"][task][length]
            assert cell["n"] == 2 and 0.0 <= cell["mean"] <= 1.0 and cell["se"] is not None and cell["se"] >= 0
            assert cell["prompt_tokens"] <= int(length) - 4
    assert results["lengths"]["1536"]["tasks"] == 3 and results["overall"]["score"]["n"] == 12
    assert all(1 <= row["generated_tokens"] <= row["answer_budget"] == 4 and isinstance(row["answer"], str) for row in results["items"])
    json.dumps(results)
    # the model's default cache (None) answers exactly as a DynamicCache does
    default = run_task_suite(model, tokenizer, None, options, progress=False, items=items)
    assert [row["answer"] for row in default["items"]] == [row["answer"] for row in results["items"]]
    paired = compare_task_results(default, results)
    assert paired["overall"]["score"] == {"mean": 0.0, "se": 0.0, "n": 12}
    assert paired["cells"]["vt"]["1024"]["strict"]["n"] == 2
    shorter = run_task_suite(model, tokenizer, None, options, progress=False, items=items[:6])
    with pytest.raises(ValueError, match="same TaskSuiteOptions"):
        compare_task_results(shorter, results)


def test_several_methods_share_items_and_compare_with_the_reference(tokenizer, model):
    options = TaskSuiteOptions(tasks=("niah_single", "vt"), lengths=(1024,), items_per_cell=2, answer_tokens=3)
    methods = {"fp": None, "dynamic": lambda: DynamicCache(config=model.config)}
    suite = run_task_suite_methods(model, tokenizer, methods, options, reference="fp", progress=False)
    assert set(suite["methods"]) == {"fp", "dynamic"} and set(suite["vs_reference"]) == {"dynamic"}
    assert suite["vs_reference"]["dynamic"]["cells"]["vt"]["1024"]["score"] == {"mean": 0.0, "se": 0.0, "n": 2}
    table = task_suite_table(suite["methods"])
    assert len(table) == 4 and table[0] == "| method | niah_single 1024 | vt 1024 | mean 1024 |"
    assert table[2].startswith("| fp | ") and table[3].count("±") == 3
    with pytest.raises(ValueError, match="reference method 'fp16' is not among the methods"):
        run_task_suite_methods(model, tokenizer, methods, options, reference="fp16", progress=False)


def test_package_exports():
    from hf_kvcodecs import evaluation

    assert evaluation.run_task_suite is tasks.run_task_suite and evaluation.TaskSuiteOptions is TaskSuiteOptions
    assert evaluation.run_task_suite_methods is tasks.run_task_suite_methods
