"""SCD's fine-tuned consumer: the LoRA fine-tune (on a tiny random Llama with a byte-level tokenizer, fitted on real
text), what it saves, loading it back through load_model, the make-consumer command, and its fine-tuning corpus."""

import argparse
import dataclasses
import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from hf_kvcodecs import cli, models, text
from hf_kvcodecs.cli import _common, scd_consumer
from hf_kvcodecs.scd.consumer import (
    ConsumerFitSettings,
    check_consumer_directory,
    fit_consumer,
    make_consumer,
    report_markdown,
)
from hf_kvcodecs.text import Corpus, load_corpus, tokenize_corpus

from .conftest import tiny_llama_config

# small enough for a few seconds of fine-tuning, with both a training window and held-out windows to spare
TINY_SETTINGS = dict(steps=20, sequence_tokens=64, batch_size=4, learning_rate=1e-2, eval_windows=4,
                     eval_window_tokens=64)


def _byte_tokenizer() -> PreTrainedTokenizerFast:
    """A real (saveable, AutoTokenizer-loadable) tokenizer small enough for a tiny model: one token per byte."""
    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


@pytest.fixture(scope="module")
def tiny_base_dir(tmp_path_factory):
    """A tiny random Llama and its byte tokenizer saved as a local model directory (load_model loads it by path).

    LoRA leaves the LM head as it is; at the usual initializer range its logits span too little for a few steps to lower
    the loss much, so the weights start larger."""
    directory = tmp_path_factory.mktemp("tiny_base")
    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=260, bos_token_id=256, eos_token_id=256, pad_token_id=256, initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(directory)
    _byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def texts():
    """Real text: a stretch of standard-library code repeated (so 20 steps can learn it), and licence prose."""
    code = load_corpus(text.PYTHON_SOURCE, default=text.PYTHON_SOURCE).text[:3000]
    licence = load_corpus(text.EVALUATION_DEFAULT, default=text.EVALUATION_DEFAULT).text[:4000]
    return Corpus("\n".join([code] * 8), "stdlib code, repeated (unit test)"), Corpus(licence, "licence prose (unit test)")


@pytest.fixture(scope="module")
def fitted(tiny_base_dir, texts):
    loaded = models.load_model(str(tiny_base_dir))
    train, licence = texts
    peft_model, fit = fit_consumer(loaded.model, tokenize_corpus(loaded.tokenizer, train),
                                   settings=ConsumerFitSettings(**TINY_SETTINGS),
                                   eval_ids={"licence": tokenize_corpus(loaded.tokenizer, licence)}, progress=False)
    return loaded, peft_model, fit


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids[None], use_cache=False).logits[0]


def test_fine_tune_lowers_the_loss_and_changes_only_the_adapter(fitted):
    loaded, peft_model, fit = fitted
    training = fit["training"]
    assert training["tokens_seen"] == 20 * 4 * 64 and len(training["losses"]) == 20
    assert training["loss_last"] < training["loss_first"] - 0.5, training["losses"]
    base = loaded.model.state_dict()
    adapted = peft_model.get_base_model().state_dict()
    frozen = {name.replace(".base_layer", ""): tensor for name, tensor in adapted.items() if "lora_" not in name}
    assert frozen.keys() == base.keys()
    assert all(torch.equal(frozen[name], base[name]) for name in base)  # bit-identical: only LoRA was trained
    lora_b = [tensor for name, tensor in adapted.items() if "lora_B" in name]
    assert len(lora_b) == 2 * 7 and all(tensor.abs().sum() > 0 for tensor in lora_b)  # every projection adapted
    rows = fit["perplexity"]
    assert set(rows) == {"fine-tuning text", "licence"} and rows["licence"]["role"] == "evaluation"
    assert rows["fine-tuning text"]["consumer_ppl"] < rows["fine-tuning text"]["base_ppl"]
    assert rows["fine-tuning text"]["delta_ppl_pct_se"] is not None
    # a copy was tuned: the caller's model (the producer) carries no adapter
    assert not any("lora_" in name for name, _ in loaded.model.named_modules())


