"""SCD knowledge bases on the Hugging Face Hub: fetch the two files of one from a repo, or from a folder of it such as
the ``scd_knowledge_base/`` folder of a consumer saved by hf_kvcodecs.

A knowledge base is fitted once per (producer, consumer) pair and every machine that runs the consumer needs it.
Downloads go through ``huggingface_hub``'s cache, so they work offline once fetched (``HF_HUB_OFFLINE=1``) and a
commit hash pins them.
"""

from __future__ import annotations

from pathlib import Path

from .knowledge_base import METADATA_FILE, TENSORS_FILE, KnowledgeBaseError

KNOWLEDGE_BASE_FILES = (METADATA_FILE, TENSORS_FILE)
# Where a consumer saved by hf_kvcodecs keeps its knowledge base, relative to the checkpoint (named here so the hint
# below and the quantizer that writes the folder cannot drift apart).
SAVED_MODEL_FOLDER = "scd_knowledge_base"
_SAVED_MODEL_HINT = (f" If the repo holds a consumer saved by hf_kvcodecs, its knowledge base is in its "
                     f"{SAVED_MODEL_FOLDER}/ folder: pass subfolder={SAVED_MODEL_FOLDER!r}.")


def download_knowledge_base(repo_id: str, *, revision: str | None = None, subfolder: str | None = None,
                            token: str | bool | None = None, cache_dir: str | Path | None = None,
                            local_files_only: bool = False) -> Path:
    """The local directory holding the knowledge base files of Hub repo ``repo_id`` (downloaded into the Hub cache)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f"/{subfolder}" if subfolder else "") + (f" at revision {revision}" if revision else "")
    hint = "" if subfolder else _SAVED_MODEL_HINT
    paths = []
    for name in KNOWLEDGE_BASE_FILES:
        try:
            paths.append(Path(hf_hub_download(repo_id, filename=f"{subfolder}/{name}" if subfolder else name,
                                              revision=revision, token=token, cache_dir=cache_dir,
                                              local_files_only=local_files_only)))
        except LocalEntryNotFoundError as error:  # before EntryNotFoundError, which it subclasses
            raise KnowledgeBaseError(
                f"The SCD knowledge base of {where} is not in the Hub cache and could not be downloaded (offline?). "
                "Download it once with network access, or pass a local directory." + hint
            ) from error
        except GatedRepoError as error:  # before RepositoryNotFoundError, which it subclasses
            raise KnowledgeBaseError(f"The Hub repo {repo_id} is gated: accept its terms on the Hub and log in "
                                     f"(`hf auth login`) to download its SCD knowledge base ({error}).") from error
        except RepositoryNotFoundError as error:
            raise KnowledgeBaseError(
                f"{repo_id!r} is not a Hub repo this machine can read (private repos need `hf auth login` or "
                "token=...). Pass a directory written by `hf-kvcodecs scd fit --out DIR` or the id of a repo that "
                "holds one."
            ) from error
        except RevisionNotFoundError as error:
            raise KnowledgeBaseError(f"The Hub repo {repo_id} has no revision {revision!r}.") from error
        except EntryNotFoundError as error:
            raise KnowledgeBaseError(
                f"The Hub repo {where} has no {name}: it does not hold an SCD knowledge base there. A knowledge base "
                f"is the two files `hf-kvcodecs scd fit` writes ({', '.join(KNOWLEDGE_BASE_FILES)})." + hint
            ) from error
    if len({path.parent for path in paths}) != 1:  # both files of one snapshot, so they were saved together
        raise KnowledgeBaseError(f"The knowledge base files of {where} resolved to different folders: {paths}.")
    return paths[0].parent
