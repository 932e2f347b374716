"""The only module that touches private symbols of transformers.

transformers 5.24 has no public hook to add a ``cache_implementation`` name: the accepted names are a module-level
tuple read by ``GenerationConfig.validate`` and the cache is built by an if/elif chain in
``GenerationMixin._prepare_cache_for_generation``. We extend the tuple and wrap that method so it builds our caches
for our names and delegates everything else unchanged. The patch is idempotent, composes with other wrappers, and
refuses to apply (with a clear error) if those symbols are not what this version of hf_kvcodecs was written against.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping

from packaging.version import Version

logger = logging.getLogger(__name__)

SUPPORTED_TRANSFORMERS = (Version("5.24.0"), Version("5.25.0"))  # [min, max)
_PATCH_MARKER = "_hf_kvcodecs_cache_implementations"

CACHE_IMPLEMENTATIONS: dict[str, Callable] = {}


class TransformersIntegrationError(RuntimeError):
    pass


def _check_transformers():
    import transformers
    import transformers.generation.configuration_utils as generation_configuration
    from transformers.generation.utils import GenerationMixin

    version = Version(transformers.__version__)
    low, high = SUPPORTED_TRANSFORMERS
    if not low <= Version(version.base_version) < high:
        raise TransformersIntegrationError(
            f"hf_kvcodecs registers cache implementations by patching transformers internals and supports "
            f"transformers>={low},<{high}; found {version}. Install a supported version "
            f"(`pip install 'transformers>={low},<{high}'`) or upgrade hf_kvcodecs."
        )
    problems = []
    if not isinstance(getattr(generation_configuration, "ALL_CACHE_IMPLEMENTATIONS", None), (tuple, list)):
        problems.append("transformers.generation.configuration_utils.ALL_CACHE_IMPLEMENTATIONS is no longer a tuple")
    method = getattr(GenerationMixin, "_prepare_cache_for_generation", None)
    if method is None:
        problems.append("GenerationMixin._prepare_cache_for_generation no longer exists")
    else:
        parameters = list(inspect.signature(method).parameters)
        if parameters[:3] != ["self", "generation_config", "model_kwargs"]:
            problems.append(f"GenerationMixin._prepare_cache_for_generation has signature {parameters}")
    if problems:
        raise TransformersIntegrationError(
            "hf_kvcodecs cannot register `cache_implementation` names with this transformers "
            f"({transformers.__version__}): " + "; ".join(problems) + ". Please report this at hf_kvcodecs' issue tracker."
        )
    return generation_configuration, GenerationMixin


def register_cache_implementation(name: str, factory: Callable) -> None:
    """Make ``generate(cache_implementation=name, cache_config={...})`` build the cache.

    ``factory.for_generate(model, **cache_config)`` builds it when the factory has that method (a cache that needs
    more of the model than its config: RoPE frequencies, projections, an attention implementation to switch to),
    else ``factory(config=<the model's text config>, **cache_config)``. ``factory.artifact_options`` (optional) names
    the ``cache_config`` keys that locate its fitted artifact, the first naming it: a per-call value for that key
    replaces the model's default for all of them.
    """
    generation_configuration, generation_mixin = _check_transformers()
    CACHE_IMPLEMENTATIONS[name] = factory
    if name not in generation_configuration.ALL_CACHE_IMPLEMENTATIONS:
        generation_configuration.ALL_CACHE_IMPLEMENTATIONS = tuple(generation_configuration.ALL_CACHE_IMPLEMENTATIONS) + (name,)
    _wrap_prepare_cache(generation_mixin)


def _cache_options(model, generation_config, implementation: str, artifact_options: tuple[str, ...] = ()) -> dict:
    """The cache's keyword arguments: the per-call ``cache_config`` over the model's default one for the same cache.

    generate() replaces the model's ``cache_config`` with a per-call one instead of merging them, so on a compressed
    checkpoint ``cache_config={"bits": 1}`` would drop the artifact (codebooks) it carries; here per-call keys override
    the default's and the rest is kept. A shallow copy: an artifact passed as an object holds model-level tables, not
    per-call state."""
    per_call = generation_config.cache_config
    if per_call is not None and not isinstance(per_call, Mapping):
        raise TypeError(f"cache_config must be a dict, got {type(per_call).__name__}: e.g. "
                        f"cache_config={{'codebooks': DIR, 'bits': 2}} with cache_implementation={implementation!r}.")
    options = dict(per_call or {})
    model_default = getattr(model, "generation_config", None)
    default_options = getattr(model_default, "cache_config", None)
    if getattr(model_default, "cache_implementation", None) != implementation or not isinstance(default_options, Mapping):
        return options
    inherited = dict(default_options)
    if artifact_options and artifact_options[0] in options:  # another artifact: the default's location is not its own
        inherited = {key: value for key, value in inherited.items() if key not in artifact_options}
    kept = sorted(inherited.keys() - options.keys())
    if kept and options:
        logger.info("cache_config %s given to generate() is merged over the model's default; kept from the default: "
                    "%s.", sorted(options), kept)
    return {**inherited, **options}


def _wrap_prepare_cache(generation_mixin) -> None:
    original = generation_mixin._prepare_cache_for_generation
    if getattr(original, _PATCH_MARKER, None) is CACHE_IMPLEMENTATIONS:
        return  # already wrapped by this module (e.g. a second import or importlib.reload of the package)

    @functools.wraps(original)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        implementation = generation_config.cache_implementation
        user_cache = model_kwargs.get("cache") is not None or model_kwargs.get("past_key_values") is not None
        if implementation in CACHE_IMPLEMENTATIONS and user_cache:
            # A compressed checkpoint makes our cache the model's default; a cache passed to generate() wins over a
            # default (transformers would refuse the pair). generation_config is generate()'s per-call copy.
            logger.info("generate() got a cache: using it instead of the default cache_implementation=%r.", implementation)
            generation_config.cache_implementation = None
            implementation = None
        if (
            implementation in CACHE_IMPLEMENTATIONS
            and not user_cache  # transformers raises its own clear error for cache= together with cache_implementation
            and generation_config.use_cache is not False
            and self._supports_default_dynamic_cache()
        ):
            from transformers.cache_utils import DynamicCache, EncoderDecoderCache

            factory = CACHE_IMPLEMENTATIONS[implementation]
            cache_kwargs = _cache_options(self, generation_config, implementation,
                                          tuple(getattr(factory, "artifact_options", ())))
            if hasattr(factory, "for_generate"):
                cache = factory.for_generate(self, **cache_kwargs)
            else:
                cache_kwargs.setdefault("config", self.config.get_text_config(decoder=True))
                cache = factory(**cache_kwargs)
            if self.config.is_encoder_decoder:
                cache = EncoderDecoderCache(cache, DynamicCache(config=self.config.get_text_config(decoder=True)))
            if getattr(generation_config, "is_assistant", False):
                cache.activate_past_recording()
            model_kwargs["cache"] = cache
            return None
        return original(self, generation_config, model_kwargs, *args, **kwargs)

    setattr(_prepare_cache_for_generation, _PATCH_MARKER, CACHE_IMPLEMENTATIONS)
    generation_mixin._prepare_cache_for_generation = _prepare_cache_for_generation
