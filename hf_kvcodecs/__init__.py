"""hf_kvcodecs: drop-in KV-cache, KV-transfer and weight compression for Hugging Face transformers.

Importing the package registers ``cache_implementation="gsrq"`` and ``"scd"`` with ``transformers``' ``generate()``, the
code-reading attention implementations, and ``quant_method="hf_kvcodecs"`` with its quantizers, so
``from_pretrained`` loads models compressed by hf_kvcodecs.

The import itself stays light (torch and transformers load in seconds, and ``hf-kvcodecs --help`` needs neither): the
public names are imported on first use, and the registration runs at once if transformers is already imported, else
as soon as transformers loads its model code (``transformers.modeling_utils`` or ``transformers.generation.utils``),
which every model class imports before it can be built, loaded or asked to generate.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from typing import TYPE_CHECKING

from .integrations.import_hooks import add_import_hook, is_being_imported, remove_import_hook
from .version import __version__

if TYPE_CHECKING:
    from .gsrq import GSRQCache, GSRQCacheConfig, GSRQCodebooks, calibrate_gsrq
    from .integrations.attention import enable_code_attention, register_code_attention  # noqa: F401 (the second: not in __all__)
    from .integrations.transformers_patch import register_cache_implementation
    from .quantization import KVCodecsConfig
    from .rope import model_rope_inv_freq
    from .scd import SCDKnowledgeBase, SCDTransferCache
    from .training import SQuaTConfig, SQuaTTrainer

# public name -> the subpackage or module defining it, imported on first use
_LAZY = {
    "GSRQCache": "gsrq", "GSRQCacheConfig": "gsrq", "GSRQCodebooks": "gsrq", "calibrate_gsrq": "gsrq",
    "SCDKnowledgeBase": "scd", "SCDTransferCache": "scd",
    "KVCodecsConfig": "quantization",
    "SQuaTConfig": "training", "SQuaTTrainer": "training",  # Trainer pulls in accelerate
    "enable_code_attention": "integrations.attention", "register_code_attention": "integrations.attention",
    "register_cache_implementation": "integrations.transformers_patch",
    "model_rope_inv_freq": "rope",
}
# What every model class imports before it exists: GenerationMixin (generation.utils) and PreTrainedModel, which brings
# the attention and quantizer registries (modeling_utils). Either one loaded means a model is about to be built.
_TRANSFORMERS_MODEL_CODE = ("transformers.modeling_utils", "transformers.generation.utils")
_CACHE_IMPLEMENTATIONS = ("gsrq", "scd")


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # `hf_kvcodecs.gsrq` without `import hf_kvcodecs.gsrq`
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _import_the_methods(name: str) -> None:
    """Import GSRQ and SCD before ``name`` runs: each registers its KV artifact when imported, and the quantization
    layer reads that registry as it loads (it knows no method itself)."""
    importlib.import_module(".gsrq", __name__)
    importlib.import_module(".scd", __name__)
    remove_import_hook(_import_the_methods)


def _register_with_transformers() -> None:
    """What ``import hf_kvcodecs`` promises: the cache names, the attention implementations and the quantizer."""
    from .gsrq import GSRQCache
    from .integrations.attention import register_code_attention
    from .integrations.transformers_patch import register_cache_implementation
    from .quantization.quantizer import register as register_quantization
    from .scd import SCDTransferCache

    for name, cache in zip(_CACHE_IMPLEMENTATIONS, (GSRQCache, SCDTransferCache)):
        register_cache_implementation(name, cache)
    register_code_attention()
    register_quantization()


def _watched(name: str) -> bool:
    return name in _TRANSFORMERS_MODEL_CODE or name.startswith(f"{__name__}.")


def _register_once_model_code_is_loaded(just_imported: str) -> None:
    """Registers at the end of the first watched import after which transformers' model code is loaded and none of
    the modules the registration reads is still being imported: importing our own modules from inside one of their
    imports (the quantizer's, which loads transformers' model code) would find them half-defined, so this waits for
    the import that finishes them, which is watched too."""
    if not any(name in sys.modules for name in _TRANSFORMERS_MODEL_CODE) or _stay_out():
        return
    if any(_watched(name) and name != just_imported and is_being_imported(name) for name in list(sys.modules)):
        return
    remove_import_hook(_register_once_model_code_is_loaded)
    try:
        _register_with_transformers()
    except Exception as error:  # raising would fail the transformers import that got here, not this package's
        from .integrations.transformers_patch import UnsupportedTransformersWarning

        warnings.warn(f"hf_kvcodecs could not register with transformers when {just_imported} was imported: "
                      f"{error!r}. cache_implementation='gsrq'/'scd' and quant_method='hf_kvcodecs' are not available "
                      "in this process. `import transformers` before `import hf_kvcodecs` registers at import "
                      "instead, where the error is raised with its traceback.", UnsupportedTransformersWarning,
                      stacklevel=2)


def _accept_cache_names_ahead(name: str) -> None:
    if _stay_out():
        return
    from .integrations.transformers_patch import accept_cache_implementation_names

    remove_import_hook(_accept_cache_names_ahead)
    accept_cache_implementation_names(sys.modules[name], _CACHE_IMPLEMENTATIONS)


def _inside_vllm() -> bool:
    """A vLLM process (its KV connector, :mod:`hf_kvcodecs.scd.vllm_connector`, imports this package) runs vLLM's own
    model code with the transformers vLLM pins, never ``generate()``: hf_kvcodecs leaves that transformers as it is.
    (``hf_kvcodecs.register_cache_implementation`` still registers a cache name explicitly.)"""
    return "vllm" in sys.modules


def _stay_out() -> bool:
    if not _inside_vllm():
        return False
    remove_import_hook(_register_once_model_code_is_loaded)
    remove_import_hook(_accept_cache_names_ahead)
    return True


if f"{__name__}.quantization" not in sys.modules:  # (a reload finds it imported, and the methods with it)
    add_import_hook(lambda name: name == f"{__name__}.quantization", _import_the_methods, when="before")
if _inside_vllm():
    pass  # see _inside_vllm
elif "transformers" in sys.modules:
    _register_with_transformers()  # what an import after transformers costs: torch and transformers are loaded already
else:
    add_import_hook(_watched, _register_once_model_code_is_loaded, when="after")
    # a GenerationConfig(cache_implementation="gsrq") built before any model class checks the name it is given
    add_import_hook(lambda name: name == "transformers.generation.configuration_utils", _accept_cache_names_ahead,
                    when="after")

__all__ = ["GSRQCache", "GSRQCacheConfig", "GSRQCodebooks", "KVCodecsConfig", "SCDKnowledgeBase", "SCDTransferCache",
           "SQuaTConfig", "SQuaTTrainer", "enable_code_attention", "model_rope_inv_freq", "calibrate_gsrq",
           "register_cache_implementation", "__version__"]
