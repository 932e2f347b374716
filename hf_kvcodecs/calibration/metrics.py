"""Error metrics that tell the codec which directions of a key or value vector the model is sensitive to.

* Values: the attention output of query head j is ``sum_t p_t v_t`` followed by the head's slice ``W_j`` of the output
  projection, so an error ``e`` in a value reaches the residual stream as ``W_j e``. The metric of a KV head is
  ``sum_j W_j^T W_j`` over the query heads that read it.
* Keys (coded before RoPE): an error ``e`` changes the logit by ``q^T R e`` with ``R`` the relative rotation. Averaged
  over rotation angles, each rotary pair (channels ``c`` and ``c + D/2``) counts in proportion to the query energy in
  that pair, so the metric is diagonal with the pair-averaged mean squared pre-RoPE query.
"""

from __future__ import annotations

import re

import torch

_ATTENTION_PROJECTION = re.compile(r"layers\.(\d+)\.self_attn\.(q_proj|o_proj)$")


def attention_projections(model) -> dict[int, dict[str, torch.nn.Module]]:
    """``{layer: {"q_proj": module, "o_proj": module}}`` for Llama-style attention modules."""
    found: dict[int, dict[str, torch.nn.Module]] = {}
    for name, module in model.named_modules():
        match = _ATTENTION_PROJECTION.search(name)
        if match:
            found.setdefault(int(match.group(1)), {})[match.group(2)] = module
    return found


class QueryEnergy:
    """Streams the mean squared pre-RoPE query per layer, query head and channel through forward hooks."""

    def __init__(self, model, num_query_heads: int, head_dim: int):
        self.num_query_heads, self.head_dim = num_query_heads, head_dim
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}
        self._handles = []
        for layer, modules in attention_projections(model).items():
            if "q_proj" in modules:
                self._handles.append(modules["q_proj"].register_forward_hook(self._hook(layer)))
        if not self._handles:
            raise ValueError(f"{type(model).__name__} has no `layers.N.self_attn.q_proj` modules to measure queries on.")

    def _hook(self, layer):
        def record(module, inputs, output):
            queries = output.detach().float().reshape(-1, self.num_query_heads, self.head_dim)
            squared = (queries**2).sum(dim=0).cpu()
            self.sums[layer] = squared if layer not in self.sums else self.sums[layer] + squared
            self.counts[layer] = self.counts.get(layer, 0) + queries.shape[0]
        return record

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def mean_squared(self, layer: int) -> torch.Tensor:
        return self.sums[layer] / max(self.counts[layer], 1)


def key_metric(mean_squared_queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Diagonal ``[H_kv, D, D]`` key metric from ``[H_q, D]`` mean squared pre-RoPE queries."""
    num_query_heads, head_dim = mean_squared_queries.shape
    group = num_query_heads // num_kv_heads
    per_kv_head = mean_squared_queries.reshape(num_kv_heads, group, head_dim).sum(dim=1)
    half = head_dim // 2
    pair_energy = 0.5 * (per_kv_head[:, :half] + per_kv_head[:, half:])  # rotary pairs are (c, c + D/2)
    return torch.diag_embed(torch.cat([pair_energy, pair_energy], dim=-1))


def value_metric(o_proj_weight: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """``[H_kv, D, D]``: ``sum_j W_j^T W_j`` over the query heads j that read each KV head."""
    weight = o_proj_weight.detach().float()
    num_query_heads = weight.shape[1] // head_dim
    group = num_query_heads // num_kv_heads
    slices = weight.reshape(weight.shape[0], num_query_heads, head_dim)  # [hidden, H_q, D]
    per_query_head = torch.einsum("ohd,ohe->hde", slices, slices)
    return per_query_head.reshape(num_kv_heads, group, head_dim, head_dim).sum(dim=1).cpu()
