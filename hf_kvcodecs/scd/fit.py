"""Offline fitting of an SCD knowledge base for one (producer, consumer) pair, under a stated quality budget.

1. Statistics. Both models run over the same windows of real calibration text; hooks hand over each layer's
   pre-RoPE keys, values and normalized inputs, and only their first and second moments are kept (float64), per
   layer: producer keys against consumer keys, the same for values and for normalized inputs.
2. Maps. Per layer a Reuse map for keys and one for values (PCA codes of the producer's states, decoded by ridge
   least squares to the consumer's; or reduced-rank regression), and a Patch map (PCA codes of the producer's
   normalized input decoded to a prediction of the consumer's). Each map's error at every rank comes in closed form
   from the moments.
3. The loss constraint. The budget is the mean KL divergence from the oracle (the consumer's own prefill) to the
   consumer decoding through the rebuilt cache, per continuation token of held-out calibration prompts that the
   statistics never saw. Patch layers are added greedily where they lower that KL most: in ``recompute`` mode a
   candidate is a transition layer with a recompute depth (the consumer runs that many of its own layers from the
   predicted residual stream; the depths are capped in total by ``max_recompute_layers``, the consumer's compute),
   in ``project`` mode (the ablation) a layer whose KV is projected from the predicted normalized input. Then one
   knob sets every layer's rank (the smallest rank whose excess relative error over the full-rank map is at most ``tau``) and is
   bisected for the largest ``tau`` (fewest bytes) within the budget, for each code precision; the cheapest
   feasible plan wins. With ``code_format="whitened"`` every plan the search measures is first re-coded at the
   bytes of its flat codes (:func:`~hf_kvcodecs.scd.coding.whiten_plan`: per map, bits water-filled over the
   whitened components), so the same knob and precisions search whitened plans, at equal bytes by construction.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import DynamicCache

from ..codecs.lowrank import CrossMoments, LowRankMap, fit_pca_map, fit_reduced_rank_map, relative_error_by_rank
from ..evaluation import kl_divergence
from ..text import Corpus
from .cache import rebuild_into
from .coding import encode_layer, whiten_plan
from .encode import exact_columns
from .encoder_sharing import (
    encoder_fingerprint,
    load_encoder_source,
    shared_decoder_map,
    shared_layout,
    source_maps,
)
from .knowledge_base import (
    CODE_BITS,
    CODE_FORMATS,
    PATCH_MODES,
    LayerPlan,
    SCDKnowledgeBase,
    patch_plan,
    plan_bytes_per_token,
    plan_code_format,
    plan_problems,
    recomputed_layer_count,
    reuse_plan,
)
from .model_access import (
    LayerCapture,
    model_identity,
    positions_from_mask,
    prefill_with_taps,
    residual_direction,
    run_decoder_block,
    shapes,
    tokenizer_sha256,
    unwrapped,
)

logger = logging.getLogger(__name__)
ENCODERS = ("pca", "reduced_rank")


@dataclass
class SCDFitSettings:
    windows: int = 24  # calibration windows the statistics are accumulated over
    window_tokens: int = 512
    holdout_prompts: int = 4  # held-out calibration prompts the budget is measured on
    holdout_context: int = 448
    holdout_continuation: int = 64
    exact_tokens: int = 4  # attention sinks: the consumer computes them itself
    budget_kl: float = 0.05  # mean KL(oracle || SCD) in nats per continuation token
    encoder: str = "pca"  # "pca": consumer-agnostic progressive codes; "reduced_rank": consumer-specific codes
    code_bits: tuple[int, ...] = (8, 4)  # precisions tried; the cheapest plan within the budget wins
    # "whitened": per-component widths water-filled at the bytes of the flat code (lower KL at equal bytes, see
    # benchmarks/results/scd_code_format); "flat": each code at code_bits with one scale per token
    code_format: str = "whitened"
    # whitened codes: one searched per-token gain byte out of the same bytes; off by default: within 0.007 nats of
    # the KL without it on the default model's held-out text, at 2-4x the encoding time
    code_gain: bool = False
    max_patch_layers: int = 4
    patch_mode: str = "recompute"  # "recompute": SCD's Patch; "project": the projection-only ablation
    recompute_depths: tuple[int, ...] = (1, 4, 8, 32)  # candidate depths, each clipped to the layers left
    max_recompute_layers: int = 16  # consumer layers recomputed over the prompt, all blocks together
    patch_layers: tuple[int, ...] | None = None  # given: these transition layers, no greedy search (for ablations)
    patch_depths: tuple[int, ...] | None = None  # with patch_layers in recompute mode: each one's depth (default 1)
    patch_candidates: int = 3  # layers measured at every depth (recompute) or at all (project) in each greedy round
    patch_gain: float = 0.05  # a Patch layer must lower the KL by this fraction to be kept
    ridge: float = 1e-4
    tau_range: tuple[float, float] = (1e-4, 0.5)
    bisection_steps: int = 7
    # a saved knowledge base of this producer (PCA codes) whose encoders and Patch layers this fit keeps exactly, so
    # one set of stored producer codes serves both consumers (see encoder_sharing); only decoders and ranks are fitted
    encoders_from: str | None = None

    def check(self) -> None:
        if self.encoder not in ENCODERS:
            raise ValueError(f"encoder must be one of {ENCODERS}, got {self.encoder!r}.")
        if any(bits not in CODE_BITS for bits in self.code_bits) or not self.code_bits:
            raise ValueError(f"code_bits must be a non-empty choice among {CODE_BITS}, got {self.code_bits}.")
        if self.budget_kl <= 0:
            raise ValueError("budget_kl must be positive.")
        if self.code_format not in CODE_FORMATS:
            raise ValueError(f"code_format must be one of {CODE_FORMATS}, got {self.code_format!r}.")
        if self.patch_mode not in PATCH_MODES:
            raise ValueError(f"patch_mode must be one of {PATCH_MODES}, got {self.patch_mode!r}.")
        if not self.recompute_depths or any(type(d) is not int or d < 1 for d in self.recompute_depths):
            raise ValueError(f"recompute_depths must be positive integers, got {self.recompute_depths}.")
        if self.patch_depths is not None:
            if self.patch_layers is None or len(self.patch_depths) != len(self.patch_layers):
                raise ValueError("patch_depths gives one depth per layer of patch_layers; pass both, of equal length.")
            if self.patch_mode != "recompute" or any(type(d) is not int or d < 1 for d in self.patch_depths):
                raise ValueError("patch_depths are positive depths of recompute Patch blocks (patch_mode='recompute').")
        if self.encoders_from is not None and self.patch_layers is not None:
            raise ValueError("encoders_from keeps the Patch layers of the knowledge base it names; leave patch_layers "
                             "(--patch-layers) unset.")
        if self.window_tokens <= self.exact_tokens + 1 or self.holdout_context <= self.exact_tokens:
            raise ValueError("Windows and held-out contexts must be longer than the exact tokens.")


@dataclass
class PairMoments:
    keys: list[CrossMoments]
    values: list[CrossMoments]
    inputs: list[CrossMoments]  # normalized inputs (projection-only Patch); empty when not asked for
    residuals: list[CrossMoments] = field(default_factory=list)  # residual directions (recompute Patch)
    tokens: int = 0


def accumulate_pair_moments(producer, consumer, windows: list[torch.Tensor], *, skip_first: int,
                            progress: bool = True, patch_mode: str = "recompute") -> PairMoments:
    """Paired moments per layer over ``windows`` (each a 1-D token tensor): the producer's states as inputs, the
    consumer's for the same tokens as targets. Holds one window's producer states at a time. ``patch_mode`` says
    which Patch states are paired: residual-stream directions (``recompute``) or normalized inputs (``project``)."""
    model_shapes = shapes(producer)
    if shapes(consumer) != model_shapes:
        raise ValueError(f"The producer has shapes {shapes(producer)} and the consumer {shapes(consumer)}; SCD pairs "
                         "models of one architecture (a base model and its fine-tunes).")
    width, hidden = model_shapes.kv_width, model_shapes.hidden
    recompute = patch_mode == "recompute"
    patch_moments = [CrossMoments(hidden, hidden) for _ in range(model_shapes.layers)]
    moments = PairMoments([CrossMoments(width, width) for _ in range(model_shapes.layers)],
                          [CrossMoments(width, width) for _ in range(model_shapes.layers)],
                          [] if recompute else patch_moments, patch_moments if recompute else [])
    held: dict[int, LayerCapture] = {}

    def patch_state(capture: LayerCapture) -> torch.Tensor:
        if recompute:
            return residual_direction(capture.residual[0, skip_first:])[0].cpu()
        return capture.inputs[0, skip_first:].float().cpu()

    for window in tqdm(windows, desc="SCD statistics", disable=not progress):
        ids = window[None].to(next(unwrapped(producer).parameters()).device)
        held.clear()

        def keep(capture: LayerCapture) -> None:
            held[capture.index] = LayerCapture(capture.index, capture.keys[0, skip_first:].float().cpu(),
                                               capture.values[0, skip_first:].float().cpu(), patch_state(capture))

        def pair(capture: LayerCapture) -> None:
            source = held.pop(capture.index)
            moments.keys[capture.index].update(source.keys, capture.keys[0, skip_first:].float().cpu())
            moments.values[capture.index].update(source.values, capture.values[0, skip_first:].float().cpu())
            patch_moments[capture.index].update(source.inputs, patch_state(capture))

        prefill_with_taps(producer, ids, None, keep, all_inputs=not recompute, all_residuals=recompute)
        prefill_with_taps(consumer, ids, None, pair, all_inputs=not recompute, all_residuals=recompute)
        moments.tokens += ids.shape[1] - skip_first
    return moments


@dataclass
class _Prompt:
    context: torch.Tensor  # [1, C]
    continuation: torch.Tensor  # [1, N]
    captures: list[LayerCapture]  # of the context but its last token
    oracle_logprobs: torch.Tensor  # [N, V]


@dataclass
class BudgetJudge:
    """Measures a plan's KL to the oracle on held-out prompts through the same code and rebuild a payload takes."""

    consumer: object
    kb: SCDKnowledgeBase  # holds every layer's maps; its plan is replaced per measurement
    prompts: list[_Prompt]
    measurements: list[dict] = field(default_factory=list)

    @torch.inference_mode()
    def kl(self, plan: list[LayerPlan], bits: int) -> float:
        self.kb.plan = plan
        total, count = 0.0, 0
        for prompt in self.prompts:
            cached = prompt.context[:, :-1]
            mask = torch.ones_like(cached)
            start = exact_columns(mask, self.kb.exact_tokens)
            sections = {"input.attention_mask": mask.to(torch.uint8), "input.exact_token_ids": cached[:, :start]}
            for layer_plan, capture in zip(plan, prompt.captures):
                sections.update(encode_layer(capture, layer_plan, self.kb, start, bits))
            cache = DynamicCache(config=unwrapped(self.consumer).config.get_text_config(decoder=True))
            rebuild_into(cache, self.consumer, self.kb, plan, sections, bits)
            logprobs = continuation_logprobs(self.consumer, cache, prompt.context, prompt.continuation)
            total += float(kl_divergence(prompt.oracle_logprobs, logprobs).sum())
            count += logprobs.shape[0]
        value = total / max(count, 1)
        self.measurements.append({"bits": bits, "components": sum(layer.components() for layer in plan),
                                  "bytes_per_token": plan_bytes_per_token(plan, bits),
                                  "patch_layers": [layer.index for layer in plan if layer.kind == "patch"],
                                  "recompute_blocks": [[layer.index, layer.depth] for layer in plan
                                                       if layer.recomputes],
                                  "kl": value})
        return value


