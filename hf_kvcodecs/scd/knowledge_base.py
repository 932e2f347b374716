"""The SCD knowledge base of one (producer, consumer) pair: per layer a Reuse map (low-rank codes of the producer's
pre-RoPE keys and values, decoded to the consumer's) or a Patch map, the code precision, and the identities it was
fitted for.

A Patch layer is one of two modes:

- ``recompute`` (SCD's Patch): a low-rank code of the producer's RMS-normalized residual stream entering the layer
  (``h / rms(h)``, before the norm's gain) plus each token's ``rms(h)``; the consumer predicts its own residual
  stream there and runs its own decoder layers ``index .. index + depth - 1`` over the prompt, writing their keys and
  values itself. The layers after the first of such a block are ``recomputed`` and carry nothing.
- ``project`` (an ablation: projection-only Patch): a low-rank code of the producer's ``input_layernorm`` output,
  whose prediction the consumer projects with that one layer's ``k_proj`` / ``v_proj``; no later layer changes.

Codes come in one of two formats (``code_format``), chosen at fitting:

- ``flat`` (the default of knowledge bases written before the choice existed): each code vector's first ``rank``
  components at ``code_bits`` bits with one float16 max-abs scale per token.
- ``whitened``: each component divided by its fitted standard deviation and coded with a fixed unit-Gaussian
  quantizer of its own width (:mod:`hf_kvcodecs.codecs.bit_allocation`), the widths water-filled per map under the
  bytes the flat code of the same map would spend; optionally one gain byte per token. Each coded layer's plan holds
  its widths (:class:`CodeWidths`, non-increasing, every one at least 1 bit: the rank is the number of components
  that get bits), saved as uint8 tensors ``layers.l.key_bits`` / ``.value_bits`` / ``.patch_bits`` beside the
  maps, and each code's gain flag in the plan's JSON. ``code_bits`` then names the flat width whose bytes the
  allocation spent (4 or 8). At 16 or 32 bits codes are floats in either format.

Saved as safetensors + JSON (one save, one ``save_id``, see :mod:`hf_kvcodecs.fileio`). Encoders are the producer's
half and decoders the consumer's; both live in one file so a pair's fit stays one artifact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..codecs.bit_allocation import GAIN_BYTES, MAX_BITS
from ..codecs.lowrank import LowRankMap
from ..fileio import read_json, save_tensors_and_json

FORMAT_NAME = "hf_kvcodecs.scd_knowledge_base"
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)  # version 1 knew projection-only Patch layers only
TENSORS_FILE = "scd_knowledge_base.safetensors"
METADATA_FILE = "scd_knowledge_base.json"
MAX_METADATA_BYTES = 16 * 2**20  # a 100-layer description with error curves is well under 1 MiB
LAYER_KINDS = ("reuse", "patch", "recomputed")
PATCH_MODES = ("recompute", "project")
CODE_BITS = (4, 8, 16, 32)
CODE_FORMATS = ("flat", "whitened")
WHITENED_CODE_BITS = (4, 8)  # the flat widths a whitened allocation matches the bytes of
# far above any model's plan (30 layers of width 192: 11 520); bounds what a manifest's width runs may expand to
MAX_PLAN_COMPONENTS = 1 << 20


@dataclass(frozen=True)
class CodeWidths:
    """A whitened code's layout: the bit width of each component sent (non-increasing, 1..8 each, so every prefix
    is itself a valid code) and whether each token also sends a gain byte."""

    bits: tuple[int, ...]
    gain: bool = False

    @property
    def rank(self) -> int:
        return len(self.bits)

    def packed_bytes(self) -> int:
        """Bytes of one vector's packed codes: ``ceil(Σ bits / 8)``."""
        return (sum(self.bits) + 7) // 8

    def bytes_per_vector(self) -> int:
        """Bytes per code vector on the wire: the packed codes and the gain byte when sent."""
        return self.packed_bytes() + (GAIN_BYTES if self.gain else 0)

    def prefix(self, rank: int) -> CodeWidths:
        return CodeWidths(self.bits[:rank], self.gain)

    def problems(self) -> list[str]:
        bits = self.bits
        if any(type(b) is not int or not 1 <= b <= MAX_BITS for b in bits):
            return [f"widths must be integers from 1 to {MAX_BITS}"]
        if any(later > earlier for earlier, later in zip(bits, bits[1:])):
            return ["widths must not increase with the component (a prefix of the code must be a valid code)"]
        return []

    def runs(self) -> list[list[int]]:
        """The widths as ``[[width, count], ...]`` runs (widths decreasing): the payload manifest's compact form."""
        runs: list[list[int]] = []
        for width in self.bits:
            if runs and runs[-1][0] == width:
                runs[-1][1] += 1
            else:
                runs.append([width, 1])
        return runs

    @classmethod
    def from_runs(cls, runs, gain: bool, limit: int = MAX_PLAN_COMPONENTS) -> CodeWidths:
        """Inverse of :meth:`runs`; refuses runs of more than ``limit`` components before expanding them."""
        if not isinstance(runs, list) or len(runs) > MAX_BITS or not all(
                isinstance(run, list) and len(run) == 2 and all(type(v) is int for v in run) for run in runs):
            raise ValueError(f"code widths must be a list of at most {MAX_BITS} [width, count] pairs of integers")
        if any(count < 1 for _, count in runs) or sum(count for _, count in runs) > limit:
            raise ValueError(f"each [width, count] run of code widths needs a positive count, and a plan's codes have "
                             f"at most {MAX_PLAN_COMPONENTS} components in all")
        return cls(tuple(width for width, count in runs for _ in range(count)), gain)


