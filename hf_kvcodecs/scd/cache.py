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

import io
import logging
import time
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from ..transport.chunks import ChunkStream
from .knowledge_base import SCDKnowledgeBase
from .manifest import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_TOKENS,
    PairMismatchError,
    PayloadLimits,
    PayloadManifest,
    check_tokenizer,
    identity_mismatch,
)
from .model_access import model_identity, shapes, text_config, unwrapped
from .payload import unpack_payload
from .progressive import merge_all
from .rebuild import rebuild_into
from .stream import read_and_rebuild

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
    """Refuse a consumer that is not the one ``kb`` was fitted for: other weights, or another adapter applied (none,
    another one active, adapters disabled, another scaling). The same consumer with its adapter merged into its
    weights (``merge_and_unload()``) is accepted when ``kb`` records the merged weights' hash."""
    identity = model_identity(consumer)
    expected = kb.consumer
    problem = identity_mismatch(identity, expected, "consumer")
    if problem is None:
        return
    if expected.get("merged_weights_sha256") == identity["weights_sha256"] and identity["adapter_sha256"] is None:
        return  # the same consumer with its adapter merged into the weights
    raise PairMismatchError(f"{problem}; fit a knowledge base for this consumer with `hf-kvcodecs scd fit "
                            "--consumer ...`.")


def _vocab_size(model) -> int:
    embeddings = unwrapped(model).get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else int(text_config(model).vocab_size)


def _check_receiver(consumer, kb, tokenizer, expand, max_batch: int, max_tokens: int,
                    ) -> tuple[SCDKnowledgeBase, PayloadLimits]:
    """What a consumer checks before it reads a payload's first byte: its arguments, the knowledge base (loaded from
    a directory if need be, and saved) and that it is the consumer, with the tokenizer, the knowledge base is for."""
    if type(expand) is not int or expand < 1:
        raise ValueError(f"expand must be a positive integer (num_beams or num_return_sequences), got {expand!r}.")
    limits = PayloadLimits(max_batch, max_tokens)
    if not isinstance(kb, SCDKnowledgeBase):
        kb = load_knowledge_base(kb)
    kb.identity()  # KnowledgeBaseError: an unsaved knowledge base cannot tell which payloads are its own
    check_consumer(consumer, kb)
    check_tokenizer(tokenizer, kb, "consumer")
    layers = shapes(consumer).layers
    if layers != kb.num_layers:
        raise PairMismatchError(f"The consumer has {layers} layers; the knowledge base plans {kb.num_layers}.")
    return kb, limits


