"""GSRQ's codebooks as the KV artifact a compressed checkpoint carries (``kv_cache_implementation="gsrq"``).

Registered from ``hf_kvcodecs.gsrq``'s ``__init__``; the registry and what the quantizer does with an entry are in
:mod:`hf_kvcodecs.integrations.kv_artifacts`.
"""

from __future__ import annotations

from ..integrations.kv_artifacts import KVArtifact
from .cache import CACHE_CONFIG_KEYS, GSRQCache, load_codebooks
from .codebooks import METADATA_FILE, TENSORS_FILE, CodebookFileError
from .hub import download_codebooks


def _check_gsrq_codebooks(model, codebooks, **options) -> None:
    # building one cache checks the codebooks against the model config and every option
    GSRQCache(model.config.get_text_config(decoder=True), codebooks=codebooks, **options)


GSRQ_CODEBOOKS = KVArtifact(
    cache_implementation="gsrq",
    description="KV codebooks",
    folder="kv_codebooks",
    location_key="codebooks",
    files=(METADATA_FILE, TENSORS_FILE),
    # generate() supplies the model config; a checkpoint carries its own codebooks, so no Hub revision or subfolder
    cache_options=tuple(key for key in CACHE_CONFIG_KEYS
                        if key not in ("config", "codebooks_revision", "codebooks_subfolder", "rope_inv_freq")),
    load=load_codebooks,
    check=_check_gsrq_codebooks,
    download=download_codebooks,
    made_with="`hf-kvcodecs calibrate --model <model> --out DIR`",
    file_error=CodebookFileError,
)
