"""The only module that touches private symbols of transformers.

transformers 5.24 and 5.25 have no public hook to add a ``cache_implementation`` name: the accepted names are a
module-level tuple read by ``GenerationConfig.validate`` and the cache is built by an if/elif chain in
``GenerationMixin._prepare_cache_for_generation``. We extend the tuple and wrap that method so it builds our caches
for our names and delegates everything else unchanged. That method is not given the prompt, so ``generate`` is wrapped
too, only to record the token ids it was called with: a cache bound to one prompt (SCD's, rebuilt from a payload)
checks them before generation starts (``check_generate_prompt``). The patch is idempotent and composes with other
wrappers.

On a transformers outside ``SUPPORTED_TRANSFORMERS``, or one whose symbols are not what this version of hf_kvcodecs
was written against, the patch is skipped with one :class:`UnsupportedTransformersWarning` (``import hf_kvcodecs``
still works): everything but the ``cache_implementation="gsrq"``/``"scd"`` names stays usable, a cache object
included (``generate(..., cache=GSRQCache.for_generate(model, ...))``, or ``past_key_values=``).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import warnings
from collections.abc import Callable, Mapping

from packaging.version import Version

logger = logging.getLogger(__name__)

# [min, max): the releases the test suite passed on. `make check-newest-transformers` runs the patch's tests against the
# newest release on PyPI.
SUPPORTED_TRANSFORMERS = (Version("5.24.0"), Version("5.26.0"))
_PATCH_MARKER = "_hf_kvcodecs_cache_implementations"

CACHE_IMPLEMENTATIONS: dict[str, Callable] = {}
# The token ids the innermost generate() call was given: _prepare_cache_for_generation does not receive them, and a
# cache bound to a prompt (SCD's, rebuilt from a payload) must check them before generation starts.
_GENERATE_PROMPT: contextvars.ContextVar = contextvars.ContextVar("hf_kvcodecs_generate_prompt", default=None)
# names GenerationConfig accepts before their caches were registered (accept_cache_implementation_names)
_ACCEPTED_AHEAD: set[str] = set()
_warned: set[str] = set()  # one warning per reason, not one per name registered at import


class TransformersIntegrationError(RuntimeError):
    pass


class UnsupportedTransformersWarning(UserWarning):
    """The installed transformers is not one hf_kvcodecs can register ``cache_implementation`` names with."""


def transformers_problems() -> list[str]:
    """Why the installed transformers cannot be patched: its version is outside ``SUPPORTED_TRANSFORMERS`` or the
    private symbols have another shape. Empty when registration can go ahead."""
    import transformers
    import transformers.generation.configuration_utils as generation_configuration
    from transformers.generation.utils import GenerationMixin

    version = Version(transformers.__version__)
    low, high = SUPPORTED_TRANSFORMERS
    problems = []
    if not low <= Version(version.base_version) < high:
        problems.append(f"transformers {version} is outside the supported range >={low},<{high}")
    if not isinstance(getattr(generation_configuration, "ALL_CACHE_IMPLEMENTATIONS", None), (tuple, list)):
        problems.append("transformers.generation.configuration_utils.ALL_CACHE_IMPLEMENTATIONS is no longer a tuple")
    method = getattr(GenerationMixin, "_prepare_cache_for_generation", None)
    if method is None:
        problems.append("GenerationMixin._prepare_cache_for_generation no longer exists")
    else:
        parameters = list(inspect.signature(method).parameters)
        if parameters[:3] != ["self", "generation_config", "model_kwargs"]:
            problems.append(f"GenerationMixin._prepare_cache_for_generation has signature {parameters}")
    generate = getattr(GenerationMixin, "generate", None)
    if generate is None or list(inspect.signature(generate).parameters)[:2] != ["self", "inputs"]:
        problems.append("GenerationMixin.generate no longer takes (self, inputs, ...)")
    return problems


def _unsupported_message(name: str, problems: list[str]) -> str:
    low, high = SUPPORTED_TRANSFORMERS
    return (
        f"hf_kvcodecs did not register cache_implementation={name!r} (nor its other names) with generate(): "
        + "; ".join(problems) + ". Registering patches private transformers symbols, so it is only done on the tested "
        f"range. Codecs, SCD, SQuaT and cache objects passed to generate() (e.g. generate(..., "
        f"cache=GSRQCache.for_generate(model, ...))) work as usual. Fix: `pip install 'transformers>={low},<{high}'`, or "
        "upgrade hf_kvcodecs (and report the break at its issue tracker if the newest hf_kvcodecs has it too)."
    )


def register_cache_implementation(name: str, factory: Callable, *, strict: bool = False) -> bool:
    """Make ``generate(cache_implementation=name, cache_config={...})`` build the cache; returns whether it did.

    ``factory.for_generate(model, **cache_config)`` builds it when the factory has that method (a cache that needs
    more of the model than its config: RoPE frequencies, projections, an attention implementation to switch to),
    else ``factory(config=<the model's text config>, **cache_config)``. ``factory.artifact_options`` (optional) names
    the ``cache_config`` keys that locate its fitted artifact, the first naming it: a per-call value for that key
    replaces the model's default for all of them.

    On a transformers that :func:`transformers_problems` finds fault with (outside ``SUPPORTED_TRANSFORMERS``, or
    changed private symbols), nothing is patched and it returns False after one
    :class:`UnsupportedTransformersWarning` naming the supported range and the fix (``strict=True`` raises
    :class:`TransformersIntegrationError` instead). ``generate(cache_implementation=name)`` then fails with
    transformers' own error (``ValueError: Invalid `cache_implementation` (gsrq)``): telling the user more would take
    the very patch that was skipped. Names registered before stay registered.
    """
    problems = transformers_problems()
    if problems:
        _take_back_names_accepted_ahead()
        message = _unsupported_message(name, problems)
        if strict:
            raise TransformersIntegrationError(message)
        reason = "; ".join(problems)
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(message, UnsupportedTransformersWarning, stacklevel=2)
        return False
    import transformers.generation.configuration_utils as generation_configuration
    from transformers.generation.utils import GenerationMixin

    CACHE_IMPLEMENTATIONS[name] = factory
    if name not in generation_configuration.ALL_CACHE_IMPLEMENTATIONS:
        generation_configuration.ALL_CACHE_IMPLEMENTATIONS = tuple(generation_configuration.ALL_CACHE_IMPLEMENTATIONS) + (name,)
    _wrap_prepare_cache(GenerationMixin)
    _wrap_generate(GenerationMixin)
    return True


def accept_cache_implementation_names(generation_configuration, names: tuple[str, ...]) -> None:
    """Let ``GenerationConfig`` accept ``names`` before their caches are registered.

    ``import hf_kvcodecs`` registers once transformers' model code loads (torch comes with it), but a
    ``GenerationConfig(cache_implementation="gsrq")`` may be built before that: it checks the name when built and
    needs only ``generation_configuration`` (``transformers.generation.configuration_utils``, just loaded). Only the
    version is checked here (the rest of :func:`transformers_problems` needs the model code); should
    :func:`register_cache_implementation` later find the private symbols changed, it takes the names back.
    """
    import transformers

    low, high = SUPPORTED_TRANSFORMERS
    accepted = getattr(generation_configuration, "ALL_CACHE_IMPLEMENTATIONS", None)
    if not low <= Version(Version(transformers.__version__).base_version) < high or not isinstance(accepted, (tuple, list)):
        return
    new = tuple(name for name in names if name not in accepted)
    generation_configuration.ALL_CACHE_IMPLEMENTATIONS = tuple(accepted) + new
    _ACCEPTED_AHEAD.update(new)


def _take_back_names_accepted_ahead() -> None:
    """Names accepted ahead whose caches were never registered: generate() could not build them."""
    import transformers.generation.configuration_utils as generation_configuration

    unregistered = _ACCEPTED_AHEAD - CACHE_IMPLEMENTATIONS.keys()
    accepted = generation_configuration.ALL_CACHE_IMPLEMENTATIONS
    if unregistered and isinstance(accepted, (tuple, list)):
        generation_configuration.ALL_CACHE_IMPLEMENTATIONS = tuple(name for name in accepted if name not in unregistered)
    _ACCEPTED_AHEAD.difference_update(unregistered)


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
        if user_cache:
            given = model_kwargs.get("cache")
            _check_generate_prompt(given if given is not None else model_kwargs.get("past_key_values"), model_kwargs)
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
                _activate_past_recording(cache, generation_config)
            _check_generate_prompt(cache, model_kwargs)
            model_kwargs["cache"] = cache
            return None
        return original(self, generation_config, model_kwargs, *args, **kwargs)

    setattr(_prepare_cache_for_generation, _PATCH_MARKER, CACHE_IMPLEMENTATIONS)
    generation_mixin._prepare_cache_for_generation = _prepare_cache_for_generation


def _activate_past_recording(cache, generation_config) -> None:
    """Mark an assistant model's cache for rollback as transformers does: 5.25 passes how many recurrent states its
    linear-attention layers keep (``num_assistant_tokens``), 5.24's ``activate_past_recording`` takes no argument."""
    parameters = inspect.signature(cache.activate_past_recording).parameters.values()
    if any(p.kind is p.VAR_KEYWORD or p.name == "recurrent_states_to_keep" for p in parameters):
        cache.activate_past_recording(recurrent_states_to_keep=generation_config.num_assistant_tokens)
    else:
        cache.activate_past_recording()


def _wrap_generate(generation_mixin) -> None:
    """Record the token ids each generate() call is given (``inputs``, or ``input_ids=``) for the duration of the
    call, so :func:`_check_generate_prompt` can hand them to a cache bound to a prompt."""
    original = generation_mixin.generate
    if getattr(original, _PATCH_MARKER, None) is CACHE_IMPLEMENTATIONS:
        return

    @functools.wraps(original)
    def generate(self, inputs=None, *args, **kwargs):
        token = _GENERATE_PROMPT.set(inputs if inputs is not None else kwargs.get("input_ids"))
        try:
            return original(self, inputs, *args, **kwargs)
        finally:
            _GENERATE_PROMPT.reset(token)

    setattr(generate, _PATCH_MARKER, CACHE_IMPLEMENTATIONS)
    generation_mixin.generate = generate


def _check_generate_prompt(cache, model_kwargs: dict) -> None:
    """A cache bound to one prompt (it has ``check_generate_prompt``: an SCD cache rebuilt from a payload) refuses a
    generate() call for another: it gets the call's token ids as given and its attention mask (None when generate()
    found no padding), with the rows generate() has already expanded for beams or samples folded back."""
    check = getattr(cache, "check_generate_prompt", None)
    if not callable(check):
        return
    prompt, mask = _GENERATE_PROMPT.get(), model_kwargs.get("attention_mask")
    if getattr(prompt, "ndim", 0) == 2 and getattr(mask, "ndim", 0) == 2 and mask.shape[0] > prompt.shape[0] \
            and prompt.shape[0] and mask.shape[0] % prompt.shape[0] == 0:
        mask = mask[::mask.shape[0] // prompt.shape[0]]  # _expand_inputs_for_generation repeats each row in place
    check(prompt, mask)
