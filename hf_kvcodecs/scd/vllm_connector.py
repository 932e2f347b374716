"""SCD as a vLLM KV connector (V1 API), registered out of tree::

    LLM(model=..., disable_hybrid_kv_cache_manager=True, kv_transfer_config={
        "kv_connector": "SCDConnector", "kv_connector_module_path": "hf_kvcodecs.scd.vllm_connector",
        "kv_role": "kv_producer",   # or "kv_consumer" (or "kv_both")
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"knowledge_base": "kb_dir", "storage_path": "payload_dir"}})

It follows vLLM's ``ExampleConnector`` (``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``):
producer and consumer share a directory, and a prompt's KV goes through it as one file named by the hash of the
prompt's token ids. What travels is not raw KV but a checked SCD payload (:mod:`hf_kvcodecs.scd.paged_transfer`):

- The producer (``save_kv_layer``) reads each layer's keys and values of the prompt from vLLM's paged cache as the
  prefill writes them, and ``wait_for_save`` codes them with the knowledge base (RoPE undone, Reuse codes) and
  writes the payload.
- The consumer's scheduler (``get_num_new_matched_tokens``) offers the prompt's tokens only when a payload for this
  knowledge base, these models and exactly this prompt is stored and passes every check; its worker
  (``start_load_kv``) decodes the codes into its own keys and values and writes them into the paged cache with the
  attention backend's own cache writer. A payload that fails there (gone, corrupt, for something else) marks the
  request's blocks as load errors (``get_block_ids_with_load_errors``): with ``kv_load_failure_policy="recompute"``
  vLLM computes them itself, and nothing of that payload is used.

Only Reuse-only knowledge bases without exact tokens are accepted (the constructor refuses others): Patch layers and
exact tokens need the consumer's own decoder layers to run over the prompt, which a connector cannot do
(:func:`~hf_kvcodecs.scd.paged_transfer.check_paged_knowledge_base`). Each worker loads the served checkpoint once
with transformers to check it is the knowledge base's producer or consumer (weight hashes) and to read its RoPE
frequencies. One GPU / CPU worker (tensor_parallel_size 1) and unquantized KV caches only.

vLLM is not a dependency of hf_kvcodecs and nothing in the package imports this module; it is imported by vLLM,
in an environment that has vLLM (``make vllm-env``; docs/scd-vllm.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from .knowledge_base import KnowledgeBaseError, SCDKnowledgeBase
from .manifest import PairMismatchError
from .paged_transfer import (
    PromptPayloadStore,
    check_paged_knowledge_base,
    decode_prompt_kv,
    encode_prompt_kv,
    payload_limits,
    read_prompt_payload,
)
from .payload import PayloadError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

# what a refused payload raises: it is then recomputed, never used
REFUSALS = (PayloadError, PairMismatchError, KnowledgeBaseError, ValueError, OSError)


def prefix_tokens(prompt_tokens: int, block_size: int) -> int:
    """The prompt tokens a payload covers: whole blocks, leaving at least the last prompt token to vLLM (its logits
    give the first new token), as vLLM's ExampleConnector does."""
    return max(prompt_tokens - 1, 0) // block_size * block_size


