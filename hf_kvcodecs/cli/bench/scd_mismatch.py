"""`hf-kvcodecs bench scd-mismatch`: the mismatch profile of a (producer, consumer) pair: raw producer KV and the
DroidSpeak-style recompute curve against the consumer's own prefill, and whether the pair has a real mismatch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .._common import add_command, load_model, positive_int, write_results
from ..defaults import EVALUATION_TEXT
from ..scd_draft import read_draft_sidecar

# Mirrors of bench.scd_mismatch.MismatchSettings' defaults (the parser imports no torch-based module);
# tests/test_scd_pairs.py checks them against the library.
MISMATCH = {"windows": 8, "context_tokens": 1024, "continuation_tokens": 64, "droidspeak_layers": (5, 10, 15, 20, 25),
            "gate_delta_ppl_pct": 10.0}


def _fraction(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not 0.0 < number < 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction strictly between 0 and 1, got {value!r}")
    return number


def add_parser(bench) -> None:
    profile = add_command(bench, "scd-mismatch",
                          "mismatch profile of an SCD pair: raw producer KV and DroidSpeak-k against the consumer's "
                          "own prefill, and the real-mismatch gate")
    profile.add_argument("--producer", default="default",
                         help="the model that prefills ('default', a Hub id, a path, a `scd make-draft` directory)")
    profile.add_argument("--consumer", required=True,
                         help="the model that decodes ('default', a path, a `scd make-consumer` directory)")
    profile.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    profile.add_argument("--text", nargs="+", default=None,
                         help="evaluation text: files, a built-in corpus name, or datasets:NAME[:CONFIG]:SPLIT "
                              f"(default: {EVALUATION_TEXT})")
    profile.add_argument("--text-tail", type=_fraction, default=None, metavar="FRACTION",
                         help="take the windows from the last FRACTION of the text's tokens only, split as `scd "
                              "make-consumer` holds out the end of its fine-tuning text (0.1 there): the in-domain "
                              "text of a consumer fine-tuned on --text (default: the whole text)")
    profile.add_argument("--windows", type=positive_int, default=MISMATCH["windows"], help="held-out windows")
    profile.add_argument("--context", type=positive_int, default=MISMATCH["context_tokens"],
                         help="context tokens of each window (the cache is built from all but the last)")
    profile.add_argument("--continuation", type=positive_int, default=MISMATCH["continuation_tokens"],
                         help="continuation tokens of each window, scored teacher-forced")
    profile.add_argument("--droidspeak-layers", type=int, nargs="+", default=list(MISMATCH["droidspeak_layers"]),
                         help="transition layers k of DroidSpeak-k (producer KV below k, consumer recomputes k..)")
    profile.add_argument("--gate-ppl-pct", type=float, default=MISMATCH["gate_delta_ppl_pct"],
                         help="the real-mismatch gate: raw-16 must cost at least this Δ perplexity (%%) vs the oracle")
    profile.add_argument("--out", type=Path, default=Path("benchmarks/results/scd_mismatch"),
                         help="folder for scd_mismatch.json / .md / .png")
    profile.set_defaults(func=command)


def _describe(loaded, name: str):
    draft = read_draft_sidecar(name) if Path(name).is_dir() else None
    if draft is not None:
        loaded.description = f"{name} ({draft['description']})"
    return draft


def _consumer_report(name: str) -> dict | None:
    """The perplexity shift `scd make-consumer` measured for a consumer directory, if it is one."""
    path = Path(name) / "report.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    if "perplexity" not in report or "settings" not in report:
        return None
    return {"settings": report["settings"], "training": {key: report.get("training", {}).get(key) for key in
                                                         ("steps", "tokens_seen", "seconds", "loss_first", "loss_last")},
            "perplexity": report["perplexity"]}


def command(args) -> int:
    from ...bench.scd_mismatch import MismatchSettings, mismatch_markdown, mismatch_plot, run_mismatch_profile
    from ...scd.consumer import ConsumerFitSettings, split_training_stream
    from ...text import load_corpus, tokenize_corpus

    settings = MismatchSettings(windows=args.windows, context_tokens=args.context,
                                continuation_tokens=args.continuation,
                                droidspeak_layers=tuple(args.droidspeak_layers), gate_delta_ppl_pct=args.gate_ppl_pct)
    # one word may name a built-in corpus, which load_corpus takes as a string (a list is read as files)
    source = args.text[0] if args.text and len(args.text) == 1 else args.text
    corpus = load_corpus(source, default=EVALUATION_TEXT)  # a missing file fails before the model loads
    producer = load_model(argparse.Namespace(model=args.producer, threads=args.threads))
    consumer = producer if args.consumer == args.producer else load_model(
        argparse.Namespace(model=args.consumer, threads=args.threads))
    draft = _describe(producer, args.producer)
    token_ids = tokenize_corpus(producer.tokenizer, corpus)
    text = {**corpus.to_dict(), "name": EVALUATION_TEXT if args.text is None else " ".join(args.text),
            "tokens": int(token_ids.numel())}
    if args.text_tail is not None:
        total = token_ids.numel()
        _, token_ids = split_training_stream(token_ids, ConsumerFitSettings(holdout_fraction=args.text_tail))
        text.update(tokens=int(token_ids.numel()),
                    part=f"its last {100 * args.text_tail:g} % only: tokens {total - token_ids.numel()}..{total}, the "
                         "end `scd make-consumer` holds out of its fine-tuning text")
    results = run_mismatch_profile(producer, consumer, token_ids, text, settings)
    results["producer_name"], results["consumer_name"] = args.producer, args.consumer
    if draft is not None:
        results["producer_draft"] = {key: draft.get(key) for key in ("base_model", "bits", "group_size", "symmetric")}
        results["producer_draft"]["relative_weight_error"] = draft["weight_error"]["relative_error"]
    consumer_report = _consumer_report(args.consumer)
    if consumer_report is not None:
        results["consumer_fine_tune"] = consumer_report
    write_results(args.out, "scd_mismatch", results, mismatch_markdown(results))
    mismatch_plot(results, args.out / "scd_mismatch.png")
    return 0
