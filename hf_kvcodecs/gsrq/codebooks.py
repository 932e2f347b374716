"""The fitted GSRQ codebooks of one model: per layer a key codec and a value codec, saved as safetensors + JSON."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..codecs.base import KVCodec
from ..codecs.layouts import codec_class, heads_per_code, layouts_for
from ..codecs.residual import lowest_bit_rate, stages_for_rate
from ..codecs.scales import FP16_SCALE_BITS
from ..fileio import check_tensors_checksum, read_json, save_tensors_and_json
from ..models import model_fingerprint

FORMAT_NAME = "hf_kvcodecs.gsrq_codebooks"
# 2: optional 8-bit log scales (config "scale_bits", tensors "*.log_scale_range"); 3: config "key_layout" and
# "value_layout", each "per_head" or "joint_heads" (tensors "*.shape.*" plus the per-head "*.log_scale_range");
# 4: "key_layout" may also be "conditional_heads" (tensors "*.predictors" and one codec per head, "*.head.{h}.*"),
# "value_layout" also "given_keys" (tensors "*.predictor" and a joint code of the residual, "*.residual.*");
# 5: "key_layout" may also be "per_head_codebooks" (one codec per head, "*.head.{h}.*", no predictors)
FORMAT_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)  # version 1 files have fp16 scales; 1 and 2 are per-head
# The JSON description is a few hundred KB for a 30-layer model; a file far larger is not one (and is not parsed).
MAX_METADATA_BYTES = 64 * 2**20
LAYOUTS = {kind: layouts_for(kind) for kind in ("keys", "values")}
TENSORS_FILE = "gsrq_codebooks.safetensors"
METADATA_FILE = "gsrq_codebooks.json"
KEY_SPACES = ("pre_rope", "post_rope")
# How far a requested rate (bits per element) may lie above a served one and still name it: rates printed to four
# decimals (1/6 as 0.1667) pass, a rate between two stages (0.3 between 0.25 and 0.375) does not.
RATE_TOLERANCE = 5e-4
# Calibrated codec tensors are O(1)..O(1e4) (codewords of scale-normalized vectors, means and bases of activations);
# a value beyond this squares past float32's range, so every distance computed with it would be infinite.
MAX_CODEC_MAGNITUDE = 1e18
DAMAGED_FILE_FIX = ("recalibrate (`hf-kvcodecs calibrate --model <model> --out DIR --overwrite`, or calibrate_gsrq(..., "
                    "overwrite=True)), or download the codebooks again")


class CodebookFileError(ValueError):
    """A codebook directory is missing, corrupt, truncated, or of an unsupported format."""


@dataclass
class GSRQCodebooks:
    key_codecs: list[KVCodec]
    value_codecs: list[KVCodec]
    config: dict  # fit settings: learner, weighted, transform, group_dim, codebook_bits, scale_bits, key_space, max_stages, seed
    fingerprint: dict  # models.model_fingerprint of the calibrated model
    calibration: dict = field(default_factory=dict)  # text used, sample counts, time, measured errors
    rope_inv_freq: torch.Tensor | None = None  # needed when key_space == "pre_rope"
    rope_attention_scaling: float = 1.0

    def __post_init__(self):
        self._truncated: dict[tuple[str, int], list[KVCodec]] = {}

    def codecs_at(self, kind: str, num_stages: int) -> list[KVCodec]:
        """Per-layer ``kind`` ("keys"/"values") codecs truncated to ``num_stages``, memoized so that every cache at
        the same rate shares one set of codecs (and the tables built on them)."""
        if (kind, num_stages) not in self._truncated:
            codecs = self.key_codecs if kind == "keys" else self.value_codecs
            self._truncated[(kind, num_stages)] = [codec.truncated(num_stages) for codec in codecs]
        return self._truncated[(kind, num_stages)]

    @property
    def num_layers(self) -> int:
        return len(self.key_codecs)

    @property
    def key_space(self) -> str:
        return self.config["key_space"]

    @property
    def head_dim(self) -> int:
        return self.key_codecs[0].head_dim

    @property
    def scale_bits(self) -> int:
        return int(self.config.get("scale_bits", FP16_SCALE_BITS))

    def max_bits_per_element(self) -> float:
        return min(c.bits_per_element() for c in self.key_codecs + self.value_codecs)

    def layout(self, kind: str) -> str:
        """How ``kind`` ("keys"/"values") is coded: ``"per_head"`` (one code per head vector, codebooks shared by
        the heads), ``"joint_heads"`` (one code per token for all its heads), keys only ``"per_head_codebooks"`` (one
        code per head vector, each head with its own codebooks) and ``"conditional_heads"`` (the same, each head
        predicted from the heads decoded before it), values only ``"given_keys"``."""
        return layout_of(self.config, kind)

    def stages_for_bits(self, bits: float, kind: str = "keys") -> int:
        """Number of ``kind`` stages whose indices plus the per-vector scales make exactly ``bits`` per element.

        The rates served are the lowest (one stage and the scales) plus whole stages, up to the stages calibrated; a
        rate between two of them is refused, naming the nearest, rather than served at the lower one. (A tolerance of
        ``RATE_TOLERANCE`` lets a rate printed to four decimals, e.g. 0.1667, name 1/6.)"""
        codebook_bits = int(self.config["codebook_bits"])
        codecs = self.key_codecs if kind == "keys" else self.value_codecs
        # a code covers one head vector, or all of a token's heads (each with its own scale)
        heads = heads_per_code(self.layout(kind), codecs[0].num_heads)
        lowest = lowest_bit_rate(self.head_dim, codebook_bits, self.scale_bits, heads)
        step = codebook_bits / (heads * self.head_dim)  # what one more stage adds
        available = min(c.num_stages for c in codecs)
        highest = lowest + (available - 1) * step
        served = f"{_rate(lowest)} to {_rate(highest)} bits/element in steps of {_rate(step)}"
        if bits < lowest - RATE_TOLERANCE:
            raise ValueError(f"bits={bits:g} is below the lowest rate these {kind} codebooks offer ({lowest:.3f} "
                             f"bits/element: one residual stage and the scales); they serve {served}.")
        stages = max(1, stages_for_rate(bits + RATE_TOLERANCE, self.head_dim, codebook_bits, self.scale_bits, heads))
        if stages > available:
            raise ValueError(
                f"bits={bits:g} needs {stages} residual stages but these codebooks were calibrated with {available} "
                f"(at most {self.max_bits_per_element():.3f} bits/element). Re-run `hf-kvcodecs calibrate --bits {bits:g}`."
            )
        below = lowest + (stages - 1) * step
        if bits - below > RATE_TOLERANCE:
            nearest = _rate(below) + (f" or {_rate(below + step)}" if stages < available else "")
            raise ValueError(f"bits={bits:g} is not a rate these {kind} codebooks serve ({served}): {kind} would be "
                             f"coded at {_rate(below)} bits/element, not {bits:g}. Pass {nearest} (keys and values can "
                             "differ: key_bits / value_bits).")
        return stages

    def check_fits(self, config) -> None:
        """Raise a clear error if these codebooks were fitted for a model of another shape."""
        actual = model_fingerprint(config)
        for key in ("num_hidden_layers", "num_key_value_heads", "head_dim"):
            if self.fingerprint.get(key) != actual[key]:
                raise ValueError(
                    f"These GSRQ codebooks were calibrated for a model with {key}={self.fingerprint.get(key)}, but this "
                    f"model has {key}={actual[key]}. Calibrate codebooks for this model with "
                    "`hf-kvcodecs calibrate --model <model> --out DIR` and pass that directory."
                )
        # Pre-RoPE keys are rotated with the frequencies stored at calibration: another RoPE would misplace every key.
        stored_theta, stored_type = self.fingerprint.get("rope_theta"), self.fingerprint.get("rope_type")
        if self.key_space == "pre_rope" and (
                (stored_type is not None and stored_type != actual["rope_type"])
                or (stored_theta is not None and not math.isclose(stored_theta, actual["rope_theta"], rel_tol=1e-6))):
            raise ValueError(
                f"These GSRQ codebooks were calibrated for a model with RoPE {stored_type} (theta {stored_theta}), but "
                f"this model uses RoPE {actual['rope_type']} (theta {actual['rope_theta']}): keys coded before RoPE "
                "would be rotated at the wrong frequencies. Calibrate codebooks for this model with "
                "`hf-kvcodecs calibrate --model <model> --out DIR`."
            )

    # ---- persistence ----------------------------------------------------------------------------------------
    def save(self, directory: str | Path, *, overwrite: bool = True) -> Path:
        """Write the codebooks to ``directory`` as safetensors + JSON.

        Each file is written under a temporary name and moved into place, so an interrupted save never leaves a
        half-written file under the real name; both files carry the same ``save_id``, so a pair from two different
        saves (a crash between the two moves) is refused when loaded. ``overwrite=False`` refuses a directory that
        already holds codebooks instead of replacing them.
        """
        directory = Path(directory)
        check_save_directory(directory, overwrite=overwrite)
        tensors: dict[str, torch.Tensor] = {}
        for index, (key_codec, value_codec) in enumerate(zip(self.key_codecs, self.value_codecs)):
            tensors.update(key_codec.state_dict(f"layers.{index}.keys"))
            tensors.update(value_codec.state_dict(f"layers.{index}.values"))
        if self.rope_inv_freq is not None:
            tensors["rope.inv_freq"] = self.rope_inv_freq.float().contiguous()
        description = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "config": self.config,
            "fingerprint": self.fingerprint,
            "calibration": self.calibration,
            "rope_attention_scaling": self.rope_attention_scaling,
            "num_layers": self.num_layers,
            "stats": {
                "keys": [c.stats for c in self.key_codecs],
                "values": [c.stats for c in self.value_codecs],
            },
        }
        save_tensors_and_json(directory, TENSORS_FILE, METADATA_FILE, tensors, description,
                              {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)})
        return directory

    @classmethod
    def from_pretrained(cls, source: str | Path, *, revision: str | None = None, subfolder: str | None = None,
                        token: str | bool | None = None) -> GSRQCodebooks:
        """Codebooks from a local directory or a Hub repo id (``owner/name``; ``revision`` pins a branch, tag or
        commit, ``subfolder`` reads e.g. the ``kv_codebooks/`` folder of a saved hf_kvcodecs model)."""
        from .hub import resolve_codebooks

        return cls.load(resolve_codebooks(source, revision=revision, subfolder=subfolder, token=token))

    def push_to_hub(self, repo_id: str, *, base_model: str | None = None, token: str | None = None,
                    private: bool | None = None, revision: str | None = None, create_pr: bool = False,
                    commit_message: str | None = None):
        """Upload these codebooks and a card describing them to the Hub repo ``repo_id`` (see
        :func:`hf_kvcodecs.gsrq.hub.push_codebooks`)."""
        from .hub import push_codebooks

        return push_codebooks(self, repo_id, base_model=base_model, token=token, private=private, revision=revision,
                              create_pr=create_pr, commit_message=commit_message)

    @classmethod
    def load(cls, directory: str | Path) -> GSRQCodebooks:
        directory = Path(directory)
        metadata_path, tensors_path = directory / METADATA_FILE, directory / TENSORS_FILE
        for path in (metadata_path, tensors_path):
            if not path.is_file():
                raise CodebookFileError(
                    f"{path} does not exist. A GSRQ codebook directory holds {METADATA_FILE} and {TENSORS_FILE}; "
                    "create one with `hf-kvcodecs calibrate --model <model> --out DIR`."
                )
        metadata = read_json(metadata_path, max_bytes=MAX_METADATA_BYTES, kind="a GSRQ codebook file",
                             content="a codebook description", fix="re-run calibrate", error=CodebookFileError)
        if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
            raise CodebookFileError(f"{metadata_path} is not a GSRQ codebook file (format={metadata.get('format') if isinstance(metadata, dict) else None!r}).")
        version = metadata.get("format_version")
        if type(version) is not int or version not in READABLE_VERSIONS:  # (not True, 4.0 or "4")
            raise CodebookFileError(
                f"{metadata_path} has format_version={version!r}, this hf_kvcodecs reads versions "
                f"{list(READABLE_VERSIONS)}. Upgrade hf_kvcodecs or re-run calibrate."
            )
        try:  # tensors and header from one handle, so both come from the same file
            with safe_open(str(tensors_path), "pt") as handle:
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
                header = handle.metadata() or {}
        except (SafetensorError, OSError, ValueError) as error:
            raise CodebookFileError(
                f"{tensors_path} could not be read ({error}); it is corrupt or truncated: re-run calibrate or re-download it."
            ) from error
        _check_same_save(metadata.get("save_id"), header.get("save_id"), tensors_path, metadata_path)
        check_tensors_checksum(metadata, tensors_path, metadata_path, fix=DAMAGED_FILE_FIX, error=CodebookFileError)
        _check_tensor_values(tensors, tensors_path)
        config, num_layers, group_dim, heads, stats = _described_shape(metadata, metadata_path)
        for kind in ("keys", "values"):
            if layout_of(config, kind) not in LAYOUTS[kind]:
                raise CodebookFileError(f"{metadata_path}: {kind[:-1]}_layout must be one of {LAYOUTS[kind]}, got "
                                        f"{layout_of(config, kind)!r}.")

        def read(kind, index):
            prefix, codec_stats = f"layers.{index}.{kind}", _at(stats.get(kind), index)
            return codec_class(layout_of(config, kind)).from_state_dict(tensors, prefix, group_dim, heads, codec_stats)

        key_codecs, value_codecs = [], []
        try:
            for index in range(num_layers):
                key_codecs.append(read("keys", index))
                value_codecs.append(read("values", index))
        except KeyError as error:
            raise CodebookFileError(f"{tensors_path} lacks tensor {error}; the file is incomplete: re-run calibrate.") from error
        except ValueError as error:  # a codec's own consistency checks (e.g. predictors of the wrong shape)
            raise CodebookFileError(f"{tensors_path} holds inconsistent codebooks ({error}); re-run calibrate.") from error
        expected = (int(config["codebook_bits"]), int(config["group_dim"]), int(config.get("scale_bits", FP16_SCALE_BITS)))
        for codec in key_codecs + value_codecs:
            problems = codec.consistency_problems(*expected)
            if problems:
                raise CodebookFileError(f"{tensors_path} holds inconsistent codebooks ({'; '.join(problems)}); re-run "
                                        "calibrate.")
        if config.get("key_space") not in KEY_SPACES:
            raise CodebookFileError(f"{metadata_path}: key_space must be one of {KEY_SPACES}, got {config.get('key_space')!r}.")
        for kind in ("keys", "values"):
            layout = layout_of(config, kind)
            if codec_class(layout).needs_pre_rope_keys and config["key_space"] != "pre_rope":
                raise CodebookFileError(f"{metadata_path}: {layout} {kind} need keys coded before RoPE (key_space "
                                        f"'pre_rope'), got {config['key_space']!r}; re-run calibrate.")
        inv_freq = tensors.get("rope.inv_freq")
        if config["key_space"] == "pre_rope" and inv_freq is None:
            raise CodebookFileError(f"{tensors_path} stores pre-RoPE key codebooks but lacks rope.inv_freq; re-run calibrate.")
        if config["key_space"] == "post_rope" and inv_freq is not None:  # only pre-RoPE calibrations store them
            raise CodebookFileError(f"{metadata_path} says keys are coded after RoPE, but {tensors_path} holds the rotary "
                                    "frequencies of codebooks fitted before RoPE; the description was edited: re-run "
                                    "calibrate.")
        head_dim = key_codecs[0].head_dim
        if inv_freq is not None and (inv_freq.shape != (head_dim // 2,) or not inv_freq.is_floating_point()
                                     or not torch.isfinite(inv_freq).all() or not (inv_freq > 0).all()):
            raise CodebookFileError(f"{tensors_path}: rope.inv_freq must hold {head_dim // 2} positive finite rotary "
                                    f"frequencies, got a {inv_freq.dtype} tensor of shape {tuple(inv_freq.shape)}; "
                                    "the file is corrupt: re-run calibrate.")
        scaling = metadata.get("rope_attention_scaling", 1.0)
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not 0 < scaling < math.inf:
            raise CodebookFileError(f"{metadata_path}: rope_attention_scaling must be a positive finite number, got "
                                    f"{scaling!r}; re-run calibrate.")
        return cls(
            key_codecs, value_codecs, config, metadata["fingerprint"], metadata.get("calibration", {}),
            inv_freq, float(scaling),
        )


def holds_codebooks(directory: str | Path) -> bool:
    """Whether ``directory`` already holds (some of) a saved set of GSRQ codebooks."""
    return any((Path(directory) / name).exists() for name in (TENSORS_FILE, METADATA_FILE))


def check_save_directory(directory: str | Path, *, overwrite: bool) -> None:
    """``directory`` can receive codebooks: not a file, and (unless ``overwrite``) not holding codebooks already."""
    if Path(directory).exists() and not Path(directory).is_dir():
        raise ValueError(f"{directory} is a file; codebooks are saved as a directory: pass a directory path.")
    if not overwrite and holds_codebooks(directory):
        raise FileExistsError(f"{directory} already holds GSRQ codebooks; pass another directory, or --overwrite "
                              "(Python: overwrite=True) to replace them.")


def _check_same_save(described, stored, tensors_path: Path, metadata_path: Path) -> None:
    """Both files of a save carry its ``save_id`` (files written before it existed carry none and are not checked)."""
    if described != stored:  # (one file written before save_ids existed, the other after: also a mixed pair)
        raise CodebookFileError(f"{metadata_path} and {tensors_path} come from two different saves (save_id "
                                f"{described!r} vs {stored!r}), e.g. a save interrupted between its two files or "
                                "files copied from two directories: re-run calibrate.")


def _check_tensor_values(tensors: dict[str, torch.Tensor], tensors_path: Path) -> None:
    """Stage-group indices are integers, everything else real floating point: another dtype would be cast silently
    (fractional indices truncated, complex parts dropped). No codec value is so large that its square overflows
    float32 (a damaged exponent: files written before checksums were recorded are not verified otherwise); NaNs are
    refused by the codecs' own consistency checks, rope.inv_freq by its check below."""
    for name, tensor in tensors.items():
        integral = name.endswith(".stage_groups")
        valid = (not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool) if integral \
            else tensor.is_floating_point()
        if not valid:
            raise CodebookFileError(f"{tensors_path}: tensor {name} is {tensor.dtype}, expected "
                                    f"{'an integer' if integral else 'a floating-point'} dtype; the file is corrupt or "
                                    "was not written by hf_kvcodecs: re-run calibrate.")
        if not integral and name.startswith("layers.") and tensor.numel() and \
                bool(tensor.abs().max() > MAX_CODEC_MAGNITUDE):
            raise CodebookFileError(f"{tensors_path}: tensor {name} holds an infinite value or one beyond "
                                    f"{MAX_CODEC_MAGNITUDE:.0e} in magnitude, which no calibration produces: the file "
                                    f"is damaged; {DAMAGED_FILE_FIX}.")