class KnowledgeBaseError(ValueError):
    """A knowledge base directory is missing, corrupt, or does not fit the models it is used with."""


@dataclass
class LayerPlan:
    """How one layer travels: ``reuse`` (key and value codes of ranks ``key_rank`` / ``value_rank``), ``patch`` (a
    code of rank ``patch_rank``; ``patch_mode`` ``recompute`` makes the consumer run its own layers ``index ..
    index + depth - 1`` from the predicted residual stream, ``project`` projects one layer's prediction, depth 1), or
    ``recomputed`` (written by the recompute Patch block above it; nothing is sent)."""

    index: int
    kind: str
    key_rank: int = 0
    value_rank: int = 0
    patch_rank: int = 0
    patch_mode: str = ""
    depth: int = 0
    # whitened codes only: per code ("key", "value" or "patch") its widths; empty for flat codes
    widths: dict[str, CodeWidths] = field(default_factory=dict)

    def code_ranks(self) -> tuple[tuple[str, int], ...]:
        """``(name, rank)`` of every code this layer sends: key and value (Reuse), patch (Patch), none (recomputed)."""
        if self.kind == "reuse":
            return (("key", self.key_rank), ("value", self.value_rank))
        return (("patch", self.patch_rank),) if self.kind == "patch" else ()

    def components(self) -> int:
        if self.kind == "reuse":
            return self.key_rank + self.value_rank
        return self.patch_rank if self.kind == "patch" else 0

    @property
    def recomputes(self) -> bool:
        return self.kind == "patch" and self.patch_mode == "recompute"

    def to_dict(self, *, bits: bool = True) -> dict:
        """The JSON entry; whitened codes add ``"codes": {name: {"gain": bool, "bits": runs}}`` (``bits=False``
        leaves the widths out: a knowledge base saves them as tensors)."""
        entry = {"index": self.index, "kind": self.kind, "key_rank": self.key_rank, "value_rank": self.value_rank,
                 "patch_rank": self.patch_rank}
        if self.kind == "patch":
            entry.update(patch_mode=self.patch_mode, depth=self.depth)
        if self.widths:
            entry["codes"] = {name: {"gain": code.gain, **({"bits": code.runs()} if bits else {})}
                              for name, code in self.widths.items()}
        return entry


def reuse_plan(index: int, key_rank: int, value_rank: int) -> LayerPlan:
    return LayerPlan(index, "reuse", key_rank=key_rank, value_rank=value_rank)


def patch_plan(index: int, rank: int, mode: str, depth: int = 1) -> LayerPlan:
    return LayerPlan(index, "patch", patch_rank=rank, patch_mode=mode, depth=depth if mode == "recompute" else 1)


