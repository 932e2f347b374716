"""The consumer's side: ``SCDTransferCache``, a transformers ``DynamicCache`` rebuilt from an SCD payload.

Reuse layers are decoded from their codes; at a recompute Patch layer the consumer predicts its own residual stream
from the code and the per-token RMS and runs its own decoder layers of that block over the prompt (LoRA included),
which write their keys and values; a projection-only Patch layer (an ablation) projects the predicted normalized
input with that layer's ``k_proj`` / ``v_proj``. Keys get RoPE at the consumer's positions, and the first few tokens
(attention sinks) are computed by the consumer itself. The result is an ordinary ``DynamicCache``, so
``generate()`` continues from it exactly as from its own prefill: greedy, sampling, beam search, padded batches.

Every check a payload must pass comes before any state is built, and each refusal names what differs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from ..rope import find_rotary_parameters
from .coding import consumer_angles, predict_residual, rebuild_layer, rms_dtype
from .encode import CODEC_ID, CODEC_VERSION, READABLE_CODEC_VERSIONS, PairMismatchError, check_left_padded
from .knowledge_base import CODE_BITS, LayerPlan, SCDKnowledgeBase, _read_plan
from .model_access import (
    decoder_layers,
    model_identity,
    positions_from_mask,
    run_decoder_block,
    shapes,
    text_config,
    token_ids_sha256,
    unwrapped,
)
from .payload import PayloadError, unpack_payload

logger = logging.getLogger(__name__)


_LOADED: dict[tuple[str, int, int], SCDKnowledgeBase] = {}


def load_knowledge_base(directory: str | Path) -> SCDKnowledgeBase:
    """:meth:`SCDKnowledgeBase.load`, memoized on the resolved path and the description's modification time and
    size: a checkpoint whose default cache names a directory would otherwise read it at every ``generate()``."""
    from .knowledge_base import METADATA_FILE

    path = Path(directory).resolve()
    try:
        stat = (path / METADATA_FILE).stat()
    except OSError:
        return SCDKnowledgeBase.load(path)  # raises the clear missing-file error
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key not in _LOADED:
        if len(_LOADED) > 16:
            _LOADED.clear()
        _LOADED[key] = SCDKnowledgeBase.load(path)
    return _LOADED[key]


def check_consumer(consumer, kb: SCDKnowledgeBase) -> None:
    identity = model_identity(consumer)
    expected = kb.consumer
    for key, what in (("weights_sha256", "weights"), ("adapter_sha256", "LoRA adapter")):
        if expected.get(key) == identity[key]:
            continue
        if expected.get("merged_weights_sha256") == identity["weights_sha256"] and identity["adapter_sha256"] is None:
            return  # the same consumer with its adapter merged into the weights
        raise PairMismatchError(
            f"This consumer's {what} (sha256 {str(identity[key])[:12]}) differ from those the knowledge base was "
            f"fitted for ({str(expected.get(key))[:12]}, model {expected.get('name')!r}); fit a knowledge base for this "
            "consumer with `hf-kvcodecs scd fit --consumer ...`.")


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise PayloadError(message)


def _check_manifest(manifest: dict, sections: dict[str, torch.Tensor], kb: SCDKnowledgeBase) -> list[LayerPlan]:
    _expect(manifest.get("codec") == CODEC_ID, f"This payload's codec is {manifest.get('codec')!r}, not SCD's "
            f"{CODEC_ID!r}.")
    version = manifest.get("codec_version")
    _expect(type(version) is int and version in READABLE_CODEC_VERSIONS,
            f"SCD codec version {version!r} is not supported (this hf_kvcodecs reads {CODEC_VERSION}); upgrade "
            "hf_kvcodecs on the consumer or re-encode on the producer.")
    if manifest.get("knowledge_base") != kb.save_id:
        raise PairMismatchError(f"The payload was coded with knowledge base {manifest.get('knowledge_base')!r}; this "
                                f"one is {kb.save_id!r}. Use the knowledge base the producer used.")
    for side in ("producer", "consumer"):
        named = manifest.get(side) if isinstance(manifest.get(side), dict) else {}
        for key, what in (("weights_sha256", "weights"), ("adapter_sha256", "LoRA adapter")):
            if named.get(key) != getattr(kb, side).get(key):
                raise PairMismatchError(f"The payload names a {side} whose {what} differ from the knowledge base's "
                                        f"({str(named.get(key))[:12]} != {str(getattr(kb, side).get(key))[:12]}).")
    if manifest.get("tokenizer_sha256") != kb.tokenizer_sha256:
        raise PairMismatchError("The payload was tokenized with another tokenizer than the knowledge base's.")
    for key in ("batch", "tokens", "exact_columns", "code_bits"):
        _expect(type(manifest.get(key)) is int and manifest[key] >= 0, f"The payload's {key} must be a non-negative "
                f"integer, got {manifest.get(key)!r}.")
    batch, tokens, exact = manifest["batch"], manifest["tokens"], manifest["exact_columns"]
    _expect(batch >= 1 and tokens >= 1 and exact <= tokens, f"Inconsistent payload sizes: batch {batch}, tokens "
            f"{tokens}, exact columns {exact}.")
    bits = manifest["code_bits"]
    _expect(bits in CODE_BITS and bits >= kb.code_bits, f"The payload's codes are {bits}-bit; this knowledge base "
            f"decodes {kb.code_bits}-bit codes or finer.")
    try:
        plan = _read_plan(manifest.get("layers"))
    except ValueError as error:
        raise PayloadError(f"The payload's layer table is malformed: {error}.") from None
    _expect(len(plan) == kb.num_layers, f"The payload has {len(plan)} layers; the knowledge base {kb.num_layers}.")
    coded = tokens - exact
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "input.attention_mask": ((batch, tokens), torch.uint8),
        "input.exact_token_ids": ((batch, exact), torch.int64),
    }
    for carried, fitted in zip(plan, kb.plan):
        _expect(carried.index == fitted.index, f"The payload's layer table lists layer {carried.index} where the "
                f"knowledge base has layer {fitted.index}.")
        _expect((carried.kind, carried.patch_mode, carried.depth) == (fitted.kind, fitted.patch_mode, fitted.depth),
                f"Layer {carried.index} is {_describe(carried)} in the payload but {_describe(fitted)} in the "
                "knowledge base.")
        if carried.kind == "recomputed":
            continue
        ranks = ((carried.key_rank, fitted.key_rank, "key"), (carried.value_rank, fitted.value_rank, "value")) \
            if carried.kind == "reuse" else ((carried.patch_rank, fitted.patch_rank, "patch"),)
        for rank, limit, name in ranks:
            _expect(1 <= rank <= limit or (rank == 0 == limit), f"Layer {carried.index} carries {name} rank {rank}; "
                    f"the knowledge base decodes 1..{limit}.")
            if coded == 0:
                continue
            width = rank if bits != 4 else (rank + 1) // 2
            code_dtype = {4: torch.uint8, 8: torch.int8, 16: torch.float16, 32: torch.float32}[bits]
            expected[f"layers.{carried.index}.{name}_codes"] = ((batch, coded, width), code_dtype)
            if bits < 16:
                expected[f"layers.{carried.index}.{name}_scales"] = ((batch, coded), torch.float16)
        if carried.recomputes and coded:
            expected[f"layers.{carried.index}.patch_rms"] = ((batch, coded), rms_dtype(bits))
    unexpected = sorted(set(sections) - set(expected))
    missing = sorted(set(expected) - set(sections))
    _expect(not missing and not unexpected, f"The payload's sections do not match its manifest (missing: "
            f"{missing[:5]}, unexpected: {unexpected[:5]}).")
    for name, (shape, dtype) in expected.items():
        tensor = sections[name]
        _expect(tuple(tensor.shape) == shape and tensor.dtype == dtype, f"Section {name!r} is {tensor.dtype} "
                f"{tuple(tensor.shape)}; the manifest implies {dtype} {shape}.")
        if tensor.is_floating_point():
            _expect(bool(torch.isfinite(tensor).all()), f"Section {name!r} holds non-finite values.")
    mask = sections["input.attention_mask"]
    _expect(bool(((mask == 0) | (mask == 1)).all()), "The payload's attention mask must hold only 0 and 1.")
    try:
        check_left_padded(mask)
    except ValueError as error:
        raise PayloadError(f"The payload's attention mask is invalid: {error}") from None
    return plan


def _describe(layer: LayerPlan) -> str:
    if layer.kind != "patch":
        return repr(layer.kind)
    return f"a {layer.patch_mode} Patch layer of depth {layer.depth}"


@torch.inference_mode()
def rebuild_into(cache: DynamicCache, consumer, kb: SCDKnowledgeBase, plan: list[LayerPlan],
                 sections: dict[str, torch.Tensor], code_bits: int) -> dict[str, float]:
    """Fill an empty ``cache`` with the consumer's states for the prompt ``sections`` describe; the seconds spent
    on the exact tokens, the Reuse layers, the projection-only Patch layers and the recompute Patch blocks."""
    started = time.perf_counter()
    mask = sections["input.attention_mask"].long()
    exact_ids = sections["input.exact_token_ids"]
    exact = exact_ids.shape[1]
    model_shapes = shapes(consumer)
    dtype = next(unwrapped(consumer).parameters()).dtype
    device = next(unwrapped(consumer).parameters()).device
    exact_cache = DynamicCache(config=text_config(consumer))
    if exact:
        exact_mask = mask[:, :exact]
        consumer(input_ids=exact_ids.to(device), attention_mask=exact_mask.to(device),
                 position_ids=positions_from_mask(exact_mask).to(device), cache=exact_cache, use_cache=True,
                 logits_to_keep=1)
    seconds = {"exact": time.perf_counter() - started, "reuse": 0.0, "patch": 0.0, "recompute": 0.0}
    inv_freq, scaling = find_rotary_parameters(unwrapped(consumer))
    positions = positions_from_mask(mask)[:, exact:]
    cos, sin = (angle.to(device) for angle in consumer_angles(inv_freq, scaling, positions))
    for layer_plan, layer in zip(plan, decoder_layers(consumer)):
        layer_started = time.perf_counter()
        if layer_plan.kind == "recomputed" and positions.shape[1]:
            continue  # written by its block
        if layer_plan.recomputes and positions.shape[1]:
            _recompute_block(cache, consumer, kb, layer_plan, sections, code_bits, exact_cache, mask, positions)
            seconds["recompute"] += time.perf_counter() - layer_started
            continue
        if positions.shape[1]:
            layer_sections = {name: tensor.to(device) for name, tensor in sections.items()
                              if name.startswith(f"layers.{layer_plan.index}.")}
            keys, values = rebuild_layer(layer, layer_plan, kb, layer_sections, code_bits, cos, sin,
                                         (model_shapes.kv_heads, model_shapes.head_dim), dtype)
            if exact:
                exact_layer = exact_cache.layers[layer_plan.index]
                keys, values = torch.cat((exact_layer.keys, keys), 2), torch.cat((exact_layer.values, values), 2)
        else:
            keys, values = exact_cache.layers[layer_plan.index].keys, exact_cache.layers[layer_plan.index].values
        cache.update(keys, values, layer_plan.index)
        seconds["reuse" if layer_plan.kind == "reuse" else "patch"] += time.perf_counter() - layer_started
    return seconds


def _recompute_block(cache: DynamicCache, consumer, kb: SCDKnowledgeBase, layer_plan: LayerPlan,
                     sections: dict[str, torch.Tensor], code_bits: int, exact_cache: DynamicCache,
                     mask: torch.Tensor, positions: torch.Tensor) -> None:
    """Run the consumer's layers of one recompute Patch block from the predicted residual stream; each layer attends
    to the exact tokens' own states and to the coded tokens' recomputed ones."""
    first, depth = layer_plan.index, layer_plan.depth
    block_cache = DynamicCache(config=text_config(consumer))
    for index, exact_layer in enumerate(exact_cache.layers):
        if getattr(exact_layer, "keys", None) is not None and exact_layer.keys.numel():
            block_cache.update(exact_layer.keys, exact_layer.values, index)
    device = next(unwrapped(consumer).parameters()).device
    layer_sections = {name: tensor.to(device) for name, tensor in sections.items()
                      if name.startswith(f"layers.{first}.")}
    residual = predict_residual(layer_plan, kb, layer_sections, code_bits)
    run_decoder_block(consumer, residual, mask, positions, block_cache, first, depth)
    for index in range(first, first + depth):
        cache.update(block_cache.layers[index].keys, block_cache.layers[index].values, index)


class SCDTransferCache(DynamicCache):
    """A ``DynamicCache`` whose prefix was rebuilt from an SCD payload instead of computed.

    ``transfer_report`` holds what the rebuild cost: payload bytes and bytes per token, and the seconds spent
    checking and unpacking, recomputing the exact (sink) tokens, decoding Reuse layers and projecting Patch layers.
    """

    transfer_report: dict

    @classmethod
    @torch.inference_mode()
    def from_payload(cls, payload: bytes | bytearray | memoryview, consumer, kb: SCDKnowledgeBase | str | Path, *,
                     input_ids: torch.Tensor | None = None, max_payload_bytes: int = 1 << 34,
                     expand: int = 1) -> SCDTransferCache:
        """Rebuild the consumer's cache for the payload's prompt.

        Pass the prompt's ``input_ids`` (with generate()'s ``attention_mask`` convention, left-padded) to have the
        payload checked against it; ``generate(input_ids, attention_mask=..., cache=this)`` must then be given the
        same prompt followed by at least one token it has not seen (typically the question or the prompt's last
        token, which the producer leaves out).

        ``expand`` repeats every row that many times, as ``generate()`` expands its inputs for beam search
        (``num_beams``) or several samples (``num_return_sequences``): it does not expand a cache it is given.
        """
        started = time.perf_counter()
        if not isinstance(kb, SCDKnowledgeBase):
            kb = load_knowledge_base(kb)
        check_consumer(consumer, kb)
        manifest, sections = unpack_payload(payload, max_bytes=max_payload_bytes)
        plan = _check_manifest(manifest, sections, kb)
        mask = sections["input.attention_mask"].long()
        if input_ids is not None:
            ids = input_ids if input_ids.ndim == 2 else input_ids[None]
            if ids.shape[0] != mask.shape[0] or ids.shape[1] < mask.shape[1]:
                raise PairMismatchError(f"The payload covers a prompt of {tuple(mask.shape)} tokens; input_ids has "
                                        f"shape {tuple(ids.shape)}.")
            if token_ids_sha256(ids[:, :mask.shape[1]], mask) != manifest.get("token_ids_sha256"):
                raise PairMismatchError("The payload was encoded for another prompt (its token-id hash differs from "
                                        "these input_ids' first tokens and attention mask).")
        model_shapes = shapes(consumer)
        if model_shapes.layers != len(plan):
            raise PairMismatchError(f"The consumer has {model_shapes.layers} layers; the payload {len(plan)}.")
        unpacked = time.perf_counter()
        cache = cls(config=text_config(consumer))
        seconds = rebuild_into(cache, consumer, kb, plan, sections, manifest["code_bits"])
        cache.transfer_report = {
            "payload_bytes": len(payload), "tokens": int(mask.numel()),
            "bytes_per_token": len(payload) / max(int(mask.numel()), 1),
            "unpack_seconds": unpacked - started, "exact_seconds": seconds["exact"],
            "reuse_seconds": seconds["reuse"], "patch_seconds": seconds["patch"],
            "recompute_seconds": seconds["recompute"],
            "total_seconds": time.perf_counter() - started, "exact_columns": manifest["exact_columns"],
            "patch_layers": [layer.index for layer in plan if layer.kind == "patch"],
            "recompute_blocks": [[layer.index, layer.depth] for layer in plan if layer.recomputes],
        }
        cache.prompt_attention_mask = mask
        if expand != 1:
            if type(expand) is not int or expand < 1:
                raise ValueError(f"expand must be a positive integer (num_beams or num_return_sequences), got {expand!r}.")
            cache.batch_repeat_interleave(expand)
        return cache

    @classmethod
    def for_generate(cls, model, *, payload=None, knowledge_base=None, input_ids=None, expand=1,
                     **unknown) -> SCDTransferCache:
        """``generate(cache_implementation="scd", cache_config={"payload": bytes, "knowledge_base": kb_or_dir})``;
        add ``"expand": num_beams`` for beam search."""
        if unknown:
            raise ValueError(f"Unknown cache_config keys for cache_implementation='scd': {sorted(unknown)}; it takes "
                             "payload, knowledge_base and (optionally) input_ids and expand.")
        if payload is None or knowledge_base is None:
            raise ValueError("cache_implementation='scd' needs cache_config={'payload': <bytes from "
                             "hf_kvcodecs.scd.encode>, 'knowledge_base': <SCDKnowledgeBase or its directory>}.")
        return cls.from_payload(payload, model, knowledge_base, input_ids=input_ids, expand=expand)
