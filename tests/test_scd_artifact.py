"""An SCD knowledge base travels with the consumer's checkpoint, as GSRQ codebooks do: ``KVCodecsConfig(
kv_cache_implementation="scd")``, ``save_pretrained`` writes ``scd_knowledge_base/``, ``from_pretrained`` finds it
(next to the weights or on the Hub at the weights' commit), refuses one fitted for another consumer, and makes
``generate(cache_config={"payload": ...})`` rebuild the cache from a producer's payload. Tiny random Llamas, no
network."""

import hashlib
import json
import shutil
import types

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import RepositoryNotFoundError
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from hf_kvcodecs.quantization import KVCodecsConfig, quantize_model
from hf_kvcodecs.quantization.hub import check_saved_model
from hf_kvcodecs.quantization.quantizer import resolve_artifact_dir
from hf_kvcodecs.scd import (
    KnowledgeBaseError,
    PairMismatchError,
    SCDKnowledgeBase,
    SCDTransferCache,
    encode,
    full_rank_knowledge_base,
)
from hf_kvcodecs.scd.artifact import SCD_KNOWLEDGE_BASE
from hf_kvcodecs.scd.hub import SAVED_MODEL_FOLDER, download_knowledge_base
from hf_kvcodecs.scd.knowledge_base import METADATA_FILE, TENSORS_FILE

from .conftest import tiny_llama_config

FOLDER = SAVED_MODEL_FOLDER
GENERATE = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True)


def _model(seed: int, layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers)).eval()


def _copy_of(model):
    """A separate model with the same weights (quantize_model changes the model it is given)."""
    copy = LlamaForCausalLM(model.config.__class__.from_dict(model.config.to_dict()))
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def _scd_config(knowledge_base) -> KVCodecsConfig:
    return KVCodecsConfig(weight_bits=None, kv_cache_implementation="scd",
                          kv_cache_config={"knowledge_base": str(knowledge_base)})


def _fitted(model, stream, directory, windows: int = 2):
    kb = full_rank_knowledge_base(model, model, stream, window_tokens=128, windows=windows, patch_layers=(1,),
                                  code_bits=32)
    kb.save(directory)
    return kb


@pytest.fixture(scope="module")
def consumer():
    return _model(0)