def recompute_blocks(plan: list[LayerPlan]) -> list[tuple[int, int]]:
    """``(first layer, depth)`` of every recompute Patch block, in layer order."""
    return [(layer.index, layer.depth) for layer in plan if layer.recomputes]


def recomputed_layer_count(plan: list[LayerPlan]) -> int:
    """Decoder layers the consumer runs itself over the prompt (every recompute block's depth)."""
    return sum(depth for _, depth in recompute_blocks(plan))


def plan_problems(plan: list[LayerPlan]) -> list[str]:
    """What is structurally wrong with a plan: layers out of order, a Patch mode or depth out of range, a recompute
    block that runs past the last layer or over a layer that sends codes, a ``recomputed`` layer no block covers."""
    problems = []
    if [layer.index for layer in plan] != list(range(len(plan))):
        return ["the plan must list layers 0..L-1 in order"]
    covered_until = 0
    for layer in plan:
        inside = layer.index < covered_until
        if layer.kind == "recomputed":
            if not inside:
                problems.append(f"layer {layer.index} is 'recomputed' but no recompute Patch block above covers it")
            if layer.components():
                problems.append(f"layer {layer.index} is 'recomputed' but names code ranks")
            continue
        if inside:
            problems.append(f"layer {layer.index} is inside the recompute block ending at layer {covered_until - 1} "
                            f"but is {layer.kind!r}, not 'recomputed'")
        if layer.kind == "patch":
            if layer.patch_mode not in PATCH_MODES:
                problems.append(f"layer {layer.index}: patch_mode must be one of {PATCH_MODES}, got "
                                f"{layer.patch_mode!r}")
            elif layer.patch_mode == "project" and layer.depth != 1:
                problems.append(f"layer {layer.index}: a projection-only Patch layer has depth 1, got {layer.depth}")
            elif not 1 <= layer.depth <= len(plan) - layer.index:
                problems.append(f"layer {layer.index}: recompute depth {layer.depth} must be 1..{len(plan) - layer.index}")
            else:
                covered_until = layer.index + layer.depth
            if layer.key_rank or layer.value_rank:
                problems.append(f"layer {layer.index} is a Patch layer but names key/value ranks")
        elif layer.patch_rank or layer.patch_mode or layer.depth:
            problems.append(f"layer {layer.index} is a Reuse layer but names a Patch rank, mode or depth")
        problems.extend(_width_problems(layer))
    coded = [bool(layer.widths) for layer in plan if layer.kind != "recomputed"]
    if any(coded) and not all(coded):
        problems.append("some layers name whitened code widths and others do not: a plan codes every layer in one "
                        "format")
    return problems


def _width_problems(layer: LayerPlan) -> list[str]:
    if not layer.widths:
        return []
    ranks = dict(layer.code_ranks())
    if set(layer.widths) != set(ranks):
        return [f"layer {layer.index} names code widths for {sorted(layer.widths)} but sends codes "
                f"{sorted(ranks)}"]
    problems = []
    for name, code in layer.widths.items():
        if not isinstance(code, CodeWidths):
            problems.append(f"layer {layer.index}: {name} widths must be CodeWidths")
            continue
        problems.extend(f"layer {layer.index}: {name} {problem}" for problem in code.problems())
        if code.rank != ranks[name]:
            problems.append(f"layer {layer.index}: {code.rank} {name} code widths for {name} rank {ranks[name]}")
    return problems


