import importlib

import pytest
import transformers.generation.configuration_utils as generation_configuration
from transformers.generation.utils import GenerationMixin

import hf_kvcodecs
from hf_kvcodecs.integrations import transformers_patch


def test_registration_is_idempotent_across_reimport():
    wrapped = GenerationMixin._prepare_cache_for_generation
    importlib.reload(hf_kvcodecs)
    hf_kvcodecs.register_cache_implementation("gsrq", hf_kvcodecs.GSRQCache)
    assert GenerationMixin._prepare_cache_for_generation is wrapped
    assert generation_configuration.ALL_CACHE_IMPLEMENTATIONS.count("gsrq") == 1


def test_other_cache_implementations_are_delegated(tiny_model):
    import torch

    out = tiny_model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache_implementation="dynamic",
                              return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    assert type(out.cache).__name__ == "DynamicCache"


def test_unsupported_transformers_version_fails_loudly(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "6.0.0")
    with pytest.raises(transformers_patch.TransformersIntegrationError, match=r"supports transformers>=5.24.0,<5.25.0; found 6.0.0"):
        transformers_patch.register_cache_implementation("gsrq", hf_kvcodecs.GSRQCache)


def test_changed_private_symbols_fail_loudly(monkeypatch):
    monkeypatch.setattr(generation_configuration, "ALL_CACHE_IMPLEMENTATIONS", None)
    with pytest.raises(transformers_patch.TransformersIntegrationError, match="ALL_CACHE_IMPLEMENTATIONS is no longer a tuple"):
        transformers_patch.register_cache_implementation("gsrq", hf_kvcodecs.GSRQCache)
