"""Model cards for compressed models and pushing a saved model folder to the Hugging Face Hub.

A folder written by ``hf-kvcodecs compress`` holds ``hf_kvcodecs_compression.json``: what was compressed, how, the
evaluation measured in that run and the command that reproduces it. :func:`model_card` renders it through a
template in ``model_cards/`` into a ``huggingface_hub.ModelCard``; :func:`push_compressed_model` checks that the
folder is complete and uploads it as one commit.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..hub import templates_dir
from .config import QUANT_METHOD
from .kv_artifacts import kv_artifact

logger = logging.getLogger(__name__)

REPORT_FILE = "hf_kvcodecs_compression.json"
REPORT_FORMAT = "hf_kvcodecs.compression_report"
REPORT_FORMAT_VERSION = 1
DEFAULT_TEMPLATE = "compressed_model.md"
MISSING = "–"


def read_report(directory: str | Path) -> dict:
    path = Path(directory) / REPORT_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: the folder was not written by `hf-kvcodecs compress`, so there is nothing to "
            "build a model card from. Pass report=... explicitly or write README.md yourself."
        )
    report = json.loads(path.read_text(encoding="utf-8"))
    if report.get("format") != REPORT_FORMAT or report.get("format_version") != REPORT_FORMAT_VERSION:
        raise ValueError(
            f"{path} is not a compression report this hf_kvcodecs can read (format={report.get('format')!r}, "
            f"version={report.get('format_version')!r}); upgrade hf_kvcodecs."
        )
    return report


def model_card(report: dict, *, repo_id: str | None = None, template: str | Path | None = None):
    """A ``huggingface_hub.ModelCard`` for the compressed model described by ``report``."""
    from huggingface_hub import ModelCard, ModelCardData

    template_path = Path(template) if template is not None else templates_dir() / DEFAULT_TEMPLATE
    if not template_path.is_file():
        raise FileNotFoundError(
            f"Model card template {template_path} not found. It ships in the model_cards/ folder of the hf_kvcodecs "
            "source tree; pass template=PATH to use your own."
        )
    model = report["model"]
    weights, kv = report.get("weights"), report.get("kv_cache")
    tags = ["hf_kvcodecs", "quantized"]
    if weights:
        tags.append(f"{weights['bits']}-bit")
    if kv:
        tags += ["kv-cache-compression", "gsrq"]
    card_data = ModelCardData(
        base_model=model.get("hub_id"),
        library_name="transformers",
        pipeline_tag="text-generation",
        license=model.get("license"),
        tags=tags,
        model_name=_model_name(report),
        base_model_relation="quantized" if model.get("hub_id") else None,
    )
    versions = report["environment"]["versions"]
    return ModelCard.from_template(
        card_data,
        template_path=str(template_path),
        model_name=_model_name(report),
        repo_id=repo_id or "<namespace>/<repository>",
        base_description=_base_description(model),
        weights=_weights_section(weights),
        kv=_kv_section(kv),
        evaluation=_evaluation_section(report["evaluation"]),
        commands=report["commands"],
        versions=versions,
        versions_line=", ".join(f"{name} {version}" for name, version in versions.items() if version),
    )


def write_model_card(directory: str | Path, report: dict | None = None, *, repo_id: str | None = None,
                     template: str | Path | None = None) -> Path:
    """Render the card of the compressed model saved in ``directory`` into ``directory/README.md``."""
    directory = Path(directory)
    card = model_card(report if report is not None else read_report(directory), repo_id=repo_id, template=template)
    path = directory / "README.md"
    card.save(path)
    return path


def push_compressed_model(directory: str | Path, repo_id: str, *, token: str | None = None, private: bool | None = None,
                          commit_message: str | None = None, revision: str | None = None, create_pr: bool = False):
    """Upload a saved compressed model folder to ``repo_id`` as one commit (the card is rendered for that repo).

    The folder must hold what ``from_pretrained`` needs: ``config.json`` with an hf_kvcodecs ``quantization_config``,
    the weights and, when the config names a KV cache, its codebooks. Returns the commit info of the upload.
    """
    from huggingface_hub import HfApi

    directory = Path(directory)
    check_saved_model(directory)
    if (directory / REPORT_FILE).is_file():
        write_model_card(directory, repo_id=repo_id)
    elif not (directory / "README.md").is_file():
        logger.warning("%s has no %s and no README.md: the repository will have no model card.", directory, REPORT_FILE)
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
    return api.upload_folder(
        folder_path=str(directory), repo_id=repo_id, repo_type="model", revision=revision, create_pr=create_pr,
        commit_message=commit_message or "Upload model compressed with hf_kvcodecs",
    )


def check_saved_model(directory: Path) -> dict:
    """The ``quantization_config`` of a saved hf_kvcodecs model folder; a clear error if something is missing."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} holds no config.json: save the model there with model.save_pretrained first.")
    quantization = json.loads(config_path.read_text(encoding="utf-8")).get("quantization_config") or {}
    if quantization.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"{config_path} has no hf_kvcodecs quantization_config; this is not a model saved by hf_kvcodecs.")
    if not any(directory.glob("*.safetensors")):
        raise FileNotFoundError(f"{directory} holds no *.safetensors weights.")
    if quantization.get("kv_cache_implementation"):
        kind = kv_artifact(quantization["kv_cache_implementation"])
        folder = directory / quantization["kv_cache_config"][kind.location_key]
        missing = [name for name in kind.files if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{folder} lacks {', '.join(missing)}: the {kind.description} this model needs would not be uploaded. "
                "Save the model with model.save_pretrained (with hf_kvcodecs imported) to write them."
            )
    return quantization


