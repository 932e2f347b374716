"""Compiled CPU loops for the decode attention (``cpu_native.cpp``), built on first use with the machine's compiler.

Why compiled code at all: on CPU the code-reading attention in ``cpu.py`` is a chain of PyTorch ops, each writing a
multi-megabyte temporary (reconstructed keys, rotations, histogram sources) that the next op reads back; the fused
loops keep one reconstructed key in a stack buffer instead. They compute exactly what ``reference.py`` computes.

The library is compiled once per machine (about half a minute; ``torch.utils.cpp_extension`` with ninja) into
``$HF_KVCODECS_CACHE/torch_extensions`` (default ``~/.cache/hf_kvcodecs``), keyed by the source, the torch version
and the CPU's instruction-set flags (it is built with ``-march=native``). If it cannot be built (no C++ compiler,
no ninja) the PyTorch implementation in ``cpu.py`` is used and a warning says why, once. ``HF_KVCODECS_KERNELS=pytorch``
skips it on purpose; ``HF_KVCODECS_KERNELS=reference`` uses the readable reference everywhere.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.cpp")
NAMESPACE = "hf_kvcodecs_cpu_native"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops" once loaded, or "error" once a build failed


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_name() -> str:
    identity = "|".join([SOURCE.read_text(), torch.__version__, platform.machine(), _cpu_flags()])
    return f"{NAMESPACE}_{hashlib.sha256(identity.encode()).hexdigest()[:12]}"


def build_directory() -> Path:
    root = Path(os.environ.get("HF_KVCODECS_CACHE", Path.home() / ".cache" / "hf_kvcodecs"))
    return root / "torch_extensions" / _build_name()


def native_ops():
    """``torch.ops.hf_kvcodecs_cpu_native`` once the library is built and loaded; None if it cannot be (reason logged)."""
    if os.environ.get("HF_KVCODECS_KERNELS", "auto") in ("reference", "pytorch"):
        return None
    if "ops" in _state:
        return _state["ops"]
    if "error" in _state:
        return None
    with _lock:
        if "ops" not in _state and "error" not in _state:
            try:
                _state["ops"] = _load()
            except Exception as error:  # no compiler, no ninja, a failed build: fall back, and say so once
                _state["error"] = error
                logger.warning(
                    "hf_kvcodecs: the compiled CPU attention could not be built (%s: %s); using the slower PyTorch "
                    "implementation. Install a C++ compiler and `pip install ninja` to get it.",
                    type(error).__name__, str(error).strip().splitlines()[-1][:300] if str(error).strip() else "",
                )
    return _state.get("ops")


def _load():
    from torch.utils.cpp_extension import load

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    logger.info("hf_kvcodecs: building the compiled CPU attention in %s (once per machine)", directory)
    load(
        name=directory.name, sources=[str(SOURCE)], build_directory=str(directory), is_python_module=False,
        extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False,
    )
    ops = getattr(torch.ops, NAMESPACE)
    _register_fakes()
    return ops


def _register_fakes() -> None:
    """Shapes of ``decode_attention``'s outputs for fake tensors (tracing that reaches the op directly); once per
    process, however often the library is loaded."""
    if _state.get("fakes"):
        return

    @torch.library.register_fake(f"{NAMESPACE}::decode_attention")
    def _(q, *args):
        return q.new_empty(q.shape), q.new_empty(q.shape[:3])

    _state["fakes"] = True


def build_error() -> BaseException | None:
    """Why the library could not be built, if it was tried and failed."""
    error = _state.get("error")
    return error if isinstance(error, BaseException) else None
