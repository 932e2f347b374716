"""Hugging Face Hub helpers every method shares: what a Hub id looks like, the default model's Hub id, downloading a
method's artifact files (codebooks, knowledge bases) with errors that say what to do, the card templates shipped in
``model_cards/`` and the library versions a card or report records."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.resources
import platform
from pathlib import Path

from .models import DEFAULT_MODEL_NAME

# Hub id of the model the default GGUF was converted from (the card's base_model links to it).
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_LICENSE = "apache-2.0"
VERSIONED_PACKAGES = ("hf-kvcodecs", "transformers", "torch", "huggingface_hub", "safetensors", "tokenizers")


def looks_like_repo_id(source: str) -> bool:
    """Whether ``source`` can name a Hub repository (``name`` or ``owner/name``) rather than only a local path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if source.startswith((".", "/", "~")) or "\\" in source:
        return False
    try:
        validate_repo_id(source)
    except HFValidationError:
        return False
    return True


def is_owner_name(source: str) -> bool:
    """Whether ``source`` has the form of a Hub repo id ``owner/name`` (what a pushed artifact is named by); a bare
    ``name`` is not looked up on the Hub."""
    return source.count("/") == 1 and looks_like_repo_id(source)


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """None when the Hub endpoint answers within ``timeout`` seconds; else why it cannot be reached (offline mode, or
    the connection error), found in one request instead of the minute of retries a download spends on it."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as error:  # the HTTP client's own transport errors: DNS, refused connection, timeout, proxy
        return f"{constants.ENDPOINT} did not answer: {error}"
    return None


@dataclasses.dataclass(frozen=True)
class HubArtifactKind:
    """What one method's artifact looks like in a Hub repo, so that a failed download says what to do."""

    name: str  # as the errors name it, e.g. "GSRQ codebooks"
    files: tuple[str, ...]  # the files one artifact is, read from one snapshot
    error: type[Exception]  # the method's own error for unusable artifact files
    made_by: str  # the command that writes the files, e.g. "`hf-kvcodecs calibrate --out DIR`"
    saved_model_hint: str = ""  # where a model saved by hf_kvcodecs keeps this artifact (said when no subfolder)


def download_artifact(kind: HubArtifactKind, repo_id: str, *, revision: str | None = None,
                      subfolder: str | None = None, token: str | bool | None = None,
                      cache_dir: str | Path | None = None, local_files_only: bool = False,
                      not_found_locally: str = "") -> Path:
    """The local directory (in the Hub cache) holding ``kind``'s files from Hub repo ``repo_id``.

    When the Hub cannot be reached (offline mode, no network), only the Hub cache is looked in, so a missing artifact
    fails at once instead of after a minute of retries. ``not_found_locally``: where the caller looked first, said at
    the start of the error when the files are not in the cache either.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if not is_owner_name(repo_id):
        raise kind.error(f"{repo_id!r} is not a Hub repo id of the form owner/name, so no {kind.name} can be "
                         f"downloaded from it. Pass a local directory written by {kind.made_by}.")
    where = f"{repo_id}" + (f"/{subfolder}" if subfolder else "") + (f" at revision {revision}" if revision else "")
    hint = "" if subfolder else kind.saved_model_hint
    unreachable = None if local_files_only else hub_unreachable()
    if unreachable:  # its cache may still hold them
        local_files_only = True
    paths = []
    for name in kind.files:
        try:
            paths.append(Path(hf_hub_download(repo_id, filename=f"{subfolder}/{name}" if subfolder else name,
                                              revision=revision, token=token, cache_dir=cache_dir,
                                              local_files_only=local_files_only)))
        except LocalEntryNotFoundError as error:  # before EntryNotFoundError, which it subclasses
            why = f"the Hub could not be reached ({unreachable})" if unreachable else "they could not be downloaded"
            lead = f"{not_found_locally}; " if not_found_locally else ""
            raise kind.error(
                f"{lead}{kind.name} from the Hub ({where}): not in the Hub cache, and {why}. Download them once with "
                "network access, or pass a local directory." + hint
            ) from error
        except GatedRepoError as error:  # before RepositoryNotFoundError, which it subclasses
            raise kind.error(f"The Hub repo {repo_id} is gated: accept its terms on the Hub and log in "
                             f"(`hf auth login`) to download its {kind.name} ({error}).") from error
        except RepositoryNotFoundError as error:
            raise kind.error(
                f"{repo_id!r} is neither a local {kind.name} directory nor a Hub repo this machine can read (private "
                f"repos need `hf auth login` or token=...). Pass a directory written by {kind.made_by} or the id of a "
                "repo that holds one."
            ) from error
        except RevisionNotFoundError as error:
            raise kind.error(f"The Hub repo {repo_id} has no revision {revision!r}.") from error
        except EntryNotFoundError as error:
            raise kind.error(
                f"The Hub repo {where} has no {name}: it does not hold {kind.name} there. They are the files "
                f"{kind.made_by} writes ({', '.join(kind.files)})." + hint
            ) from error
    if len({path.parent for path in paths}) != 1:  # every file of one snapshot, so they were saved together
        raise kind.error(f"The {kind.name} files of {where} resolved to different folders: {paths}.")
    return paths[0].parent


def model_hub_id(name: str) -> str | None:
    """The Hub id of the model a command was given: the repo the default GGUF was converted from, or ``owner/name``
    that is not a local path; ``None`` for a local folder."""
    if name == DEFAULT_MODEL_NAME:
        return DEFAULT_MODEL_HUB_ID
    return name if name.count("/") == 1 and not Path(name).exists() else None


def templates_dir() -> Path:
    """The card templates: the repository's top-level ``model_cards/``, installed as ``hf_kvcodecs.model_cards``."""
    return Path(str(importlib.resources.files("hf_kvcodecs.model_cards")))


def library_versions() -> dict[str, str | None]:
    versions = {}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package.replace("-", "_")] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package.replace("-", "_")] = None
    versions["python"] = platform.python_version()
    return versions

