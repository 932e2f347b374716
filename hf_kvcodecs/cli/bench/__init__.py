"""`hf-kvcodecs bench ...`: one module per benchmark, each adding its sub-command and running it."""

from __future__ import annotations

from .._common import HelpFormatter
from . import codec, decode, kv, memory, scd, scd_mismatch, scd_serving, scd_transport, split, squat, weights


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks", description="benchmarks", formatter_class=HelpFormatter)
    benchmarks = bench.add_subparsers(dest="bench", required=True)
    for module in (kv, memory, codec, weights, split, decode, scd, scd_mismatch, scd_transport, scd_serving, squat):
        module.add_parser(benchmarks)
