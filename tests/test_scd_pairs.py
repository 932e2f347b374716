"""SCD pairs with a real mismatch: `scd make-draft` (an RTN weight-quantized copy saved as a float model directory)
and `bench scd-mismatch` (raw producer KV and the DroidSpeak-k curve against the consumer's own prefill), on tiny
random Llama models."""

import argparse
import copy
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from hf_kvcodecs import cli, models
from hf_kvcodecs.bench import scd_mismatch
from hf_kvcodecs.bench.scd import producer_cache, producer_hidden_state
from hf_kvcodecs.cli import scd_draft
from hf_kvcodecs.cli.bench import scd_mismatch as scd_mismatch_cli
from hf_kvcodecs.codecs.weight_quantization import SUPPORTED_BITS, dequantize_weight, quantize_weight

from .conftest import tiny_llama_config
from .test_scd_consumer import _byte_tokenizer


@pytest.fixture(scope="module")
def tiny_base_dir(tmp_path_factory):
    """A tiny random Llama (4 layers, tied embeddings, inputs a multiple of 32) with a byte tokenizer, saved."""
    directory = tmp_path_factory.mktemp("tiny_pair_base")
    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=260, bos_token_id=256, eos_token_id=256, pad_token_id=256,
                               num_hidden_layers=4, tie_word_embeddings=True, initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(directory)
    _byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def draft_dir(tiny_base_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_draft") / "draft"
    assert cli.run(["scd", "make-draft", "--model", str(tiny_base_dir), "--bits", "3", "--group-size", "32",
                    "--out", str(out)]) == 0
    return out


def test_make_draft_saves_a_loadable_model_whose_weights_are_the_rtn_grid(tiny_base_dir, draft_dir):
    base = models.load_model(str(tiny_base_dir)).model
    draft = models.load_model(str(draft_dir))
    assert isinstance(draft.tokenizer, PreTrainedTokenizerFast) and not getattr(draft.model, "is_quantized", False)
    assert getattr(draft.model.config, "quantization_config", None) is None  # a plain float model
    ours = dict(draft.model.named_parameters())
    linear = {name for name, module in base.named_modules() if type(module) is torch.nn.Linear}
    quantized = 0
    for name, parameter in base.named_parameters():
        module = name.rsplit(".", 1)[0]
        if module in linear and module != "lm_head" and name.endswith("weight"):
            packed = quantize_weight(parameter.detach(), 3, 32)
            grid = dequantize_weight(packed.packed, packed.scale, packed.offset, 3, 32, parameter.shape[1])
            assert torch.equal(ours[name], grid), name
            assert not torch.equal(ours[name], parameter), name
            quantized += 1
        else:  # embeddings (tied with the LM head), norms
            assert torch.equal(ours[name], parameter), name
    assert quantized == 4 * 7
    sidecar = json.loads((draft_dir / scd_draft.DRAFT_SIDECAR_FILE).read_text())
    assert (sidecar["bits"], sidecar["group_size"], sidecar["base_model"]) == (3, 32, str(tiny_base_dir.resolve()))
    error = sidecar["weight_error"]
    assert error["quantized_layers"] == quantized and error["bits_per_weight"] == 4.0
    assert 0.0 < error["relative_error"] < 0.5 and set(error["relative_error_per_kind"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert scd_draft.read_draft_sidecar(draft_dir)["description"].startswith("RTN W3 g32 draft of ")
    assert scd_draft.DRAFT_BITS == SUPPORTED_BITS


def test_make_draft_refuses_a_directory_that_is_not_empty_before_loading(tmp_path, monkeypatch, capsys):
    (tmp_path / "taken.txt").write_text("x")
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("the model was loaded"))
    assert cli.run(["scd", "make-draft", "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err


def test_producer_states_are_producer_cache_and_producer_hidden_state(tiny_base_dir):
    model = models.load_model(str(tiny_base_dir)).model
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(0))
    cache, hidden = scd_mismatch.producer_states(model, ids, (0, 2, 3))
    reference = producer_cache(model, ids)
    for ours, theirs in zip(cache.layers, reference.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    for layer in (0, 2, 3):
        assert torch.equal(hidden[layer], producer_hidden_state(model, ids, layer))


def _loaded(model, description):
    return SimpleNamespace(model=model, description=description)


def test_mismatch_profile_on_a_tiny_pair(tiny_base_dir, tmp_path):
    """Producer: a perturbed copy of the consumer with the same embeddings. The oracle scores zero against itself,
    droidspeak-0 (the consumer's own prefill from the producer's embeddings, sent in 16 bits) is the oracle, and the
    report, verdict and plot are written."""
    consumer = models.load_model(str(tiny_base_dir)).model
    producer = copy.deepcopy(consumer)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in producer.named_parameters():
            if "layers." in name and name.endswith("proj.weight"):
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    stream = torch.randint(3, 250, (2000,), generator=torch.Generator().manual_seed(4))
    settings = scd_mismatch.MismatchSettings(windows=2, context_tokens=64, continuation_tokens=16,
                                             droidspeak_layers=(2, 0, 1, 3), gate_delta_ppl_pct=1.0)
    results = scd_mismatch.run_mismatch_profile(_loaded(producer, "tiny perturbed"), _loaded(consumer, "tiny"),
                                                stream, {"description": "random tokens", "tokens": 2000}, settings,
                                                progress=False)
    methods = results["methods"]
    assert list(methods) == ["oracle", "raw-16", "droidspeak-0", "droidspeak-1", "droidspeak-2", "droidspeak-3",
                             "producer"]
    oracle = methods["oracle"]
    assert oracle["delta_ppl_pct"] == 0.0 and oracle["kl_mean"] == 0.0 and oracle["top1_agreement"] == 1.0
    assert methods["droidspeak-0"]["delta_ppl_pct"] == pytest.approx(0.0, abs=0.05)
    assert methods["droidspeak-0"]["kl_mean"] < 1e-5 and methods["droidspeak-0"]["top1_agreement"] == 1.0
    assert methods["raw-16"]["kl_mean"] > 100 * max(methods["droidspeak-0"]["kl_mean"], 1e-9)
    assert [methods[name]["reused_layers"] for name in methods] == [0, 4, 0, 1, 2, 3, None]
    assert methods["raw-16"]["bytes_per_token"] == 2 * 4 * 32 * 2
    assert methods["droidspeak-2"]["bytes_per_token"] == 2 * 2 * 32 * 2 + 2 * 64
    gate = results["gate"]
    assert gate["depth_curve_methods"] == ["droidspeak-0", "droidspeak-1", "droidspeak-2", "droidspeak-3", "raw-16"]
    assert gate["kl_grows_with_depth"] == all(b > a for a, b in zip(gate["depth_curve_kl"], gate["depth_curve_kl"][1:]))
    assert gate["passes"] == (gate["raw16_passes"] and gate["kl_grows_with_depth"])
    markdown = scd_mismatch.mismatch_markdown(results)
    assert "| raw-16 | 4 |" in markdown and "## Gate: " in markdown
    scd_mismatch.mismatch_plot(results, tmp_path / "profile.png")
    assert (tmp_path / "profile.png").stat().st_size > 1000
    json.dumps(results)  # the report is plain JSON


def test_the_gate_needs_raw16_over_the_threshold_and_kl_rising_with_depth():
    settings = scd_mismatch.MismatchSettings(droidspeak_layers=(5, 10))

    def methods(raw_delta, kls):
        rows = {name: {"kl_mean": kl, "delta_ppl_pct": 100 * kl, "delta_ppl_pct_se": 1.0, "reused_layers": layers}
                for name, kl, layers in zip(("droidspeak-5", "droidspeak-10", "raw-16"), kls, (5, 10, 30))}
        rows["raw-16"]["delta_ppl_pct"] = raw_delta
        return rows

    assert scd_mismatch.gate(methods(12.0, (0.01, 0.02, 0.05)), settings)["passes"]
    assert not scd_mismatch.gate(methods(8.0, (0.01, 0.02, 0.05)), settings)["passes"]
    flat = scd_mismatch.gate(methods(12.0, (0.02, 0.01, 0.05)), settings)
    assert flat["raw16_passes"] and not flat["kl_grows_with_depth"] and not flat["passes"]


def test_the_command_runs_on_a_draft_and_its_base(tiny_base_dir, draft_dir, tmp_path):
    """`bench scd-mismatch --producer DRAFT --consumer BASE` end to end, windows from the end of real text."""
    out = tmp_path / "profile"
    assert cli.run(["bench", "scd-mismatch", "--producer", str(draft_dir), "--consumer", str(tiny_base_dir),
                    "--text", "debian-licenses", "--text-tail", "0.1", "--windows", "2", "--context", "64",
                    "--continuation", "8", "--droidspeak-layers", "1", "3", "--out", str(out)]) == 0
    results = json.loads((out / "scd_mismatch.json").read_text())
    assert set(results["methods"]) == {"oracle", "raw-16", "droidspeak-1", "droidspeak-3", "producer"}
    assert results["producer_draft"]["bits"] == 3 and "RTN W3 g32 draft" in results["producer"]
    assert "last 10 %" in results["evaluation_text"]["part"]
    assert results["methods"]["raw-16"]["kl_mean"] > 0
    assert (out / "scd_mismatch.md").is_file() and (out / "scd_mismatch.png").stat().st_size > 1000


def test_the_command_refuses_layers_outside_the_model(tiny_base_dir, tmp_path, capsys):
    assert cli.run(["bench", "scd-mismatch", "--producer", str(tiny_base_dir), "--consumer", str(tiny_base_dir),
                    "--windows", "1", "--context", "32", "--continuation", "4", "--droidspeak-layers", "4",
                    "--out", str(tmp_path)]) == 2
    assert "outside 0..3" in capsys.readouterr().err


def test_the_parser_mirrors_the_library_defaults():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "scd-mismatch", "--consumer", "c"])
    library = scd_mismatch.MismatchSettings()
    assert scd_mismatch_cli.MISMATCH == {"windows": library.windows, "context_tokens": library.context_tokens,
                                         "continuation_tokens": library.continuation_tokens,
                                         "droidspeak_layers": library.droidspeak_layers,
                                         "gate_delta_ppl_pct": library.gate_delta_ppl_pct}
    assert (args.windows, args.context, args.continuation, tuple(args.droidspeak_layers), args.gate_ppl_pct) == (
        8, 1024, 64, (5, 10, 15, 20, 25), 10.0)
    assert args.producer == "default" and args.text is None and args.text_tail is None
    draft = parser.parse_args(["scd", "make-draft", "--out", "d"])
    assert (draft.model, draft.bits, draft.group_size) == ("default", 3, 32)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "scd-mismatch", "--consumer", "c", "--text-tail", "1.5"])
    assert isinstance(draft, argparse.Namespace)
