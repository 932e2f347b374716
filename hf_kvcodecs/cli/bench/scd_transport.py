"""`hf-kvcodecs bench scd-transport`: measured TTFT with the producer and the consumer in two real processes (gloo on
loopback): SCD streaming against the consumer's own prefill and raw bfloat16 KV over the same transport, beside the
TTFT `bench scd` models for the same prompt length."""

from __future__ import annotations

from pathlib import Path

from .._common import add_command, positive_int, write_results
from ..defaults import EVALUATION_TEXT


def add_parser(bench) -> None:
    transport = add_command(bench, "scd-transport",
                            "SCD between two real processes: measured TTFT against local prefill and raw bf16 KV")
    transport.add_argument("--producer", default="default", help="the model that prefills ('default', a Hub id or a path)")
    transport.add_argument("--consumer", default="default", help="the model that decodes")
    transport.add_argument("--knowledge-base", required=True, type=Path, help="the pair's knowledge base (`scd fit --out`)")
    transport.add_argument("--tokens", type=positive_int, nargs="+", default=[1024],
                           help="prompt lengths (several draw a TTFT curve)")
    transport.add_argument("--repeats", type=positive_int, default=5, help="timed rounds of every method (interleaved)")
    transport.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads of each process")
    transport.add_argument("--text", default=EVALUATION_TEXT, help="the text whose first tokens are the prompt")
    transport.add_argument("--modelled-repeats", type=positive_int, default=3,
                           help="runs of each part of the modelled TTFT (bench scd's cost model)")
    transport.add_argument("--timeout", type=float, default=3600.0, help="seconds the two processes may run")
    transport.add_argument("--out", type=Path, default=Path("benchmarks/results/scd_transport"),
                           help="folder for scd_transport.json/.md (and .png with several --tokens)")
    transport.set_defaults(func=command)


def command(args) -> int:
    from ...bench.scd_transport import (
        TransportBenchSettings,
        run_transport_bench,
        transport_markdown,
        transport_plot,
    )

    if not (args.knowledge_base / "scd_knowledge_base.json").is_file():
        raise FileNotFoundError(f"{args.knowledge_base} holds no scd_knowledge_base.json; pass a directory written by "
                                "`hf-kvcodecs scd fit --out DIR`.")
    settings = TransportBenchSettings(producer=args.producer, consumer=args.consumer,
                                      knowledge_base=str(args.knowledge_base), tokens=tuple(args.tokens),
                                      repeats=args.repeats, threads=args.threads, text=args.text,
                                      modelled_repeats=args.modelled_repeats, timeout_s=args.timeout)
    results = run_transport_bench(settings)
    write_results(args.out, "scd_transport", results, transport_markdown(results))
    transport_plot(results, args.out / "scd_transport.png")
    return 0
