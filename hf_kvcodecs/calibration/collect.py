"""Streaming collection of KV vectors from a model run over real text (bounded memory: a fixed-size sample)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import Cache, CacheLayerMixin

from ..rope import rotary_cos_sin, undo_rope
from .metrics import QueryEnergy


class _PassThroughLayer(CacheLayerMixin):
    """Returns the states it is given, so a single no-past forward pass attends exactly as without a cache."""

    def __init__(self, sink):
        super().__init__()
        self._sink = sink

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self._sink(self, key_states, value_states, (kwargs.get("kwargs") or {}).get("position_ids"))
        return key_states, value_states

    def get_seq_length(self):
        return 0

    def get_mask_sizes(self, query_length):
        return query_length, 0

    def get_max_length(self):
        return -1


@dataclass
class KVSamples:
    """Sampled vectors per layer: keys (post-RoPE and pre-RoPE) and values, each ``[H, N, D]`` float32."""

    keys_post_rope: list[torch.Tensor]
    keys_pre_rope: list[torch.Tensor] | None
    values: list[torch.Tensor]
    tokens_seen: int
    windows: int
    query_mean_squared: list[torch.Tensor] | None = None  # per layer [H_q, D], pre-RoPE (when requested)


@torch.inference_mode()
def collect_kv_samples(
    model,
    token_ids: torch.Tensor,
    *,
    window_tokens: int = 512,
    sampled_tokens_per_window: int = 256,
    num_windows: int = 32,
    skip_first: int = 4,
    rope: tuple[torch.Tensor, float] | None = None,
    seed: int = 0,
    progress: bool = True,
    description: str = "collecting KV",
    measure_queries: bool = False,
) -> KVSamples:
    """Run ``model`` over ``num_windows`` consecutive windows of ``token_ids`` and keep a random sample of tokens.

    Only ``sampled_tokens_per_window`` tokens per window and layer are kept (never all activations). The first
    ``skip_first`` tokens of each window are excluded: they are attention sinks, which the cache keeps exact anyway.
    With ``rope=(inv_freq, attention_scaling)``, keys are also returned before RoPE, undone with each token's own
    position exactly as :class:`~hf_kvcodecs.gsrq.GSRQCache` does at run time.
    """
    available = token_ids.numel() // window_tokens
    if available < 1:
        raise ValueError(f"The text has {token_ids.numel()} tokens, fewer than one window of {window_tokens}.")
    num_windows = min(num_windows, available)
    if sampled_tokens_per_window > window_tokens - skip_first:
        raise ValueError("sampled_tokens_per_window must leave room for the skipped sink tokens in each window.")
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    post_keys: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    pre_keys: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    values: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    layer_index = {}

    def record(layer, key_states, value_states, position_ids):
        index = layer_index[id(layer)]
        chosen = chosen_positions.to(key_states.device)
        keys = key_states[0][:, chosen].float()
        post_keys[index].append(keys.cpu())
        values[index].append(value_states[0][:, chosen].float().cpu())
        if rope is not None:
            positions = (position_ids if position_ids is not None else torch.arange(key_states.shape[-2])[None]).to(key_states.device)
            cos, sin = rotary_cos_sin(positions[:, chosen].expand(1, -1), rope[0], rope[1])
            pre_keys[index].append(undo_rope(keys[None], cos, sin, rope[1])[0].cpu())

    queries = None
    if measure_queries:
        text_config = model.config.get_text_config(decoder=True)
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        queries = QueryEnergy(model, text_config.num_attention_heads, head_dim)
    try:
        for window in tqdm(range(num_windows), desc=description, disable=not progress):
            ids = token_ids[window * window_tokens : (window + 1) * window_tokens][None].to(device)
            chosen_positions = skip_first + torch.randperm(window_tokens - skip_first, generator=generator)[:sampled_tokens_per_window]
            layers = [_PassThroughLayer(record) for _ in range(num_layers)]
            layer_index.clear()
            layer_index.update({id(layer): i for i, layer in enumerate(layers)})
            model(input_ids=ids, cache=Cache(layers=layers), use_cache=True)
    finally:
        if queries is not None:
            queries.remove()

    cat = lambda parts: [torch.cat(p, dim=1) for p in parts]  # noqa: E731
    return KVSamples(
        cat(post_keys), cat(pre_keys) if rope is not None else None, cat(values),
        tokens_seen=num_windows * window_tokens, windows=num_windows,
        query_mean_squared=None if queries is None else [queries.mean_squared(i) for i in range(num_layers)],
    )
