"""The transformers ``HfQuantizer`` of hf_kvcodecs, and the KV artifacts (GSRQ codebooks, an SCD knowledge base)
that travel with a quantized model.

Loading (``from_pretrained``) runs, in transformers 5.24:
``_process_model_before_weight_loading`` (swap ``nn.Linear`` for empty quantized modules on the meta device) →
weights load (a float checkpoint goes through :class:`QuantizeOnLoad`; a quantized one loads its packed tensors
directly) → ``generation_config.json`` is read → ``_process_model_after_weight_loading`` (find and check the KV
artifact, make its cache (GSRQ, SCD) the default cache of ``generate()``).

Saving: transformers' ``save_pretrained`` only writes config, generation config and weights, so a model with a KV
artifact (``kv_artifacts``: GSRQ's codebooks, SCD's knowledge base) gets an instance-level ``save_pretrained``
(``integrations.loading.install_save_extension``) that also writes it to its folder (``kv_codebooks/``,
``scd_knowledge_base/``: safetensors + JSON) and stores that relative location in ``config.json`` and
``generation_config.json``. ``push_to_hub`` and ``Trainer`` checkpoints call ``save_pretrained``, so the artifact
travels with every copy of the model.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import weakref
from pathlib import Path, PurePosixPath

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer

from ..codecs.weight_quantization import SCALE_DTYPES, quantize_weight
from ..gsrq.codebooks import GSRQCodebooks
from ..hub import looks_like_repo_id
from ..integrations.loading import (
    install_save_extension,
    keep_in_fp32_modules,
    loaded_from,
    remove_save_extension,
    was_loaded_from_checkpoint,
)
from .config import QUANT_METHOD, KVCodecsConfig
from .kv_artifacts import GSRQ_CODEBOOKS, KVArtifact, kv_artifact
from .modules import (
    QUANTIZED_LINEAR_TYPES,
    FakeQuantLinear,
    activation_quantized_layers,
    empty_quantized_linear,
    initial_weight_grid,
    linear_layers_to_convert,
    quantized_from_linear,
)

logger = logging.getLogger(__name__)


class QuantizeOnLoad(ConversionOps):
    """Turns a float checkpoint weight into the tensors of the quantized module that replaced its ``nn.Linear``."""

    def __init__(self, hf_quantizer: KVCodecsHfQuantizer):
        self.hf_quantizer = hf_quantizer

    @torch.no_grad()
    def convert(self, input_dict, *args, model=None, **kwargs):
        if len(input_dict) != 1:
            raise ValueError(f"hf_kvcodecs quantizes one weight at a time, got {sorted(input_dict)}.")
        (key, value), = input_dict.items()
        weight = value[0] if isinstance(value, list) else value
        module_name = key.rsplit(".", 1)[0]
        module = model.get_submodule(module_name)
        config = self.hf_quantizer.quantization_config
        if isinstance(module, FakeQuantLinear):
            scale, offset = initial_weight_grid(weight, bits=config.weight_bits, group_size=config.group_size,
                                                symmetric=config.symmetric, weight_init=config.weight_init,
                                                zero_point=config.zero_point,
                                                scale_dtype=SCALE_DTYPES[config.scale_dtype])
            dtype = module.weight.dtype
            tensors = {"weight": weight.to(dtype), "weight_scale": scale.clamp_min(torch.finfo(dtype).tiny).to(dtype)}
            if offset is not None:
                tensors["weight_offset"] = offset.to(dtype)
        else:
            quantized = quantize_weight(weight, config.weight_bits, config.group_size, symmetric=config.symmetric,
                                        scale_dtype=SCALE_DTYPES[config.scale_dtype], zero_point=config.zero_point)
            tensors = {"weight": quantized.packed, "weight_scale": quantized.scale}
            if quantized.offset is not None:
                tensors["weight_offset"] = quantized.offset
        return {f"{module_name}.{name}": tensor for name, tensor in tensors.items()}


class KVCodecsHfQuantizer(HfQuantizer):
    """Quantizer behind ``quant_method="hf_kvcodecs"``: packed or fake-quant weights, plus a default KV cache whose
    fitted artifact (GSRQ codebooks, SCD knowledge base) travels with the checkpoint."""

    requires_calibration = False

    def __init__(self, quantization_config: KVCodecsConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.modules_to_not_convert: list[str] = []
        self.checkpoint_files: list[str] = []
        # the loaded artifact of the config's kv_cache_implementation (GSRQCodebooks, SCDKnowledgeBase)
        self.kv_artifact = None
        self.kv_artifact_dir: Path | None = None  # local, absolute; what generation_config.cache_config points to

    # ---- capabilities -------------------------------------------------------------------------------------------
    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        # Packed int32 codes have no gradient; fake-quant weights (and unquantized ones) train with the STE.
        return self.quantization_config.mode == "fake" or not self.quantization_config.quantizes_weights

    @property
    def is_qat_trainable(self) -> bool:
        return self.is_trainable

    @property
    def quantized_element_size(self) -> float | None:
        config = self.quantization_config
        return config.weight_bits / 8 if config.quantizes_weights and config.mode == "packed" else None

    # ---- loading ------------------------------------------------------------------------------------------------
    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized or not self.quantization_config.quantizes_weights:
            return False
        module_name, _, tensor_name = param_name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            return False
        return tensor_name == "weight" and isinstance(module, QUANTIZED_LINEAR_TYPES)

    def get_quantize_ops(self):
        return QuantizeOnLoad(self)

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        self.checkpoint_files = list(checkpoint_files or [])
        config = self.quantization_config
        if not config.quantizes_weights:
            return model
        self.modules_to_not_convert = self.get_modules_to_not_convert(
            model, config.modules_to_not_convert, keep_in_fp32_modules(model)
        )
        names = linear_layers_to_convert(model, config, self.modules_to_not_convert)
        with_inputs = activation_quantized_layers(names, config.activation_modules) if config.activation_bits else ()
        for name in names:
            model.set_submodule(name, empty_quantized_linear(model.get_submodule(name), config,
                                                             quantize_input=name in with_inputs))
        if not names:
            logger.warning("hf_kvcodecs: no nn.Linear layer matched for quantization; the weights stay in floating point.")
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.pre_quantized and self.quantization_config.quantizes_weights:
            _check_quantized_tensors_loaded(model)
        if self.quantization_config.kv_cache_implementation is not None:
            self.activate_kv_cache(model)
        return model

    def get_state_dict_and_metadata(self, model):
        # Written into the safetensors header, so the file says what it holds even without config.json.
        return None, {"quant_method": QUANT_METHOD,
                      "hf_kvcodecs_format_version": str(self.quantization_config.to_dict()["format_version"])}

    # ---- KV cache -------------------------------------------------------------------------------------------------
    @property
    def kv_artifact_kind(self) -> KVArtifact | None:
        implementation = self.quantization_config.kv_cache_implementation
        return None if implementation is None else kv_artifact(implementation)

    def activate_kv_cache(self, model, *, override: bool = False) -> None:
        """Load and check the KV artifact named in the config and make its cache ``generate()``'s default.

        The model's generation config keeps a cache implementation set by the user or the checkpoint, unless it is
        already this one with this artifact or ``override`` is set.
        """
        kind = self.kv_artifact_kind
        config = self.quantization_config
        location = config.kv_cache_config[kind.location_key]
        directory = resolve_artifact_dir(kind, location, pre_quantized=self.pre_quantized,
                                         name_or_path=loaded_from(model.config),
                                         checkpoint_files=self.checkpoint_files)
        artifact = kind.load(directory)
        options = {key: value for key, value in config.kv_cache_config.items() if key != kind.location_key}
        try:  # at load time, not at the first generate()
            kind.check(model, artifact, **options)
        except ValueError as error:
            raise ValueError(
                f"The KV cache settings of this hf_kvcodecs model do not work with it ({kind.description}: "
                f"{directory}): {error}"
            ) from error
        self.kv_artifact, self.kv_artifact_dir = artifact, directory
        if model.can_generate():
            _point_generation_config_at(kind, model.generation_config, location, directory, options, override)
        install_save_extension(model, _KVArtifactSaving())

    def deactivate_kv_cache(self, model) -> None:
        kind = self.kv_artifact_kind
        generation_config = getattr(model, "generation_config", None)
        if kind is not None and generation_config is not None and _names_artifact(
                kind, generation_config, self.kv_artifact_dir):
            generation_config.cache_implementation = None
            generation_config.cache_config = None
        self.kv_artifact = self.kv_artifact_dir = None
        remove_save_extension(model)

    # ---- conversions ----------------------------------------------------------------------------------------------
    def _dequantize(self, model, dtype=None):
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        for name, module in list(model.named_modules()):
            if isinstance(module, QUANTIZED_LINEAR_TYPES):
                model.set_submodule(name, module.to_linear(dtype))
        if self.kv_artifact is not None:
            kind = self.kv_artifact_kind
            logger.info("model.dequantize(): generate() no longer defaults to the %s cache; pass "
                        "cache_implementation=%r, cache_config={%r: %r} to keep using it.", kind.cache_implementation,
                        kind.cache_implementation, kind.location_key, str(self.kv_artifact_dir))
        self.deactivate_kv_cache(model)
        return model

    def convert_fake_to_packed(self, model) -> None:
        """Replace every ``FakeQuantLinear`` by a ``PackedLinear`` on its learned grid (after QAT, before deployment)."""
        config = self.quantization_config
        if config.mode != "fake":
            raise ValueError(f"The model is already in mode={config.mode!r}; only mode='fake' models can be packed.")
        for name, module in list(model.named_modules()):
            if isinstance(module, FakeQuantLinear):
                model.set_submodule(name, module.to_packed(SCALE_DTYPES[config.scale_dtype]))
        config.mode = "packed"


def _check_quantized_tensors_loaded(model) -> None:
    # transformers only warns about missing keys and leaves their memory uninitialised; for packed codes that would
    # be silent garbage, so a quantized tensor the checkpoint did not provide is an error.
    missing = []
    for name, module in model.named_modules():
        if isinstance(module, QUANTIZED_LINEAR_TYPES):
            for tensor_name in ("weight", "weight_scale", "weight_offset"):
                tensor = getattr(module, tensor_name, None)
                if tensor is not None and not was_loaded_from_checkpoint(tensor):
                    missing.append(f"{name}.{tensor_name}")
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(
            f"This hf_kvcodecs checkpoint lacks quantized tensors its config requires: {shown}. The weight files are "
            "incomplete or were written with other settings (bits, group_size, symmetric); re-save the model."
        )


def resolve_artifact_dir(kind: KVArtifact, location: str, *, pre_quantized: bool, name_or_path: str | None,
                         checkpoint_files: list[str]) -> Path:
    """Local directory of a checkpoint's KV artifact.

    A checkpoint stores ``location`` relative to itself (``"kv_codebooks"``): it is looked up next to the weight
    files, then downloaded from the Hub repo the model came from. A path given by the user (quantizing while loading)
    is relative to the working directory, or else the id of a Hub repo holding the artifact.
    """
    path = Path(location).expanduser()
    if path.is_absolute() or not pre_quantized:
        candidates = [path]
    else:
        roots = [Path(file).parent for file in checkpoint_files[:1]]
        if name_or_path and Path(name_or_path).is_dir():
            roots.append(Path(name_or_path))
        candidates = [root / path for root in roots]
    for candidate in candidates:
        if (candidate / kind.files[0]).is_file():
            return candidate.resolve()
    if pre_quantized and not path.is_absolute() and name_or_path and not Path(name_or_path).exists():
        return _download_artifact(kind, name_or_path, PurePosixPath(location), checkpoint_files)
    if not pre_quantized and looks_like_repo_id(location):  # an artifact pushed on its own (push-codebooks)
        return kind.download(location)
    where = ", ".join(str(c) for c in candidates) or str(path)
    raise kind.file_error(
        f"The {kind.description} of this hf_kvcodecs model ({location!r}) are missing: no {kind.files[0]} in {where}. "
        f"A saved model keeps them in its {kind.folder}/ folder: copy or upload the whole folder written by "
        f"save_pretrained, or pass a directory written by {kind.made_with}."
    )


def resolve_codebooks_dir(location: str, *, pre_quantized: bool, name_or_path: str | None,
                          checkpoint_files: list[str]) -> Path:
    """Local directory of a checkpoint's GSRQ codebooks (:func:`resolve_artifact_dir` for them)."""
    return resolve_artifact_dir(GSRQ_CODEBOOKS, location, pre_quantized=pre_quantized, name_or_path=name_or_path,
                                checkpoint_files=checkpoint_files)


