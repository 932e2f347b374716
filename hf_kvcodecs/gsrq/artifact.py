"""GSRQ's codebooks as the KV artifact a compressed checkpoint carries (``kv_cache_implementation="gsrq"``).

Registered from ``hf_kvcodecs.gsrq``'s ``__init__``; the registry and what the quantizer does with an entry are in
:mod:`hf_kvcodecs.integrations.kv_artifacts`.
"""

from __future__ import annotations

from ..integrations.kv_artifacts import KVArtifact
from .cache import GSRQCache
from .codebooks import METADATA_FILE, TENSORS_FILE, CodebookFileError
from .config import GSRQCacheConfig
from .hub import download_codebooks
from .loading import load_codebooks


def _check_gsrq_codebooks(model, codebooks, **options) -> None:
    # building one cache checks the codebooks against the model config and every option
    GSRQCache(model.config.get_text_config(decoder=True), codebooks=codebooks, **options)


GSRQ_CODEBOOKS = KVArtifact(
    cache_implementation="gsrq",
    description="KV codebooks",
    folder="kv_codebooks",
    location_key="codebooks",
    files=(METADATA_FILE, TENSORS_FILE),
    # generate() supplies the model config and its RoPE frequencies; a checkpoint carries its own codebooks, so no Hub
    # revision or subfolder
    cache_options=GSRQCacheConfig.option_names(checkpoint=True),
    load=load_codebooks,
    check=_check_gsrq_codebooks,
    download=download_codebooks,
    made_with="`hf-kvcodecs calibrate --model <model> --out DIR`",
    file_error=CodebookFileError,
)
