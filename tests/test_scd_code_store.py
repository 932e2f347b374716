"""The SCD code store on tiny random Llamas: knowledge bases fitted with shared encoders have one encoder fingerprint;
a prompt put once is served to two consumers as payloads ``SCDTransferCache.from_payload`` accepts, which rebuild the
cache a fresh ``encode`` rebuilds (exactly at the widths the entry stores); a knowledge base with other encoders and
a tampered, truncated or misfiled entry are refused; the directory and Redis backends round-trip (Redis against a
server this module starts)."""

from __future__ import annotations

import copy
import importlib.util
import shutil
import socket
import subprocess
import threading
import time

import pytest
import torch

from hf_kvcodecs.scd import SCDKnowledgeBase, SCDTransferCache, encode, full_rank_knowledge_base
from hf_kvcodecs.scd.code_store import SCDCodeStore
from hf_kvcodecs.scd.encode import encode_sections
from hf_kvcodecs.scd.encoder_sharing import EncoderSharingError, encoder_fingerprint
from hf_kvcodecs.scd.payload import unpack_payload
from hf_kvcodecs.scd.store_backends import DirectoryBackend, RedisBackend, StoreBackend, StoreError

FIT = {"window_tokens": 128, "windows": 10, "code_bits": 4, "code_format": "whitened", "patch_layers": (1,),
       "patch_depths": (2,)}


def _perturbed(model, seed: int, scale: float):
    consumer = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in consumer.model.layers[1:]:
            for module in (layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.down_proj):
                module.weight.add_(scale * module.weight.std() * torch.randn(module.weight.shape, generator=generator))
    return consumer


@pytest.fixture(scope="module")
def consumers(producer, deep_mismatch_consumer):
    return {"first": deep_mismatch_consumer, "second": _perturbed(producer, 7, 0.3)}


@pytest.fixture(scope="module")
def shared(producer, consumers, stream, tmp_path_factory):
    """Two saved knowledge bases: the first fitted as usual, the second keeping the first's encoders."""
    first_dir = tmp_path_factory.mktemp("kb_first")
    first = full_rank_knowledge_base(producer, consumers["first"], stream, **FIT)
    first.save(first_dir)
    second = full_rank_knowledge_base(producer, consumers["second"], stream, window_tokens=128, windows=10,
                                      code_bits=4, code_format="whitened", encoders_from=str(first_dir))
    second.save(tmp_path_factory.mktemp("kb_second"))
    return {"first": SCDKnowledgeBase.load(first_dir), "second": second, "first_dir": first_dir}


@pytest.fixture()
def prompt(stream):
    return stream[300:365][None]


def test_shared_encoders_have_one_fingerprint_and_own_decoders(shared, producer, consumers, stream):
    first, second = shared["first"], shared["second"]
    assert encoder_fingerprint(first) == encoder_fingerprint(second)
    assert second.fitting["shared_encoders"]["encoder_fingerprint"] == encoder_fingerprint(first)
    assert [(layer.kind, layer.depth) for layer in first.plan] == [(layer.kind, layer.depth) for layer in second.plan]
    for index in first.keys:
        assert torch.equal(first.keys[index].encoder, second.keys[index].encoder)
    last = max(first.keys)  # the consumers differ from layer 1 on
    assert not torch.allclose(first.keys[last].decoder, second.keys[last].decoder)
    # the second pair's widths are its own (decoder-weighted), so the store has something to reconcile
    assert any(a.widths != b.widths for a, b in zip(first.plan, second.plan) if a.kind != "recomputed")
    # on the text the encoders were fitted on, shared decoders are what the pair's own PCA fit gives
    own = full_rank_knowledge_base(producer, consumers["second"], stream, **FIT)
    for index in own.keys:
        assert torch.allclose(own.keys[index].decoder, second.keys[index].decoder, atol=1e-5)


def test_sharing_across_producers_or_layouts_is_refused(shared, producer, consumers, stream):
    other_producer = _perturbed(consumers["second"], 11, 0.2)
    with pytest.raises(EncoderSharingError, match="one producer only"):
        full_rank_knowledge_base(other_producer, consumers["second"], stream, window_tokens=128, windows=4,
                                 encoders_from=str(shared["first_dir"]))
    with pytest.raises(ValueError, match="leave patch_layers"):
        full_rank_knowledge_base(producer, consumers["second"], stream, window_tokens=128, windows=4,
                                 patch_layers=(2,), encoders_from=str(shared["first_dir"]))
    with pytest.raises(EncoderSharingError, match="PCA"):
        full_rank_knowledge_base(producer, consumers["second"], stream, window_tokens=128, windows=4,
                                 encoder="reduced_rank", encoders_from=str(shared["first_dir"]))


def _rebuild_error(cache, reference) -> float:
    worst = 0.0
    for got, want in zip(cache.layers, reference.layers):
        for a, b in ((got.keys, want.keys), (got.values, want.values)):
            worst = max(worst, float((a - b).pow(2).sum() / b.pow(2).sum()))
    return worst


