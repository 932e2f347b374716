import importlib
import importlib.metadata
import os
import subprocess
import sys
import warnings

import pytest
import torch
import transformers
import transformers.generation.configuration_utils as generation_configuration
from packaging.version import Version
from transformers.generation.utils import GenerationMixin

import hf_kvcodecs
from hf_kvcodecs.integrations import transformers_patch

LOW, HIGH = transformers_patch.SUPPORTED_TRANSFORMERS
INSTALLED = Version(Version(transformers.__version__).base_version)
# `make check-newest-transformers` runs this file on the newest transformers release, which may be past the range:
# there the tests of the registration itself are skipped and test_patch_works_on_the_installed_transformers says
# whether the range can be widened.
needs_supported = pytest.mark.skipif(
    bool(transformers_patch.transformers_problems()),
    reason=f"transformers {transformers.__version__} is outside the supported range >={LOW},<{HIGH}",
)
EXACT = {"window_length": 10_000}


def _greedy(model, **kwargs):
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    return model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The warning is issued once per process; a test that expects it starts from a process that has not seen it."""
    monkeypatch.setattr(transformers_patch, "_warned", set())


@needs_supported
def test_registration_inside_the_supported_range():
    assert transformers_patch.transformers_problems() == []
    assert transformers_patch.register_cache_implementation("gsrq", hf_kvcodecs.GSRQCache) is True
    assert {"gsrq", "scd"} <= set(generation_configuration.ALL_CACHE_IMPLEMENTATIONS)
    assert transformers_patch.CACHE_IMPLEMENTATIONS["scd"] is hf_kvcodecs.SCDTransferCache
    marker = getattr(GenerationMixin._prepare_cache_for_generation, transformers_patch._PATCH_MARKER, None)
    assert marker is transformers_patch.CACHE_IMPLEMENTATIONS


@needs_supported
def test_registration_is_idempotent_across_reimport():
    wrapped = GenerationMixin._prepare_cache_for_generation
    importlib.reload(hf_kvcodecs)
    hf_kvcodecs.register_cache_implementation("gsrq", hf_kvcodecs.GSRQCache)
    assert GenerationMixin._prepare_cache_for_generation is wrapped
    assert generation_configuration.ALL_CACHE_IMPLEMENTATIONS.count("gsrq") == 1


def test_other_cache_implementations_are_delegated(tiny_model):
    out = tiny_model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache_implementation="dynamic",
                              return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    assert type(out.cache).__name__ == "DynamicCache"


def test_unsupported_transformers_version_warns_once_and_skips(monkeypatch, fresh_warnings):
    monkeypatch.setattr(transformers, "__version__", "6.0.0")
    names_before = generation_configuration.ALL_CACHE_IMPLEMENTATIONS
    wrapped = GenerationMixin._prepare_cache_for_generation
    with pytest.warns(transformers_patch.UnsupportedTransformersWarning) as caught:
        assert transformers_patch.register_cache_implementation("unsupported_a", hf_kvcodecs.GSRQCache) is False
        assert transformers_patch.register_cache_implementation("unsupported_b", hf_kvcodecs.GSRQCache) is False
    assert len(caught) == 1  # one warning for the reason, not one per name
    message = str(caught[0].message)
    assert f"transformers 6.0.0 is outside the supported range >={LOW},<{HIGH}" in message
    assert f"pip install 'transformers>={LOW},<{HIGH}'" in message and "cache=GSRQCache.for_generate(" in message
    assert caught[0].filename == __file__  # points at the caller, not at this module
    assert generation_configuration.ALL_CACHE_IMPLEMENTATIONS is names_before
    assert GenerationMixin._prepare_cache_for_generation is wrapped
    assert not {"unsupported_a", "unsupported_b"} & set(transformers_patch.CACHE_IMPLEMENTATIONS)


def test_unsupported_transformers_version_raises_when_strict(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "6.0.0")
    with pytest.raises(transformers_patch.TransformersIntegrationError, match=r"6\.0\.0 is outside the supported range"):
        transformers_patch.register_cache_implementation("gsrq", hf_kvcodecs.GSRQCache, strict=True)


def test_changed_private_symbols_warn_instead_of_raising(monkeypatch, fresh_warnings):
    monkeypatch.setattr(generation_configuration, "ALL_CACHE_IMPLEMENTATIONS", None)
    with pytest.warns(transformers_patch.UnsupportedTransformersWarning, match="ALL_CACHE_IMPLEMENTATIONS is no longer a tuple"):
        assert transformers_patch.register_cache_implementation("gsrq", hf_kvcodecs.GSRQCache) is False
    assert generation_configuration.ALL_CACHE_IMPLEMENTATIONS is None  # left as it was


def test_reimport_outside_the_range_warns_once_and_keeps_the_package(monkeypatch, fresh_warnings):
    monkeypatch.setattr(transformers, "__version__", "6.0.0")
    names_before = generation_configuration.ALL_CACHE_IMPLEMENTATIONS
    wrapped = GenerationMixin._prepare_cache_for_generation
    with pytest.warns(transformers_patch.UnsupportedTransformersWarning) as caught:
        importlib.reload(hf_kvcodecs)  # registers "gsrq" and "scd": one warning
    assert len(caught) == 1 and "cache_implementation='gsrq'" in str(caught[0].message)
    assert all(hasattr(hf_kvcodecs, name) for name in hf_kvcodecs.__all__)
    # what an earlier import registered stays registered for the rest of the session
    assert generation_configuration.ALL_CACHE_IMPLEMENTATIONS is names_before
    assert GenerationMixin._prepare_cache_for_generation is wrapped


def test_activate_past_recording_matches_the_installed_transformers():
    from transformers import DynamicCache, GenerationConfig

    cache = DynamicCache()
    transformers_patch._activate_past_recording(cache, GenerationConfig(num_assistant_tokens=5))


def test_patch_works_on_the_installed_transformers(monkeypatch, tiny_model, tiny_codebooks_dir):
    """generate(cache_implementation="gsrq") against a cache object, with the range widened to the installed
    transformers if it is past it; everything the registration changes is put back afterwards."""
    monkeypatch.setattr(transformers_patch, "SUPPORTED_TRANSFORMERS", (min(LOW, INSTALLED), max(HIGH, Version(f"{INSTALLED}.post1"))))
    monkeypatch.setattr(generation_configuration, "ALL_CACHE_IMPLEMENTATIONS", generation_configuration.ALL_CACHE_IMPLEMENTATIONS)
    monkeypatch.setattr(GenerationMixin, "_prepare_cache_for_generation", GenerationMixin.__dict__["_prepare_cache_for_generation"])
    monkeypatch.setitem(transformers_patch.CACHE_IMPLEMENTATIONS, "gsrq", hf_kvcodecs.GSRQCache)
    with warnings.catch_warnings():
        warnings.simplefilter("error", transformers_patch.UnsupportedTransformersWarning)
        assert transformers_patch.register_cache_implementation("gsrq", hf_kvcodecs.GSRQCache) is True
    reference = _greedy(tiny_model)
    via_name = _greedy(tiny_model, cache_implementation="gsrq", cache_config={"codebooks": str(tiny_codebooks_dir), **EXACT})
    assert torch.equal(reference, via_name)


FRESH_IMPORT = """
import sys, warnings
import torch, transformers
transformers.__version__ = "6.0.0"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import hf_kvcodecs
from hf_kvcodecs.integrations.transformers_patch import UnsupportedTransformersWarning
import transformers.generation.configuration_utils as generation_configuration
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.utils import GenerationMixin

