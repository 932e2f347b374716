"""GSRQ kernels, installed as ``hf_kvcodecs.kernels`` (never as a top-level ``kernels`` module: that name belongs
to the Hugging Face ``kernels`` package, which transformers probes for).

``ops`` holds the ``torch.library`` custom ops the package calls; ``reference`` the readable PyTorch versions;
``cpu`` the CPU implementation, whose hot loops (``cpu_native.cpp``) ``cpu_native`` compiles on first use;
``triton_attention`` / ``triton_encode`` the Triton kernels used on CUDA. Importing this package neither imports
Triton nor compiles anything.
"""

from .ops import backend_for, coded_attention, residual_encode, triton_available

__all__ = ["backend_for", "coded_attention", "residual_encode", "triton_available"]