@pytest.mark.parametrize("precision", ["widths", "float16"])
def test_put_once_serves_both_consumers(shared, producer, consumers, prompt, tmp_path, precision):
    store = SCDCodeStore(tmp_path / "store", precision=precision)
    kbs = [shared["first"], shared["second"]]
    key = store.put(producer, prompt[:, :-1], kbs)
    size = store.total_bytes()
    assert size == store.entry_bytes(key) > 0
    assert store.put(producer, prompt[:, :-1], kbs) == key and store.total_bytes() == size  # written once
    for name, kb in zip(("first", "second"), kbs):
        served = store.payload_for(kb, prompt[:, :-1])
        fresh = encode(producer, prompt[:, :-1], kb)
        assert len(served) == len(fresh)  # the same manifest and section table
        raw_served, sections_served = unpack_payload(served)
        raw_fresh, sections_fresh = unpack_payload(fresh)
        assert raw_served == raw_fresh
        cache = SCDTransferCache.from_payload(served, consumers[name], kb, input_ids=prompt[:, :-1])
        reference = SCDTransferCache.from_payload(fresh, consumers[name], kb, input_ids=prompt[:, :-1])
        assert _rebuild_error(cache, reference) < 0.01, (name, precision)
        for section in ("input.attention_mask", "input.exact_token_ids"):
            assert torch.equal(sections_served[section], sections_fresh[section])
        rms = [section for section in sections_fresh if section.endswith("patch_rms")]
        assert rms and all(torch.equal(sections_served[s], sections_fresh[s]) for s in rms)
        if precision == "widths":
            # a code whose stored widths are this knowledge base's own is served byte for byte as a fresh encode
            entry, _ = store.read_entry(key)
            stored = {(code["layer"], code["name"]): tuple(code["bits"]) for code in entry["codes"]}
            same = [(layer.index, code_name) for layer in kb.plan for code_name, code in layer.widths.items()
                    if stored[layer.index, code_name] == code.bits]
            assert same, name
            for index, code_name in same:
                section = f"layers.{index}.{code_name}_codes"
                agree = (sections_served[section] == sections_fresh[section]).float().mean()
                assert agree > 0.999, (name, section, float(agree))


def test_a_consumer_sending_more_than_the_entry_stores_is_refused(shared, producer, prompt, tmp_path):
    first, second = shared["first"], shared["second"]
    store = SCDCodeStore(tmp_path / "store")
    key = store.put(producer, prompt[:, :-1], [first])
    wider = any(len(b.widths[name].bits) > len(a.widths[name].bits) or
                any(y > x for x, y in zip(a.widths[name].bits, b.widths[name].bits))
                for a, b in zip(first.plan, second.plan) for name in a.widths)
    assert wider  # the second pair spends more bits somewhere than the first
    with pytest.raises(StoreError, match="overwrite=True"):
        store.payload_for(second, prompt[:, :-1])
    with pytest.raises(StoreError, match="float16"):
        store.payload_for(first, prompt[:, :-1], code_bits=16)
    assert store.put(producer, prompt[:, :-1], [first, second], overwrite=True) == key
    store.payload_for(second, prompt[:, :-1])


def test_float32_store_serves_the_fresh_payload(shared, producer, prompt, tmp_path):
    store = SCDCodeStore(tmp_path / "store", precision="float32")
    store.put(producer, prompt[:, :-1], [shared["first"], shared["second"]])
    for kb in (shared["first"], shared["second"]):
        manifest, served = store.sections_for(kb, prompt[:, :-1])
        _, fresh = encode_sections(producer, prompt[:, :-1], kb)
        for name, tensor in fresh.items():
            agree = (served[name] == tensor).float().mean()
            assert agree > 0.995, (name, float(agree))  # float32 matmuls of other widths may round one code apart


def test_knowledge_base_with_other_encoders_is_refused(shared, producer, consumers, stream, prompt, tmp_path):
    store = SCDCodeStore(tmp_path / "store")
    store.put(producer, prompt[:, :-1], [shared["first"], shared["second"]])
    other = full_rank_knowledge_base(producer, consumers["second"], stream[3000:], **FIT)  # other text: other PCA
    other.save(tmp_path / "other")
    assert encoder_fingerprint(other) != encoder_fingerprint(shared["first"])
    with pytest.raises(StoreError, match="holds no entry"):
        store.payload_for(other, prompt[:, :-1])
    with pytest.raises(EncoderSharingError, match="encoders-from"):
        store.put(producer, prompt[:, :-1], [shared["first"], other])
    with pytest.raises(StoreError, match="holds no entry"):
        store.payload_for(shared["first"], prompt[:, 1:])  # another prompt