def continuation_logprobs(model, cache, context: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log-probabilities ``[N, V]`` of the continuation's tokens given a cache of the context:
    the first predicts ``continuation[0]`` from the context's last position, so the context's last token is fed
    again as the first input (the cache holds every context token but the last)."""
    context_length = context.shape[1]
    inputs = torch.cat((context[:, -1:], continuation[:, :-1]), 1)
    mask = torch.ones(1, context_length - 1 + inputs.shape[1], dtype=torch.long)
    positions = positions_from_mask(mask)[:, context_length - 1:]
    logits = model(input_ids=inputs, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True).logits
    return torch.log_softmax(logits[0].float(), -1)


def _fit_maps(moments: PairMoments, settings: SCDFitSettings):
    """Per kind (``keys``, ``values`` and the Patch states, ``inputs`` or ``residuals``), every layer's map and its
    error curve over ranks."""
    fit = fit_pca_map if settings.encoder == "pca" else fit_reduced_rank_map
    kinds = ("keys", "values", "residuals" if settings.patch_mode == "recompute" else "inputs")
    maps: dict[str, list[LowRankMap]] = {kind: [] for kind in kinds}
    curves: dict[str, list[torch.Tensor]] = {kind: [] for kind in kinds}
    for kind in kinds:
        for layer_moments in getattr(moments, kind):
            fitter = fit if kind in ("keys", "values") else fit_pca_map  # Patch codes stay consumer-agnostic
            mapping = fitter(layer_moments, layer_moments.input_dim, ridge=settings.ridge)
            maps[kind].append(mapping)
            curves[kind].append(relative_error_by_rank(layer_moments, mapping))
    return maps, curves


def _share_encoders(source: SCDKnowledgeBase, moments: PairMoments, maps: dict[str, list[LowRankMap]],
                    curves: dict[str, list[torch.Tensor]], ridge: float) -> None:
    """Replace the fitted maps of every layer ``source`` codes with maps that keep its encoders exactly, decoded to
    this pair's targets, and their error curves (over the source's ranks, which bound the ranks this plan sends)."""
    for kind, by_layer in source_maps(source).items():
        for index, mapping in by_layer.items():
            shared = shared_decoder_map(mapping, getattr(moments, kind)[index], ridge=ridge)
            maps[kind][index] = shared
            curves[kind][index] = relative_error_by_rank(getattr(moments, kind)[index], shared)


def _encoder_source(settings: SCDFitSettings, producer) -> SCDKnowledgeBase | None:
    if settings.encoders_from is None:
        return None
    source = load_encoder_source(settings.encoders_from, model_identity(producer), encoder=settings.encoder,
                                 patch_mode=settings.patch_mode)
    if source.num_layers != shapes(producer).layers:
        raise ValueError(f"{settings.encoders_from} plans {source.num_layers} layers; the producer has "
                         f"{shapes(producer).layers}.")
    return source


def _sharing_record(source: SCDKnowledgeBase | None) -> dict | None:
    if source is None:
        return None
    return {"knowledge_base": source.save_id, "encoder_fingerprint": encoder_fingerprint(source)}


def _settings_record(settings: SCDFitSettings) -> dict:
    return {**asdict(settings), "code_bits": list(settings.code_bits), "tau_range": list(settings.tau_range),
            "recompute_depths": list(settings.recompute_depths),
            "patch_layers": None if settings.patch_layers is None else list(settings.patch_layers),
            "patch_depths": None if settings.patch_depths is None else list(settings.patch_depths),
            "encoders_from": None if settings.encoders_from is None else str(settings.encoders_from)}


def _rank_for(curve: torch.Tensor, tau: float) -> int:
    """The smallest rank whose relative error exceeds the full-rank map's by at most ``tau`` (at least 1)."""
    floor = float(curve[-1])
    within = (curve - floor <= tau).nonzero()
    return max(1, int(within[0])) if len(within) else len(curve) - 1


