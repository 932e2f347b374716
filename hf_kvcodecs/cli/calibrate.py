"""`hf-kvcodecs calibrate`: fit GSRQ codebooks for a model, save them, optionally upload them."""

from __future__ import annotations

import json
from pathlib import Path

from ._common import add_command, add_model_arguments, add_push_arguments, calibration_text, load_model, positive_int
from .defaults import (
    CALIBRATION,
    CODEBOOK_LEARNERS,
    DEFAULT_VALUE_LAYOUT,
    GSRQ_CALIBRATION_TEXT,
    KEY_LAYOUTS,
    POST_ROPE_KEY_LAYOUT,
    POST_ROPE_VALUE_LAYOUT,
    VALUE_LAYOUTS,
)


def add_parser(commands) -> None:
    calibrate = add_command(commands, "calibrate", "fit GSRQ codebooks for a model and save them")
    add_model_arguments(calibrate)
    calibrate.add_argument("--out", required=True, type=Path,
                           help="directory the codebooks are saved in (created if missing; refused if it already "
                                "holds codebooks, unless --overwrite)")
    calibrate.add_argument("--overwrite", action="store_true", help="replace codebooks already saved in --out")
    calibrate.add_argument("--bits", type=float, default=CALIBRATION["bits"],
                           help="highest bits/element (incl. the scale) to serve; every lower rate is a prefix of the "
                                "same codebook stages")
    calibrate.add_argument("--learner", default=CALIBRATION["learner"], choices=CODEBOOK_LEARNERS,
                           help="codebook learner: 'l2' k-means, or a Gain-Shape k-means variant ('gskm'; "
                                "'gskm-cosine': cosine assignment; 'gskm-principal': principal-direction shapes)")
    calibrate.add_argument("--unweighted", action="store_true", help="do not weight samples by their squared scale")
    calibrate.add_argument("--transform", default=CALIBRATION["transform"], choices=["pca", "none"],
                           help="'pca': code each head's vectors in their principal-component basis, fitted on the "
                                "calibration samples; 'none': in the model's own channels")
    calibrate.add_argument("--metric", default=CALIBRATION["metric"], choices=["none", "attention"],
                           help="'attention': weight key errors by query energy, value errors by the output projection")
    calibrate.add_argument("--key-space", default=CALIBRATION["key_space"], choices=["pre_rope", "post_rope"],
                           help="code keys before RoPE (the rotation undone with each token's position, redone when "
                                "the attention reads them) or after it")
    calibrate.add_argument("--key-layout", default=None, choices=KEY_LAYOUTS,
                           help=f"'per_head_codebooks' (default; {POST_ROPE_KEY_LAYOUT} with --key-space post_rope): "
                                "one code per key head vector, each head with its own codebooks; 'per_head': the same "
                                "with codebooks shared by the heads (higher error, same decode cost); 'joint_heads': "
                                "one code per token for all "
                                "KV heads (lower error; on CPU each decoding step rebuilds keys from H times the rows); "
                                "'conditional_heads': one code per head vector, each head predicted from the heads "
                                "decoded before it (about the joint error at the per-head rate)")
    calibrate.add_argument("--value-layout", default=None, choices=VALUE_LAYOUTS,
                           help=f"'{DEFAULT_VALUE_LAYOUT}' (default; {POST_ROPE_VALUE_LAYOUT} with --key-space "
                                "post_rope): one code per token for all heads of what a prediction from the token's "
                                "decoded keys leaves (on CPU each decoding step also sums the attention weights per "
                                "key codeword for the prediction); 'joint_heads': one code per token for all heads "
                                "(higher error, a little faster); 'per_head': one code per head vector")
    calibrate.add_argument("--group-dim", type=positive_int, default=CALIBRATION["group_dim"],
                           help="channels per residual VQ group (must divide head_dim)")
    calibrate.add_argument("--scale-bits", type=int, default=CALIBRATION["scale_bits"], choices=[8, 16],
                           help="per-vector scale: 8-bit log-uniform levels or fp16")
    calibrate.add_argument("--windows", type=int, default=CALIBRATION["num_windows"],
                           help=f"windows of {CALIBRATION['window_tokens']} tokens of calibration text the codebooks "
                                f"are fitted on ({CALIBRATION['sampled_tokens_per_window']} tokens sampled from each); "
                                f"the {CALIBRATION['holdout_windows']} windows after them measure the held-out error")
    calibrate.add_argument("--calibration-text", "--text", nargs="+", default=None,
                           help="files, a built-in corpus name, or datasets:NAME[:CONFIG]:SPLIT "
                                f"(default: {GSRQ_CALIBRATION_TEXT})")
    calibrate.add_argument("--seed", type=int, default=CALIBRATION["seed"],
                           help="seeds the choice of the tokens sampled from each window and the k-means "
                                "initialisation of the codebooks")
    add_push_arguments(calibrate, "--push-to-hub", "also upload the codebooks (and a card) to this Hub repo")
    calibrate.set_defaults(func=command)


def command(args) -> int:
    from ..gsrq import calibrate_gsrq
    from ..gsrq.codebooks import check_save_directory

    check_save_directory(args.out, overwrite=args.overwrite)  # before minutes of loading and calibrating
    loaded = load_model(args)
    codebooks = calibrate_gsrq(
        loaded.model, loaded.tokenizer, text=calibration_text(args), bits=args.bits, learner=args.learner,
        weighted=not args.unweighted, transform=args.transform, metric=args.metric, key_space=args.key_space,
        key_layout=args.key_layout, value_layout=args.value_layout, group_dim=args.group_dim, scale_bits=args.scale_bits,
        num_windows=args.windows, seed=args.seed, out=args.out, overwrite=args.overwrite,
    )
    summary = {
        "out": str(args.out),
        "model": loaded.description,
        "calibration_text": codebooks.calibration["text"]["description"],
        "max_bits_per_element": codebooks.max_bits_per_element(),
        "seconds": round(codebooks.calibration["seconds_total"], 1),
        "holdout_mean": codebooks.calibration["holdout_mean"],
    }
    print(json.dumps(summary, indent=2))
    if args.push_to_hub:
        from ..gsrq.hub import push_codebooks
        from ..hub import model_hub_id

        commit = push_codebooks(codebooks, args.push_to_hub, base_model=model_hub_id(args.model), token=args.token,
                                private=args.private)
        print(f"pushed to {args.push_to_hub}: {getattr(commit, 'commit_url', commit)}")
    return 0