def test_tampered_truncated_or_misfiled_entries_are_refused(shared, producer, consumers, prompt, tmp_path):
    backend = DirectoryBackend(tmp_path / "store")
    store = SCDCodeStore(backend)
    kb = shared["first"]
    key = store.put(producer, prompt[:, :-1], [kb, shared["second"]])
    path = tmp_path / "store" / f"{key}.safetensors"
    original = path.read_bytes()

    flipped = bytearray(original)
    flipped[-5] ^= 0x10  # a code byte
    path.write_bytes(bytes(flipped))
    with pytest.raises(StoreError, match="sha256 differs"):
        store.payload_for(kb, prompt[:, :-1])
    path.write_bytes(original[: len(original) // 2])
    with pytest.raises(StoreError):
        store.payload_for(kb, prompt[:, :-1])
    # a whole valid entry filed under another prompt's key
    other_key = SCDCodeStore.key_for(kb, prompt[:, 1:])
    backend.put(other_key, original)
    with pytest.raises(StoreError, match="names another prompt"):
        store.payload_for(kb, prompt[:, 1:])
    path.write_bytes(original)
    assert SCDTransferCache.from_payload(store.payload_for(kb, prompt[:, :-1]), consumers["first"], kb)
    bounded = SCDCodeStore(backend, max_entry_bytes=len(original) - 1)
    with pytest.raises(StoreError, match="over the"):
        bounded.payload_for(kb, prompt[:, :-1])
    with pytest.raises(StoreError, match="Store keys"):
        backend.get("../escape", 10)


def _roundtrip(backend: StoreBackend) -> None:
    assert isinstance(backend, StoreBackend)
    assert backend.get("absent", 100) is None and not backend.exists("absent") and backend.size("absent") is None
    backend.put("one", b"\x00\x01payload")
    backend.put("two", b"")
    assert backend.exists("one") and backend.get("one", 100) == b"\x00\x01payload"
    assert backend.get("two", 100) == b"" and backend.size("two") == 0
    assert backend.size("one") == 9 and backend.total_bytes() == 9
    with pytest.raises(StoreError, match="over the"):
        backend.get("one", 8)
    assert backend.delete("one") and not backend.delete("one") and not backend.exists("one")
    assert backend.total_bytes() == 0


def test_directory_backend_round_trips(tmp_path):
    _roundtrip(DirectoryBackend(tmp_path / "entries"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url():
    """A Redis-compatible server on a free loopback port, started here: fakeredis' TCP server (the dev extra), else
    a redis-server binary; skipped, saying why, when neither can start."""
    if importlib.util.find_spec("redis") is None:
        pytest.skip("the redis client is not installed (pip install 'hf_kvcodecs[redis]')")
    port = _free_port()
    if importlib.util.find_spec("fakeredis") is not None:
        try:
            from fakeredis import TcpFakeServer
        except ImportError:
            TcpFakeServer = None
        if TcpFakeServer is not None:
            server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
            thread = threading.Thread(target=server.serve_forever, daemon=True)
            thread.start()
            yield f"redis://127.0.0.1:{port}/0"
            server.shutdown()
            server.server_close()
            return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no Redis-compatible server can start: install fakeredis[tcp] (the dev extra) or redis-server")
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_redis_backend_round_trips_and_serves(redis_url, shared, producer, consumers, prompt):
    backend = RedisBackend(redis_url, prefix="test-scd:")
    _roundtrip(backend)
    store = SCDCodeStore(backend)
    key = store.put(producer, prompt[:, :-1], [shared["first"], shared["second"]])
    assert store.total_bytes() == store.entry_bytes(key) > 0
    for name in ("first", "second"):
        kb = shared[name]
        cache = SCDTransferCache.from_payload(store.payload_for(kb, prompt[:, :-1]), consumers[name], kb,
                                              input_ids=prompt[:, :-1])
        reference = SCDTransferCache.from_payload(encode(producer, prompt[:, :-1], kb), consumers[name], kb)
        assert _rebuild_error(cache, reference) < 0.01
    assert store.delete(key) and store.total_bytes() == 0


def test_fit_cli_passes_encoders_from_to_the_fit(monkeypatch, tmp_path, shared, producer):
    """`hf-kvcodecs scd fit --encoders-from DIR` reaches SCDFitSettings.encoders_from (the fit itself is stubbed)."""
    from types import SimpleNamespace

    import hf_kvcodecs.scd as scd
    import hf_kvcodecs.text as text
    from hf_kvcodecs import cli

    seen = {}

    def fit(*args, settings, **kwargs):
        seen["settings"] = settings
        raise ValueError("stub fit")

    monkeypatch.setattr(cli, "_load", lambda args: SimpleNamespace(model=producer, tokenizer=None, description=""))
    monkeypatch.setattr(text, "tokenize_corpus", lambda tokenizer, corpus: torch.arange(10))
    monkeypatch.setattr(scd, "fit_knowledge_base", fit)
    argv = ["scd", "fit", "--consumer", "default", "--out", str(tmp_path / "kb"), "--text", "python-docs",
            "--encoders-from", str(shared["first_dir"])]
    assert cli.run(argv) == 2
    assert seen["settings"].encoders_from == str(shared["first_dir"])