def plan_for(tau: float, patches: dict[int, int], curves: dict[str, list[torch.Tensor]]) -> list[LayerPlan]:
    """The plan at rank knob ``tau`` with Patch layers ``patches`` (first layer -> depth; depth 1 for a
    projection-only Patch). The Patch mode is the one ``curves`` were fitted for."""
    mode = "recompute" if "residuals" in curves else "project"
    patch_curves = curves["residuals" if mode == "recompute" else "inputs"]
    plan: list[LayerPlan] = []
    covered_until = 0
    for index in range(len(curves["keys"])):
        if index < covered_until:
            plan.append(LayerPlan(index, "recomputed"))
        elif index in patches:
            plan.append(patch_plan(index, _rank_for(patch_curves[index], tau), mode, patches[index]))
            covered_until = index + plan[-1].depth
        else:
            plan.append(reuse_plan(index, _rank_for(curves["keys"][index], tau), _rank_for(curves["values"][index], tau)))
    return plan


def _bytes_per_token(plan: list[LayerPlan], bits: int) -> float:
    return plan_bytes_per_token(plan, bits)


def patch_trials(patches: dict[int, int], floors: list[float], settings: SCDFitSettings,
                 evaluate: Callable[[tuple[int, int]], float]) -> dict[tuple[int, int], float]:
    """The KL of every ``(layer, depth)`` Patch candidate one greedy round measures with ``evaluate``.

    ``project`` mode: the ``patch_candidates`` free layers with the largest Reuse error floor, at depth 1.
    ``recompute`` mode, in two stages: every free layer (every ``ceil(L / 16)``-th on deeper models) at the deepest
    block it may start, up to the next block, the last layer and the ``max_recompute_layers`` left; then the
    ``patch_candidates`` best of those at each shallower depth of ``recompute_depths``. Where a block should start
    depends on where the mismatch enters, which the Reuse error floors do not show, so no start is ruled out
    unmeasured."""
    layers = len(floors)
    taken = {index for first, depth in patches.items() for index in range(first, first + depth)}
    free = [index for index in range(layers) if index not in taken]
    if settings.patch_mode == "project":
        chosen = sorted(free, key=lambda index: -floors[index])[:settings.patch_candidates]
        return {(index, 1): evaluate((index, 1)) for index in chosen}
    budget = settings.max_recompute_layers - sum(patches.values())
    if budget < 1:
        return {}

    def deepest(index: int) -> int:
        room = next((first - index for first in sorted(taken) if first > index), layers - index)
        return min(room, budget)

    stride = math.ceil(layers / 16)
    trials = {(index, deepest(index)): 0.0 for index in free[::stride]}
    trials = {candidate: evaluate(candidate) for candidate in trials}
    for index, _ in sorted(trials, key=trials.get)[:settings.patch_candidates]:
        for depth in sorted({min(depth, deepest(index)) for depth in settings.recompute_depths}):
            if (index, depth) not in trials:
                trials[(index, depth)] = evaluate((index, depth))
    return trials


