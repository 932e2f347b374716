import copy
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests never reach the Hub: a name that is not found locally fails at once instead of after network timeouts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton has no CPU backend: its interpreter runs the kernels on CPU tensors. The variable is read when a kernel is
# decorated, so it must be set before hf_kvcodecs.kernels.triton_* are imported (they are only imported lazily).
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import huggingface_hub
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_kvcodecs  # noqa: F401  (registers cache_implementation="gsrq")
from hf_kvcodecs.gsrq import fit_gsrq_codebooks

TINY_BITS = 3.0  # head_dim 16, 8-dim groups, 256-word codebooks, 8-bit scales: (3*16-8)/8 = 5 stages


def tiny_llama_config(**overrides) -> LlamaConfig:
    settings = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


@pytest.fixture(autouse=True)
def float32_key_tables(request, monkeypatch):
    """Tests hold the code-reading path to float32's error budget (equal to the dequantize path to float32 rounding),
    so they read float32 key tables; the 16-bit tables the compiled CPU loops read by default (int16 fixed point, or
    float16) are held to float16's budget in tests/test_kernels.py, and tests marked ``default_key_tables`` run with
    the default."""
    if request.node.get_closest_marker("default_key_tables") is None:
        monkeypatch.setenv("HF_KVCODECS_KEY_TABLE", "float32")


@pytest.fixture(scope="module")
def single_torch_thread():
    """One torch thread for a module's tests: tiny models gain nothing from threads, and on a busy machine their
    spin-waiting multiplies the run time. A module opts in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


@pytest.fixture(scope="session")
def tiny_token_stream():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, 128, (4096,), generator=generator)


@pytest.fixture(scope="session")
def tiny_codebooks_dir(tiny_model, tiny_token_stream, tmp_path_factory):
    """Codebooks with the default layouts (keys per head with each head's own codebooks, values one code per token for
    both KV heads)."""
    return _tiny_codebooks(tiny_model, tiny_token_stream, tmp_path_factory.mktemp("tiny_codebooks"))


@pytest.fixture(scope="session")
def tiny_per_head_codebooks_dir(tiny_model, tiny_token_stream, tmp_path_factory):
    """Keys and values both coded per head vector."""
    return _tiny_codebooks(tiny_model, tiny_token_stream, tmp_path_factory.mktemp("tiny_per_head_codebooks"),
                           key_layout="per_head", value_layout="per_head")


@pytest.fixture(scope="session")
def tiny_joint_codebooks_dir(tiny_model, tiny_token_stream, tmp_path_factory):
    """Keys and values both coded with one code per token for both KV heads."""
    return _tiny_codebooks(tiny_model, tiny_token_stream, tmp_path_factory.mktemp("tiny_joint_codebooks"),
                           key_layout="joint_heads", value_layout="joint_heads")


@pytest.fixture(scope="session")
def tiny_given_keys_codebooks_dir(tiny_model, tiny_token_stream, tmp_path_factory):
    """Keys per head (shared codebooks), values coded jointly given the token's decoded keys (with each head's own key
    codebooks: tests/test_per_head_codebooks.py)."""
    return _tiny_codebooks(tiny_model, tiny_token_stream, tmp_path_factory.mktemp("tiny_given_keys_codebooks"),
                           key_layout="per_head", value_layout="given_keys")


def _tiny_codebooks(model, token_stream, directory, **settings):
    fit_gsrq_codebooks(
        model, token_stream, text_info={"description": "random token ids (unit test, not an evaluation)"},
        bits=TINY_BITS, window_tokens=128, sampled_tokens_per_window=64, num_windows=8, holdout_windows=1,
        n_iter=4, fit_rows=1024, out=directory, progress=False, **settings,
    )
    return directory


def resave_codebook_tensors(directory, tensors):
    """Rewrite a codebook directory's tensor file (to damage it on purpose) keeping its header metadata and recording
    its new checksum in the JSON, so that the check under test, not the save_id pairing of the two files or the
    checksum, is what refuses it."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from hf_kvcodecs.fileio import TENSORS_CHECKSUM_KEY, file_sha256
    from hf_kvcodecs.gsrq.codebooks import METADATA_FILE, TENSORS_FILE

    path = str(directory / TENSORS_FILE)
    with safe_open(path, "pt") as handle:
        metadata = handle.metadata()
    save_file(tensors, path, metadata=metadata)
    description = json.loads((directory / METADATA_FILE).read_text())
    description[TENSORS_CHECKSUM_KEY] = file_sha256(directory / TENSORS_FILE)
    (directory / METADATA_FILE).write_text(json.dumps(description))