def _download_artifact(kind: KVArtifact, repo_id: str, folder: PurePosixPath, checkpoint_files: list[str]) -> Path:
    # The weights were resolved to .../snapshots/<commit>/...: fetch the artifact of that same commit.
    revision = None
    if checkpoint_files:
        snapshot = Path(checkpoint_files[0]).parent
        if snapshot.parent.name == "snapshots":
            revision = snapshot.name
    return kind.download(repo_id, revision=revision, subfolder=str(folder)).resolve()


def _same_directory(reference, directory) -> bool:
    if reference is None or directory is None:
        return False
    try:
        return Path(reference).expanduser().resolve() == Path(directory).resolve()
    except (TypeError, OSError):
        return False


def _names_artifact(kind: KVArtifact, generation_config, directory) -> bool:
    """Whether ``generation_config`` selects this cache implementation with the artifact in ``directory``."""
    return (generation_config.cache_implementation == kind.cache_implementation
            and isinstance(generation_config.cache_config, dict)
            and _same_directory(generation_config.cache_config.get(kind.location_key), directory))


def _point_generation_config_at(kind: KVArtifact, generation_config, location: str, directory: Path, options: dict,
                                override: bool) -> None:
    current = generation_config.cache_implementation
    ours_implementation = current == kind.cache_implementation
    cache_config = dict(generation_config.cache_config or {}) if ours_implementation else {}
    named = cache_config.get(kind.location_key)
    ours = ours_implementation and (named in (None, location) or _same_directory(named, directory))
    if current is None or ours or override:
        # Options saved in generation_config.json (or set by the user) win over the quantization config's defaults.
        merged = {**options, **({} if override or not ours else cache_config), kind.location_key: str(directory)}
        generation_config.cache_implementation = kind.cache_implementation
        generation_config.cache_config = merged
    else:
        logger.info("hf_kvcodecs: keeping generation_config.cache_implementation=%r; pass cache_implementation=%r "
                    "to generate() to use the model's %s.", current, kind.cache_implementation, kind.description)


