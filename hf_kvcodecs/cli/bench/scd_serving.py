"""`hf-kvcodecs bench scd-serving`: SCD's operating points on one pair (knowledge bases x code prefixes, raw bf16 KV,
the consumer's own prefill) with measured bytes, seconds and quality; the bandwidth-aware planner's choices over a
bandwidth sweep; and a progressive payload's quality against the bytes received."""

from __future__ import annotations

import argparse
from pathlib import Path

from .._common import add_command, load_model, positive_int, write_results
from ..defaults import EVALUATION_TEXT


def _named_directory(value: str) -> tuple[str, Path]:
    name, _, directory = value.partition("=")
    if not name or not directory:
        raise argparse.ArgumentTypeError(f"expected NAME=DIRECTORY (a knowledge base `scd fit --out` wrote), got "
                                         f"{value!r}")
    return name, Path(directory)


def add_parser(bench) -> None:
    serving = add_command(bench, "scd-serving",
                          "SCD operating points, the bandwidth-aware planner's choices and a progressive payload's "
                          "quality against bytes received, on one pair")
    serving.add_argument("--producer", default="default", help="the model that prefills ('default', a path)")
    serving.add_argument("--consumer", default="default", help="the model that decodes ('default', a path)")
    serving.add_argument("--knowledge-base", type=_named_directory, nargs="+", required=True, metavar="NAME=DIR",
                         help="the pair's knowledge bases (each one Patch depth and code precision)")
    serving.add_argument("--main", default=None, help="the knowledge base of the progressive curve (default: first)")
    serving.add_argument("--tokens", type=positive_int, default=1024, help="prompt tokens")
    serving.add_argument("--windows", type=positive_int, default=4, help="held-out windows for quality")
    serving.add_argument("--repeats", type=positive_int, default=3, help="interleaved timing repeats")
    serving.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")
    serving.add_argument("--text", default=EVALUATION_TEXT, help="evaluation text: a built-in corpus name or files")
    serving.add_argument("--out", type=Path, default=Path("benchmarks/results/scd_serving"),
                         help="folder for scd_serving.json / .md / .png")
    serving.set_defaults(func=command)


def command(args) -> int:
    from ...bench.scd_serving import ServingBenchSettings, run_serving_bench, serving_markdown, serving_plot
    from ...scd import SCDKnowledgeBase
    from ...text import load_corpus, tokenize_corpus

    corpus = load_corpus(args.text, default=EVALUATION_TEXT)
    kbs = {name: SCDKnowledgeBase.load(directory) for name, directory in args.knowledge_base}
    main = args.main or args.knowledge_base[0][0]
    if main not in kbs:
        raise ValueError(f"--main {main!r} is not one of the --knowledge-base names {sorted(kbs)}.")
    producer = load_model(argparse.Namespace(model=args.producer, threads=args.threads))
    consumer = producer if args.consumer == args.producer else load_model(
        argparse.Namespace(model=args.consumer, threads=args.threads))
    token_ids = tokenize_corpus(producer.tokenizer, corpus)
    text = {**corpus.to_dict(), "name": args.text, "tokens": int(token_ids.numel())}
    settings = ServingBenchSettings(tokens=args.tokens, windows=args.windows, repeats=args.repeats)
    results = run_serving_bench(producer, consumer, kbs, main, token_ids, text, settings)
    results["producer_name"], results["consumer_name"] = args.producer, args.consumer
    results["knowledge_base_dirs"] = {name: str(directory) for name, directory in args.knowledge_base}
    write_results(args.out, "scd_serving", results, serving_markdown(results))
    serving_plot(results, args.out / "scd_serving.png")
    return 0
