"""Codebooks on the Hub by repo id: real ``hf_hub_download`` calls against an offline Hub cache built in a temporary
folder (the Hub is unreachable in tests), and pushes up to the upload call."""

import hashlib
import types

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import RepositoryNotFoundError

from hf_kvcodecs import GSRQCache
from hf_kvcodecs.cli import build_parser, main
from hf_kvcodecs.gsrq.codebooks import METADATA_FILE, TENSORS_FILE, CodebookFileError, GSRQCodebooks
from hf_kvcodecs.gsrq.hub import push_codebooks, resolve_codebooks
from hf_kvcodecs.hub import DEFAULT_MODEL_HUB_ID, looks_like_repo_id, model_hub_id
from hf_kvcodecs.quantization import KV_CODEBOOKS_FOLDER
from hf_kvcodecs.quantization.quantizer import resolve_codebooks_dir


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """A Hub cache that ``hf_hub_download`` reads in offline mode; ``publish`` adds a commit to a repo in it."""
    cache = tmp_path / "hub_cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def publish(repo_id, files, *, branch="main"):
        """``files``: path in repo -> bytes. Returns the commit hash, which ``branch`` then points at."""
        commit = hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        for name, data in files.items():
            target = repo / "snapshots" / commit / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
        return commit

    return publish


def _files(directory, prefix=""):
    return {f"{prefix}{name}": (directory / name).read_bytes() for name in (METADATA_FILE, TENSORS_FILE)}


def _same_codebooks(a: GSRQCodebooks, b: GSRQCodebooks) -> bool:
    return a.config == b.config and all(
        torch.equal(x, y) for left, right in zip(a.key_codecs + a.value_codecs, b.key_codecs + b.value_codecs)
        for x, y in zip(left.state_dict("s").values(), right.state_dict("s").values())
    )


def test_repo_ids_are_told_apart_from_local_paths():
    assert looks_like_repo_id("owner/name") and looks_like_repo_id("name")
    for path in ("./owner/name", "/abs/dir", "~/codebooks", "a/b/c", "owner/name/", "C:\\codebooks"):
        assert not looks_like_repo_id(path), path


def test_codebooks_load_by_repo_id_and_generate_as_from_the_directory(tiny_model, tiny_codebooks_dir, offline_hub):
    offline_hub("someone/tiny-codebooks", _files(tiny_codebooks_dir))
    from_hub = GSRQCodebooks.from_pretrained("someone/tiny-codebooks")
    assert _same_codebooks(from_hub, GSRQCodebooks.load(tiny_codebooks_dir))

    prompt = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    outputs = {}
    for name, source in (("directory", str(tiny_codebooks_dir)), ("hub", "someone/tiny-codebooks")):
        cache_config = {"codebooks": source, "window_length": 4, "flush_interval": 4, "num_sink_tokens": 2}
        outputs[name] = tiny_model.generate(prompt, max_new_tokens=12, do_sample=False, cache_implementation="gsrq",
                                            cache_config=cache_config, pad_token_id=0)
    assert torch.equal(outputs["directory"], outputs["hub"])
    cache = GSRQCache(tiny_model.config, codebooks="someone/tiny-codebooks")
    assert cache.codebooks.fingerprint == from_hub.fingerprint


def test_revision_and_subfolder_select_what_is_read(tiny_model, tiny_codebooks_dir, tiny_per_head_codebooks_dir,
                                                    offline_hub):
    first = offline_hub("someone/cb", _files(tiny_per_head_codebooks_dir))
    offline_hub("someone/cb", _files(tiny_codebooks_dir))  # main moves on to the default layout
    assert GSRQCodebooks.from_pretrained("someone/cb").layout("values") == "given_keys"
    pinned = GSRQCodebooks.from_pretrained("someone/cb", revision=first)
    assert pinned.layout("values") == "per_head"
    assert _same_codebooks(pinned, GSRQCodebooks.load(tiny_per_head_codebooks_dir))
    cache = GSRQCache(tiny_model.config, codebooks="someone/cb", codebooks_revision=first)
    assert cache.codebooks.layout("values") == "per_head"

    # a model saved by hf_kvcodecs keeps its codebooks in kv_codebooks/
    offline_hub("someone/model", {"config.json": b"{}", **_files(tiny_codebooks_dir, f"{KV_CODEBOOKS_FOLDER}/")})
    with pytest.raises(CodebookFileError, match="kv_codebooks"):
        GSRQCodebooks.from_pretrained("someone/model")
    cache = GSRQCache(tiny_model.config, codebooks="someone/model", codebooks_subfolder=KV_CODEBOOKS_FOLDER)
    assert _same_codebooks(cache.codebooks, GSRQCodebooks.load(tiny_codebooks_dir))


