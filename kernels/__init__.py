"""GSRQ kernels, installed as ``hf_kvcodecs.kernels`` (never as a top-level ``kernels`` module: that name belongs
to the Hugging Face ``kernels`` package, which transformers probes for).

``ops`` holds the ``torch.library`` custom ops the package calls; ``reference`` the readable PyTorch versions;
``cpu`` the CPU implementation, whose hot loops (``cpu_native.cpp``) ``cpu_native`` compiles on first use;
``triton_attention`` / ``triton_encode`` the Triton kernels used on CUDA. Importing this package neither imports
Triton nor compiles anything.

The package's public surface below is what the rest of hf_kvcodecs reaches kernels through: the ops, the math of
the references that codecs share, and the compiled CPU decode loop with the table formats it reads (a decoding
step calls that loop directly with constants built once per layer, which are not tensors and so cannot be the
custom op's arguments).
"""

if __name__ == "kernels":
    # Reached only when this repository's root is on sys.path (``python -m pytest`` or ``python -c`` run from the
    # root): the folder then shadows the Hugging Face ``kernels`` package, which transformers >= 5.25 imports. Hand the
    # name to the next ``kernels`` on the path, so transformers gets the package it asked for. Without one, the module
    # stays empty (transformers then finds no version and treats kernels as absent), rather than loading this
    # package's ops a second time under a foreign name.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    def _load_next_kernels_on_path() -> None:
        repository_root = os.path.realpath(os.path.dirname(os.path.dirname(__file__)))
        rest_of_path = [entry for entry in sys.path if os.path.realpath(entry or os.getcwd()) != repository_root]
        spec = importlib.machinery.PathFinder.find_spec(__name__, rest_of_path)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules[__name__] = module
        spec.loader.exec_module(module)

    _load_next_kernels_on_path()
else:
    from .cpu import (
        DecodeConstants,
        FixedPointKeyTable,
        conditional_key_table,
        conditional_native_supports,
        decode_constants,
        decode_with_constants,
        float_key_table_dtype,
        folded_key_table,
        fuses_value_prediction,
        native_key_table_dtype,
    )
    from .cpu_native import native_ops
    from .ops import MAX_BEAM_WIDTH, backend_for, coded_attention, residual_encode, triton_available
    from .reference import LOOKUP_MAX_ROWS, cached_fold_value_prediction, scale_values_from_levels

    __all__ = [
        "LOOKUP_MAX_ROWS",
        "MAX_BEAM_WIDTH",
        "DecodeConstants",
        "FixedPointKeyTable",
        "backend_for",
        "cached_fold_value_prediction",
        "coded_attention",
        "conditional_key_table",
        "conditional_native_supports",
        "decode_constants",
        "decode_with_constants",
        "float_key_table_dtype",
        "folded_key_table",
        "fuses_value_prediction",
        "native_key_table_dtype",
        "native_ops",
        "residual_encode",
        "scale_values_from_levels",
        "triton_available",
    ]
