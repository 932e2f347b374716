"""What a GSRQ cache holds with the per-model tables it references: counted whole, built lazily per layer, shared."""

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_kvcodecs import GSRQCache, GSRQCodebooks
from hf_kvcodecs.bench.memory import cache_bytes, cache_footprint, shared_storages, tensor_storages
from hf_kvcodecs.gsrq import fit_gsrq_codebooks
from hf_kvcodecs.gsrq.attention import gsrq_layer_attention, held_decode_constants
from hf_kvcodecs.integrations.attention import enable_code_attention
from hf_kvcodecs.kernels.cpu_native import native_ops

from .conftest import tiny_llama_config

pytestmark = [pytest.mark.usefixtures("single_torch_thread"), pytest.mark.default_key_tables,
              pytest.mark.skipif(native_ops() is None, reason="needs the compiled CPU loops (a C++ compiler)")]

HEADS, DIM = 2, 64  # head_dim 64: the compiled loop forms the value prediction itself, as on the default model
BITS = 1.0
CODED = {"window_length": 4, "flush_interval": 4, "num_sink_tokens": 2, "bits": BITS, "attention": "codes"}
# Scale level tables, stage orders, cached means: a few KiB per layer. A copy of any codebook, basis or predictor, a
# matrix of zero predictors or a dense decode table would each be tens of KiB or more per layer here.
SMALL_TABLES_PER_LAYER = 16 * 1024


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(head_dim=DIM, num_key_value_heads=HEADS, num_attention_heads=4)).eval()
    enable_code_attention(model)
    return model


@pytest.fixture(scope="module")
def codebooks_dir(model, tiny_token_stream, tmp_path_factory):
    """The default layouts (keys per head with each head's own codebooks, values given the keys), fitted fast."""
    directory = tmp_path_factory.mktemp("memory_codebooks")
    fit_gsrq_codebooks(model, tiny_token_stream, text_info={"description": "random token ids (unit test)"}, bits=BITS,
                       window_tokens=128, sampled_tokens_per_window=32, num_windows=4, holdout_windows=1, n_iter=2,
                       fit_rows=256, out=directory, progress=False)
    return directory


@pytest.fixture
def codebooks(codebooks_dir):
    """The codebooks loaded afresh for each test, with no table built yet (a directory is loaded once per process,
    and the tables built from it are shared by every cache of it)."""
    return GSRQCodebooks.load(codebooks_dir)


def _prefilled(model, codebooks, tokens=30):
    cache = GSRQCache(model.config, codebooks=codebooks, **CODED)
    ids = torch.randint(3, 128, (1, tokens + 8), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        model(ids[:, :tokens], cache=cache)  # a prefill attends its exact tokens: it reads no codes
    return cache, ids


def _footprint(cache, model, codebooks):
    return cache_footprint(cache, GSRQCache(model.config, codebooks=codebooks, **CODED))


def _key_table_bytes(layer) -> int:
    """The int16 per-head table the compiled loop rebuilds keys from ([H, S*K, D]), its step and the key means."""
    codec = layer.key_codec
    return HEADS * codec.num_stages * codec.codebook_size * DIM * 2 + 2 * HEADS * DIM * 4


def test_the_total_is_the_cache_and_every_table_it_references_and_nothing_more(model, codebooks):
    cache, ids = _prefilled(model, codebooks)
    with torch.inference_mode():
        for position in range(30, 34):
            model(ids[:, position:position + 1], cache=cache)
    assert all(layer.last_attention == "codes" for layer in cache.layers)
    footprint = _footprint(cache, model, codebooks)
    assert footprint.total_bytes == footprint.state_bytes + footprint.table_bytes == cache_bytes(cache)
    saved = sum(tensor.nbytes for codec in codebooks.key_codecs + codebooks.value_codecs
                for tensor in codec.state_dict("codec").values())
    rotary = cache.ledger.rotary_table
    needed = saved + sum(_key_table_bytes(layer) for layer in cache.layers) + rotary.cos.nbytes + rotary.sin.nbytes
    assert needed <= footprint.table_bytes <= needed + SMALL_TABLES_PER_LAYER * len(cache.layers)


def test_a_layers_tables_are_built_by_its_own_first_code_reading_step(model, codebooks):
    cache, ids = _prefilled(model, codebooks)
    first, second = cache.layers
    assert held_decode_constants(first) is None and held_decode_constants(second) is None
    tables_after_prefill = _footprint(cache, model, codebooks).table_bytes
    second_held = tensor_storages([second.key_codec, second.value_codec])
    query = torch.randn(1, 4, 1, DIM, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        gsrq_layer_attention(first, query, None, DIM ** -0.5)  # layer 0's first code-reading step, alone
    assert held_decode_constants(first) is not None and held_decode_constants(second) is None
    assert tensor_storages([second.key_codec, second.value_codec]) == second_held
    tables_after_first_layer = _footprint(cache, model, codebooks).table_bytes
    assert tables_after_first_layer - tables_after_prefill >= _key_table_bytes(first)
    with torch.inference_mode():
        model(ids[:, 30:31], cache=cache)
    assert held_decode_constants(second) is not None
    assert _footprint(cache, model, codebooks).table_bytes - tables_after_first_layer >= _key_table_bytes(second)


def test_every_cache_of_the_codebooks_shares_the_tables_a_deep_copy_included(model, codebooks):
    cache, ids = _prefilled(model, codebooks)
    with torch.inference_mode():
        model(ids[:, 30:31], cache=cache)
    tables = _footprint(cache, model, codebooks).table_bytes
    copied = copy.deepcopy(cache)
    assert sum(shared_storages(cache, copied).values()) == tables
    other, other_ids = _prefilled(model, codebooks, tokens=20)
    with torch.inference_mode():
        model(other_ids[:, 20:21], cache=other)  # its first code-reading steps find every table built
    assert sum(shared_storages(cache, other).values()) == tables
    assert all(held_decode_constants(mine) is held_decode_constants(theirs)
               for mine, theirs in zip(cache.layers, other.layers))
