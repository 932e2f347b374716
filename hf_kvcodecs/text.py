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
# Legal text that stays on slimmed Debian images (they drop /usr/share/doc but keep each package's copyright file).
DEBIAN_COPYRIGHT = "debian-copyright"
# Several kinds in one text, for calibration: reference prose, source code and legal text, all on every Debian machine
# with CPython.
MIXED = "mixed"
MIXED_KINDS = ("python-docs", PYTHON_SOURCE, DEBIAN_COPYRIGHT)
MIXED_CHUNK_CHARACTERS = 2000  # about one 512-token calibration window
# GSRQ's codebooks are calibrated on several kinds by default: on kinds of text none of them includes their error is
# lower than after one kind (benchmarks/gsrq_mixed_calibration.py). SCD and SQuaT keep CALIBRATION_DEFAULT.
GSRQ_CALIBRATION_DEFAULT = MIXED
# Kinds none of the above includes, for held-out evaluation (full Debian installs; slim images lack them).
HELD_OUT_KINDS = ("debian-changelogs", "c-headers", "man-pages")
# Bounds on what the directory-wide corpora read (they would otherwise read every installed package's files).
_DIRECTORY_CORPUS_CHARACTERS = 600_000
_DIRECTORY_FILE_CHARACTERS = 20_000  # per file, so that a few long files (bash's manual) do not make the whole text

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


def _files_text(paths, limit: int = _DIRECTORY_CORPUS_CHARACTERS,
                per_file: int = _DIRECTORY_FILE_CHARACTERS) -> tuple[str, list[str]]:
    """The text of ``paths`` in order (``.gz`` decompressed), the first ``per_file`` characters of each, up to
    ``limit`` characters in all; the paths read."""
    import gzip

    texts, used, total = [], [], 0
    for path in paths:
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        except (OSError, EOFError):
            continue
        text = raw.decode("utf-8", errors="replace")
        if not text.strip():
            continue
        texts.append(text[: min(per_file, limit - total)])
        used.append(str(path))
        total += len(texts[-1])
        if total >= limit:
            break
    return "\n\n".join(texts), used


def _directory_corpus(name: str, paths, what: str, minimum: int = 10) -> Corpus:
    text, used = _files_text(sorted(paths))
    if len(used) < minimum:
        raise FileNotFoundError(
            f"The corpus {name} reads {what}, but this system has {len(used)} such files (at least {minimum} are "
            "needed; slim images strip them). Choose another corpus or pass your own text with --text FILE."
        )
    return Corpus(text, f"{what}: {len(used)} files, first {used[0]}, last {used[-1]}, {len(text):,} characters")


def _debian_copyright() -> Corpus:
    return _directory_corpus(DEBIAN_COPYRIGHT, Path("/usr/share/doc").glob("*/copyright"),
                             "Debian packages' copyright files (/usr/share/doc/*/copyright)")


def _debian_changelogs() -> Corpus:
    return _directory_corpus("debian-changelogs", Path("/usr/share/doc").glob("*/changelog.Debian.gz"),
                             "Debian packages' changelogs (/usr/share/doc/*/changelog.Debian.gz)")


def _c_headers() -> Corpus:
    return _directory_corpus("c-headers", Path("/usr/include").glob("*.h"), "C headers (/usr/include/*.h)")


def _man_pages() -> Corpus:
    return _directory_corpus("man-pages", Path("/usr/share/man/man1").glob("*.1.gz"),
                             "manual pages in roff (/usr/share/man/man1/*.1.gz)")


def _mixed() -> Corpus:
    """Round-robin chunks of each kind in MIXED_KINDS, cut at line ends, so that every prefix (calibration reads the
    first windows) holds each kind about equally; it ends when the shortest kind does."""
    kinds, missing = [], []
    for name in MIXED_KINDS:
        try:
            kinds.append(BUILTIN_CORPORA[name]())
        except FileNotFoundError as error:
            missing.append(f"{name} ({error})")
    if len(kinds) < 2:
        raise FileNotFoundError(f"The corpus {MIXED} mixes {', '.join(MIXED_KINDS)}; this system lacks "
                                f"{'; '.join(missing)}. Pass your own text with --text FILE.")
    if missing:  # the description (and the codebooks' text hash) records what was mixed
        import logging

        logging.getLogger(__name__).warning("The %s calibration text leaves out %s.", MIXED, "; ".join(missing))
    chunked = [_line_chunks(corpus.text, MIXED_CHUNK_CHARACTERS) for corpus in kinds]
    rounds = min(len(chunks) for chunks in chunked)
    text = "\n\n".join(chunks[index] for index in range(rounds) for chunks in chunked)
    return Corpus(text, f"mixed real text, round-robin chunks of about {MIXED_CHUNK_CHARACTERS} characters from "
                        + "; ".join(f"({corpus.description})" for corpus in kinds))


def _line_chunks(text: str, size: int) -> list[str]:
    chunks, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end
        if text[start:end].strip():
            chunks.append(text[start:end].strip("\n"))
        start = end + 1
    return chunks


def _python_version() -> str:
    import platform

    return platform.python_version()


BUILTIN_CORPORA = {"python-docs": _python_docs, EVALUATION_DEFAULT: _debian_licenses,
                   PYTHON_SOURCE: _python_stdlib_source, DEBIAN_COPYRIGHT: _debian_copyright, MIXED: _mixed,
                   "debian-changelogs": _debian_changelogs, "c-headers": _c_headers, "man-pages": _man_pages}


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