# ---- card sections ------------------------------------------------------------------------------------------------
def _model_name(report: dict) -> str:
    model = report["model"]
    base = (model.get("hub_id") or model["name"]).rstrip("/").split("/")[-1]
    parts = [base]
    if report.get("weights"):
        parts.append(f"W{report['weights']['bits']}g{report['weights']['group_size']}")
    if report.get("kv_cache"):
        parts.append(f"GSRQ-KV{report['kv_cache']['bits']:g}")
    return "-".join(parts) + "-hf_kvcodecs"


def _base_description(model: dict) -> str:
    if model.get("hub_id"):
        return f"[{model['hub_id']}](https://huggingface.co/{model['hub_id']}) ({model['description']})"
    return model["description"]


def _weights_section(weights: dict | None) -> dict | None:
    if not weights:
        return None
    return {**weights, "method": weights.get("method", "round-to-nearest")}


def _kv_section(kv: dict | None) -> dict | None:
    if not kv:
        return None
    calibration = kv["calibration"]
    return {
        **kv,
        "bits": f"{kv['bits']:g}",
        "calibration_text": calibration["text"],
        "calibration_tokens": calibration["tokens"],
        "calibration_seconds": calibration["seconds"],
        "holdout_keys_mse": calibration["holdout_keys_relative_mse"],
        "holdout_values_mse": calibration["holdout_values_relative_mse"],
    }


def _evaluation_section(evaluation: dict) -> dict:
    protocol = evaluation["protocol"]
    rows = []
    for row in evaluation["rows"]:
        rows.append({
            "name": row["name"],
            "size": _size(row.get("bytes")),
            "perplexity": _number(row.get("perplexity"), ".3f"),
            "delta": "baseline" if row.get("is_reference") else _delta(row.get("delta_ppl_pct"), row.get("delta_ppl_pct_se")),
            "kl": "0" if row.get("is_reference") else _number(row.get("kl_mean"), ".4f"),
            "top1": "1" if row.get("is_reference") else _number(row.get("top1_agreement"), ".3f"),
        })
    return {
        "text": evaluation["text"]["description"],
        "windows": protocol["windows"],
        "protocol": (
            f"{protocol['windows']} windows; each prefills {protocol['context_tokens']} tokens into the KV cache and then "
            f"decodes {protocol['decoded_tokens']} tokens one at a time (teacher-forced), scoring only the decoded "
            "tokens, so that the compressed cache is what they attend to. Δ perplexity ± the standard error of the "
            "paired per-window differences."
        ),
        "rows": rows,
        "size_note": evaluation.get("size_note", ""),
    }


def _number(value, spec: str) -> str:
    return MISSING if value is None else format(value, spec)


def _delta(value, error) -> str:
    if value is None:
        return MISSING
    return f"{value:+.2f}%" + ("" if error is None else f" ± {error:.2f}")


def _size(size_bytes) -> str:
    if size_bytes is None:
        return MISSING
    return f"{size_bytes / 2**20:.1f} MiB" if size_bytes >= 2**20 else f"{size_bytes / 2**10:.1f} KiB"
