"""The GSRQ cache's code-reading attention inside a model traced by torch.compile (TorchDynamo).

In eager mode the cache calls the compiled CPU loop directly; while Dynamo traces, it must go through the
``hf_kvcodecs::coded_attention`` custom op instead (Dynamo cannot trace the C++ call). Both must give the same
decoding steps, on the code-reading path."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from transformers import LlamaForCausalLM

from hf_kvcodecs import GSRQCache, GSRQCodebooks
from hf_kvcodecs.gsrq import fit_gsrq_codebooks
from hf_kvcodecs.integrations.attention import enable_code_attention

from .conftest import tiny_llama_config


@pytest.fixture(scope="module")
def model64():
    torch.manual_seed(0)  # head size 64: the compiled loop for conditional keys is built for it
    return LlamaForCausalLM(tiny_llama_config(head_dim=64, num_key_value_heads=2, num_attention_heads=4)).eval()


@pytest.fixture(scope="module")
def conditional_codebooks(model64, tiny_token_stream):
    return fit_gsrq_codebooks(  # small and quick: the test compares two paths over the same codes
        model64, tiny_token_stream, text_info={"description": "random token ids (unit test, not an evaluation)"},
        bits=1.0, key_layout="conditional_heads", window_tokens=128, sampled_tokens_per_window=64, num_windows=2,
        holdout_windows=1, n_iter=2, fit_rows=256, progress=False,
    )


@pytest.fixture(params=["per_head", "conditional_heads", "values_given_keys"])
def model_and_codebooks(request, tiny_model, tiny_codebooks_dir):
    if request.param == "per_head":  # the default layout, head size 16
        return tiny_model, GSRQCodebooks.load(tiny_codebooks_dir)
    if request.param == "values_given_keys":  # traced, the op's reference adds the values' prediction
        return tiny_model, GSRQCodebooks.load(request.getfixturevalue("tiny_given_keys_codebooks_dir"))
    return request.getfixturevalue("model64"), request.getfixturevalue("conditional_codebooks")


def _decode(forward, model, codebooks, steps=4):
    cache = GSRQCache(model.config, codebooks=codebooks, bits=1.0, window_length=4, flush_interval=4, num_sink_tokens=2)
    prompt = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(prompt, cache=cache)
        logits = [forward(input_ids=torch.full((2, 1), 7 + step), cache=cache).logits for step in range(steps)]
    return torch.cat(logits, 1), cache


def test_traced_model_reads_codes_and_decodes_as_eager(model_and_codebooks):
    model, codebooks = model_and_codebooks
    enable_code_attention(model)
    expected, eager_cache = _decode(model, model, codebooks)
    counter = CompileCounter()
    torch._dynamo.reset()
    got, traced_cache = _decode(torch.compile(model, backend=counter), model, codebooks)
    torch._dynamo.reset()
    assert counter.frame_count >= 1  # Dynamo did trace the forward
    assert all(layer.last_attention == "codes" for layer in traced_cache.layers)
    assert all(layer.last_attention == "codes" for layer in eager_cache.layers)
    assert traced_cache.layers[0].region_lengths()["codes"] > 0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