class _KVArtifactSaving:
    """``save_pretrained`` of a model with a KV artifact: the artifact goes into ``save_directory/<folder>``."""

    @contextlib.contextmanager
    def saving(self, model):
        """While saving, config.json and generation_config.json name the artifact by its place in the checkpoint,
        not by this machine's path."""
        quantizer = getattr(model, "hf_quantizer", None)
        if getattr(quantizer, "kv_artifact", None) is None:
            yield
            return
        kind = quantizer.kv_artifact_kind
        kv_cache_config = quantizer.quantization_config.kv_cache_config
        generation_config = getattr(model, "generation_config", None)
        cache_config = None
        if generation_config is not None and _names_artifact(kind, generation_config, quantizer.kv_artifact_dir):
            cache_config = generation_config.cache_config
        saved_kv = kv_cache_config[kind.location_key]
        saved_generation = None if cache_config is None else cache_config[kind.location_key]
        kv_cache_config[kind.location_key] = kind.folder
        if cache_config is not None:
            cache_config[kind.location_key] = kind.folder
        try:
            yield
        finally:
            kv_cache_config[kind.location_key] = saved_kv
            if cache_config is not None:
                cache_config[kind.location_key] = saved_generation

    def write(self, model, save_directory: Path) -> None:
        quantizer = getattr(model, "hf_quantizer", None)
        if getattr(quantizer, "kv_artifact", None) is None:
            return
        kind = quantizer.kv_artifact_kind
        if kind.write is None:
            quantizer.kv_artifact.save(save_directory / kind.folder)
        else:
            kind.write(quantizer.kv_artifact, quantizer.kv_artifact_dir, save_directory / kind.folder)


