"""The consumer's rebuild of one payload, layer by layer: the exact (sink) tokens' own prefill, each Reuse layer
decoded from its codes, each recompute Patch block run by the consumer's own layers from its predicted residual
stream, and (for a stream cut short under the ``recompute`` policy) the consumer's own first layers.

Every layer's rebuild reads only its own sections and the exact tokens' states, so a streaming consumer rebuilds a
layer as soon as its sections have arrived (:class:`LayerRebuild`), and a whole payload is the same loop
(:func:`rebuild_into`).
"""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import DynamicCache

from ..rope import find_rotary_parameters
from .coding import consumer_angles, predict_residual, rebuild_layer
from .knowledge_base import LayerPlan, SCDKnowledgeBase
from .model_access import decoder_layers, positions_from_mask, run_decoder_block, shapes, text_config, unwrapped

__all__ = ["LayerRebuild", "rebuild_into"]


class LayerRebuild:
    """The consumer's side of one payload, layer by layer, in any order: the exact (sink) tokens' prefill when the
    prompt's sections are known, then each layer's keys and values as soon as that layer's sections are
    (:meth:`layer`), and :meth:`into` a cache at the end. A streaming consumer calls :meth:`layer` while later
    sections are still arriving; every layer's rebuild reads only its own sections and the exact tokens' states."""

    def __init__(self, consumer, kb: SCDKnowledgeBase, code_bits: int, mask: torch.Tensor, exact_ids: torch.Tensor,
                 recomputes: bool):
        started = time.perf_counter()
        self.consumer, self.kb, self.code_bits = consumer, kb, code_bits
        self.mask = mask.long()
        self.exact = exact_ids.shape[1]
        self.model_shapes = shapes(consumer)
        parameter = next(unwrapped(consumer).parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        self.exact_cache = DynamicCache(config=text_config(consumer))
        self.exact_hidden: tuple[torch.Tensor, ...] = ()  # the exact tokens' residual stream entering each layer
        if self.exact:
            exact_mask = self.mask[:, :self.exact]
            output = consumer(input_ids=exact_ids.to(self.device), attention_mask=exact_mask.to(self.device),
                              position_ids=positions_from_mask(exact_mask).to(self.device), cache=self.exact_cache,
                              use_cache=True, logits_to_keep=1, output_hidden_states=recomputes)
            self.exact_hidden = output.hidden_states or ()
        self.seconds = {"exact": time.perf_counter() - started, "reuse": 0.0, "patch": 0.0, "recompute": 0.0}
        inv_freq, scaling = find_rotary_parameters(unwrapped(consumer))
        self.positions = positions_from_mask(self.mask)[:, self.exact:]
        self.cos, self.sin = (angle.to(self.device) for angle in consumer_angles(inv_freq, scaling, self.positions))
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, layer_plan: LayerPlan, sections: dict[str, torch.Tensor]) -> None:
        """Rebuild one plan entry from its own sections (a recompute Patch layer writes its whole block; a layer a
        block recomputes does nothing here)."""
        started = time.perf_counter()
        index = layer_plan.index
        coded = self.positions.shape[1]
        if layer_plan.kind == "recomputed" and coded:
            return  # written by its block
        if layer_plan.recomputes and coded:
            self._recompute_block(layer_plan, sections)
            self.seconds["recompute"] += time.perf_counter() - started
            return
        if coded:
            layer_sections = {name: tensor.to(self.device) for name, tensor in sections.items()
                              if name.startswith(f"layers.{index}.")}
            keys, values = rebuild_layer(decoder_layers(self.consumer)[index], layer_plan, self.kb, layer_sections,
                                         self.code_bits, self.cos, self.sin,
                                         (self.model_shapes.kv_heads, self.model_shapes.head_dim), self.dtype)
            if self.exact:
                exact_layer = self.exact_cache.layers[index]
                keys, values = torch.cat((exact_layer.keys, keys), 2), torch.cat((exact_layer.values, values), 2)
        else:
            keys, values = self.exact_cache.layers[index].keys, self.exact_cache.layers[index].values
        self.states[index] = keys, values
        self.seconds["reuse" if layer_plan.kind == "reuse" else "patch"] += time.perf_counter() - started

    def _recompute_block(self, layer_plan: LayerPlan, sections: dict[str, torch.Tensor]) -> None:
        """Run the consumer's layers of one recompute Patch block over the whole prompt: the exact tokens from their
        own residual stream entering the block (``exact_hidden``, by layer), the coded tokens from the predicted one.

        The block starts from an empty cache, as a prefill does, rather than appending after the exact tokens'
        cached states: the causal mask of a prefill needs no explicit mask tensor, so attention takes its causal path
        (on CPU a masked attention over a cache prefix costs about 1.6x as much at 2K tokens). The exact tokens' keys
        and values come out as their own prefill wrote them, since they attend only to each other."""
        first, depth = layer_plan.index, layer_plan.depth
        layer_sections = {name: tensor.to(self.device) for name, tensor in sections.items()
                          if name.startswith(f"layers.{first}.")}
        residual = predict_residual(layer_plan, self.kb, layer_sections, self.code_bits)
        if self.exact_hidden:
            residual = torch.cat((self.exact_hidden[first].to(residual.dtype), residual), 1)
        block_cache = DynamicCache(config=text_config(self.consumer))
        run_decoder_block(self.consumer, residual, self.mask, positions_from_mask(self.mask), block_cache, first,
                          depth)
        for index in range(first, first + depth):
            self.states[index] = block_cache.layers[index].keys, block_cache.layers[index].values

    def recompute_prefix(self, input_ids: torch.Tensor, last: int) -> None:
        """The consumer's own states of layers ``0 .. last``: its decoder run from its input embeddings of the
        prompt (what a local prefill computes for those layers, and no more)."""
        started = time.perf_counter()
        embeddings = unwrapped(self.consumer).get_input_embeddings()(input_ids.to(self.device))
        block_cache = DynamicCache(config=text_config(self.consumer))
        run_decoder_block(self.consumer, embeddings, self.mask, positions_from_mask(self.mask), block_cache, 0,
                          last + 1)
        for index in range(last + 1):
            self.states[index] = block_cache.layers[index].keys, block_cache.layers[index].values
        self.seconds["recompute"] += time.perf_counter() - started

    def into(self, cache: DynamicCache) -> dict[str, float]:
        """Write every layer's states into an empty ``cache`` in layer order; the seconds each kind of work took."""
        missing = [index for index in range(self.model_shapes.layers) if index not in self.states]
        if missing:
            raise RuntimeError(f"Layers {missing[:8]} were not rebuilt.")  # a bug here, never a payload's fault
        for index in range(self.model_shapes.layers):
            cache.update(*self.states[index], index)
        return self.seconds


@torch.inference_mode()
def rebuild_into(cache: DynamicCache, consumer, kb: SCDKnowledgeBase, plan: list[LayerPlan],
                 sections: dict[str, torch.Tensor], code_bits: int) -> dict[str, float]:
    """Fill an empty ``cache`` with the consumer's states for the prompt ``sections`` describe; the seconds spent
    on the exact tokens, the Reuse layers, the projection-only Patch layers and the recompute Patch blocks."""
    rebuild = LayerRebuild(consumer, kb, code_bits, sections["input.attention_mask"],
                           sections["input.exact_token_ids"], any(layer.recomputes for layer in plan))
    for layer_plan in plan:
        rebuild.layer(layer_plan, sections)
    return rebuild.into(cache)