def test_saved_consumer_loads_back_as_the_same_model(fitted, texts, tmp_path):
    loaded, peft_model, _ = fitted
    train, licence = texts
    out = tmp_path / "consumer"
    report = make_consumer(loaded, train, settings=ConsumerFitSettings(**TINY_SETTINGS), out=out,
                           eval_corpora={"licence": licence, "same as training": train}, progress=False)
    assert set(report["perplexity"]) == {"fine-tuning text", "licence"}  # the copy of the training text is skipped
    assert {"adapter_config.json", "adapter_model.safetensors", models.CONSUMER_SIDECAR_FILE, "report.json",
            "report.md"} <= {path.name for path in out.iterdir()}
    sidecar = json.loads((out / models.CONSUMER_SIDECAR_FILE).read_text())
    assert sidecar["format_version"] == 1 and sidecar["base_model"] == str(loaded.name)
    assert sidecar["train_text"]["sha256"] == train.sha256 and sidecar["tokens_seen"] == 20 * 4 * 64
    assert json.loads((out / "report.json").read_text())["perplexity"] == json.loads(json.dumps(report["perplexity"]))
    assert "| fine-tuning text |" in (out / "report.md").read_text() == report_markdown(report)
    # the sidecar, not peft's record, names the base (peft's is a package directory for the default model)
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = str(tmp_path / "nowhere")
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))

    ids = tokenize_corpus(loaded.tokenizer, licence)[:96]
    reloaded = models.load_model(str(out))
    assert type(reloaded.model).__name__.startswith("PeftModel") and not reloaded.model.training
    assert reloaded.description == f"{loaded.description} + LoRA adapter {out}"
    # the run is seeded: make_consumer's adapter is the one fitted in memory by fit_consumer
    torch.testing.assert_close(_logits(reloaded.model, ids), _logits(peft_model, ids), rtol=0, atol=1e-6)
    merged = models.load_model(str(out), merge_adapter=True)
    assert isinstance(merged.model, LlamaForCausalLM) and not hasattr(merged.model, "peft_config")
    torch.testing.assert_close(_logits(merged.model, ids), _logits(peft_model, ids), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(_logits(loaded.model, ids), _logits(peft_model, ids), atol=1e-3)  # a different model

    with pytest.raises(FileExistsError, match="--overwrite"):
        make_consumer(loaded, train, settings=ConsumerFitSettings(**TINY_SETTINGS), out=out, progress=False)
    (tmp_path / "file").write_text("keep me")
    with pytest.raises(ValueError, match="is a file"):
        check_consumer_directory(tmp_path / "file", overwrite=True)
    check_consumer_directory(out, overwrite=True)
    with pytest.raises(ValueError, match="merge_adapter=True needs a directory holding a peft adapter"):
        models.load_model(str(tmp_path / "file"), merge_adapter=True)
    sidecar["base_model"] = str(out)  # an adapter naming itself as its base
    (out / models.CONSUMER_SIDECAR_FILE).write_text(json.dumps(sidecar))
    with pytest.raises(ValueError, match="names another adapter directory"):
        models.load_model(str(out))


def test_full_fine_tune_trains_every_weight_and_saves_a_model_directory(tiny_base_dir, texts, tmp_path):
    loaded = models.load_model(str(tiny_base_dir))
    train, licence = texts
    before = {name: parameter.detach().clone() for name, parameter in loaded.model.named_parameters()}
    out = tmp_path / "expert"
    report = make_consumer(loaded, train, settings=ConsumerFitSettings(method="full", **TINY_SETTINGS), out=out,
                           eval_corpora={"licence": licence}, progress=False)
    training = report["training"]
    assert training["trainable_parameters"] == training["base_parameters"] == sum(
        parameter.numel() for parameter in loaded.model.parameters())
    assert training["loss_last"] < training["loss_first"] - 0.5
    assert report["perplexity"]["fine-tuning text"]["delta_ppl_pct"] < -10
    for name, parameter in loaded.model.named_parameters():  # the producer is not touched
        assert torch.equal(parameter, before[name]), name
    assert not (out / "adapter_config.json").exists() and (out / "tokenizer.json").is_file()
    assert "full fine-tune" in (out / "report.md").read_text()
    reloaded = models.load_model(str(out))
    assert isinstance(reloaded.model, LlamaForCausalLM) and not hasattr(reloaded.model, "peft_config")
    ids = tokenize_corpus(loaded.tokenizer, licence)[:96]
    assert reloaded.tokenizer(licence.text[:200])["input_ids"] == loaded.tokenizer(licence.text[:200])["input_ids"]
    # every decoder layer moved, not just the head
    changed = {name.split(".")[2] for name, parameter in reloaded.model.named_parameters()
               if name.startswith("model.layers.") and not torch.allclose(parameter, before[name])}
    assert changed == {str(index) for index in range(loaded.model.config.num_hidden_layers)}
    assert not torch.allclose(_logits(reloaded.model, ids), _logits(loaded.model, ids), atol=1e-3)
    with pytest.raises(ValueError, match="method is 'qlora'; pick one of lora, full"):
        ConsumerFitSettings(method="qlora")


def test_bad_settings_and_short_texts_are_refused_before_training(fitted):
    loaded, _, _ = fitted
    with pytest.raises(ValueError, match="steps must be at least 1"):
        ConsumerFitSettings(steps=0)
    with pytest.raises(ValueError, match="fewer than one training window"):
        fit_consumer(loaded.model, torch.arange(100) % 200, settings=ConsumerFitSettings(**TINY_SETTINGS), progress=False)
    with pytest.raises(ValueError, match="Use fewer or shorter windows"):
        fit_consumer(loaded.model, torch.arange(5000) % 200, settings=ConsumerFitSettings(**TINY_SETTINGS),
                     eval_ids={"short": torch.arange(100)}, progress=False)


def _parser():
    parser = argparse.ArgumentParser()
    scd_consumer.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_make_consumer_command(fitted, tmp_path, monkeypatch, capsys):
    loaded, _, _ = fitted
    # the mirrored defaults are the library's
    assert scd_consumer.CONSUMER_TEXT == text.PYTHON_SOURCE
    settings = {field.name: field.default for field in dataclasses.fields(ConsumerFitSettings)}
    assert scd_consumer.CONSUMER_FIT == {name: settings[name] for name in scd_consumer.CONSUMER_FIT}
    assert settings["lora_alpha"] == 2 * settings["lora_rank"]  # the command's alpha rule reproduces the default
    args = _parser().parse_args(["make-consumer", "--out", "unused"])
    assert (args.model, args.steps, args.seq_len, args.batch_size, args.lr, args.rank, args.seed) == (
        models.DEFAULT_MODEL_NAME, settings["steps"], settings["sequence_tokens"], settings["batch_size"],
        settings["learning_rate"], settings["lora_rank"], settings["seed"])
    (leaf,) = [action for action in _parser()._actions if isinstance(action, argparse._SubParsersAction)]
    command = leaf.choices["make-consumer"]
    assert command.formatter_class is _common.HelpFormatter
    formatter = command._get_formatter()
    for action in command._actions:
        help_text = formatter._expand_help(action)
        if action.option_strings and action.nargs != 0 and not action.required:
            assert "(default" in help_text and "(default: None)" not in help_text, action.dest

    # the output directory is checked before the model is loaded
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("the model was loaded"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    args = _parser().parse_args(["make-consumer", "--out", str(tmp_path / "full")])
    with pytest.raises(FileExistsError, match="not empty"):
        args.func(args)

    # a run on the default fine-tuning text, measured on the default calibration and evaluation texts
    monkeypatch.setattr(cli, "_load", lambda args: loaded)
    out = tmp_path / "cli"
    args = _parser().parse_args(["make-consumer", "--out", str(out), "--steps", "2", "--seq-len", "32",
                                 "--batch-size", "2", "--rank", "4", "--eval-windows", "2"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert set(report["perplexity"]) == {text.PYTHON_SOURCE, text.CALIBRATION_DEFAULT, text.EVALUATION_DEFAULT}
    assert report["settings"]["lora_rank"] == 4 and report["settings"]["lora_alpha"] == 8
    assert report["settings"]["method"] == "lora"
    assert f"| {text.PYTHON_SOURCE} |" in printed and "standard-library source" in report["train_text"]["description"]


def test_python_stdlib_source_is_real_code_unlike_python_docs():
    source = load_corpus(text.PYTHON_SOURCE, default=text.CALIBRATION_DEFAULT)
    docs = load_corpus(None, default=text.CALIBRATION_DEFAULT)
    assert text.PYTHON_SOURCE in text.BUILTIN_CORPORA and source.sha256 != docs.sha256
    assert "CPython" in source.description and "standard-library source" in source.description
    assert "import " in source.text and "def " in source.text and len(source.text) > 500_000
    assert load_corpus(text.PYTHON_SOURCE, default="unused").sha256 == source.sha256  # the same text every time
