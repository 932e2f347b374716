"""The bandwidth-aware planner: arithmetic on measured costs, checked by hand on small numbers."""

from __future__ import annotations

import pytest

from hf_kvcodecs.scd.planner import OperatingPoint, plan_transfer

LOCAL = OperatingPoint("local prefill", "local", 0, consumer_seconds=1.0)
RAW = OperatingPoint("raw bf16 KV", "raw", 8_000_000, consumer_seconds=0.01, producer_seconds=0.5, kl=0.20)
SCD_SMALL = OperatingPoint("scd 4-bit", "scd", 500_000, consumer_seconds=0.30, producer_seconds=0.6, kl=0.05)
SCD_DEEP = OperatingPoint("scd recompute 10..29", "scd", 1_000_000, consumer_seconds=0.60, producer_seconds=0.6,
                          kl=0.01)


def test_predicted_time_is_wire_plus_rebuild_plus_producer_on_the_path():
    # 500 kB at 1 Gbps = 4 ms
    assert SCD_SMALL.predicted_seconds(1.0) == pytest.approx(0.6 + 0.004 + 0.30)
    assert SCD_SMALL.predicted_seconds(1.0, producer_on_path=False) == pytest.approx(0.304)
    assert LOCAL.predicted_seconds(0.001) == 1.0


def test_the_choice_follows_bandwidth_and_the_quality_budget():
    points = [LOCAL, RAW, SCD_SMALL, SCD_DEEP]
    fast = plan_transfer(points, 100.0, producer_on_path=False)
    assert fast.choice is RAW  # 8 MB at 100 Gbps: 0.64 ms + 10 ms
    assert plan_transfer(points, 100.0, producer_on_path=False, max_kl=0.1).choice is SCD_SMALL
    assert plan_transfer(points, 100.0, producer_on_path=False, max_kl=0.02).choice is SCD_DEEP
    # a slow link: raw KV costs 6.4 s, SCD 4-bit 0.7 s
    assert plan_transfer(points, 0.01, producer_on_path=False).choice is SCD_SMALL
    # slower still, nothing beats computing locally, and the plan says so
    slow = plan_transfer(points, 0.001, producer_on_path=False)
    assert slow.choice is LOCAL and "no transfer" in slow.reason
    # with the producer's prefill on the path, a tight budget falls back to local
    assert plan_transfer(points, 100.0, max_kl=0.02).choice is LOCAL
    row = {c["name"]: c for c in plan_transfer(points, 1.0, max_kl=0.02).candidates}
    assert not row["raw bf16 KV"]["eligible"] and "over the budget" in row["raw bf16 KV"]["why"]


def test_bad_inputs_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="local-prefill"):
        plan_transfer([SCD_SMALL], 1.0)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        plan_transfer([LOCAL], 0)
    with pytest.raises(ValueError, match="kind"):
        OperatingPoint("x", "magic", 1, 0.1)
    with pytest.raises(ValueError, match="consumer_seconds"):
        OperatingPoint("x", "scd", 1, float("nan"))
    unmeasured = OperatingPoint("scd unmeasured", "scd", 10, 0.0)
    assert plan_transfer([LOCAL, unmeasured], 1.0).choice is LOCAL
