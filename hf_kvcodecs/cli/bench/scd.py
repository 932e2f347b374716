"""`hf-kvcodecs bench scd`: SCD against raw, quantized, PCA-coded and DroidSpeak-style transfer and the consumer's own
prefill, for quality (perplexity, KL, pass-key) and cost (bytes, measured times, modelled TTFT)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from .._common import add_command, load_model, positive_int, write_results
from ..defaults import CALIBRATION_TEXT, EVALUATION_TEXT


def add_parser(bench) -> None:
    scd = add_command(bench, "scd", "SCD transfer against its baselines: quality, bytes, measured cost, modelled TTFT")
    scd.add_argument("--producer", default="default", help="the model that prefills ('default', a Hub id or a path)")
    scd.add_argument("--consumer", required=True, help="the model that decodes (e.g. a `scd make-consumer` directory)")
    scd.add_argument("--knowledge-base", required=True, type=Path, help="the pair's knowledge base (`scd fit --out`)")
    scd.add_argument("--more-knowledge-bases", nargs="*", default=[], metavar="NAME=DIR",
                     help="more SCD operating points of the same pair (other budgets, forced Patch layers), each "
                          "reported as method NAME (e.g. scd-kl0.2=DIR)")
    scd.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    scd.add_argument("--text", nargs="+", default=None,
                     help=f"evaluation text (default: {EVALUATION_TEXT}); must differ from the calibration and "
                          "fine-tuning texts")
    scd.add_argument("--kvtc-windows", type=positive_int, default=8,
                     help=f"windows of {CALIBRATION_TEXT} the same-model PCA codec (kvtc-like) is fitted on")
    scd.add_argument("--kvtc-code-bits", type=int, choices=(4, 8), default=4,
                     help="bytes of the kvtc-like codec, as flat codes of this precision; its codes are whitened with "
                          "per-component bit allocation at those bytes, as KVTC's dynamic program allocates them")
    scd.add_argument("--windows", type=positive_int, default=8, help="held-out windows for the quality metrics")
    scd.add_argument("--context", type=positive_int, default=1024, help="context tokens of each quality window")
    scd.add_argument("--cost-contexts", type=positive_int, nargs="+", default=[1024, 4096, 8192],
                     help="context lengths the times are measured at")
    scd.add_argument("--passkey-trials", type=int, default=6, help="pass-key prompts")
    scd.add_argument("--needle-trials", type=int, default=8,
                     help="RULER-style multi-key needle prompts in the evaluation text (0 to leave them out)")
    scd.add_argument("--needles", type=positive_int, default=4, help="key/number needles per multi-key prompt")
    scd.add_argument("--fact-trials", type=int, default=8,
                     help="fact look-up questions over Debian's package database (0 to leave them out)")
    scd.add_argument("--instruction-trials", type=int, default=8,
                     help="chat-templated instructions over licence paragraphs, scored against the oracle's answers")
    scd.add_argument("--droidspeak-layers", type=int, nargs="*", default=[10, 20],
                     help="transition layers of the DroidSpeak-style baseline")
    scd.add_argument("--gsrq-bits", type=float, nargs="*", default=[2.0],
                     help="GSRQ rates of the GSRQ-coded producer KV baseline (codebooks from the store, calibrated "
                          "for the producer if missing); none to leave it out")
    scd.add_argument("--out", type=Path, default=Path("benchmarks/results/scd"), help="folder for scd.json/.md/.png")
    scd.set_defaults(func=command)


def command(args) -> int:
    from ...bench.scd import SCDBenchSettings, run_scd_bench, scd_bytes_plot, scd_markdown, scd_plot
    from ...scd import SCDKnowledgeBase, full_rank_knowledge_base
    from ...text import load_corpus, tokenize_corpus

    kb = SCDKnowledgeBase.load(args.knowledge_base)
    extra_kbs = {}
    for item in args.more_knowledge_bases:
        name, separator, directory = item.partition("=")
        if not separator or not name.startswith("scd-"):
            raise ValueError(f"--more-knowledge-bases takes NAME=DIR with NAME starting 'scd-', got {item!r}.")
        extra_kbs[name] = SCDKnowledgeBase.load(directory)
    evaluation = load_corpus(args.text, default=EVALUATION_TEXT)
    producer = load_model(argparse.Namespace(model=args.producer, threads=args.threads))
    consumer = load_model(argparse.Namespace(model=args.consumer, threads=args.threads))
    calibration = tokenize_corpus(producer.tokenizer, load_corpus(None, default=CALIBRATION_TEXT))
    kvtc_kb = full_rank_knowledge_base(producer.model, producer.model, calibration, window_tokens=512,
                                       windows=args.kvtc_windows, code_bits=args.kvtc_code_bits,
                                       code_format="whitened", tokenizer=producer.tokenizer)
    # rebuilt by every run from the calibration text; saved only to get the id its payloads name
    kvtc_kb.save(Path(tempfile.mkdtemp(prefix="hf_kvcodecs_kvtc_like_")))
    settings = SCDBenchSettings(windows=args.windows, context_tokens=args.context,
                                cost_contexts=tuple(args.cost_contexts), passkey_trials=args.passkey_trials,
                                needle_trials=args.needle_trials, needles=args.needles, fact_trials=args.fact_trials, instruction_trials=args.instruction_trials,
                                droidspeak_layers=tuple(args.droidspeak_layers), gsrq_bits=tuple(args.gsrq_bits))
    codebooks = None
    if args.gsrq_bits:
        from ...gsrq.store import ensure_codebooks

        codebooks, _, _ = ensure_codebooks(producer)
    results = run_scd_bench(producer, consumer, kb, kvtc_kb, tokenize_corpus(producer.tokenizer, evaluation),
                            evaluation.description, settings, gsrq_codebooks=codebooks, extra_kbs=extra_kbs)
    write_results(args.out, "scd", results, scd_markdown(results))
    scd_plot(results, args.out / "scd.png")
    scd_bytes_plot(results, args.out / "scd_bytes.png")
    return 0
