"""How many bytes a KV cache really holds: walk the object and add up the storage of every tensor it references.

A cache's ``nbytes`` cannot be read off its class: quantized layers keep codes, scales, zero points and a
full-precision residual window in backend-specific objects (quanto keeps tensor subclasses that wrap packed
``uint8`` data, HQQ keeps a ``(codes, meta dict)`` tuple). Walking the object graph and counting each underlying
storage once covers all of them without knowing their layout.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..models import model_fingerprint

# Identifies one allocation while it is alive: two live tensors share a key exactly when they share memory.
StorageKey = tuple[str, int]

# Objects that can reference tensors only through module globals, never as cache state.
_OPAQUE_TYPES = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    torch.dtype,
    torch.device,
)


def tensor_storages(obj) -> dict[StorageKey, int]:
    """Every storage reachable from ``obj`` (attributes, containers, tensor subclasses), with its size in bytes.

    A storage shared by several tensors (views, or keys and values aliasing one buffer) appears once, with its whole
    size: a view keeps its full base allocation alive.
    """
    storages: dict[StorageKey, int] = {}
    visited: set[int] = set()
    pending = [obj]
    while pending:
        item = pending.pop()
        if item is None or isinstance(item, _OPAQUE_TYPES) or id(item) in visited:
            continue
        visited.add(id(item))
        if isinstance(item, torch.Tensor):
            if is_traceable_wrapper_subclass(item):
                # quanto's QTensors are wrappers without storage of their own; the bytes live in their inner tensors.
                inner_names, _ = item.__tensor_flatten__()
                pending.extend(getattr(item, name) for name in inner_names)
            elif item.device.type != "meta":
                storage = item.untyped_storage()
                storages[(str(item.device), storage.data_ptr())] = storage.nbytes()
            continue
        pending.extend(_references(item))
    return storages


def _references(item) -> Iterable:
    if isinstance(item, dict):
        return list(item.values())
    if isinstance(item, (list, tuple, set, frozenset)):
        return list(item)
    if isinstance(item, functools.partial):  # e.g. a Cache's layer_class_to_replicate bound to a codec
        return [*item.args, *item.keywords.values()]
    references = list(vars(item).values()) if hasattr(item, "__dict__") else []
    for cls in type(item).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if hasattr(item, slot):
                references.append(getattr(item, slot))
    return references


def cache_bytes(cache, *, excluding: Iterable[StorageKey] = ()) -> int:
    """Bytes of every tensor the cache object holds, each storage counted once.

    ``excluding`` names storages to leave out, typically the tables a codec shares between all its caches
    (see :func:`shared_storages`). A cache that held a reference to the model would have the weights counted too;
    that is deliberate, as it is memory the cache keeps alive.
    """
    excluded = set(excluding)
    return sum(size for key, size in tensor_storages(cache).items() if key not in excluded)


def shared_storages(*caches) -> dict[StorageKey, int]:
    """Storages held by every one of ``caches``: tables a codec shares between all its caches.

    Codebooks or rotation matrices are a fixed cost paid once per model, not per token or per sequence, so they are
    reported apart from bits per element. Pass caches made independently by the same factory; they are all alive
    during the call, so equal storage keys really are the same memory.
    """
    common = tensor_storages(caches[0])
    for cache in caches[1:]:
        held = tensor_storages(cache)
        common = {key: size for key, size in common.items() if key in held}
    return {key: size for key, size in common.items() if size > 0}


@dataclass(frozen=True)
class CacheFootprint:
    """What a cache costs in memory, counted from the tensors it references (see :func:`cache_footprint`)."""

    state_bytes: int  # held for this cache's own tokens: codes, scales, exact windows, positions
    table_bytes: int  # per-model tables it references, shared with every cache of the model: codebooks and the
    # tables built from them (lazily, by the steps that read them)

    @property
    def total_bytes(self) -> int:
        """What keeping this cache alive costs when it is the model's only cache: its state and every table."""
        return self.state_bytes + self.table_bytes


def cache_footprint(cache, twin) -> CacheFootprint:
    """``cache``'s bytes, its own state apart from the per-model tables it references.

    ``twin`` is a second cache made the same way (the same factory, alive during the call), typically fresh: the
    storages both reach are the tables. Tables built lazily (e.g. the GSRQ code-reading attention's key tables, built
    by a layer's first decode step) are reachable from the twin once built, so measure after the steps of interest.
    The total is every storage reachable from ``cache`` (:func:`cache_bytes` with nothing excluded), however it
    splits.
    """
    shared = shared_storages(cache, twin)
    return CacheFootprint(state_bytes=cache_bytes(cache, excluding=shared), table_bytes=sum(shared.values()))


def dynamic_cache_bytes(config, tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes a transformers ``DynamicCache`` of ``dtype`` holds for ``tokens`` tokens of one sequence of the model
    whose config is ``config``: the keys and values of every layer and KV head, nothing else."""
    shape = model_fingerprint(config)
    elements = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"]
    return tokens * elements * torch.empty((), dtype=dtype).element_size()
