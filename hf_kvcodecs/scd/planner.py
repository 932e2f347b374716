"""A bandwidth-aware choice of how a consumer gets its prefill: which SCD operating point (knowledge base, code
prefix, Patch depth), raw KV, or its own local prefill, and the time to first token each is predicted to take.

The prediction is the model the SCD bench uses, from measured parts: a transfer costs ``bytes / bandwidth`` plus the
consumer's rebuild (measured for that operating point) plus, when the producer's work is on the critical path, the
producer's encode; a local prefill costs the consumer's measured prefill. Every option carries its measured quality
(mean KL divergence from the consumer's own prefill, on a continuation; 0 for the local prefill), and an option whose
quality is unknown or over the request's budget is not chosen. The planner never measures: :func:`plan_transfer`
is arithmetic on the numbers it is given, so its choice can be checked against a measured run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["LOCAL_PREFILL", "OperatingPoint", "TransferPlan", "plan_transfer"]

LOCAL_PREFILL = "local prefill"


@dataclass(frozen=True)
class OperatingPoint:
    """One way to give the consumer its cache for a prompt of ``tokens`` tokens, with its measured costs.

    ``payload_bytes``: bytes on the wire (0 for a local prefill); ``consumer_seconds``: the consumer's work once the
    bytes are in (its rebuild, or its whole prefill); ``producer_seconds``: the producer's work before the first byte
    (prefill and coding), counted only when the producer is on the critical path; ``kl``: mean KL divergence from the
    consumer's own prefill (None when not measured)."""

    name: str
    kind: str  # "scd", "raw", "local"
    payload_bytes: int
    consumer_seconds: float
    producer_seconds: float = 0.0
    kl: float | None = None
    detail: str = ""

    def __post_init__(self):
        if self.kind not in ("scd", "raw", "local"):
            raise ValueError(f"kind must be 'scd', 'raw' or 'local', got {self.kind!r}.")
        for field in ("payload_bytes", "consumer_seconds", "producer_seconds"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{field} of {self.name!r} must be a finite non-negative number, got {value!r}.")
        if self.kind == "local" and self.payload_bytes:
            raise ValueError(f"a local prefill ({self.name!r}) sends no bytes.")

    def predicted_seconds(self, bandwidth_gbps: float, *, producer_on_path: bool = True) -> float:
        """Predicted time to the consumer's cache (the first decode step, common to every option, left out)."""
        if self.kind == "local":
            return self.consumer_seconds
        wire = self.payload_bytes * 8 / (bandwidth_gbps * 1e9)
        return (self.producer_seconds if producer_on_path else 0.0) + wire + self.consumer_seconds


@dataclass(frozen=True)
class TransferPlan:
    choice: OperatingPoint
    predicted_seconds: float
    bandwidth_gbps: float
    max_kl: float | None
    candidates: list[dict]  # every option: its prediction, and why it was or was not eligible
    reason: str

    def to_dict(self) -> dict:
        return {"choice": self.choice.name, "kind": self.choice.kind, "predicted_seconds": self.predicted_seconds,
                "bandwidth_gbps": self.bandwidth_gbps, "max_kl": self.max_kl, "reason": self.reason,
                "candidates": self.candidates}


def plan_transfer(points: list[OperatingPoint], bandwidth_gbps: float, *, max_kl: float | None = None,
                  producer_on_path: bool = True) -> TransferPlan:
    """The fastest option at ``bandwidth_gbps`` whose measured KL is within ``max_kl`` (any measured KL when None).

    ``points`` must include a local prefill (``kind="local"``): it is always eligible (it is the reference), so the
    planner always has a fallback, and reports when SCD cannot win. Ties go to the earlier point."""
    if not (isinstance(bandwidth_gbps, (int, float)) and math.isfinite(bandwidth_gbps) and bandwidth_gbps > 0):
        raise ValueError(f"bandwidth_gbps must be a positive number, got {bandwidth_gbps!r}.")
    if max_kl is not None and not (math.isfinite(max_kl) and max_kl >= 0):
        raise ValueError(f"max_kl must be a non-negative number or None, got {max_kl!r}.")
    if not any(point.kind == "local" for point in points):
        raise ValueError("plan_transfer needs a local-prefill OperatingPoint (kind='local') to fall back to.")
    candidates, best = [], None
    for point in points:
        seconds = point.predicted_seconds(bandwidth_gbps, producer_on_path=producer_on_path)
        if point.kind == "local":
            eligible, why = True, "the consumer's own prefill (the reference)"
        elif point.kl is None:
            eligible, why = False, "quality not measured"
        elif max_kl is not None and point.kl > max_kl:
            eligible, why = False, f"KL {point.kl:.4f} over the budget {max_kl:g}"
        else:
            eligible, why = True, f"KL {point.kl:.4f}"
        candidates.append({**asdict(point), "predicted_seconds": seconds, "eligible": eligible, "why": why})
        if eligible and (best is None or seconds < best[1]):
            best = (point, seconds)
    choice, seconds = best
    local = min(c["predicted_seconds"] for c in candidates if c["kind"] == "local")
    if choice.kind == "local":
        reason = "no transfer within the quality budget beats the local prefill at this bandwidth"
    else:
        reason = f"{local / seconds:.2f}x faster than the local prefill"
    return TransferPlan(choice, seconds, float(bandwidth_gbps), max_kl, candidates, reason)