def _described_shape(metadata: dict, metadata_path: Path):
    """(config, num_layers, group_dim, KV heads, stats) from a codebook file's JSON, or a clear error for a file whose
    description is damaged (hand edits, truncation)."""
    try:
        config, fingerprint = metadata["config"], metadata["fingerprint"]
        num_layers, group_dim = metadata["num_layers"], config["group_dim"]
        heads, layers = fingerprint["num_key_value_heads"], fingerprint["num_hidden_layers"]
        stats = metadata.get("stats", {})
        counts = (num_layers, group_dim, heads, layers)
        if not (isinstance(config, dict) and isinstance(stats, dict)
                and all(type(count) is int and count >= 1 for count in counts) and num_layers == layers):
            raise TypeError(f"num_layers={num_layers!r} (fingerprint: {layers!r} layers), group_dim={group_dim!r}, "
                            f"num_key_value_heads={heads!r}, config and stats objects")
    except (KeyError, TypeError, AttributeError) as error:
        raise CodebookFileError(f"{metadata_path} does not describe GSRQ codebooks ({type(error).__name__}: {error}); "
                                "the file was damaged or edited: re-run calibrate.") from error
    return config, num_layers, group_dim, heads, stats


def layout_of(config: dict, kind: str) -> str:
    """The layout of ``kind`` ("keys"/"values") in a codebook config (files before version 3: per head)."""
    return config.get(f"{kind[:-1]}_layout", "per_head")


def _rate(bits: float) -> str:
    """A rate as a user would pass it back: at most four decimals."""
    return f"{round(bits, 4):g}"


def _at(items, index):
    return items[index] if isinstance(items, list) and index < len(items) else {}