@pytest.fixture
def fake_hub(monkeypatch):
    """Records what would be sent to the Hub: create_repo, upload_folder and create_commit calls."""
    calls = {"create_repo": [], "upload_folder": [], "create_commit": []}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"].append((repo_id, kwargs))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, *, folder_path, **kwargs):
        files = {p.relative_to(folder_path).as_posix(): p.read_bytes() for p in Path(folder_path).rglob("*") if p.is_file()}
        calls["upload_folder"].append((kwargs, files))
        return "commit"

    def create_commit(self, repo_id, operations, **kwargs):
        files = {op.path_in_repo: Path(op.path_or_fileobj).read_bytes() for op in operations}
        calls["create_commit"].append((repo_id, files))
        return "commit"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
    # transformers' push_to_hub first loads the repo's existing card from the Hub
    import transformers.utils.hub as transformers_hub

    monkeypatch.setattr(transformers_hub, "create_and_tag_model_card",
                        lambda repo_id, tags=None, token=None: huggingface_hub.ModelCard("---\nlibrary_name: transformers\n---\n"))
    return calls


# Generation through a GSRQ cache with a small exact window (so that a 50-token prompt has coded history), shared by
# the layout tests that compare the code-reading path with the dequantize path.
SMALL_WINDOW = {"window_length": 4, "flush_interval": 4, "num_sink_tokens": 2}


def generate_gsrq(model, ids, codebooks, attention, **kwargs):
    """(sequences, cache) of 12 greedy tokens through ``cache_implementation="gsrq"`` with :data:`SMALL_WINDOW`."""
    out = model.generate(ids, cache_implementation="gsrq", return_dict_in_generate=True, max_new_tokens=12,
                         do_sample=False, eos_token_id=None, pad_token_id=0,
                         cache_config={"codebooks": str(codebooks), "attention": attention, **SMALL_WINDOW}, **kwargs)
    return out.sequences, out.past_key_values


def layout_prompt(batch=2, length=50):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(1))


def generation_mode(mode: str):
    """(prompt ids, generate kwargs) for "greedy", "beam" (3 beams) or "padded_batch" (row 1 left-padded by 9)."""
    ids, kwargs = layout_prompt(), {}
    if mode == "beam":
        kwargs = dict(num_beams=3)
    elif mode == "padded_batch":
        ids[1, :9] = 0
        kwargs = dict(attention_mask=(torch.arange(ids.shape[1]) >= 9).long()[None].repeat(2, 1))
        kwargs["attention_mask"][0] = 1
    return ids, kwargs


# ---- a tiny SCD pair whose mismatch enters at layer 1 and grows with depth (test_scd_recompute, test_scd_codes) ----

SCD_PAIR_LAYERS = 4


@pytest.fixture(scope="module")
def producer():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=SCD_PAIR_LAYERS)).eval()


@pytest.fixture(scope="module")
def deep_mismatch_consumer(producer):
    """The producer with every layer from 1 on perturbed: the mismatch enters at layer 1 and grows with depth."""
    consumer = copy.deepcopy(producer)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in consumer.model.layers[1:]:
            for module in (layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.down_proj):
                module.weight.add_(0.5 * module.weight.std() * torch.randn(module.weight.shape, generator=generator))
    return consumer


@pytest.fixture(scope="module")
def stream():
    return torch.randint(3, 128, (6000,), generator=torch.Generator().manual_seed(3))
