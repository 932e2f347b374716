"""`hf-kvcodecs bench memory`: bits per element each cache holds, its total with the per-model tables it references,
and the error of what attention reads from it."""

from __future__ import annotations

from pathlib import Path

from .._common import (
    add_command,
    add_gsrq_row_arguments,
    add_model_arguments,
    calibration_text,
    load_model,
    write_results,
)
from ..defaults import EVALUATION_TEXT, GSRQ_LEARNERS


def add_parser(bench) -> None:
    memory = add_command(bench, "memory", "bits per element held by each cache, and its total with the per-model "
                         "tables it references, at several context lengths")
    add_model_arguments(memory)
    memory.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for memory.json and memory.md")
    memory.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096],
                        help=f"tokens of {EVALUATION_TEXT} text prefilled into each cache, one measurement each "
                             "(rounded down to a length every cache can prefill)")
    memory.add_argument("--decode-steps", type=int, default=64,
                        help="single-token decode steps after each prefill, after which the cache is measured again")
    memory.add_argument("--learners", nargs="+", default=list(GSRQ_LEARNERS), choices=GSRQ_LEARNERS,
                        help="codebook learners of the GSRQ rows, each calibrated unless the codebook store holds it")
    add_gsrq_row_arguments(memory)
    memory.set_defaults(func=command)


def command(args) -> int:
    from ...bench.kv import measure_memory, memory_markdown

    results = measure_memory(load_model(args), contexts=tuple(args.contexts), decode_steps=args.decode_steps,
                             learners=tuple(args.learners), calibration_text=calibration_text(args),
                             key_layout=args.key_layout, value_layout=args.value_layout, group_dim=args.group_dim)
    write_results(Path(args.out), "memory", results, memory_markdown(results))
    return 0
