"""transformers' loading internals that hf_kvcodecs reads (kept here, beside the other private-symbol uses).

``_is_hf_initialized``: transformers 5.24 marks every parameter it filled from a checkpoint with this attribute and
only *warns* about missing keys, leaving their memory uninitialised. For packed low-bit codes that would be silent
garbage, so the quantizer checks the mark. The supported transformers range is enforced in ``transformers_patch``.
"""

from __future__ import annotations

import torch

LOADED_MARK = "_is_hf_initialized"


def was_loaded_from_checkpoint(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, LOADED_MARK, False))