# ---- in-memory API ---------------------------------------------------------------------------------------------
def quantize_model(model, quantization_config: KVCodecsConfig | dict):
    """Quantize a model already in memory, in place, exactly as ``from_pretrained(..., quantization_config=...)`` would.

    Returns the model, which then saves, pushes, dequantizes and trains (fake mode) like one loaded that way.
    """
    if isinstance(quantization_config, dict):
        quantization_config = KVCodecsConfig(**quantization_config)
    if not isinstance(quantization_config, KVCodecsConfig):
        raise TypeError(f"quantization_config must be a KVCodecsConfig or a dict, got {type(quantization_config).__name__}.")
    existing = getattr(model, "hf_quantizer", None) or getattr(model.config, "quantization_config", None)
    if existing is not None:
        raise ValueError(
            "This model is already quantized; quantize its floating-point original instead (or call model.dequantize() first)."
        )
    quantizer = KVCodecsHfQuantizer(quantization_config, pre_quantized=False)
    if quantization_config.quantizes_weights:
        quantizer.modules_to_not_convert = quantizer.get_modules_to_not_convert(
            model, quantization_config.modules_to_not_convert, keep_in_fp32_modules(model)
        )
        names = linear_layers_to_convert(model, quantization_config, quantizer.modules_to_not_convert)
        with_inputs = (activation_quantized_layers(names, quantization_config.activation_modules)
                       if quantization_config.activation_bits else ())
        for name in names:
            model.set_submodule(name, quantized_from_linear(model.get_submodule(name), quantization_config,
                                                            quantize_input=name in with_inputs))
    # What from_pretrained's preprocess/postprocess steps record on a quantized model.
    model.is_quantized = True
    model.quantization_method = QUANT_METHOD
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    return model