def merged_identity(model) -> dict | None:
    """The identity a ``PeftModel`` consumer has once its adapter is merged (``merge_and_unload``), so a knowledge
    base fitted with the adapter also serves the merged model; None for a model without an adapter."""
    if not hasattr(model, "merge_and_unload"):
        return None
    merged = copy.deepcopy(model).merge_and_unload()
    return model_identity(merged)


def fit_knowledge_base(producer, consumer, calibration_ids: torch.Tensor, *, settings: SCDFitSettings | None = None,
                       text_info: Corpus | dict | None = None, tokenizer=None, producer_name: str = "",
                       consumer_name: str = "", progress: bool = True) -> SCDKnowledgeBase:
    """Fit the knowledge base for sending ``producer``'s prefill to ``consumer`` (1-D ``calibration_ids`` of real
    text; its last part is held out for the budget). Returns it unsaved; ``kb.save(DIR)``."""
    settings = settings or SCDFitSettings()
    settings.check()
    started = time.perf_counter()
    prompt_tokens = settings.holdout_context + settings.holdout_continuation
    holdout_tokens = settings.holdout_prompts * prompt_tokens
    needed = holdout_tokens + settings.window_tokens
    if calibration_ids.numel() < needed:
        raise ValueError(f"The calibration text has {calibration_ids.numel()} tokens; fitting needs at least {needed} "
                         f"({settings.holdout_prompts} held-out prompts of {prompt_tokens} and one window of "
                         f"{settings.window_tokens}). Pass more text or lower the settings.")
    layers = shapes(producer).layers
    _check_forced_patches(settings, layers)  # before minutes of statistics
    source = _encoder_source(settings, producer)
    statistics_ids, holdout_ids = calibration_ids[:-holdout_tokens], calibration_ids[-holdout_tokens:]
    count = min(settings.windows, statistics_ids.numel() // settings.window_tokens)
    stride = statistics_ids.numel() // count
    windows = [statistics_ids[i * stride: i * stride + settings.window_tokens] for i in range(count)]
    moments = accumulate_pair_moments(producer, consumer, windows, skip_first=settings.exact_tokens, progress=progress,
                                      patch_mode=settings.patch_mode)
    maps, curves = _fit_maps(moments, settings)
    if source is not None:
        _share_encoders(source, moments, maps, curves, settings.ridge)
    num_layers = len(maps["keys"])
    recompute = settings.patch_mode == "recompute"
    patch_kind = "residuals" if recompute else "inputs"

    prompts = []
    for index in range(settings.holdout_prompts):
        ids = holdout_ids[index * prompt_tokens:(index + 1) * prompt_tokens][None]
        context, continuation = ids[:, :settings.holdout_context], ids[:, settings.holdout_context:]
        captures: list[LayerCapture] = []
        # the cache covers the context but its last token, which generate() feeds as the first new input
        prefill_with_taps(producer, context[:, :-1], None, captures.append, all_inputs=not recompute,
                          all_residuals=recompute)
        oracle = DynamicCache(config=unwrapped(consumer).config.get_text_config(decoder=True))
        with torch.inference_mode():
            consumer(input_ids=context[:, :-1], cache=oracle, use_cache=True, logits_to_keep=1)
            oracle_logprobs = continuation_logprobs(consumer, oracle, context, continuation)
        prompts.append(_Prompt(context, continuation, captures, oracle_logprobs))

    identity = {**model_identity(producer), "name": producer_name}
    consumer_identity = {**model_identity(consumer), "name": consumer_name}
    merged = merged_identity(consumer)
    if merged is not None:
        consumer_identity["merged_weights_sha256"] = merged["weights_sha256"]
    patch_maps = {i: maps[patch_kind][i] for i in range(num_layers)}
    working = SCDKnowledgeBase([], {i: maps["keys"][i] for i in range(num_layers)},
                               {i: maps["values"][i] for i in range(num_layers)},
                               {} if recompute else patch_maps, max(settings.code_bits),
                               settings.exact_tokens, identity, consumer_identity, tokenizer_sha256(tokenizer),
                               residuals=patch_maps if recompute else {})
    judge = BudgetJudge(consumer, working, prompts)
    allocations: dict = {}

    def plan_at(tau: float, patches: dict[int, int], bits: int) -> list[LayerPlan]:
        """The plan measured and sent at knob ``tau``: flat, or whitened at the same bytes."""
        plan = plan_for(tau, patches, curves)
        if settings.code_format == "whitened" and bits < 16:
            plan = whiten_plan(plan, working, bits, settings.code_gain, allocations)
        return plan

    finest = min(settings.tau_range)
    best_bits = max(settings.code_bits)
    search = {"patch_mode": settings.patch_mode, "reuse_only_full_rank_kl": None, "patch_rounds": [], "bisection": {}}
    patches: dict[int, int] = {}
    current = judge.kl(plan_at(0.0, patches, best_bits), best_bits)
    search["reuse_only_full_rank_kl"] = current
    forced = shared_layout(source) if source is not None else \
        _forced_patches(settings) if settings.patch_layers is not None else None
    if forced is not None:
        patches = forced
        search["forced_patch_layers"] = sorted(patches)
        search["forced_patch_depths"] = [patches[index] for index in sorted(patches)]
        search["forced_patch_full_rank_kl"] = judge.kl(plan_at(0.0, patches, best_bits), best_bits)
    floors = [float(curves["keys"][i][-1] + curves["values"][i][-1]) for i in range(num_layers)]
    rounds = 0 if forced is not None else settings.max_patch_layers
    with tqdm(total=rounds, desc="SCD patch layers", disable=not progress) as bar:
        for _ in range(rounds):
            trials = patch_trials(patches, floors, settings, lambda candidate: judge.kl(
                plan_at(0.0, {**patches, candidate[0]: candidate[1]}, best_bits), best_bits))
            if not trials:
                break
            lowest = min(trials.values())
            # among the candidates within 2 % of the lowest KL, the one recomputing fewest layers
            chosen = min(trials, key=lambda c: (trials[c] > lowest * 1.02, c[1], trials[c]))
            search["patch_rounds"].append({"kl_before": current, "chosen": list(chosen), "trials": [
                {"layer": layer, "depth": depth, "kl": kl} for (layer, depth), kl in trials.items()]})
            if trials[chosen] > current * (1 - settings.patch_gain):
                break
            patches[chosen[0]] = chosen[1]
            current = trials[chosen]
            bar.update(1)
    search["recompute_seconds_per_layer"] = _recompute_seconds(consumer, prompts, num_layers) if recompute else None

    best = None
    for bits in sorted(settings.code_bits, reverse=True):
        low, high = math.log(finest), math.log(max(settings.tau_range))
        trace = []
        feasible_tau = None
        if judge.kl(plan_at(finest, patches, bits), bits) <= settings.budget_kl:
            feasible_tau = finest
            for _ in range(settings.bisection_steps):
                middle = (low + high) / 2
                kl = judge.kl(plan_at(math.exp(middle), patches, bits), bits)
                trace.append({"tau": math.exp(middle), "kl": kl})
                if kl <= settings.budget_kl:
                    low, feasible_tau = middle, math.exp(middle)
                else:
                    high = middle
        search["bisection"][str(bits)] = {"feasible_tau": feasible_tau, "trace": trace}
        if feasible_tau is None:
            continue
        plan = plan_at(feasible_tau, patches, bits)
        candidate = (_bytes_per_token(plan, bits), bits, feasible_tau, plan)
        if best is None or candidate[0] < best[0]:
            best = candidate
    budget_met = best is not None
    if not budget_met:
        # nothing meets the budget: send the finest plan and say so (the report carries the measured KL)
        plan = plan_for(0.0, patches, curves)
        best = (_bytes_per_token(plan, 16), 16, 0.0, plan)
        logger.warning("No plan met the budget of %.4f nats/token (finest measured: %.4f); the knowledge base uses "
                       "full-rank 16-bit codes.", settings.budget_kl, judge.measurements[-1]["kl"])
    bytes_per_token, bits, tau, plan = best
    chosen_kl = judge.kl(plan, bits)
    model_shapes = shapes(producer)
    raw_bytes = 2 * model_shapes.layers * model_shapes.kv_width * 2
    fitting = {
        "settings": _settings_record(settings), "shared_encoders": _sharing_record(source),
        "text": text_info.to_dict() if isinstance(text_info, Corpus) else (text_info or {}),
        "statistics_tokens": moments.tokens, "statistics_windows": len(windows),
        "holdout_prompts": len(prompts), "budget_kl": settings.budget_kl, "budget_met": budget_met,
        "kl": chosen_kl, "tau": tau, "code_bits": bits, "code_format": plan_code_format(plan),
        "bytes_per_coded_token": bytes_per_token,
        "raw_16bit_bytes_per_token": raw_bytes, "compression_vs_16bit": raw_bytes / bytes_per_token,
        "recomputed_layers": recomputed_layer_count(plan),
        "search": search, "measurements": judge.measurements, "seconds": time.perf_counter() - started,
        "error_curves": {kind: [[round(float(v), 6) for v in curve] for curve in curves[kind]] for kind in curves},
    }
    # shared encoders are saved whole (the source's ranks), so both knowledge bases hold the same producer half
    kept = (lambda mapping, rank: mapping) if source is not None else (lambda mapping, rank: mapping.truncated(rank))
    keys = {layer.index: kept(maps["keys"][layer.index], layer.key_rank) for layer in plan if layer.kind == "reuse"}
    values = {layer.index: kept(maps["values"][layer.index], layer.value_rank) for layer in plan
              if layer.kind == "reuse"}
    patch = {layer.index: kept(maps[patch_kind][layer.index], layer.patch_rank) for layer in plan
             if layer.kind == "patch"}
    return SCDKnowledgeBase(plan, keys, values, {} if recompute else patch, bits, settings.exact_tokens, identity,
                            consumer_identity, tokenizer_sha256(tokenizer), fitting,
                            residuals=patch if recompute else {})


def _forced_patches(settings: SCDFitSettings) -> dict[int, int]:
    depths = settings.patch_depths or (1,) * len(settings.patch_layers)
    return dict(zip(settings.patch_layers, depths))


def _check_forced_patches(settings: SCDFitSettings, layers: int) -> None:
    if settings.patch_layers is None:
        return
    unknown = [layer for layer in settings.patch_layers if not 0 <= layer < layers]
    if unknown:
        raise ValueError(f"Patch layers {unknown} do not exist: the models have layers 0..{layers - 1}.")
    patches = _forced_patches(settings)
    curves = {"keys": [torch.ones(2)] * layers, "values": [torch.ones(2)] * layers,
              "residuals" if settings.patch_mode == "recompute" else "inputs": [torch.ones(2)] * layers}
    plan = plan_for(0.0, patches, curves)
    problems = plan_problems(plan) + [f"layer {layer.index} falls inside an earlier block" for layer in plan
                                      if layer.index in patches and layer.kind != "patch"]
    if problems or len(patches) != len(settings.patch_layers):
        raise ValueError(f"Patch layers {list(settings.patch_layers)} with depths {list(settings.patch_depths or ())}"
                         f" do not make a valid plan ({'; '.join(problems) or 'a layer is named twice'}): blocks may "
                         "not overlap or run past the last layer.")


def _recompute_seconds(consumer, prompts: list[_Prompt], layers: int, repeats: int = 3) -> dict:
    """Measured seconds for the consumer to run one of its decoder layers over a held-out prompt (the median of
    ``repeats``), what each recomputed layer adds to the time to first token."""
    prompt = prompts[0]
    capture = prompt.captures[layers // 2]
    tokens = capture.residual.shape[1]
    mask = torch.ones(1, tokens, dtype=torch.long)
    times = []
    for _ in range(repeats):
        cache = DynamicCache(config=unwrapped(consumer).config.get_text_config(decoder=True))
        started = time.perf_counter()
        run_decoder_block(consumer, capture.residual, mask, positions_from_mask(mask), cache, layers // 2, 1)
        times.append(time.perf_counter() - started)
    return {"tokens": tokens, "seconds": sorted(times)[len(times) // 2]}


def full_rank_knowledge_base(producer, consumer, calibration_ids: torch.Tensor, *, window_tokens: int = 256,
                             windows: int = 8, exact_tokens: int = 4, patch_layers: tuple[int, ...] = (),
                             patch_mode: str = "recompute", patch_depths: tuple[int, ...] | None = None,
                             code_bits: int = 16, ridge: float = 0.0, encoder: str = "pca",
                             code_format: str = "flat", code_gain: bool = False,
                             tokenizer=None, encoders_from: str | None = None) -> SCDKnowledgeBase:
    """A knowledge base at full rank with no budget search (for exactness checks and ablations): every layer's maps
    at full rank, the given Patch layers (``patch_mode`` ``recompute`` with ``patch_depths``, default 1 each, or
    ``project``), ``code_bits`` codes. ``code_format="whitened"`` (below 16 bits) re-codes the full-rank plan at the
    bytes of its flat ``code_bits`` codes (the maps stay at full rank; the plan's ranks are the allocations').
    ``encoders_from`` (a saved knowledge base's directory) keeps its encoders and Patch layers, at its ranks."""
    settings = SCDFitSettings(windows=windows, window_tokens=window_tokens, exact_tokens=exact_tokens,
                              encoder=encoder, ridge=ridge, patch_mode=patch_mode, code_format=code_format,
                              code_gain=code_gain,
                              patch_layers=tuple(patch_layers) if patch_layers else None,
                              patch_depths=tuple(patch_depths) if patch_depths else None,
                              encoders_from=encoders_from)
    settings.check()
    _check_forced_patches(settings, shapes(producer).layers)
    source = _encoder_source(settings, producer)
    count = min(windows, calibration_ids.numel() // window_tokens)
    chunks = [calibration_ids[i * window_tokens:(i + 1) * window_tokens] for i in range(count)]
    moments = accumulate_pair_moments(producer, consumer, chunks, skip_first=exact_tokens, progress=False,
                                      patch_mode=patch_mode)
    maps, curves = _fit_maps(moments, settings)
    if source is not None:
        _share_encoders(source, moments, maps, curves, ridge)
    patch_kind = "residuals" if patch_mode == "recompute" else "inputs"
    forced = shared_layout(source) if source is not None else _forced_patches(settings) if patch_layers else {}
    plan = plan_for(0.0, forced, curves)
    plan = [patch_plan(p.index, maps[patch_kind][p.index].rank, p.patch_mode, p.depth) if p.kind == "patch" else
            reuse_plan(p.index, maps["keys"][p.index].rank, maps["values"][p.index].rank) if p.kind == "reuse" else p
            for p in plan]
    patch = {p.index: maps[patch_kind][p.index] for p in plan if p.kind == "patch"}
    consumer_identity = {**model_identity(consumer), "name": ""}
    merged = merged_identity(consumer)
    if merged is not None:  # a merge_and_unload()ed consumer is served too, as fit_knowledge_base's are
        consumer_identity["merged_weights_sha256"] = merged["weights_sha256"]
    kb = SCDKnowledgeBase(plan, {p.index: maps["keys"][p.index] for p in plan if p.kind == "reuse"},
                          {p.index: maps["values"][p.index] for p in plan if p.kind == "reuse"},
                          patch if patch_mode == "project" else {}, code_bits,
                          exact_tokens, {**model_identity(producer), "name": ""},
                          consumer_identity, tokenizer_sha256(tokenizer),
                          {"settings": {**_settings_record(settings), "patch_layers": list(patch_layers),
                                        "patch_depths": list(patch_depths or ())},
                           "shared_encoders": _sharing_record(source), "statistics_tokens": moments.tokens},
                          residuals=patch if patch_mode == "recompute" else {})
    if code_format == "whitened" and code_bits < 16:
        kb.plan = whiten_plan(kb.plan, kb, code_bits, code_gain)
    return kb