@dataclass
class SCDKnowledgeBase:
    plan: list[LayerPlan]
    keys: dict[int, LowRankMap]  # reuse layers
    values: dict[int, LowRankMap]
    inputs: dict[int, LowRankMap]  # projection-only patch layers: normalized input -> the consumer's
    code_bits: int
    exact_tokens: int  # the first tokens of every prompt the consumer computes itself (attention sinks)
    producer: dict  # model_access.model_identity of the producer, plus its name
    consumer: dict
    tokenizer_sha256: str | None
    fitting: dict = field(default_factory=dict)  # texts, settings, the budget and what was measured
    save_id: str | None = None
    residuals: dict[int, LowRankMap] = field(default_factory=dict)  # recompute patch layers: h / rms(h), both sides

    # ---- what it is -------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.plan)

    @property
    def patch_layers(self) -> list[int]:
        return [layer.index for layer in self.plan if layer.kind == "patch"]

    @property
    def residual_layers(self) -> list[int]:
        """Layers whose residual stream the producer codes (the first layer of each recompute block)."""
        return [layer.index for layer in self.plan if layer.recomputes]

    @property
    def input_layers(self) -> list[int]:
        """Layers whose normalized input the producer codes (projection-only Patch layers)."""
        return [layer.index for layer in self.plan if layer.kind == "patch" and not layer.recomputes]

    def patch_map(self, layer: LayerPlan) -> LowRankMap:
        return (self.residuals if layer.recomputes else self.inputs)[layer.index]

    def components_per_token(self) -> int:
        return sum(layer.components() for layer in self.plan)

    @property
    def code_format(self) -> str:
        """``whitened`` when the plan's layers carry code widths, else ``flat`` (see the module docstring)."""
        return plan_code_format(self.plan)

    def bytes_per_token(self, code_bits: int | None = None) -> float:
        """Bytes on the wire per coded token: the codes plus one float16 scale per flat code vector, or the packed
        whitened codes and their gain bytes, and each recompute block's RMS."""
        return plan_bytes_per_token(self.plan, code_bits or self.code_bits)

    def identity(self) -> str:
        """What a payload names to say which knowledge base coded it."""
        if self.save_id is None:
            raise KnowledgeBaseError("This knowledge base has not been saved; save it (kb.save(DIR)) so payloads can "
                                     "name it.")
        return self.save_id

    # ---- persistence ------------------------------------------------------------------------------------------
    def save(self, directory: str | Path, *, overwrite: bool = True) -> Path:
        directory = Path(directory)
        if not overwrite and (directory / METADATA_FILE).exists():
            raise FileExistsError(f"{directory} already holds an SCD knowledge base; pass overwrite=True (or "
                                  "--overwrite) to replace it, or choose another directory.")
        tensors: dict[str, torch.Tensor] = {}
        for index, mapping in self.keys.items():
            tensors.update(mapping.tensors(f"layers.{index}.keys"))
        for index, mapping in self.values.items():
            tensors.update(mapping.tensors(f"layers.{index}.values"))
        for index, mapping in self.inputs.items():
            tensors.update(mapping.tensors(f"layers.{index}.inputs"))
        for index, mapping in self.residuals.items():
            tensors.update(mapping.tensors(f"layers.{index}.residuals"))
        for layer in self.plan:
            for name, code in layer.widths.items():
                tensors[f"layers.{layer.index}.{name}_bits"] = torch.tensor(code.bits, dtype=torch.uint8)
        description = {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
            "plan": [layer.to_dict(bits=False) for layer in self.plan], "code_format": self.code_format,
            "code_bits": self.code_bits, "exact_tokens": self.exact_tokens, "producer": self.producer,
            "consumer": self.consumer, "tokenizer_sha256": self.tokenizer_sha256, "fitting": self.fitting,
            "bytes_per_token": self.bytes_per_token(),
        }
        self.save_id = save_tensors_and_json(directory, TENSORS_FILE, METADATA_FILE, tensors, description,
                                             {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)})
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> SCDKnowledgeBase:
        directory = Path(directory)
        metadata_path, tensors_path = directory / METADATA_FILE, directory / TENSORS_FILE
        for path in (metadata_path, tensors_path):
            if not path.is_file():
                raise KnowledgeBaseError(f"{path} does not exist. An SCD knowledge base directory holds {METADATA_FILE}"
                                         f" and {TENSORS_FILE}; create one with `hf-kvcodecs scd fit`.")
        metadata = read_json(metadata_path, max_bytes=MAX_METADATA_BYTES, kind="an SCD knowledge base",
                             content="a knowledge base description", fix="re-run `hf-kvcodecs scd fit`",
                             error=KnowledgeBaseError)
        if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
            raise KnowledgeBaseError(f"{metadata_path} is not an SCD knowledge base.")
        version = metadata.get("format_version")
        if type(version) is not int or version not in READABLE_FORMAT_VERSIONS:
            raise KnowledgeBaseError(f"{metadata_path} has format_version={version!r}; this hf_kvcodecs reads version "
                                     f"{FORMAT_VERSION}. Upgrade hf_kvcodecs or re-run `hf-kvcodecs scd fit`.")
        try:
            with safe_open(str(tensors_path), "pt") as handle:
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
                header = handle.metadata() or {}
        except (SafetensorError, OSError, ValueError) as error:
            raise KnowledgeBaseError(f"{tensors_path} could not be read ({error}); it is corrupt or truncated.") from error
        if metadata.get("save_id") != header.get("save_id"):
            raise KnowledgeBaseError(f"{metadata_path} and {tensors_path} come from different saves; copy both files "
                                     "of one save, or re-run `hf-kvcodecs scd fit`.")
        def stored_bits(index: int, name: str) -> list[int]:
            widths = tensors[f"layers.{index}.{name}_bits"]
            if widths.dtype != torch.uint8 or widths.ndim != 1:
                raise ValueError(f"layers.{index}.{name}_bits must be a 1-D uint8 tensor")
            return widths.tolist()

        try:
            plan = _read_plan(metadata.get("plan"), stored_bits)
            code_format = metadata.get("code_format", "flat")
            if code_format not in CODE_FORMATS or code_format != plan_code_format(plan):
                raise ValueError(f"code_format {str(code_format)[:20]!r} is not what its plan codes "
                                 f"({plan_code_format(plan)!r})")
            code_bits, exact_tokens = int(metadata["code_bits"]), int(metadata["exact_tokens"])
            keys, values, inputs, residuals = {}, {}, {}, {}
            for layer in plan:
                if layer.kind == "reuse":
                    keys[layer.index] = LowRankMap.from_tensors(tensors, f"layers.{layer.index}.keys")
                    values[layer.index] = LowRankMap.from_tensors(tensors, f"layers.{layer.index}.values")
                elif layer.recomputes:
                    residuals[layer.index] = LowRankMap.from_tensors(tensors, f"layers.{layer.index}.residuals")
                elif layer.kind == "patch":
                    inputs[layer.index] = LowRankMap.from_tensors(tensors, f"layers.{layer.index}.inputs")
        except (KeyError, TypeError, ValueError) as error:
            raise KnowledgeBaseError(f"{directory} holds an inconsistent knowledge base ({error}); re-run "
                                     "`hf-kvcodecs scd fit`.") from error
        made = cls(plan, keys, values, inputs, code_bits, exact_tokens, metadata.get("producer") or {},
                   metadata.get("consumer") or {}, metadata.get("tokenizer_sha256"), metadata.get("fitting") or {},
                   metadata.get("save_id"), residuals)
        problems = made.consistency_problems()
        if problems:
            raise KnowledgeBaseError(f"{directory} holds an inconsistent knowledge base: {'; '.join(problems)}.")
        return made

    def consistency_problems(self) -> list[str]:
        problems = []
        if self.code_bits not in CODE_BITS:
            problems.append(f"code_bits must be one of {CODE_BITS}, got {self.code_bits}")
        if self.exact_tokens < 0:
            problems.append("exact_tokens must be >= 0")
        problems.extend(plan_problems(self.plan))
        if self.code_format == "whitened" and self.code_bits not in WHITENED_CODE_BITS:
            problems.append(f"whitened codes are allocated at the bytes of {WHITENED_CODE_BITS}-bit flat codes, not "
                            f"{self.code_bits}-bit")
        for layer in self.plan:
            if layer.kind == "reuse":
                for kind, rank, mapping in (("key", layer.key_rank, self.keys.get(layer.index)),
                                            ("value", layer.value_rank, self.values.get(layer.index))):
                    if mapping is None or rank < 0 or rank > mapping.rank:
                        problems.append(f"layer {layer.index}: {kind} rank {rank} exceeds its map's rank")
            elif layer.kind == "patch":
                mapping = (self.residuals if layer.recomputes else self.inputs).get(layer.index)
                if mapping is None or layer.patch_rank < 1 or layer.patch_rank > mapping.rank:
                    problems.append(f"layer {layer.index}: patch rank {layer.patch_rank} exceeds its map's rank")
        return problems


