"""The SCD knowledge base of one (producer, consumer) pair: per layer a Reuse map (low-rank codes of the producer's
pre-RoPE keys and values, decoded to the consumer's) or a Patch map (a low-rank code of the producer's normalized
layer input, decoded to a prediction of the consumer's), the code precision, and the identities it was fitted for.

Saved as safetensors + JSON (one save, one ``save_id``, see :mod:`hf_kvcodecs.fileio`). Encoders are the producer's
half and decoders the consumer's; both live in one file so a pair's fit stays one artifact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..codecs.lowrank import LowRankMap
from ..fileio import read_json, save_tensors_and_json

FORMAT_NAME = "hf_kvcodecs.scd_knowledge_base"
FORMAT_VERSION = 1
TENSORS_FILE = "scd_knowledge_base.safetensors"
METADATA_FILE = "scd_knowledge_base.json"
MAX_METADATA_BYTES = 16 * 2**20  # a 100-layer description with error curves is well under 1 MiB
LAYER_KINDS = ("reuse", "patch")
CODE_BITS = (4, 8, 16, 32)


class KnowledgeBaseError(ValueError):
    """A knowledge base directory is missing, corrupt, or does not fit the models it is used with."""


@dataclass
class LayerPlan:
    """How one layer travels: ``reuse`` (key and value codes of ranks ``key_rank`` / ``value_rank``) or ``patch``
    (a code of rank ``patch_rank`` of the normalized input; the consumer projects its prediction itself)."""

    index: int
    kind: str
    key_rank: int = 0
    value_rank: int = 0
    patch_rank: int = 0

    def components(self) -> int:
        return self.key_rank + self.value_rank if self.kind == "reuse" else self.patch_rank

    def to_dict(self) -> dict:
        return {"index": self.index, "kind": self.kind, "key_rank": self.key_rank, "value_rank": self.value_rank,
                "patch_rank": self.patch_rank}


@dataclass
class SCDKnowledgeBase:
    plan: list[LayerPlan]
    keys: dict[int, LowRankMap]  # reuse layers
    values: dict[int, LowRankMap]
    inputs: dict[int, LowRankMap]  # patch layers
    code_bits: int
    exact_tokens: int  # the first tokens of every prompt the consumer computes itself (attention sinks)
    producer: dict  # model_access.model_identity of the producer, plus its name
    consumer: dict
    tokenizer_sha256: str | None
    fitting: dict = field(default_factory=dict)  # texts, settings, the budget and what was measured
    save_id: str | None = None

    # ---- what it is -------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.plan)

    @property
    def patch_layers(self) -> list[int]:
        return [layer.index for layer in self.plan if layer.kind == "patch"]

    def components_per_token(self) -> int:
        return sum(layer.components() for layer in self.plan)

    def bytes_per_token(self, code_bits: int | None = None) -> float:
        """Bytes on the wire per coded token: the codes plus one float16 scale per code vector."""
        bits = code_bits or self.code_bits
        vectors = sum(2 if layer.kind == "reuse" else 1 for layer in self.plan)
        scale_bytes = 0 if bits >= 16 else 2 * vectors
        code_bytes = sum(_packed_bytes(rank, bits) for layer in self.plan
                         for rank in ((layer.key_rank, layer.value_rank) if layer.kind == "reuse" else (layer.patch_rank,)))
        return code_bytes + scale_bytes

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
        description = {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "plan": [layer.to_dict() for layer in self.plan],
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
        if type(version) is not int or version != FORMAT_VERSION:
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
        try:
            plan = _read_plan(metadata.get("plan"))
            code_bits, exact_tokens = int(metadata["code_bits"]), int(metadata["exact_tokens"])
            keys, values, inputs = {}, {}, {}
            for layer in plan:
                if layer.kind == "reuse":
                    keys[layer.index] = LowRankMap.from_tensors(tensors, f"layers.{layer.index}.keys")
                    values[layer.index] = LowRankMap.from_tensors(tensors, f"layers.{layer.index}.values")
                else:
                    inputs[layer.index] = LowRankMap.from_tensors(tensors, f"layers.{layer.index}.inputs")
        except (KeyError, TypeError, ValueError) as error:
            raise KnowledgeBaseError(f"{directory} holds an inconsistent knowledge base ({error}); re-run "
                                     "`hf-kvcodecs scd fit`.") from error
        made = cls(plan, keys, values, inputs, code_bits, exact_tokens, metadata.get("producer") or {},
                   metadata.get("consumer") or {}, metadata.get("tokenizer_sha256"), metadata.get("fitting") or {},
                   metadata.get("save_id"))
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
        if [layer.index for layer in self.plan] != list(range(len(self.plan))):
            problems.append("the plan must list layers 0..L-1 in order")
        for layer in self.plan:
            if layer.kind == "reuse":
                for kind, rank, mapping in (("key", layer.key_rank, self.keys.get(layer.index)),
                                            ("value", layer.value_rank, self.values.get(layer.index))):
                    if mapping is None or rank < 0 or rank > mapping.rank:
                        problems.append(f"layer {layer.index}: {kind} rank {rank} exceeds its map's rank")
            else:
                mapping = self.inputs.get(layer.index)
                if mapping is None or layer.patch_rank < 1 or layer.patch_rank > mapping.rank:
                    problems.append(f"layer {layer.index}: patch rank {layer.patch_rank} exceeds its map's rank")
        return problems


def _packed_bytes(rank: int, bits: int) -> int:
    return math.ceil(rank * bits / 8)


def _read_plan(raw) -> list[LayerPlan]:
    if not isinstance(raw, list) or not raw or len(raw) > 4096:
        raise ValueError("the plan must be a non-empty list of layers")
    plan = []
    for item in raw:
        if not isinstance(item, dict) or item.get("kind") not in LAYER_KINDS:
            raise ValueError(f"each plan entry needs a kind in {LAYER_KINDS}, got {item!r}")
        numbers = {name: item.get(name, 0) for name in ("index", "key_rank", "value_rank", "patch_rank")}
        if any(type(value) is not int or value < 0 for value in numbers.values()):
            raise ValueError(f"plan entry {item!r} must hold non-negative integers")
        plan.append(LayerPlan(kind=item["kind"], **numbers))
    return plan
