"""Retrieval prompts of `bench scd`: the package-database parser, fact look-up prompts with one real answer each, and
the scorer, whose trivial-pair SCD answers match the oracle's."""

from __future__ import annotations

import pytest
import torch
from transformers import BatchEncoding, LlamaForCausalLM

from hf_kvcodecs.bench.retrieval import (
    FACT_QUESTION,
    NEEDLE,
    NEEDLE_QUESTION,
    PACKAGE_DATABASE,
    exact_match,
    fact_lookup_prompts,
    format_record,
    multikey_needle_prompts,
    package_records,
    passkey_prompts,
    token_f1,
)
from hf_kvcodecs.bench.scd import SCDBenchSettings, retrieval, retrieval_overall
from hf_kvcodecs.evaluation.passkey import PASSKEY_NEEDLE, PASSKEY_QUESTION, answer_has_key
from hf_kvcodecs.scd import full_rank_knowledge_base

from .conftest import tiny_llama_config


class CharacterTokenizer:
    """One token per ASCII character (ids 3..127), enough for prompts a tiny random model can read."""

    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        ids = [ord(c) if 3 <= ord(c) < 128 else ord("?") for c in text]
        return BatchEncoding({"input_ids": torch.tensor([ids])})

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids if not skip_special_tokens or int(i) >= 3)


STATUS_EXCERPT = """Package: first
Status: install ok installed
Installed-Size: 12
Maintainer: A Person <a@example.org>
Architecture: all
Version: 1.0-1
Description: a package
 Version: 9.9 (a continuation line, not a field)

Package: no-version
Installed-Size: 3
Maintainer: B Person <b@example.org>
Architecture: all

Package: second
Installed-Size: 40
Maintainer: C Person <c@example.org>
Architecture: amd64
Version: 2:3.4~rc1
"""


def test_package_records_keep_complete_one_line_fields(tmp_path):
    path = tmp_path / "status"
    path.write_text(STATUS_EXCERPT)
    records = package_records(path)
    assert [r["Package"] for r in records] == ["first", "second"]
    assert records[0]["Version"] == "1.0-1" and records[1]["Version"] == "2:3.4~rc1"
    assert format_record(records[0]).startswith("Package: first\nVersion: 1.0-1\n")
    with pytest.raises(FileNotFoundError, match="--fact-trials 0"):
        package_records(tmp_path / "missing")


@pytest.mark.skipif(not PACKAGE_DATABASE.is_file(), reason="needs Debian's package database")
def test_fact_lookup_prompts_ask_one_real_record():
    tokenizer, records = CharacterTokenizer(), package_records()
    prompts = fact_lookup_prompts(tokenizer, records, trials=4, context_tokens=1024)
    by_name = {r["Package"]: r for r in records}
    targets = []
    for ids, version in prompts:
        text = tokenizer.decode(ids)
        assert ids.numel() <= 1024
        name = text.rsplit("Package: ", 1)[1].split("\n", 1)[0]
        assert text.endswith(FACT_QUESTION.format(name=name)) and by_name[name]["Version"] == version
        assert text.count(format_record(by_name[name])) == 1  # the answer is in the passage, once
        targets.append(name)
    assert len(set(targets)) == 4


def test_exact_match_and_f1():
    assert exact_match(" 1.07.1-3+b1\nPackage: x", "1.07.1-3+b1") == 1.0
    assert exact_match("1.07.1-3", "1.07.1-3+b1") == 0.0 and exact_match("", "1") == 0.0
    assert exact_match("12345. Remember it", "12345") == 1.0
    assert token_f1("1.07.1-3", "1.07.1-3+b1") == pytest.approx(2 * 1 * 0.8 / 1.8)


def test_scd_pass_key_prompts_follow_the_shared_protocol():
    tokenizer = CharacterTokenizer()
    text_ids = tokenizer(STATUS_EXCERPT * 8).input_ids[0]
    prompts = passkey_prompts(tokenizer, text_ids, trials=3, context_tokens=200, seed=0)
    question = PASSKEY_QUESTION
    depths = []
    for ids, key in prompts:
        text = tokenizer.decode(ids)
        needle = PASSKEY_NEEDLE.format(key=key)
        assert ids.numel() == 200 and len(key) == 5 and text.endswith(question) and text.count(needle) == 1
        depths.append(text.index(needle))
    assert depths == sorted(depths) and len(set(depths)) == 3  # the needle moves deeper trial by trial
    assert answer_has_key(" " + prompts[0][1] + ".", prompts[0][1])