def _packed_bytes(rank: int, bits: int) -> int:
    return math.ceil(rank * bits / 8)


SCALE_BYTES = 2  # one float16 scale per flat code vector below 16 bits


def flat_vector_bytes(rank: int, bits: int) -> int:
    """Bytes of one flat code vector: its packed codes and, below 16 bits, its float16 scale."""
    return _packed_bytes(rank, bits) + (SCALE_BYTES if bits < 16 else 0)


def plan_code_format(plan: Sequence[LayerPlan]) -> str:
    return "whitened" if any(layer.widths for layer in plan) else "flat"


def plan_bytes_per_token(plan: list[LayerPlan], bits: int) -> float:
    """Bytes on the wire per coded token: per code vector its codes and, below 16 bits, its float16 scale (flat) or
    its packed widths and gain byte (whitened); and one RMS per recompute block (float16; float32 beside lossless
    32-bit codes). At 16 and 32 bits codes are floats in either format."""
    code_bytes = 0
    for layer in plan:
        for name, rank in layer.code_ranks():
            code = layer.widths.get(name)
            code_bytes += code.bytes_per_vector() if code is not None and bits < 16 else flat_vector_bytes(rank, bits)
    rms_bytes = 4 if bits == 32 else 2
    return code_bytes + rms_bytes * len(recompute_blocks(plan))