def attach_kv_codebooks(model, codebooks: GSRQCodebooks | str | Path, **cache_options) -> None:
    """Make GSRQ with ``codebooks`` the model's default KV cache, saved with it by ``save_pretrained``.

    ``cache_options`` are :class:`~hf_kvcodecs.GSRQCache` options (``bits``, ``window_length``, ...). A model not
    quantized by hf_kvcodecs gets a KV-only ``KVCodecsConfig(weight_bits=None)``.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        quantize_model(model, KVCodecsConfig(weight_bits=None))
        quantizer = model.hf_quantizer
    elif not isinstance(quantizer, KVCodecsHfQuantizer):
        raise ValueError(
            f"This model is quantized with {quantizer.quantization_config.quant_method}; hf_kvcodecs can only attach "
            "KV codebooks to models it quantized (or to floating-point models)."
        )
    if isinstance(codebooks, GSRQCodebooks):
        directory = Path(tempfile.mkdtemp(prefix="hf_kvcodecs_kv_codebooks_"))
        codebooks.save(directory)
        weakref.finalize(quantizer, shutil.rmtree, directory, True)  # lives as long as the model refers to it
    else:
        directory = Path(codebooks).expanduser().resolve()
    config = quantizer.quantization_config
    previous = (config.kv_cache_implementation, config.kv_cache_config)
    config.kv_cache_implementation = GSRQ_CODEBOOKS.cache_implementation
    config.kv_cache_config = {**cache_options, GSRQ_CODEBOOKS.location_key: str(directory)}
    try:
        config.post_init()
        quantizer.activate_kv_cache(model, override=True)
    except Exception:
        config.kv_cache_implementation, config.kv_cache_config = previous
        raise


def pack_fake_quantized(model) -> None:
    """After quantization-aware training: turn the model's ``FakeQuantLinear`` layers into ``PackedLinear``."""
    quantizer = getattr(model, "hf_quantizer", None)
    if not isinstance(quantizer, KVCodecsHfQuantizer):
        raise ValueError("The model was not quantized by hf_kvcodecs.")
    quantizer.convert_fake_to_packed(model)


def register() -> None:
    """Register ``quant_method="hf_kvcodecs"`` with transformers; safe to call any number of times."""
    from transformers.quantizers import register_quantization_config, register_quantizer
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    for mapping, cls, register_under in (
        (AUTO_QUANTIZATION_CONFIG_MAPPING, KVCodecsConfig, register_quantization_config),
        (AUTO_QUANTIZER_MAPPING, KVCodecsHfQuantizer, register_quantizer),
    ):
        registered = mapping.get(QUANT_METHOD)
        if registered is None:
            register_under(QUANT_METHOD)(cls)
        elif registered.__module__ != cls.__module__ or registered.__qualname__ != cls.__qualname__:
            # Same module and name but another object only happens after importlib.reload: the first one stays.
            raise RuntimeError(
                f"quant_method {QUANT_METHOD!r} is already registered with transformers by {registered.__module__}."
                f"{registered.__qualname__}; two packages claim the same name."
            )


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules() if isinstance(module, QUANTIZED_LINEAR_TYPES)}