class SCDTransferCache(DynamicCache):
    """A ``DynamicCache`` whose prefix was rebuilt from an SCD payload instead of computed.

    ``transfer_report`` holds what the rebuild cost: payload bytes and bytes per token, and the seconds spent
    checking and unpacking, recomputing the exact (sink) tokens, decoding Reuse layers and projecting Patch layers.
    ``payload_manifest`` is the payload's validated manifest: ``generate()`` checks its prompt against it (see
    :meth:`check_generate_prompt`), so the cache serves only the prompt the payload was encoded for.
    """

    transfer_report: dict
    payload_manifest: PayloadManifest | None = None
    prompt_attention_mask: torch.Tensor | None = None

    @classmethod
    @torch.inference_mode()
    def from_payload(cls, payload: bytes | bytearray | memoryview, consumer, kb: SCDKnowledgeBase | str | Path, *,
                     input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                     tokenizer=None, max_tokens: int = DEFAULT_MAX_TOKENS, max_batch: int = DEFAULT_MAX_BATCH,
                     max_payload_bytes: int | None = None, expand: int = 1,
                     hmac_key: bytes | None = None) -> SCDTransferCache:
        """Rebuild the consumer's cache for the payload's prompt.

        Everything is checked before any state is built: the consumer is the one ``kb`` was fitted for (weights and
        the adapter it applies now), ``kb`` is saved and is the one the payload names, ``tokenizer`` (optional) is
        the knowledge base's, the payload is well formed and within the limits, and its exact columns are the ones
        ``kb`` makes. Each refusal raises ``PayloadError``, ``PairMismatchError`` or ``KnowledgeBaseError`` naming
        what differs and the fix.

        Limits: a payload may ask for at most ``max_batch`` prompts (default 16) of at most ``max_tokens`` tokens
        (default 32768); the rebuild's work and memory grow with ``batch * tokens``, whatever the payload's size.
        ``max_payload_bytes`` defaults to the largest payload ``kb`` writes within those limits.

        The payload is bound to its prompt: ``generate()`` refuses a prompt whose first tokens (ids and attention
        mask) are not the payload's (through hf_kvcodecs' transformers integration), and so does this method when
        given the prompt's ``input_ids`` (with ``attention_mask``, else the payload's own mask). ``generate(input_ids,
        attention_mask=..., cache=this)`` must be given that prompt followed by at least one token it does not cover
        (typically the prompt's last token, which the producer leaves out).

        ``expand`` repeats every row that many times, as ``generate()`` expands its inputs for beam search
        (``num_beams``) or several samples (``num_return_sequences``): it does not expand a cache it is given.

        ``hmac_key``: the key shared with the producer (``encode(..., hmac_key=)``); with it, a payload not signed
        with that key is refused, and without it a signed payload is.
        """
        started = time.perf_counter()
        kb, limits = _check_receiver(consumer, kb, tokenizer, expand, max_batch, max_tokens)
        max_bytes = limits.max_payload_bytes(kb) if max_payload_bytes is None else max_payload_bytes
        # The manifest, its section table included, is validated before any section becomes a tensor.
        raw, sections = unpack_payload(payload, max_bytes=max_bytes, hmac_key=hmac_key,
                                       check=lambda raw, table: PayloadManifest.parse(raw, kb, limits=limits))
        manifest = PayloadManifest.parse(raw, kb, sections, limits=limits, vocab_size=_vocab_size(consumer))
        plan = list(manifest.layers)
        mask = sections["input.attention_mask"].long()
        if input_ids is not None:
            manifest.check_prompt(input_ids, attention_mask, payload_mask=mask)
        if manifest.progressive is not None:
            sections = merge_all(manifest.layers, manifest.base_layers(), sections, manifest.code_bits)
        unpacked = time.perf_counter()
        cache = cls(config=text_config(consumer))
        seconds = rebuild_into(cache, consumer, kb, plan, sections, manifest.code_bits)
        payload_bytes = memoryview(payload).nbytes
        cache.transfer_report = {
            "payload_bytes": payload_bytes, "tokens": int(mask.numel()),
            "bytes_per_token": payload_bytes / max(int(mask.numel()), 1),
            "unpack_seconds": unpacked - started, "exact_seconds": seconds["exact"],
            "reuse_seconds": seconds["reuse"], "patch_seconds": seconds["patch"],
            "recompute_seconds": seconds["recompute"],
            "total_seconds": time.perf_counter() - started, "exact_columns": manifest.exact_columns,
            "patch_layers": [layer.index for layer in plan if layer.kind == "patch"],
            "recompute_blocks": [[layer.index, layer.depth] for layer in plan if layer.recomputes],
        }
        cache.payload_manifest = manifest
        cache.prompt_attention_mask = mask
        if expand != 1:
            cache.batch_repeat_interleave(expand)
        return cache

    @classmethod
    @torch.inference_mode()
    def from_stream(cls, source, consumer, kb: SCDKnowledgeBase | str | Path, *, partial: str = "fail",
                    deadline_s: float | None = None, byte_budget: int | None = None,
                    input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                    tokenizer=None, max_tokens: int = DEFAULT_MAX_TOKENS, max_batch: int = DEFAULT_MAX_BATCH,
                    max_payload_bytes: int | None = None, expand: int = 1,
                    hmac_key: bytes | None = None) -> SCDTransferCache:
        """Rebuild the consumer's cache from a payload as it arrives: each layer as soon as its sections are in.

        ``source`` is a binary stream (``read(n)``: a file, a socket's ``makefile("rb")``), an iterable of byte
        chunks (a transport's receiver, e.g. :func:`hf_kvcodecs.transport.receive_chunks`) or the payload's bytes.
        Everything :meth:`from_payload` checks is checked, each section as it arrives.

        A stream that stops short (the source raises ``TimeoutError`` or ``ConnectionError``, or ends; a section
        fails its CRC-32; ``deadline_s`` seconds pass between sections; the next section would take the bytes read
        past ``byte_budget``) is handled by ``partial`` (see :mod:`hf_kvcodecs.scd.stream`): ``"fail"`` raises,
        ``"accept"`` decodes what arrived (a progressive payload's base pass is enough; missing sections are never
        filled in), ``"recompute"`` computes the layers that cannot be decoded on the consumer from ``input_ids``,
        the prompt the payload covers. ``transfer_report["stream"]`` records what was used. ``deadline_s`` bounds
        the time between sections as this reader sees it; a blocking read is bounded by the transport's own
        deadline."""
        started = time.perf_counter()
        kb, limits = _check_receiver(consumer, kb, tokenizer, expand, max_batch, max_tokens)
        if isinstance(source, (bytes, bytearray, memoryview)):
            source = io.BytesIO(source)
        elif not hasattr(source, "read"):
            source = ChunkStream(source)
        max_bytes = limits.max_payload_bytes(kb) if max_payload_bytes is None else max_payload_bytes
        manifest, rebuild, mask, report = read_and_rebuild(
            source, consumer, kb, limits=limits, max_bytes=max_bytes, vocab_size=_vocab_size(consumer),
            partial=partial, deadline_s=deadline_s, byte_budget=byte_budget, input_ids=input_ids,
            attention_mask=attention_mask, hmac_key=hmac_key)
        cache = cls(config=text_config(consumer))
        seconds = rebuild.into(cache)
        tokens = int(mask.numel())
        cache.transfer_report = {
            "payload_bytes": report.bytes_received, "tokens": tokens,
            "bytes_per_token": report.bytes_received / max(tokens, 1), "exact_seconds": seconds["exact"],
            "reuse_seconds": seconds["reuse"], "patch_seconds": seconds["patch"],
            "recompute_seconds": seconds["recompute"], "total_seconds": time.perf_counter() - started,
            "exact_columns": manifest.exact_columns if manifest is not None else 0, "stream": report.to_dict(),
        }
        cache.payload_manifest = manifest
        cache.prompt_attention_mask = mask.long()
        if expand != 1:
            cache.batch_repeat_interleave(expand)
        return cache

    def check_generate_prompt(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None) -> None:
        """Refuse a ``generate()`` prompt this cache was not rebuilt for. hf_kvcodecs' transformers integration calls
        it before generation starts, with generate()'s ``input_ids`` (as given, before any beam expansion) and its
        attention mask (None when generate() found no padding): the first ``tokens`` columns must be the payload's
        prompt, and at least one more token must follow. Raises ``PairMismatchError``."""
        if self.payload_manifest is None:
            return
        if input_ids is None:
            raise PairMismatchError("generate() got no input_ids (inputs_embeds only?), so the SCD payload cannot be "
                                    "checked against its prompt; pass the prompt's token ids.")
        if attention_mask is None and isinstance(input_ids, torch.Tensor):
            attention_mask = torch.ones(input_ids.shape[-2:] if input_ids.ndim == 2 else input_ids.shape,
                                        dtype=torch.uint8)  # generate() drops a mask that has no padding
        self.payload_manifest.check_prompt(input_ids, attention_mask, payload_mask=self.prompt_attention_mask,
                                           new_tokens=1, what="generate()'s input_ids")

    @classmethod
    def for_generate(cls, model, *, payload=None, knowledge_base=None, input_ids=None, attention_mask=None,
                     tokenizer=None, expand=1, max_tokens=DEFAULT_MAX_TOKENS, max_batch=DEFAULT_MAX_BATCH,
                     max_payload_bytes=None, hmac_key=None, **unknown) -> SCDTransferCache:
        """``generate(cache_implementation="scd", cache_config={"payload": bytes, "knowledge_base": kb_or_dir})``;
        add ``"expand": num_beams`` for beam search, and ``max_tokens`` / ``max_batch`` / ``max_payload_bytes`` /
        ``tokenizer`` as :meth:`from_payload` takes them. generate() checks its prompt against the payload."""
        if unknown:
            raise ValueError(f"Unknown cache_config keys for cache_implementation='scd': {sorted(unknown)}; it takes "
                             "payload, knowledge_base and (optionally) input_ids, attention_mask, tokenizer, expand, "
                             "max_tokens, max_batch, max_payload_bytes and hmac_key.")
        if payload is None or knowledge_base is None:
            raise ValueError("cache_implementation='scd' needs cache_config={'payload': <bytes from "
                             "hf_kvcodecs.scd.encode>, 'knowledge_base': <SCDKnowledgeBase or its directory>}.")
        return cls.from_payload(payload, model, knowledge_base, input_ids=input_ids, attention_mask=attention_mask,
                                tokenizer=tokenizer, expand=expand, max_tokens=max_tokens, max_batch=max_batch,
                                max_payload_bytes=max_payload_bytes, hmac_key=hmac_key)
