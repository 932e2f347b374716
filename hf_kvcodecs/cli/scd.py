"""`hf-kvcodecs scd make-consumer | fit`: build a fine-tuned consumer of a model, and fit the SCD knowledge base that
sends a producer's prefill to it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import scd_consumer, scd_draft
from ._common import HelpFormatter, add_command, load_model, positive_int
from .defaults import CALIBRATION_TEXT

# Mirrors of scd.fit.SCDFitSettings' defaults (the parser imports no torch-based module); tests/test_scd_cli.py
# checks them against the library.
SCD_FIT = {"windows": 24, "window_tokens": 512, "holdout_prompts": 4, "holdout_context": 448,
           "holdout_continuation": 64, "exact_tokens": 4, "budget_kl": 0.05, "encoder": "pca", "code_bits": (8, 4),
           "max_patch_layers": 4, "patch_mode": "recompute", "recompute_depths": (1, 4, 8, 32),
           "max_recompute_layers": 16, "code_format": "whitened", "code_gain": False}
SCD_CODE_FORMATS = ("flat", "whitened")  # scd.knowledge_base.CODE_FORMATS
SCD_PATCH_MODES = ("recompute", "project")  # scd.knowledge_base.PATCH_MODES
SCD_ENCODERS = ("pca", "reduced_rank")  # scd.fit.ENCODERS


def add_parser(commands) -> None:
    scd = commands.add_parser("scd", help="Semantic Cache Distillation: a producer's prefill sent to a consumer as codes",
                              description="Semantic Cache Distillation", formatter_class=HelpFormatter)
    scd_commands = scd.add_subparsers(dest="scd", required=True)
    scd_consumer.add_parser(scd_commands)
    scd_draft.add_parser(scd_commands)
    fit = add_command(scd_commands, "fit", "fit the SCD knowledge base of a (producer, consumer) pair under a KL budget")
    fit.add_argument("--producer", default="default",
                     help="the model that prefills: 'default', a Hub id, a local path, or a LoRA adapter directory")
    fit.add_argument("--consumer", required=True,
                     help="the model that decodes (a directory made by `scd make-consumer`, any model of the "
                          "producer's architecture, or the producer itself for the trivial pair)")
    fit.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    fit.add_argument("--text", nargs="+", default=None,
                     help="calibration text: files, a built-in corpus name, or datasets:NAME[:CONFIG]:SPLIT "
                          f"(default: {CALIBRATION_TEXT}); its last part is held out for the budget")
    fit.add_argument("--out", required=True, type=Path, help="directory the knowledge base and its report are saved in")
    fit.add_argument("--overwrite", action="store_true", help="replace a knowledge base already saved in --out")
    fit.add_argument("--budget-kl", type=float, default=SCD_FIT["budget_kl"],
                     help="quality budget: mean KL divergence (nats per token) from the consumer's own prefill to "
                          "decoding through the rebuilt cache, on held-out calibration prompts")
    fit.add_argument("--windows", type=positive_int, default=SCD_FIT["windows"],
                     help=f"calibration windows of {SCD_FIT['window_tokens']} tokens the statistics are streamed over")
    fit.add_argument("--holdout-prompts", type=positive_int, default=SCD_FIT["holdout_prompts"],
                     help=f"held-out prompts ({SCD_FIT['holdout_context']} context + "
                          f"{SCD_FIT['holdout_continuation']} continuation tokens) the budget is measured on")
    fit.add_argument("--encoder", default=SCD_FIT["encoder"], choices=SCD_ENCODERS,
                     help="'pca': consumer-agnostic codes of the producer's states (progressive: any prefix decodes); "
                          "'reduced_rank': codes fitted to predict this consumer (fewer components for the same error)")
    fit.add_argument("--code-bits", type=int, nargs="+", default=list(SCD_FIT["code_bits"]), choices=[4, 8, 16],
                     help="code precisions tried; the plan with the fewest bytes within the budget wins")
    fit.add_argument("--code-format", default=SCD_FIT["code_format"], choices=SCD_CODE_FORMATS,
                     help="'flat': each code's components at --code-bits with one scale per token; 'whitened': "
                          "components whitened by the fitted spectrum, bits per component water-filled at the same "
                          "bytes (4 and 8 of --code-bits name the bytes spent)")
    fit.add_argument("--code-gain", action=argparse.BooleanOptionalAction, default=SCD_FIT["code_gain"],
                     help="whitened codes: one per-token gain byte out of the same bytes (a searched rescale; slower "
                          "to encode)")
    fit.add_argument("--max-patch-layers", type=int, default=SCD_FIT["max_patch_layers"],
                     help="most transition (Patch) layers; 0 sends every layer as Reuse codes")
    fit.add_argument("--patch-mode", default=SCD_FIT["patch_mode"], choices=SCD_PATCH_MODES,
                     help="'recompute' (SCD's Patch): the producer codes its residual stream at a transition layer "
                          "and the consumer runs its own layers from there for a fitted depth; 'project' (an "
                          "ablation): the consumer projects one layer's KV from the predicted normalized input")
    fit.add_argument("--recompute-depths", type=positive_int, nargs="+", default=list(SCD_FIT["recompute_depths"]),
                     help="recompute depths tried at each candidate transition layer (clipped to the layers left)")
    fit.add_argument("--max-recompute-layers", type=int, default=SCD_FIT["max_recompute_layers"],
                     help="most consumer layers recomputed over the prompt, all blocks together (its compute cost)")
    fit.add_argument("--patch-layers", type=int, nargs="+", default=None,
                     help="use these transition layers instead of choosing them, an ablation (default: chosen "
                          "greedily under the budget)")
    fit.add_argument("--patch-depths", type=positive_int, nargs="+", default=None,
                     help="with --patch-layers in recompute mode: each block's depth (default 1 each)")
    fit.add_argument("--exact-tokens", type=int, default=SCD_FIT["exact_tokens"],
                     help="first tokens of each prompt (attention sinks) the consumer computes itself")
    fit.add_argument("--encoders-from", type=Path, default=None, metavar="KB_DIR",
                     help="keep the producer encoders and Patch layers of this saved knowledge base (same producer, "
                          "PCA codes) and fit only this consumer's decoders and ranks, so one stored set of producer "
                          "codes serves both consumers (hf_kvcodecs.scd.code_store) (default: fit its own encoders)")
    fit.set_defaults(func=run_fit)


def _load(name: str, threads):
    return load_model(argparse.Namespace(model=name, threads=threads))


def run_fit(args) -> int:
    from ..scd import SCDFitSettings, fit_knowledge_base
    from ..scd.knowledge_base import METADATA_FILE
    from ..text import load_corpus, tokenize_corpus

    if (args.out / METADATA_FILE).exists() and not args.overwrite:
        raise FileExistsError(f"{args.out} already holds an SCD knowledge base; pass --overwrite to replace it.")
    corpus = load_corpus(args.text, default=CALIBRATION_TEXT)
    producer = _load(args.producer, args.threads)
    consumer = producer if args.consumer == args.producer else _load(args.consumer, args.threads)
    settings = SCDFitSettings(windows=args.windows, holdout_prompts=args.holdout_prompts, budget_kl=args.budget_kl,
                              encoder=args.encoder, code_bits=tuple(args.code_bits),
                              max_patch_layers=args.max_patch_layers, exact_tokens=args.exact_tokens,
                              code_format=args.code_format, code_gain=args.code_gain,
                              patch_mode=args.patch_mode, recompute_depths=tuple(args.recompute_depths),
                              max_recompute_layers=args.max_recompute_layers,
                              patch_layers=None if args.patch_layers is None else tuple(args.patch_layers),
                              patch_depths=None if args.patch_depths is None else tuple(args.patch_depths),
                              encoders_from=None if args.encoders_from is None else str(args.encoders_from))
    settings.check()
    ids = tokenize_corpus(producer.tokenizer, corpus)
    kb = fit_knowledge_base(producer.model, consumer.model, ids, settings=settings, text_info=corpus,
                            tokenizer=producer.tokenizer, producer_name=producer.description,
                            consumer_name=consumer.description)
    kb.save(args.out, overwrite=args.overwrite)
    fitting = kb.fitting
    summary = {
        "out": str(args.out), "producer": producer.description, "consumer": consumer.description,
        "calibration_text": corpus.description, "budget_kl": fitting["budget_kl"], "budget_met": fitting["budget_met"],
        "kl": round(fitting["kl"], 5), "code_bits": kb.code_bits, "code_format": kb.code_format,
        "patch_layers": kb.patch_layers,
        "patch_mode": fitting["settings"]["patch_mode"],
        "recompute_blocks": [[layer.index, layer.depth] for layer in kb.plan if layer.recomputes],
        "bytes_per_coded_token": fitting["bytes_per_coded_token"],
        "raw_16bit_bytes_per_token": fitting["raw_16bit_bytes_per_token"],
        "compression_vs_16bit": round(fitting["compression_vs_16bit"], 2),
        "reuse_only_full_rank_kl": round(fitting["search"]["reuse_only_full_rank_kl"], 5),
        "seconds": round(fitting["seconds"], 1),
        "shared_encoders": fitting.get("shared_encoders"),
    }
    print(json.dumps(summary, indent=2))
    return 0
