"""Fit GSRQ codebooks for every layer of a model from real calibration text."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..calibration.collect import collect_kv_samples
from ..calibration.metrics import attention_projections, key_metric, value_metric
from ..codecs.joint import resolve_layouts
from ..codecs.kmeans import DEFAULT_LEARNER, KMEANS_SEEDING_REVISION
from ..codecs.layouts import codec_class, heads_per_code
from ..codecs.residual import (
    DEFAULT_BEAM_WIDTH,
    DEFAULT_GAIN,
    ENCODER_REVISION,
    LOG_SCALE_BITS,
    check_bit_rate,
    gaussian_rate_distortion_reference,
    joint_rate_distortion_reference,
    relative_mse,
    stages_for_rate,
)
from ..models import model_fingerprint
from ..rope import find_rotary_parameters
from ..text import GSRQ_CALIBRATION_DEFAULT, load_corpus, tokenize_corpus
from .codebooks import CodebookFileError, GSRQCodebooks, check_save_directory, holds_codebooks
from .identity import (
    IDENTITY_KEY,
    calibration_identity,
    default_store,
    how_they_differ,
    same_calibration,
    store_directory,
    stored_candidates,
)

logger = logging.getLogger(__name__)


def calibrate_gsrq(model, tokenizer, *, text=None, out: str | Path | None = None, overwrite: bool = False,
                   reuse: bool = True, store: str | Path | None = None, progress: bool = True,
                   settings: GSRQFitSettings | None = None, **changes) -> GSRQCodebooks:
    """Calibrate GSRQ codebooks for ``model`` on real text and optionally save them (``out=DIR``).

    ``text`` is a corpus name, a list of files or a ``datasets:`` spec (default: ``"mixed"``, CPython's reference
    manual topics, CPython's standard-library source and Debian's copyright files in turn).
    ``settings`` and the keyword arguments on top are those of :func:`fit_gsrq_codebooks`: ``bits`` is the highest
    rate (bits per KV element, scale included) the codebooks must serve, and every lower rate is a prefix of the same
    stages.

    Calibrating takes minutes, so codebooks calibrated before are reused (and a line says so) when they were
    calibrated with the same settings for the same model (its weights) on the same tokens: those ``out`` already
    holds, or those of the codebook store ``store`` (default :func:`~hf_kvcodecs.gsrq.store.default_store`, which
    ``hf-kvcodecs demo`` fills), copied into ``out``. ``out`` holding other codebooks is refused, naming what
    differs. ``overwrite=True`` calibrates anew and replaces what ``out`` holds; ``reuse=False`` calibrates anew.
    """
    done = calibrate_or_reuse(model, tokenizer, text=text, settings=(settings or GSRQFitSettings()).replaced(**changes),
                              out=out, overwrite=overwrite, reuse=reuse, store=store, progress=progress)
    if done.reused:
        message = (f"Reusing the GSRQ codebooks in {done.reused_from}: calibrated with the same settings for the same "
                   "model on the same text" + (f"; copied to {done.directory}" if done.directory != done.reused_from
                                               else "") + ". Pass overwrite=True (CLI: --overwrite) or reuse=False to "
                   "calibrate anew.")
        logger.info(message)
        if progress:
            print(message, file=sys.stderr)
    return done.codebooks


@dataclass
class Calibration:
    """What :func:`calibrate_or_reuse` did: the codebooks, the directory holding them (None: not saved) and whether
    they were reused (from ``reused_from``) rather than calibrated."""

    codebooks: GSRQCodebooks
    directory: Path | None
    reused: bool
    reused_from: Path | None = None


def calibrate_or_reuse(model, tokenizer, *, text, settings: GSRQFitSettings, out: str | Path | None = None,
                       overwrite: bool = False, reuse: bool = True, store: str | Path | None = None,
                       keep_as: str | None = None, progress: bool = True) -> Calibration:
    """:func:`calibrate_gsrq`'s work. ``keep_as`` (the model's name as the user gave it) keeps codebooks calibrated
    without an ``out`` in the store, in a directory named for the model and the calibration's identity (what
    :func:`~hf_kvcodecs.gsrq.store.ensure_codebooks` does)."""
    started = time.perf_counter()
    corpus = load_corpus(text, default=GSRQ_CALIBRATION_DEFAULT)
    token_ids = tokenize_corpus(tokenizer, corpus)
    identity = calibration_identity(model, token_ids, dataclasses.asdict(settings), name=keep_as)
    store = Path(store).expanduser() if store is not None else default_store()
    if identity is not None and reuse and not overwrite:
        found = _reusable(identity, out, store)
        if found is not None:
            codebooks, directory = found
            if out is not None and Path(out) != directory:  # found in the store: a copy where it was asked for
                codebooks.save(out, overwrite=False)
            return Calibration(codebooks, Path(out) if out is not None else directory, True, directory)
    if out is None and keep_as is not None and identity is not None:
        out = store_directory(store, keep_as, identity)
        overwrite = True  # what is there is unusable (else it was reused above), so replacing it loses nothing
    codebooks = _fit_codebooks(model, token_ids, settings, text_info=corpus.to_dict(), out=out, overwrite=overwrite,
                               progress=progress, started=started, identity=identity)
    return Calibration(codebooks, Path(out) if out is not None else None, False)


def _reusable(identity: dict, out, store: Path) -> tuple[GSRQCodebooks, Path] | None:
    """Codebooks of ``identity`` in ``out`` or else in the store, with their directory; ``out`` holding codebooks of
    another calibration is an error (they are not replaced unless asked)."""
    if out is not None and holds_codebooks(out):
        try:
            codebooks = GSRQCodebooks.load(out)
        except CodebookFileError as error:
            raise FileExistsError(f"{out} already holds GSRQ codebooks, but they cannot be used ({error}). Pass "
                                  "overwrite=True (CLI: --overwrite) to calibrate anew and replace them.") from error
        if same_calibration(codebooks, identity):
            return codebooks, Path(out)
        raise FileExistsError(f"{out} already holds GSRQ codebooks, calibrated {how_they_differ(codebooks, identity)}. "
                              "Pass another directory, or overwrite=True (CLI: --overwrite) to calibrate anew and "
                              "replace them.")
    for directory in stored_candidates(store, identity):
        try:
            codebooks = GSRQCodebooks.load(directory)
        except CodebookFileError as error:
            logger.warning("Not reusing the stored codebooks in %s, which are unusable (%s).", directory, error)
            continue
        if same_calibration(codebooks, identity):
            return codebooks, directory
    return None


@dataclass(frozen=True)
class GSRQFitSettings:
    """Everything that decides which codebooks a calibration fits (see :func:`fit_gsrq_codebooks`)."""

    bits: float = 2.0  # the highest rate (bits per KV element, scales included) the codebooks serve
    learner: str = DEFAULT_LEARNER  # codebook learner: codecs.kmeans.CODEBOOK_LEARNERS
    weighted: bool = True
    transform: str = "pca"
    metric: str = "none"  # "attention": fit under attention-weighted error metrics (per-head layouts only)
    key_space: str = "pre_rope"
    key_layout: str | None = None  # None: the default for the key space (codecs.joint.resolve_layouts)
    value_layout: str | None = None
    group_dim: int = 8
    codebook_bits: int = 8
    scale_bits: int = LOG_SCALE_BITS
    window_tokens: int = 512
    sampled_tokens_per_window: int = 256
    num_windows: int = 32
    holdout_windows: int = 4
    n_iter: int = 12
    fit_rows: int = 8192
    seed: int = 0

    def replaced(self, **changes) -> GSRQFitSettings:
        """These settings with ``changes``; an unknown name is an error that lists the valid ones."""
        names = [field.name for field in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise TypeError(f"Unknown GSRQ calibration setting(s) {unknown}; valid settings: {names}.")
        return dataclasses.replace(self, **changes)


def fit_gsrq_codebooks(model, token_ids: torch.Tensor, *, text_info: dict, settings: GSRQFitSettings | None = None,
                       out: str | Path | None = None, overwrite: bool = False, progress: bool = True,
                       started: float | None = None, **changes) -> GSRQCodebooks:
    """Fit GSRQ codebooks on already tokenized text (``token_ids``: 1-D LongTensor; ``text_info`` describes it).

    ``settings`` (default :class:`GSRQFitSettings`), with any of its fields given as keyword arguments on top, choose
    the codec: ``learner``/``weighted``/``transform``/``metric``/``key_space``/``group_dim`` (see
    ``benchmarks/results/codec_ablation.md`` for why the defaults are what they are); ``key_layout`` None is
    ``per_head_codebooks`` for keys coded before RoPE and ``per_head`` after (``codecs.joint.resolve_layouts``),
    ``value_layout`` None ``given_keys`` before RoPE and ``joint_heads`` after (same function). Held-out windows
    (after the calibration windows) measure the relative MSE per layer next to the Gaussian rate-distortion
    reference. ``out`` saves the codebooks there (``overwrite`` replaces codebooks already in it).
    """
    settings = (settings or GSRQFitSettings()).replaced(**changes)
    return _fit_codebooks(model, token_ids, settings, text_info=text_info, out=out, overwrite=overwrite,
                          progress=progress, started=started)


def _fit_codebooks(
    model,
    token_ids: torch.Tensor,
    settings: GSRQFitSettings,
    *,
    text_info: dict,
    out: str | Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
    started: float | None = None,
    identity: dict | None = None,
) -> GSRQCodebooks:
    """:func:`fit_gsrq_codebooks` with every setting spelled out; ``identity`` (of the calibration: see
    :mod:`hf_kvcodecs.gsrq.identity`) is recorded with the codebooks, so that they can be reused."""
    _check_settings(settings, out=out, overwrite=overwrite)
    if settings.key_space not in ("pre_rope", "post_rope"):
        raise ValueError(f"key_space must be 'pre_rope' or 'post_rope', got {settings.key_space!r}.")
    key_layout, value_layout = resolve_layouts(settings.key_space, settings.key_layout, settings.value_layout)
    settings = dataclasses.replace(settings, key_layout=key_layout, value_layout=value_layout)
    for kind, layout in (("keys", settings.key_layout), ("values", settings.value_layout)):
        codec = codec_class(layout, kind)
        if codec.needs_pre_rope_keys and settings.key_space != "pre_rope":
            raise ValueError(f"{kind[:-1]}_layout={layout!r} {codec.pre_rope_reason}: use key_space='pre_rope'.")
    started = time.perf_counter() if started is None else started
    fingerprint = model_fingerprint(model.config)
    head_dim = fingerprint["head_dim"]
    kv_heads = fingerprint["num_key_value_heads"]
    if head_dim % settings.group_dim:
        raise ValueError(f"group_dim={settings.group_dim} must divide the model's head_dim={head_dim} (e.g. 8).")

    def stages_for(layout):  # a joint code covers all of a token's heads: its index bits are the budget of all of them
        return max(1, stages_for_rate(settings.bits, head_dim, settings.codebook_bits, settings.scale_bits,
                                      heads_per_code(layout, kv_heads)))

    rope = find_rotary_parameters(model) if settings.key_space == "pre_rope" else None
    needed = (settings.num_windows + settings.holdout_windows) * settings.window_tokens
    if token_ids.numel() < needed:
        raise ValueError(
            f"Calibration needs {needed} tokens ({settings.num_windows}+{settings.holdout_windows} windows of "
            f"{settings.window_tokens}), but the "
            f"text ({text_info.get('description')}) has {token_ids.numel()}. Pass more text or fewer windows."
        )
    if settings.metric not in ("attention", "none"):
        raise ValueError(f"metric must be 'attention' or 'none', got {settings.metric!r}.")
    if settings.metric == "attention" and not all(codec_class(layout).supports_metric
                                                  for layout in (settings.key_layout, settings.value_layout)):
        raise ValueError("metric='attention' needs per-head layouts (its metrics are per head): pass "
                         "value_layout='per_head' and a per-head key layout, per_head_codebooks (the default) or "
                         "per_head (CLI: --value-layout per_head).")
    samples = collect_kv_samples(
        model, token_ids[: settings.num_windows * settings.window_tokens], window_tokens=settings.window_tokens,
        sampled_tokens_per_window=settings.sampled_tokens_per_window, num_windows=settings.num_windows, rope=rope,
        seed=settings.seed,
        progress=progress, description="calibration activations", measure_queries=settings.metric == "attention",
    )
    holdout = collect_kv_samples(
        model, token_ids[settings.num_windows * settings.window_tokens : needed], window_tokens=settings.window_tokens,
        sampled_tokens_per_window=settings.sampled_tokens_per_window, num_windows=settings.holdout_windows, rope=rope,
        seed=settings.seed + 1,
        progress=progress, description="held-out activations",
    )
    collected = time.perf_counter()
    fit_settings = {name: getattr(settings, name) for name in ("group_dim", "codebook_bits", "learner", "weighted",
                                                                "transform", "scale_bits", "n_iter", "fit_rows")}
    key_codecs, value_codecs, per_layer = [], [], []
    train_keys = samples.keys_pre_rope if settings.key_space == "pre_rope" else samples.keys_post_rope
    test_keys = holdout.keys_pre_rope if settings.key_space == "pre_rope" else holdout.keys_post_rope
    projections = attention_projections(model) if settings.metric == "attention" else {}
    key_codec_class, value_codec_class = codec_class(settings.key_layout), codec_class(settings.value_layout)
    for layer in tqdm(range(len(train_keys)), desc=f"fitting {settings.learner} codebooks", disable=not progress):
        key_weights = value_weights = None
        if settings.metric == "attention":
            if settings.key_space == "pre_rope":  # the pair-averaged query metric only holds for keys coded before RoPE
                key_weights = key_metric(samples.query_mean_squared[layer], kv_heads)
            value_weights = value_metric(projections[layer]["o_proj"].weight, kv_heads, head_dim)
        key_codec = key_codec_class.fit(train_keys[layer], max_stages=stages_for(settings.key_layout), metric=key_weights,
                                        seed=settings.seed + 2 * layer, **fit_settings)
        decoded_test_keys = key_codec.reconstruct(test_keys[layer])
        if value_codec_class.needs_keys:  # predicted from the keys as the cache will decode them
            value_codec = value_codec_class.fit(
                samples.values[layer], decoded_keys=key_codec.reconstruct(train_keys[layer]),
                max_stages=stages_for(settings.value_layout), metric=value_weights, seed=settings.seed + 2 * layer + 1,
                **fit_settings)
            decoded_test_values = value_codec.reconstruct(holdout.values[layer], decoded_test_keys)
        else:
            value_codec = value_codec_class.fit(samples.values[layer], max_stages=stages_for(settings.value_layout),
                                                metric=value_weights, seed=settings.seed + 2 * layer + 1, **fit_settings)
            decoded_test_values = value_codec.reconstruct(holdout.values[layer])
        key_codecs.append(key_codec)
        value_codecs.append(value_codec)
        per_layer.append({
            "keys_relative_mse": relative_mse(test_keys[layer], decoded_test_keys),
            "values_relative_mse": relative_mse(holdout.values[layer], decoded_test_values),
            "keys_gaussian_rd_reference": gaussian_rate_distortion_reference(test_keys[layer], key_codec.code_bits_per_vector()),
            "values_gaussian_rd_reference": gaussian_rate_distortion_reference(holdout.values[layer], value_codec.code_bits_per_vector()),
            # the same reference for one code over all heads (the joint layout's; lower where heads correlate)
            "keys_gaussian_rd_reference_joint": joint_rate_distortion_reference(test_keys[layer], key_codec.code_bits_per_vector()),
            "values_gaussian_rd_reference_joint": joint_rate_distortion_reference(holdout.values[layer], value_codec.code_bits_per_vector()),
        })
    finished = time.perf_counter()
    mean = lambda key: sum(p[key] for p in per_layer) / len(per_layer)  # noqa: E731
    config = {
        **{name: getattr(settings, name) for name in ("learner", "weighted", "transform", "metric", "key_space",
                                                       "key_layout", "value_layout", "group_dim", "codebook_bits",
                                                       "scale_bits")},
        "max_stages": {"keys": stages_for(settings.key_layout), "values": stages_for(settings.value_layout)},
        "max_bits": settings.bits,
        "n_iter": settings.n_iter, "fit_rows": settings.fit_rows, "seed": settings.seed,
    }
    calibration = {
        "text": text_info,
        "windows": samples.windows, "window_tokens": settings.window_tokens, "tokens_seen": samples.tokens_seen,
        "sampled_tokens_per_layer": int(train_keys[0].shape[1]), "holdout_windows": holdout.windows,
        "seconds_collecting": collected - started, "seconds_fitting": finished - collected,
        "seconds_total": finished - started,
        "bits_per_element_at_max": {"keys": key_codecs[0].bits_per_element(), "values": value_codecs[0].bits_per_element()},
        "holdout_encoder": {"revision": ENCODER_REVISION, "gain": DEFAULT_GAIN, "beam_width": DEFAULT_BEAM_WIDTH},
        "kmeans_seeding": KMEANS_SEEDING_REVISION,
        "holdout_mean": {k: mean(k) for k in per_layer[0]},
        "holdout_per_layer": per_layer,
        **({IDENTITY_KEY: identity} if identity is not None else {}),
    }
    codebooks = GSRQCodebooks(
        key_codecs, value_codecs, config, fingerprint, calibration,
        rope_inv_freq=None if rope is None else rope[0], rope_attention_scaling=1.0 if rope is None else rope[1],
    )
    if out is not None:
        codebooks.save(out, overwrite=overwrite)
    logger.info("calibrated %s codebooks in %.1fs: %s", settings.learner, finished - started, calibration["holdout_mean"])
    return codebooks


def _check_settings(settings: GSRQFitSettings, *, out, overwrite) -> None:
    """Settings checked before any activation is collected (a bad one would otherwise surface minutes later)."""
    check_bit_rate("bits", settings.bits)
    for name in ("group_dim", "num_windows", "holdout_windows", "window_tokens"):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if out is not None:
        check_save_directory(out, overwrite=overwrite)
