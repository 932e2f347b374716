"""What attention reads from a cache, recorded at the attention function and compared with full precision."""

import torch
from transformers import DynamicCache, LlamaForCausalLM, QuantizedCache

from hf_kvcodecs import GSRQCache, enable_code_attention
from hf_kvcodecs.bench.fidelity import recorded_attention_inputs, relative_errors

from .conftest import tiny_llama_config

CODED = {"window_length": 4, "flush_interval": 4, "num_sink_tokens": 2}


def _read_after_prefill(model, cache, ids):
    with torch.inference_mode():
        model(ids[:, :-1], cache=cache)
        with recorded_attention_inputs(model) as records:
            logits = model(ids[:, -1:], cache=cache).logits
    return records, logits


def test_recorded_inputs_measure_each_cache_against_full_precision(tiny_codebooks_dir):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    ids = torch.randint(3, 128, (1, 65), generator=torch.Generator().manual_seed(3))
    reference, reference_logits = _read_after_prefill(model, DynamicCache(config=model.config), ids)
    assert sorted(reference) == list(range(model.config.num_hidden_layers))
    assert reference[0][0].shape == (1, model.config.num_key_value_heads, 65, model.config.head_dim)
    with torch.inference_mode():
        plain_logits = model(ids, cache=DynamicCache(config=model.config)).logits[:, -1:]
    assert torch.allclose(reference_logits, plain_logits, atol=1e-5)  # recording leaves the forward pass unchanged
    assert model.config._attn_implementation == "sdpa"  # and restores the implementation

    exact = GSRQCache(model.config, codebooks=tiny_codebooks_dir, window_length=10_000)
    assert relative_errors(_read_after_prefill(model, exact, ids)[0], reference) == {"keys": 0.0, "values": 0.0}

    dequantized = relative_errors(_read_after_prefill(
        model, GSRQCache(model.config, codebooks=tiny_codebooks_dir, attention="dequantize", **CODED), ids)[0], reference)
    enable_code_attention(model)
    code_path = relative_errors(_read_after_prefill(
        model, GSRQCache(model.config, codebooks=tiny_codebooks_dir, attention="codes", **CODED), ids)[0], reference)
    assert model.config._attn_implementation == "kvcodecs_sdpa"
    assert 0 < dequantized["keys"] < 1 and 0 < dequantized["values"] < 1
    assert code_path == dequantized  # the code-reading path attends over the same decoded history

    quanto = QuantizedCache(config=model.config, backend="quanto", nbits=4, axis_key=-1, axis_value=0, q_group_size=16,
                            residual_length=16)
    quanto_errors = relative_errors(_read_after_prefill(model, quanto, ids)[0], reference)
    assert 0 < quanto_errors["keys"] < 0.1 and 0 < quanto_errors["values"] < 0.1