def slot_mapping(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """The paged-cache slots of tokens ``start .. end - 1`` of a request holding ``block_ids``."""
    tokens = torch.arange(start, end)
    return torch.as_tensor(block_ids, dtype=torch.int64)[tokens // block_size] * block_size + tokens % block_size


@dataclass
class TransferSpec:
    """One request's payload move this step: the prompt prefix it covers (``token_ids``), the request's blocks, and
    the tokens ``start .. end - 1`` to write (a consumer skips the blocks vLLM already holds); a producer saves
    ``0 .. len(token_ids) - 1``."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int


@dataclass
class SCDConnectorMetadata(KVConnectorMetadata):
    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)


class PagedLayout:
    """Where an attention backend's cache writer puts each token's key and value elements inside one block of the
    paged cache, found by writing known values with that writer into a one-block scratch cache. The CPU backend, for
    one, does not store keys as plain ``[block, head, token, dim]`` rows, and its layout depends on the instruction
    set; probing reads whatever layout the writer uses. Values are written as integers of at most 8 significant bits
    (exact in bfloat16 and float16), one base-255 digit per pass."""

    def __init__(self, write, cache_like: torch.Tensor, block_size: int, heads: int, head_dim: int):
        self.block_size, self.heads, self.head_dim = block_size, heads, head_dim
        scratch = torch.zeros((1, *cache_like.shape[1:]), dtype=cache_like.dtype, device=cache_like.device)
        count = block_size * heads * head_dim
        element = torch.arange(count, device=cache_like.device)
        slots = torch.arange(block_size, device=cache_like.device)
        self.positions = []
        for which in (0, 1):  # keys, then values
            position = torch.zeros(scratch.numel(), dtype=torch.int64, device=cache_like.device)
            found = torch.zeros(scratch.numel(), dtype=torch.bool, device=cache_like.device)
            digits, scale = 0, 1
            while scale < count or digits == 0:
                digit = (element // scale) % 255 + 1
                tensors = [torch.zeros(block_size, heads, head_dim, dtype=scratch.dtype, device=scratch.device)] * 2
                tensors[which] = digit.reshape(block_size, heads, head_dim).to(scratch.dtype)
                scratch.zero_()
                write(tensors[0], tensors[1], scratch, slots)
                written = scratch.reshape(-1).float().round().long()
                found |= written > 0
                position += (written - 1).clamp_min(0) * scale
                digits, scale = digits + 1, scale * 255
            flat = torch.nonzero(found).reshape(-1)
            if flat.numel() != count or int(position[flat].max()) >= count:
                raise ValueError(f"The attention backend's cache writer put {flat.numel()} elements of one block's "
                                 f"{'keys' if which == 0 else 'values'} where {count} were written; the SCD connector "
                                 "cannot read this KV cache layout (an unquantized cache is needed).")
            index = torch.full((count,), -1, dtype=torch.int64, device=cache_like.device)
            index[position[flat]] = flat
            if bool((index < 0).any()):
                raise ValueError("The attention backend's cache writer does not place each key and value element "
                                 "in a place of its own; the SCD connector cannot read this KV cache layout.")
            self.positions.append(index)

    def read(self, cache: torch.Tensor, block_ids: list[int], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[tokens, heads, head_dim]`` of a request's first ``tokens`` tokens."""
        blocks = cache[torch.as_tensor(block_ids[:-(-tokens // self.block_size)], device=cache.device)]
        flat = blocks.reshape(blocks.shape[0], -1)
        shape = (-1, self.heads, self.head_dim)
        return tuple(flat[:, index].reshape(shape)[:tokens] for index in self.positions)


@dataclass
class ServedModel:
    """What a worker needs of the model vLLM serves: its identity (checked against the knowledge base), its RoPE
    frequencies and its KV shape, read once from the checkpoint with transformers."""

    identity: dict
    inv_freq: torch.Tensor
    attention_scaling: float
    kv_heads: int
    head_dim: int

    @classmethod
    def load(cls, checkpoint: str, kb: SCDKnowledgeBase, *, producer: bool, consumer: bool) -> ServedModel:
        from transformers import AutoModelForCausalLM

        from ..rope import find_rotary_parameters
        from .cache import check_consumer
        from .encode import check_producer
        from .model_access import model_identity, shapes

        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto").eval()
        identity = check_producer(model, kb) if producer else model_identity(model)
        if consumer:
            check_consumer(model, kb)
        if kb.tokenizer_sha256 is not None:  # token ids mean the same on both sides
            from transformers import AutoTokenizer

            from .manifest import check_tokenizer

            check_tokenizer(AutoTokenizer.from_pretrained(checkpoint), kb, "producer" if producer else "consumer")
        inv_freq, scaling = find_rotary_parameters(model)
        model_shapes = shapes(model)
        return cls(identity, inv_freq, scaling, model_shapes.kv_heads, model_shapes.head_dim)


def _extra(config, key: str) -> Any:
    value = config.get_from_extra_config(key, None)
    if not value:
        raise ValueError(f"SCDConnector needs kv_connector_extra_config[{key!r}]: 'knowledge_base' (the directory of "
                         "a Reuse-only SCD knowledge base) and 'storage_path' (the directory payloads go through).")
    return value


class SCDConnector(KVConnectorBase_V1):
    """Moves a prompt's KV between vLLM instances as an SCD payload of Reuse codes (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self._producer, self._consumer = transfer.is_kv_producer, transfer.is_kv_consumer
        self._kb = SCDKnowledgeBase.load(_extra(transfer, "knowledge_base"))
        check_paged_knowledge_base(self._kb)
        self._store = PromptPayloadStore(_extra(transfer, "storage_path"))
        self._block_size = vllm_config.cache_config.block_size
        self._max_tokens = vllm_config.model_config.max_model_len
        self._max_bytes = payload_limits(self._max_tokens).max_payload_bytes(self._kb)
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("SCDConnector codes every KV head of a layer at once; run it with "
                             "tensor_parallel_size=1.")
        if str(vllm_config.cache_config.cache_dtype) not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"SCDConnector reads and writes unquantized KV caches; kv_cache_dtype="
                             f"{vllm_config.cache_config.cache_dtype!r} is quantized. Leave it at 'auto'.")
        # scheduler side
        self._local_hits: dict[str, int] = {}  # request -> tokens vLLM already held when it asked
        self._loads: dict[str, tuple[Request, int, int]] = {}  # request -> (request, start, end) to load
        self._pending_saves: dict[str, TransferSpec] = {}  # producer prompts whose prefill has not reached `end`
        self._verdicts: dict[tuple[str, int, int], bool] = {}  # (file, mtime, size) -> usable
        # worker side
        self._served: ServedModel | None = None
        if role == KVConnectorRole.WORKER:
            self._served = ServedModel.load(vllm_config.model_config.model, self._kb, producer=self._producer,
                                            consumer=self._consumer)
        self._layouts: dict[tuple, PagedLayout] = {}
        self._saving: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._load_errors: set[int] = set()

    # ==============================
    # Worker-side methods
    # ==============================

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Decode every payload this step loads and write its keys and values into the paged cache, layer by layer,
        with each attention layer's own cache writer. A payload refused here marks its blocks as load errors."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, SCDConnectorMetadata)
        if not metadata.loads:
            return
        attention = {name: layer for name, layer in forward_context.no_compile_layers.items()
                     if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)}
        served = self._served
        for load in metadata.loads:
            try:
                payload = self._store.read(load.token_ids, self._max_bytes)
                if payload is None:
                    raise PayloadError("the payload the scheduler found is gone")
                layers = decode_prompt_kv(payload, self._kb, load.token_ids, served.inv_freq,
                                          served.attention_scaling, served.kv_heads, served.head_dim, torch.float32,
                                          max_tokens=self._max_tokens)
            except REFUSALS as error:
                logger.warning("SCD payload for request %s refused, its %d tokens are recomputed: %s",
                               load.request_id, load.end - load.start, error)
                first, last = load.start // self._block_size, -(-load.end // self._block_size)
                self._load_errors.update(load.block_ids[first:last])
                continue
            for name, layer in attention.items():
                keys, values = layers[extract_layer_index(name)]
                cache = layer.kv_cache
                slots = slot_mapping(load.block_ids, self._block_size, load.start, load.end).to(cache.device)
                layer.impl.do_kv_cache_update(layer, keys[load.start:load.end].to(cache.device, cache.dtype),
                                              values[load.start:load.end].to(cache.device, cache.dtype), cache, slots)
            logger.info("SCD: loaded %d tokens of request %s from a %d-byte payload", load.end - load.start,
                        load.request_id, len(payload))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in :meth:`start_load_kv`, before the forward: nothing to wait for."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Copy this layer's keys and values of every prompt saved this step out of the paged cache (the layer has
        just written them)."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, SCDConnectorMetadata)
        if not metadata.saves:
            return
        layout = self._layout(layer_name, kv_layer)
        index = extract_layer_index(layer_name)
        for save in metadata.saves:
            keys, values = layout.read(kv_layer, save.block_ids, save.end)
            self._saving.setdefault(save.request_id, {})[index] = (keys.float().cpu(), values.float().cpu())

    def wait_for_save(self):
        """Code each prompt saved this step and write its payload (synchronously: the blocks are free to reuse
        when this returns)."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, SCDConnectorMetadata)
        served = self._served
        for save in metadata.saves:
            layers = self._saving.pop(save.request_id, {})
            if sorted(layers) != list(range(self._kb.num_layers)):
                logger.warning("SCD: request %s's prefill gave layers %s, not the knowledge base's %d; no payload "
                               "written.", save.request_id, sorted(layers), self._kb.num_layers)
                continue
            payload = encode_prompt_kv(self._kb, served.identity, save.token_ids,
                                       [layers[index] for index in range(self._kb.num_layers)], served.inv_freq,
                                       served.attention_scaling)
            path = self._store.write(save.token_ids, payload)
            logger.info("SCD: wrote %d bytes for %d tokens (%.1f bytes/token) to %s", len(payload), save.end,
                        len(payload) / max(save.end, 1), path)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose payload was refused in :meth:`start_load_kv`; vLLM recomputes them
        (``kv_load_failure_policy="recompute"``) or fails the request (``"fail"``, vLLM's default)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer runs inside the forward, between attention layers

    def _layout(self, layer_name: str, kv_layer: torch.Tensor) -> PagedLayout:
        from vllm.forward_context import get_forward_context

        layer = get_forward_context().no_compile_layers[layer_name]
        key = (type(layer.impl), tuple(kv_layer.shape[1:]), kv_layer.dtype, kv_layer.device)
        if key not in self._layouts:
            if kv_layer.shape[0] != self._kv_cache_config.num_blocks:
                raise ValueError(f"The paged cache of {layer_name} has {kv_layer.shape[0]} kernel blocks for "
                                 f"{self._kv_cache_config.num_blocks} scheduler blocks; SCDConnector needs them equal "
                                 "(pick a block_size the attention backend uses as is).")

            def write(keys, values, cache, slots):
                layer.impl.do_kv_cache_update(layer, keys, values, cache, slots)

            self._layouts[key] = PagedLayout(write, kv_layer, self._block_size, self._served.kv_heads,
                                             self._served.head_dim)
        return self._layouts[key]

    # ==============================
    # Scheduler-side methods
    # ==============================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The prompt tokens a stored payload covers beyond what vLLM holds, when one for exactly this prompt passes
        every check (container, knowledge base, models, tokenizer, prompt hash); 0 otherwise."""
        if not self._consumer:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        tokens = prefix_tokens(len(prompt), self._block_size)
        if tokens <= num_computed_tokens or not self._usable(prompt[:tokens]):
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        return tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        if num_external_tokens > 0:
            start = self._local_hits.pop(request.request_id, 0)
            self._loads[request.request_id] = (request, start, start + num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        metadata = SCDConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            blocks = list(new.block_ids[0])
            if new.req_id in self._loads:
                _, start, end = self._loads.pop(new.req_id)
                metadata.loads.append(TransferSpec(new.req_id, prompt[:end], blocks, start, end))
                continue
            tokens = prefix_tokens(len(prompt), self._block_size)
            # a stored payload this knowledge base cannot use (another save, model or prompt) is replaced
            if self._producer and tokens and not self._usable(prompt[:tokens], refusal_is_news=False):
                self._pending_saves[new.req_id] = TransferSpec(new.req_id, prompt[:tokens], blocks, 0, tokens)
                self._maybe_save(metadata, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            resumed = request_id in cached.resumed_req_ids
            if request_id in self._loads and resumed and new_blocks is not None:
                request, start, end = self._loads.pop(request_id)
                prompt = list(request.prompt_token_ids or [])
                metadata.loads.append(TransferSpec(request_id, prompt[:end], list(new_blocks[0]), start, end))
            pending = self._pending_saves.get(request_id)
            if pending is not None:
                if new_blocks is not None:
                    pending.block_ids = list(new_blocks[0]) if resumed else pending.block_ids + list(new_blocks[0])
                self._maybe_save(metadata, request_id, cached.num_computed_tokens[i] + scheduled.get(request_id, 0))
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are written before the step returns, so the blocks can be freed now."""
        for pending in (self._local_hits, self._loads, self._pending_saves):
            pending.pop(request.request_id, None)
        return False, None

    def _maybe_save(self, metadata: SCDConnectorMetadata, request_id: str, computed_after_step: int) -> None:
        """Save a pending prompt in the step whose forward completes its covered tokens."""
        if computed_after_step >= self._pending_saves[request_id].end:
            metadata.saves.append(self._pending_saves.pop(request_id))

    def _usable(self, token_ids: list[int], refusal_is_news: bool = True) -> bool:
        """Whether the stored payload for this prompt passes every check; the verdict is kept per file version. A
        consumer logs a refusal (the prompt is then computed); a producer about to replace the file does not."""
        path = self._store.path(token_ids)
        try:
            stat = path.stat()
        except FileNotFoundError:
            return False
        version = (str(path), stat.st_mtime_ns, stat.st_size)
        if version not in self._verdicts:
            if len(self._verdicts) > 1024:
                self._verdicts.clear()
            try:
                payload = self._store.read(token_ids, self._max_bytes)
                if payload is None:
                    return False
                read_prompt_payload(payload, self._kb, token_ids, max_tokens=self._max_tokens)
                self._verdicts[version] = True
            except REFUSALS as error:
                if refusal_is_news:
                    logger.warning("SCD: the stored payload %s is refused, so the prompt is computed: %s", path, error)
                self._verdicts[version] = False
        return self._verdicts[version]
