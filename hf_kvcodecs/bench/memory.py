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

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

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
