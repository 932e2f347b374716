"""Real text for calibration and evaluation: corpora that ship with installed software, user files, or `datasets`.

Calibration and evaluation use different text by default, and every corpus carries a description that reports print.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CALIBRATION_DEFAULT = "python-docs"
EVALUATION_DEFAULT = "debian-licenses"
# Python source code: a domain unlike both defaults (reference prose, licence prose), for fine-tuning a model into a
# variant that still shares the base's tokenizer and shapes.
PYTHON_SOURCE = "python-stdlib-source"

# Debian's licence texts: long, real English prose, present on every Debian/Ubuntu system.
_DEBIAN_LICENSE_DIR = Path("/usr/share/common-licenses")
_DEBIAN_LICENSES = ("GPL-3", "GFDL-1.3", "MPL-2.0", "LGPL-2.1", "Apache-2.0", "GPL-2", "CC0-1.0", "Artistic")


# Well-known pure-Python standard-library modules, sorted; read from the running interpreter, so the text is the code
# of the Python the description names. A module missing from a trimmed install is skipped.
_STDLIB_MODULES = (
    "argparse.py", "ast.py", "base64.py", "calendar.py", "collections/__init__.py", "configparser.py", "contextlib.py",
    "csv.py", "dataclasses.py", "datetime.py", "difflib.py", "enum.py", "fractions.py", "functools.py", "gettext.py",
    "heapq.py", "inspect.py", "ipaddress.py", "json/decoder.py", "json/encoder.py", "logging/__init__.py",
    "optparse.py", "os.py", "pathlib.py", "pickle.py", "pprint.py", "random.py", "shlex.py", "shutil.py",
    "statistics.py", "string.py", "subprocess.py", "tempfile.py", "textwrap.py", "threading.py", "tokenize.py",
    "typing.py", "uuid.py", "weakref.py", "zipfile.py",
)
_STDLIB_MODULES_REQUIRED = 10


@dataclass(frozen=True)
class Corpus:
    text: str
    description: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def to_dict(self) -> dict:
        return {"description": self.description, "characters": len(self.text), "sha256": self.sha256}


def _python_docs() -> Corpus:
    from pydoc_data import topics  # CPython's reference manual topics, shipped with every CPython

    keys = sorted(topics.topics)
    return Corpus("\n\n".join(topics.topics[k] for k in keys), f"CPython {_python_version()} pydoc_data.topics (language reference)")


def _debian_licenses() -> Corpus:
    present = [name for name in _DEBIAN_LICENSES if (_DEBIAN_LICENSE_DIR / name).is_file()]
    if len(present) < 3:
        raise FileNotFoundError(
            f"The default evaluation text ({EVALUATION_DEFAULT}) reads Debian's licence texts from {_DEBIAN_LICENSE_DIR}, "
            "which this system does not have. Pass your own text with --text FILE (or text=[...] in Python)."
        )
    text = "\n\n".join((_DEBIAN_LICENSE_DIR / name).read_text(encoding="utf-8", errors="replace") for name in present)
    return Corpus(text, f"Debian licence texts from {_DEBIAN_LICENSE_DIR}: {', '.join(present)}")


def _python_stdlib_source() -> Corpus:
    import sysconfig

    directory = Path(sysconfig.get_paths()["stdlib"])
    present = [name for name in _STDLIB_MODULES if (directory / name).is_file()]
    if len(present) < _STDLIB_MODULES_REQUIRED:
        raise FileNotFoundError(
            f"The corpus {PYTHON_SOURCE} reads standard-library sources from {directory}, but only {len(present)} of "
            f"its {len(_STDLIB_MODULES)} modules are there (at least {_STDLIB_MODULES_REQUIRED} are needed); this "
            "Python was installed without its .py sources. Pass your own text with --text FILE (or a file list in Python)."
        )
    text = "\n\n".join((directory / name).read_text(encoding="utf-8", errors="replace") for name in present)
    return Corpus(text, f"CPython {_python_version()} standard-library source from {directory}: {len(present)} modules "
                        f"({', '.join(present)})")


def _python_version() -> str:
    import platform

    return platform.python_version()


BUILTIN_CORPORA = {CALIBRATION_DEFAULT: _python_docs, EVALUATION_DEFAULT: _debian_licenses,
                   PYTHON_SOURCE: _python_stdlib_source}


def load_corpus(source: str | Sequence[str] | None, *, default: str) -> Corpus:
    """Resolve a text source.

    ``source`` may be ``None`` (use ``default``), a built-in corpus name, a list of file paths, or
    ``"datasets:NAME[:CONFIG]:SPLIT"`` (needs the ``datasets`` package and network access).
    """
    if source is None:
        source = default
    if not isinstance(source, (str, Path)) and len(source) == 1:  # a CLI's nargs="+" gives ["python-docs"]
        source = str(source[0])
    if isinstance(source, str) and source in BUILTIN_CORPORA:
        return BUILTIN_CORPORA[source]()
    if isinstance(source, str) and source.startswith("datasets:"):
        return _from_datasets(source)
    paths = [source] if isinstance(source, (str, Path)) else list(source)
    texts = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            known = ", ".join(sorted(BUILTIN_CORPORA))
            raise FileNotFoundError(f"Text source {str(path)!r} is neither a file nor a built-in corpus ({known}).")
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
    if not any(t.strip() for t in texts):
        raise ValueError(f"The text files {', '.join(map(str, paths))} are empty.")
    return Corpus("\n\n".join(texts), "user files: " + ", ".join(str(p) for p in paths))


def _from_datasets(source: str) -> Corpus:
    parts = source.split(":")[1:]
    if len(parts) not in (2, 3):
        raise ValueError(f"Expected 'datasets:NAME:SPLIT' or 'datasets:NAME:CONFIG:SPLIT', got {source!r}.")
    try:
        import datasets
    except ImportError as error:
        raise ImportError("Reading text from the Hub needs `pip install datasets` and network access.") from error
    name, config, split = (parts[0], None, parts[1]) if len(parts) == 2 else parts
    dataset = datasets.load_dataset(name, config, split=split)
    column = "text" if "text" in dataset.column_names else dataset.column_names[0]
    return Corpus("\n\n".join(dataset[column]), f"datasets {name}/{config or '-'} split {split} column {column}")


def tokenize_corpus(tokenizer, corpus: Corpus):
    """Token ids of a whole corpus as one 1-D LongTensor (no special tokens)."""
    import torch

    ids = tokenizer(corpus.text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)