def _read_widths(item: dict, stored_bits: Callable[[int, str], Sequence[int]] | None,
                 limit: int) -> dict[str, CodeWidths]:
    codes = item.get("codes")
    if codes is None:
        return {}
    if not isinstance(codes, dict) or not codes or len(codes) > 2:
        raise ValueError(f"plan entry {item.get('index')}: codes must map each code name to its widths")
    widths = {}
    for name, spec in codes.items():
        if name not in ("key", "value", "patch") or not isinstance(spec, dict) or type(spec.get("gain")) is not bool:
            raise ValueError(f"plan entry {item.get('index')}: codes.{str(name)[:20]} must be {{'gain': bool, ...}} "
                             "for a key, value or patch code")
        if stored_bits is None:
            if set(spec) != {"gain", "bits"}:
                raise ValueError(f"plan entry {item.get('index')}: codes.{name} must hold exactly 'gain' and 'bits'")
            widths[name] = CodeWidths.from_runs(spec["bits"], spec["gain"], limit)
            limit -= widths[name].rank
        else:
            if set(spec) != {"gain"}:
                raise ValueError(f"plan entry {item.get('index')}: codes.{name} must hold 'gain' only (the widths "
                                 "are tensors)")
            widths[name] = CodeWidths(tuple(int(b) for b in stored_bits(item["index"], name)), spec["gain"])
    return widths


def _read_plan(raw, stored_bits: Callable[[int, str], Sequence[int]] | None = None) -> list[LayerPlan]:
    """A plan from its JSON entries. Whitened code widths come from the entries' ``codes`` runs (a payload
    manifest), or from ``stored_bits(index, name)`` (a knowledge base's tensors) when given."""
    if not isinstance(raw, list) or not raw or len(raw) > 4096:
        raise ValueError("the plan must be a non-empty list of layers")
    plan = []
    remaining = MAX_PLAN_COMPONENTS  # what the width runs may still expand to
    for item in raw:
        if not isinstance(item, dict) or item.get("kind") not in LAYER_KINDS:
            raise ValueError(f"each plan entry needs a kind in {LAYER_KINDS}, got {item!r}")
        numbers = {name: item.get(name, 0) for name in ("index", "key_rank", "value_rank", "patch_rank", "depth")}
        if any(type(value) is not int or not 0 <= value < 2**31 for value in numbers.values()):
            raise ValueError(f"plan entry {item!r} must hold non-negative integers")
        mode = item.get("patch_mode", "")
        if item["kind"] == "patch" and "patch_mode" not in item:  # written before recompute Patch existed
            mode, numbers["depth"] = "project", 1
        if not isinstance(mode, str):
            raise ValueError(f"plan entry {item!r}: patch_mode must be a string")
        widths = _read_widths(item, stored_bits, remaining)
        remaining -= sum(code.rank for code in widths.values())
        plan.append(LayerPlan(kind=item["kind"], patch_mode=mode, widths=widths, **numbers))
    problems = plan_problems(plan)
    if problems:
        raise ValueError("; ".join(problems[:3]))
    return plan