@pytest.fixture(scope="module")
def stream():
    return torch.randint(3, 128, (3000,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def kb_dir(consumer, stream, tmp_path_factory):
    """A full-rank knowledge base of the trivial pair (the consumer is its own producer): rebuilt caches are exact."""
    directory = tmp_path_factory.mktemp("scd_kb")
    _fitted(consumer, stream, directory, windows=8)
    return directory


@pytest.fixture(scope="module")
def saved(consumer, kb_dir, tmp_path_factory):
    """The consumer with the knowledge base as its KV artifact, saved."""
    model = quantize_model(_copy_of(consumer), _scd_config(kb_dir))
    out = tmp_path_factory.mktemp("scd_consumer")
    model.save_pretrained(out)
    return out


def _same_files(a, b) -> bool:
    return all((a / name).read_bytes() == (b / name).read_bytes() for name in (METADATA_FILE, TENSORS_FILE))


# ---- the user flow --------------------------------------------------------------------------------------------
def test_the_knowledge_base_is_saved_with_the_consumer_and_generate_rebuilds_from_a_payload(saved, kb_dir, consumer,
                                                                                            stream):
    # copied, not saved again: payloads name the knowledge base's save id, which a new save would change
    assert _same_files(saved / FOLDER, kb_dir)
    config = json.loads((saved / "config.json").read_text())["quantization_config"]
    assert (config["kv_cache_implementation"], config["kv_cache_config"]) == ("scd", {"knowledge_base": FOLDER})
    generation = json.loads((saved / "generation_config.json").read_text())
    assert (generation["cache_implementation"], generation["cache_config"]) == ("scd", {"knowledge_base": FOLDER})
    assert check_saved_model(saved)["kv_cache_implementation"] == "scd"

    loaded = AutoModelForCausalLM.from_pretrained(saved)
    kb = SCDKnowledgeBase.load(kb_dir)
    assert loaded.hf_quantizer.kv_artifact.save_id == kb.save_id
    default = {"knowledge_base": str((saved / FOLDER).resolve())}
    assert loaded.generation_config.cache_implementation == "scd" and loaded.generation_config.cache_config == default

    prompt = stream[500:560][None]
    payload = encode(consumer, prompt[:, :-1], kb)  # on the producer (here the consumer's twin)
    by_default = loaded.generate(prompt, cache_config={"payload": payload}, **GENERATE)
    assert isinstance(by_default.cache, SCDTransferCache)
    explicit = loaded.generate(prompt, cache=SCDTransferCache.from_payload(payload, loaded, saved / FOLDER,
                                                                           input_ids=prompt), **GENERATE)
    assert torch.equal(by_default.sequences, explicit.sequences)
    own_prefill = loaded.generate(prompt, cache_implementation="dynamic", **GENERATE)
    assert torch.equal(by_default.sequences, own_prefill.sequences)  # full rank: exact
    per_call_kb = loaded.generate(prompt, cache_config={"payload": payload, "knowledge_base": kb}, **GENERATE)
    assert torch.equal(per_call_kb.sequences, explicit.sequences)
    with pytest.raises(ValueError, match="needs cache_config=.*payload"):  # a consumer's cache needs a payload
        loaded.generate(prompt, max_new_tokens=2)
    assert loaded.generation_config.cache_config == default  # the default itself is untouched


def test_quantizing_while_loading_and_saving_again_keep_the_knowledge_base(consumer, kb_dir, saved, tmp_path):
    consumer.save_pretrained(tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=_scd_config(kb_dir))
    assert model.generation_config.cache_config == {"knowledge_base": str(kb_dir.resolve())}
    model.save_pretrained(tmp_path / "again")
    assert _same_files(tmp_path / "again" / FOLDER, kb_dir)

    reloaded = AutoModelForCausalLM.from_pretrained(saved)
    reloaded.save_pretrained(tmp_path / "copy")
    assert _same_files(tmp_path / "copy" / FOLDER, kb_dir)
    reloaded.save_pretrained(saved)  # into the checkpoint it was loaded from: its files stay as they are
    assert _same_files(saved / FOLDER, kb_dir)


def test_a_knowledge_base_replaced_after_loading_is_not_saved_as_the_loaded_one(consumer, kb_dir, tmp_path):
    shutil.copytree(kb_dir, tmp_path / "kb")
    model = quantize_model(_copy_of(consumer), _scd_config(tmp_path / "kb"))
    SCDKnowledgeBase.load(tmp_path / "kb").save(tmp_path / "kb")  # the same maps, a new save id
    with pytest.raises(KnowledgeBaseError, match="no longer holds the SCD knowledge base this model loaded"):
        model.save_pretrained(tmp_path / "out")


# ---- refusals -------------------------------------------------------------------------------------------------
def test_a_knowledge_base_fitted_for_another_consumer_is_refused_at_load(saved, consumer, stream, tmp_path):
    checkpoint = tmp_path / "mismatched"
    shutil.copytree(saved, checkpoint)
    shutil.rmtree(checkpoint / FOLDER)
    _fitted(_model(1), stream, checkpoint / FOLDER)  # same architecture, other weights
    with pytest.raises(ValueError, match=r"do not work with it \(SCD knowledge base: .*\): This consumer's weights "
                                         r"\(sha256 \w+\) differ from those the knowledge base was fitted for") as error:
        AutoModelForCausalLM.from_pretrained(checkpoint)
    assert isinstance(error.value.__cause__, PairMismatchError)

    _fitted(_model(1, layers=2), stream, tmp_path / "two_layers")
    consumer.save_pretrained(tmp_path / "float")
    with pytest.raises(ValueError, match="The consumer has 3 layers; the knowledge base plans 2") as error:
        AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=_scd_config(tmp_path / "two_layers"))
    assert isinstance(error.value.__cause__, PairMismatchError)


def test_a_missing_or_incomplete_folder_is_a_clear_error(saved, tmp_path):
    checkpoint = tmp_path / "incomplete"
    shutil.copytree(saved, checkpoint)
    (checkpoint / FOLDER / TENSORS_FILE).unlink()
    with pytest.raises(KnowledgeBaseError, match=f"{TENSORS_FILE} does not exist.*hf-kvcodecs scd fit"):
        AutoModelForCausalLM.from_pretrained(checkpoint)
    with pytest.raises(FileNotFoundError, match=f"lacks {TENSORS_FILE}: the SCD knowledge base"):
        check_saved_model(checkpoint)  # before push_to_hub
    shutil.rmtree(checkpoint / FOLDER)
    with pytest.raises(KnowledgeBaseError, match=r"SCD knowledge base of this hf_kvcodecs model \('scd_knowledge_base'\)"
                                                 r" are missing.*scd_knowledge_base/ folder.*`hf-kvcodecs scd fit"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_config_errors_name_the_knowledge_base():
    with pytest.raises(ValueError, match=r"needs kv_cache_config=\{'knowledge_base': DIR\}.*hf-kvcodecs scd fit"):
        KVCodecsConfig(weight_bits=None, kv_cache_implementation="scd")
    with pytest.raises(ValueError, match=r"Unknown kv_cache_config option\(s\) \['bits'\].*\['knowledge_base'\]"):
        KVCodecsConfig(weight_bits=None, kv_cache_implementation="scd", kv_cache_config={"knowledge_base": "d", "bits": 2})


# ---- the Hub --------------------------------------------------------------------------------------------------
@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """A Hub cache that ``hf_hub_download`` reads in offline mode; ``publish`` adds a commit to a repo in it."""
    cache = tmp_path / "hub_cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def publish(repo_id, files):
        """``files``: path in repo -> bytes. Returns the commit hash, which main then points at."""
        commit = hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        for name, data in files.items():
            target = repo / "snapshots" / commit / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        return commit

    return publish


def _files(directory, prefix=""):
    return {f"{prefix}{name}": (directory / name).read_bytes() for name in (METADATA_FILE, TENSORS_FILE)}


def test_the_knowledge_base_downloads_from_the_hub_at_the_weights_commit(kb_dir, offline_hub, tmp_path, monkeypatch):
    commit = offline_hub("someone/kb", _files(kb_dir))
    directory = download_knowledge_base("someone/kb")
    assert directory.name == commit and _same_files(directory, kb_dir)
    # quantizing while loading takes a repo id too
    assert resolve_artifact_dir(SCD_KNOWLEDGE_BASE, "someone/kb", pre_quantized=False, name_or_path=None,
                                checkpoint_files=[]) == directory

    # a consumer saved by hf_kvcodecs: its knowledge base is in scd_knowledge_base/, read at the weights' commit
    first = offline_hub("someone/consumer", {"config.json": b"{}", **_files(kb_dir, f"{FOLDER}/")})
    SCDKnowledgeBase.load(kb_dir).save(tmp_path / "resaved")
    offline_hub("someone/consumer", {"config.json": b"{}", **_files(tmp_path / "resaved", f"{FOLDER}/")})
    weights_elsewhere = tmp_path / "elsewhere" / "snapshots" / first / "model.safetensors"
    pinned = resolve_artifact_dir(SCD_KNOWLEDGE_BASE, FOLDER, pre_quantized=True, name_or_path="someone/consumer",
                                  checkpoint_files=[str(weights_elsewhere)])
    assert pinned.parent.name == first and _same_files(pinned, kb_dir)
    latest = download_knowledge_base("someone/consumer", subfolder=FOLDER)
    assert _same_files(latest, tmp_path / "resaved")

    with pytest.raises(KnowledgeBaseError, match="subfolder='scd_knowledge_base'"):
        download_knowledge_base("someone/consumer")
    with pytest.raises(KnowledgeBaseError, match="not in the Hub cache"):
        download_knowledge_base("someone/never-downloaded")

    def missing_repo(*args, **kwargs):
        response = types.SimpleNamespace(headers={}, request=None, status_code=404)
        raise RepositoryNotFoundError("404 Client Error: Repository Not Found", response=response)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", missing_repo)
    with pytest.raises(KnowledgeBaseError, match="nor a Hub repo this machine can read"):
        download_knowledge_base("someone/private-or-typo")