def test_trivial_pair_scd_answers_as_the_oracle_does(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3)).eval()
    stream = torch.randint(3, 128, (3000,), generator=torch.Generator().manual_seed(1))
    kb = full_rank_knowledge_base(model, model, stream, window_tokens=128, windows=8, code_bits=32)
    kb.save(tmp_path / "kb")
    tokenizer = CharacterTokenizer()
    text_ids = tokenizer(STATUS_EXCERPT * 8).input_ids[0]
    prompts = passkey_prompts(tokenizer, text_ids, trials=2, context_tokens=160, seed=0)
    settings = SCDBenchSettings(droidspeak_layers=(1,), kivi_group=16)
    results = retrieval(model, model, tokenizer, kb, None, prompts, settings, 6, "test", progress=False)
    assert set(results) == {"oracle", "raw-16", "kivi-8", "kivi-4", "scd", "droidspeak-1"}
    assert results["scd"]["answers"] == results["oracle"]["answers"] == results["raw-16"]["answers"]
    assert results["oracle"]["expected"] == [key for _, key in prompts]
    for row in results.values():
        assert row["trials"] == 2 and 0.0 <= row["exact_match"] <= 1.0 and 0.0 <= row["f1"] <= 1.0


LICENCE_PROSE = (
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software and associated "
    "documentation files, to deal in the Software without restriction, including without limitation the rights to "
    "use, copy, modify, merge, publish, distribute, sublicense, and sell copies of the Software, subject to the "
    "following conditions: the above copyright notice and this permission notice shall be included in all copies. "
)


def test_multikey_needles_hide_one_asked_number_among_distractors():
    tokenizer = CharacterTokenizer()
    text_ids = tokenizer(LICENCE_PROSE * 12).input_ids[0]
    prompts = multikey_needle_prompts(tokenizer, text_ids, trials=5, context_tokens=900, seed=3, needles=3)
    asked_positions = set()
    for ids, number in prompts:
        text = tokenizer.decode(ids)
        assert ids.numel() <= 900 and len(number) == 7 and number.isdigit()
        key = text.rsplit("special magic number for ", 1)[1].split(" ", 1)[0]
        assert text.endswith(NEEDLE_QUESTION.format(key=key))
        needles = text.count("One of the special magic numbers for ")
        assert needles == 3 and text.count(NEEDLE.format(key=key, value=number)) == 1  # one right answer
        assert key in LICENCE_PROSE.lower()  # keys are words of the passage itself
        order = [part.split(" ", 1)[0] for part in text.split("One of the special magic numbers for ")[1:]]
        asked_positions.add(order.index(key))
    assert asked_positions == {0, 1, 2}  # the asked needle moves through the prompt
    with pytest.raises(ValueError, match="fewer needles"):
        multikey_needle_prompts(tokenizer, text_ids, trials=1, context_tokens=120, seed=0, needles=3)


def test_retrieval_overall_pools_questions_and_pairs_with_the_oracle():
    passkey = {"oracle": {"per_question_exact_match": [1.0, 0.0], "per_question_f1": [1.0, 0.5]},
               "scd": {"per_question_exact_match": [1.0, 0.0], "per_question_f1": [1.0, 0.0]}}
    needles = {"oracle": {"per_question_exact_match": [1.0], "per_question_f1": [1.0]},
               "scd": {"per_question_exact_match": [0.0], "per_question_f1": [0.0]}}
    overall = retrieval_overall(passkey, needles, {})
    assert overall["oracle"]["questions"] == 3 and overall["oracle"]["f1"] == pytest.approx(2.5 / 3)
    assert overall["scd"]["exact_match"] == pytest.approx(1 / 3) and overall["scd"]["f1_se"] > 0
    assert overall["scd"]["f1_vs_oracle"]["mean"] == pytest.approx(-1.5 / 3)
    assert overall["oracle"]["f1_vs_oracle"]["mean"] == 0.0