ours = [w for w in caught if issubclass(w.category, UnsupportedTransformersWarning)]
assert len(ours) == 1, [str(w.message) for w in caught]
assert "gsrq" not in generation_configuration.ALL_CACHE_IMPLEMENTATIONS
assert not hasattr(GenerationMixin._prepare_cache_for_generation, "_hf_kvcodecs_cache_implementations")
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)).eval()
ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
reference = model.generate(ids, **kwargs)
cache = hf_kvcodecs.GSRQCache.for_generate(model, codebooks=sys.argv[1], window_length=10_000)
assert torch.equal(model.generate(ids, cache=cache, **kwargs), reference)
cache = hf_kvcodecs.GSRQCache.for_generate(model, codebooks=sys.argv[1], window_length=10_000)
assert torch.equal(model.generate(ids, past_key_values=cache, **kwargs), reference)  # the deprecated name
try:
    model.generate(ids, cache_implementation="gsrq", **kwargs)
except ValueError as error:
    assert "cache_implementation" in str(error), error
else:
    raise AssertionError("cache_implementation='gsrq' was accepted without the registration")
print("ok")
"""


def test_fresh_import_outside_the_range_keeps_cache_objects_usable(tiny_codebooks_dir, tmp_path):
    """A new interpreter that sees an unsupported transformers: import warns once, nothing is patched, a GSRQCache
    passed to generate() works and cache_implementation="gsrq" gets transformers' own error."""
    result = subprocess.run([sys.executable, "-c", FRESH_IMPORT, str(tiny_codebooks_dir)], cwd=tmp_path, env=dict(os.environ),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


REGISTERED_WHEN_MODEL_CODE_LOADS = """
import sys, warnings
warnings.simplefilter("error", UserWarning)  # an UnsupportedTransformersWarning or a failed registration fails it
import hf_kvcodecs
assert not {"torch", "transformers"} & set(sys.modules), "import hf_kvcodecs must stay light"
from transformers import GenerationConfig
GenerationConfig(cache_implementation="gsrq", cache_config={"bits": 2.0})  # before any model class
assert "torch" not in sys.modules
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import transformers.generation.configuration_utils as generation_configuration
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from hf_kvcodecs.integrations import transformers_patch
from hf_kvcodecs.quantization import KVCodecsConfig, KVCodecsHfQuantizer

assert generation_configuration.ALL_CACHE_IMPLEMENTATIONS.count("gsrq") == 1
assert transformers_patch.CACHE_IMPLEMENTATIONS == {"gsrq": hf_kvcodecs.GSRQCache, "scd": hf_kvcodecs.SCDTransferCache}
assert AUTO_QUANTIZATION_CONFIG_MAPPING["hf_kvcodecs"] is KVCodecsConfig is hf_kvcodecs.KVCodecsConfig
assert AUTO_QUANTIZER_MAPPING["hf_kvcodecs"] is KVCodecsHfQuantizer
assert hf_kvcodecs.gsrq.GSRQCache is hf_kvcodecs.GSRQCache and "SQuaTTrainer" in dir(hf_kvcodecs)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)).eval()
ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
reference = model.generate(ids, **kwargs)
out = model.generate(ids, cache_implementation="gsrq", return_dict_in_generate=True,
                     cache_config={"codebooks": sys.argv[1], "window_length": 10_000}, **kwargs)
assert type(out.cache).__name__ == "GSRQCache" and torch.equal(out.sequences, reference)
print("ok")
"""


def test_a_fresh_import_registers_once_transformers_loads_its_model_code(tiny_codebooks_dir, tmp_path):
    """`import hf_kvcodecs` in a new interpreter loads neither torch nor transformers; the registration is in place by
    the time a model class exists, and a GenerationConfig built before any takes the names."""
    result = subprocess.run([sys.executable, "-c", REGISTERED_WHEN_MODEL_CODE_LOADS, str(tiny_codebooks_dir)],
                            cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@needs_supported
def test_names_accepted_ahead_are_taken_back_when_the_symbols_turn_out_changed(monkeypatch, fresh_warnings):
    monkeypatch.setattr(generation_configuration, "ALL_CACHE_IMPLEMENTATIONS", generation_configuration.ALL_CACHE_IMPLEMENTATIONS)
    monkeypatch.setattr(transformers_patch, "_ACCEPTED_AHEAD", set())
    names_before = generation_configuration.ALL_CACHE_IMPLEMENTATIONS
    transformers_patch.accept_cache_implementation_names(generation_configuration, ("ahead", "gsrq"))
    assert generation_configuration.ALL_CACHE_IMPLEMENTATIONS == names_before + ("ahead",)  # gsrq was there already
    transformers.GenerationConfig(cache_implementation="ahead")
    monkeypatch.setattr(transformers_patch, "transformers_problems", lambda: ["GenerationMixin.generate changed"])
    with pytest.warns(transformers_patch.UnsupportedTransformersWarning, match="GenerationMixin.generate changed"):
        assert transformers_patch.register_cache_implementation("ahead", hf_kvcodecs.GSRQCache) is False
    assert generation_configuration.ALL_CACHE_IMPLEMENTATIONS == names_before
    with pytest.raises(ValueError, match="Invalid `cache_implementation`"):
        transformers.GenerationConfig(cache_implementation="ahead")


def test_no_name_is_accepted_ahead_outside_the_supported_range(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "6.0.0")
    names_before = generation_configuration.ALL_CACHE_IMPLEMENTATIONS
    transformers_patch.accept_cache_implementation_names(generation_configuration, ("ahead",))
    assert generation_configuration.ALL_CACHE_IMPLEMENTATIONS is names_before


SHADOWED_IMPORT = """
import sys
import kernels
assert kernels.__file__ == sys.argv[1], kernels.__file__
import hf_kvcodecs.kernels
assert hf_kvcodecs.kernels.MAX_BEAM_WIDTH > 0 and sys.modules["kernels"] is kernels
print("ok")
"""


def _installed_kernels_package() -> str | None:
    """The ``__init__.py`` of an installed Hugging Face ``kernels`` package (transformers >= 5.25 requires one)."""
    try:
        files = importlib.metadata.files("kernels") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [file for file in files if str(file).replace("\\", "/") == "kernels/__init__.py"]
    return str(found[0].locate()) if found else None


@pytest.mark.parametrize("other_kernels", [True, False], ids=["another-kernels-on-the-path", "no-other-kernels"])
def test_repository_root_on_the_path_does_not_shadow_the_kernels_package(tmp_path, other_kernels):
    """From the repository root (``python -m pytest``, ``python -c``) the checkout's kernels/ folder comes first on
    sys.path; the Hugging Face ``kernels`` package that transformers >= 5.25 imports must still be the one found, and
    without one the name stays an empty module rather than a second copy of hf_kvcodecs' ops."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    installed = _installed_kernels_package()
    path = [root]
    if installed is not None:
        if not other_kernels:
            pytest.skip("the Hugging Face kernels package is installed here")
        expected = installed
    elif other_kernels:  # a stand-in, found after the repository root
        expected = tmp_path / "site" / "kernels" / "__init__.py"
        expected.parent.mkdir(parents=True)
        expected.write_text("CUDAProperties = object\n")
        path.append(str(tmp_path / "site"))
    else:
        expected = os.path.join(root, "kernels", "__init__.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    result = subprocess.run([sys.executable, "-c", SHADOWED_IMPORT, str(expected)], cwd=root, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
