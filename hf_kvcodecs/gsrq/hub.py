"""GSRQ codebooks on the Hugging Face Hub, apart from any model: load them by repo id, push a calibrated directory.

Codebooks fitted once for a model are useful to everyone who runs that model, and calibrating takes minutes. A Hub
repository holding the two files ``hf-kvcodecs calibrate`` writes (plus a card) lets a user skip that:
``generate(..., cache_implementation="gsrq", cache_config={"codebooks": "owner/name"})``. Downloads go through
``huggingface_hub``'s cache, so they work offline once fetched (``HF_HUB_OFFLINE=1``) and a commit hash pins them.
A name is looked for as a local folder first; only an ``owner/name`` id is then looked up on the Hub, and when the Hub
cannot be reached (offline mode, no network) only in its cache, so a missing name fails at once, not after retries.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..hub import HubArtifactKind, download_artifact, is_owner_name, library_versions, templates_dir
from .codebooks import METADATA_FILE, TENSORS_FILE, CodebookFileError, GSRQCodebooks

CODEBOOK_CARD_TEMPLATE = "gsrq_codebooks.md"
CODEBOOK_FILES = (METADATA_FILE, TENSORS_FILE)
_SAVED_MODEL_HINT = (" If the repo holds a model saved by hf_kvcodecs, its codebooks are in its kv_codebooks/ folder: "
                     "pass subfolder='kv_codebooks' (cache_config key 'codebooks_subfolder').")


CODEBOOKS_ON_THE_HUB = HubArtifactKind(
    name="GSRQ codebooks", files=CODEBOOK_FILES, error=CodebookFileError,
    made_by="`hf-kvcodecs calibrate --out DIR` (pushed with `hf-kvcodecs push-codebooks`)",
    saved_model_hint=_SAVED_MODEL_HINT)


def download_codebooks(repo_id: str, *, revision: str | None = None, subfolder: str | None = None,
                       token: str | bool | None = None, cache_dir: str | Path | None = None,
                       local_files_only: bool = False) -> Path:
    """The local directory holding the codebook files of Hub repo ``repo_id`` (downloaded into the Hub cache)."""
    if not is_owner_name(repo_id):
        raise CodebookFileError(_not_found(repo_id) + " and is not a Hub repo id of the form owner/name.")
    return download_artifact(CODEBOOKS_ON_THE_HUB, repo_id, revision=revision, subfolder=subfolder, token=token,
                             cache_dir=cache_dir, local_files_only=local_files_only,
                             not_found_locally=_not_found(repo_id))


def resolve_codebooks(source: str | Path, *, revision: str | None = None, subfolder: str | None = None,
                      token: str | bool | None = None) -> Path:
    """A local codebook directory for ``source``: an existing directory, else a Hub repo id (downloaded)."""
    if isinstance(source, str) and not source.strip():
        raise ValueError("codebooks is an empty string; pass a directory written by `hf-kvcodecs calibrate --out DIR` "
                         "or a Hub repo id (owner/name).")
    path = Path(source).expanduser()
    if path.is_file():
        raise CodebookFileError(f"{source} is a file; pass the directory that holds the codebook files "
                                f"({path.parent}).")
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} was given, but {source} is a local directory; drop the revision "
                             "or pass a Hub repo id.")
        return path / subfolder if subfolder else path
    if isinstance(source, str) and is_owner_name(source):
        return download_codebooks(source, revision=revision, subfolder=subfolder, token=token)
    raise CodebookFileError(
        _not_found(source) + ", and it is not a Hub repo id (owner/name), so the Hub was not asked. Pass a directory "
        "written by `hf-kvcodecs calibrate --out DIR` or the owner/name id of codebooks pushed to the Hub."
    )


def _not_found(source) -> str:
    """The start of the error for a codebook name found nowhere: where it was looked for locally."""
    path = Path(source).expanduser()
    return f"{source} does not exist: no local folder {path if path.is_absolute() else path.absolute()}"


def codebook_card(codebooks: GSRQCodebooks, *, repo_id: str | None = None, base_model: str | None = None,
                  template: str | Path | None = None):
    """A ``huggingface_hub.ModelCard`` describing ``codebooks``: the model they fit, how and on what they were fitted."""
    from huggingface_hub import ModelCard, ModelCardData


    template_path = Path(template) if template is not None else templates_dir() / CODEBOOK_CARD_TEMPLATE
    if not template_path.is_file():
        raise FileNotFoundError(f"Codebook card template {template_path} not found; pass template=PATH.")
    config, calibration = codebooks.config, codebooks.calibration
    versions = library_versions()
    card_data = ModelCardData(base_model=base_model, library_name="hf_kvcodecs", tags=["hf_kvcodecs", "gsrq",
                              "kv-cache-compression", "vector-quantization"])
    holdout = calibration.get("holdout_mean", {})
    return ModelCard.from_template(
        card_data,
        template_path=str(template_path),
        repo_id=repo_id or "<namespace>/<repository>",
        base_model=base_model,
        fingerprint=codebooks.fingerprint,
        config=config,
        key_layout=codebooks.layout("keys"),
        value_layout=codebooks.layout("values"),
        max_bits=codebooks.max_bits_per_element(),
        text=(calibration.get("text") or {}).get("description", "not recorded"),
        tokens=calibration.get("tokens_seen"),
        seconds=calibration.get("seconds_total"),
        holdout_keys=holdout.get("keys_relative_mse"),
        holdout_values=holdout.get("values_relative_mse"),
        versions=versions,
        versions_line=", ".join(f"{name} {version}" for name, version in versions.items() if version),
    )


def push_codebooks(source: GSRQCodebooks | str | Path, repo_id: str, *, base_model: str | None = None,
                   token: str | None = None, private: bool | None = None, revision: str | None = None,
                   create_pr: bool = False, commit_message: str | None = None):
    """Upload codebooks (a ``GSRQCodebooks`` or a directory holding them) and a card to ``repo_id`` as one commit.

    The codebooks are loaded first, so a corrupt or incomplete directory fails here, not on its users' machines.
    Returns the commit info of the upload.
    """
    from huggingface_hub import HfApi

    codebooks = source if isinstance(source, GSRQCodebooks) else GSRQCodebooks.load(Path(source).expanduser())
    api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="hf_kvcodecs_codebooks_") as staging:
        staging = Path(staging)
        codebooks.save(staging)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
        codebook_card(codebooks, repo_id=repo_id, base_model=base_model).save(staging / "README.md")
        return api.upload_folder(
            folder_path=str(staging), repo_id=repo_id, repo_type="model", revision=revision, create_pr=create_pr,
            commit_message=commit_message or "Upload GSRQ KV-cache codebooks (hf_kvcodecs)",
        )