def test_hub_errors_say_what_is_wrong(tiny_codebooks_dir, offline_hub, monkeypatch):
    with pytest.raises(CodebookFileError, match="not in the Hub cache"):
        GSRQCodebooks.from_pretrained("someone/never-downloaded")
    with pytest.raises(CodebookFileError, match="does not exist"):  # a path, never looked up on the Hub
        GSRQCache(codebooks="./no/such/codebooks")
    with pytest.raises(ValueError, match="local directory"):
        GSRQCodebooks.from_pretrained(tiny_codebooks_dir, revision="main")
    with pytest.raises(ValueError, match="GSRQCodebooks object"):
        GSRQCache(codebooks=GSRQCodebooks.load(tiny_codebooks_dir), codebooks_revision="main")

    def missing_repo(*args, **kwargs):
        response = types.SimpleNamespace(headers={}, request=None, status_code=404)
        raise RepositoryNotFoundError("404 Client Error: Repository Not Found", response=response)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", missing_repo)
    with pytest.raises(CodebookFileError, match="neither a local GSRQ codebooks directory nor a Hub repo"):
        resolve_codebooks("someone/private-or-typo")


def test_pushed_codebooks_load_back_the_same_with_a_card(tiny_codebooks_dir, fake_hub, offline_hub):
    codebooks = GSRQCodebooks.load(tiny_codebooks_dir)
    assert push_codebooks(tiny_codebooks_dir, "me/tiny-gsrq", base_model="someone/tiny-llama") == "commit"
    assert [repo for repo, _ in fake_hub["create_repo"]] == ["me/tiny-gsrq"]
    (kwargs, files), = fake_hub["upload_folder"]
    assert kwargs["repo_id"] == "me/tiny-gsrq" and set(files) == {METADATA_FILE, TENSORS_FILE, "README.md"}

    card = huggingface_hub.ModelCard(files["README.md"].decode())
    assert card.data.library_name == "hf_kvcodecs" and card.data.base_model == "someone/tiny-llama"
    assert '"codebooks": "me/tiny-gsrq"' in card.text
    assert f"| {codebooks.fingerprint['num_hidden_layers']} | {codebooks.fingerprint['num_key_value_heads']} |" in card.text
    assert "random token ids (unit test, not an evaluation)" in card.text  # the calibration text is named

    offline_hub("me/tiny-gsrq", files)
    assert _same_codebooks(GSRQCodebooks.from_pretrained("me/tiny-gsrq"), codebooks)
    # the same from the object, and a corrupt directory is refused before anything is sent
    codebooks.push_to_hub("me/again")
    assert fake_hub["upload_folder"][-1][0]["repo_id"] == "me/again"
    with pytest.raises(CodebookFileError):
        push_codebooks(tiny_codebooks_dir.parent / "not-codebooks", "me/broken")
    assert len(fake_hub["upload_folder"]) == 2


def test_push_codebooks_command(tiny_codebooks_dir, fake_hub, capsys):
    assert main(["push-codebooks", str(tiny_codebooks_dir), "me/cli-gsrq", "--base-model", "someone/m", "--private"]) == 0
    (repo, options), = fake_hub["create_repo"]
    assert repo == "me/cli-gsrq" and options["private"] is True
    assert "pushed" in capsys.readouterr().out


def test_quantizing_while_loading_takes_codebooks_by_repo_id(tiny_codebooks_dir, offline_hub):
    commit = offline_hub("someone/cb", _files(tiny_codebooks_dir))
    directory = resolve_codebooks_dir("someone/cb", pre_quantized=False, name_or_path=None, checkpoint_files=[])
    assert directory.name == commit and (directory / METADATA_FILE).is_file()


def test_the_card_links_the_model_a_command_was_given(tmp_path):
    assert model_hub_id("default") == DEFAULT_MODEL_HUB_ID
    assert model_hub_id("owner/name") == "owner/name"
    assert model_hub_id(str(tmp_path)) is None and model_hub_id("a/b/c") is None
    args = build_parser().parse_args(["calibrate", "--out", str(tmp_path), "--push-to-hub", "me/cb", "--private"])
    assert args.push_to_hub == "me/cb" and args.private is True and args.token is None
