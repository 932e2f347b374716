"""Library values the parser needs for its choices, defaults and help texts.

They live in modules that import torch (or the benchmark harness); copied here, building the parser and printing
``--help`` import none of them. tests/test_cli.py checks every value against its source, so they cannot drift.
"""

DEFAULT_MODEL_NAME = "default"  # models.DEFAULT_MODEL_NAME
ZERO_POINTS = ("float", "integer")  # codecs.weight_quantization.ZERO_POINTS; the first is KVCodecsConfig's default
ZERO_POINT_HELP = ("offset of the asymmetric weight grid: 'float' (min-max: the group's minimum) or 'integer' "
                   "(-zero_point * scale with an integer zero point, held exactly: compressed-tensors' grid, so "
                   "`hf-kvcodecs export` writes it exactly; slightly less accurate)")
CALIBRATION_TEXT = "python-docs"  # text.CALIBRATION_DEFAULT
GSRQ_CALIBRATION_TEXT = "mixed"  # text.GSRQ_CALIBRATION_DEFAULT
EVALUATION_TEXT = "debian-licenses"  # text.EVALUATION_DEFAULT
# where `ensure_codebooks` keeps calibrated codebooks when no store is given (gsrq.store.default_store)
CODEBOOK_STORE = "$HF_KVCODECS_CACHE/codebooks, HF_KVCODECS_CACHE defaulting to ~/.cache/hf_kvcodecs"

CODEBOOK_LEARNERS = ("gskm", "gskm-cosine", "gskm-principal", "l2")  # sorted(codecs.kmeans.CODEBOOK_LEARNERS)
DEFAULT_LEARNER = "l2"  # codecs.kmeans.DEFAULT_LEARNER
KEY_LAYOUTS = ("per_head", "joint_heads", "per_head_codebooks", "conditional_heads")  # gsrq.codebooks.LAYOUTS["keys"]
VALUE_LAYOUTS = ("per_head", "joint_heads", "given_keys")  # gsrq.codebooks.LAYOUTS["values"]
DEFAULT_KEY_LAYOUT = "per_head_codebooks"  # codecs.joint.DEFAULT_KEY_LAYOUT
DEFAULT_VALUE_LAYOUT = "given_keys"  # codecs.joint.DEFAULT_VALUE_LAYOUT
POST_ROPE_KEY_LAYOUT = "per_head"  # codecs.joint.POST_ROPE_KEY_LAYOUT
POST_ROPE_VALUE_LAYOUT = "joint_heads"  # codecs.joint.POST_ROPE_VALUE_LAYOUT

# The fit settings `calibrate` exposes or describes, at the defaults of gsrq.calibrate.fit_gsrq_codebooks (the values
# gsrq.store.calibration_defaults() reports): a CLI calibration and an API one with the same settings agree.
CALIBRATION = {"bits": 2.0, "learner": DEFAULT_LEARNER, "transform": "pca", "metric": "none", "key_space": "pre_rope",
               "group_dim": 8, "scale_bits": 8, "window_tokens": 512, "sampled_tokens_per_window": 256,
               "num_windows": 32, "holdout_windows": 4, "seed": 0}

GSRQ_LEARNERS = ("gskm-principal", "l2")  # tuple(bench.kv.GSRQ_LEARNERS)
GSRQ_RATES = (1.0, 2.0)  # bench.kv.GSRQ_RATES
BASELINE_IDS = ("quanto-4", "quanto-2", "quanto-2-per-token", "hqq-4", "hqq-2", "turboquant-2", "turboquant-2.5",
                "turboquant-3", "turboquant-3.5", "turboquant-4", "turboquant-2-protected",
                "turboquant-3-protected")  # tuple(bench.harness.BASELINE_IDS)
# bench.kv.FULL / bench.kv.QUICK: the `bench kv` protocol settings its --windows and --passkey-trials override
KV_WINDOWS = {"full": 4, "quick": 1}
KV_PASSKEY_TRIALS = {"full": 2, "quick": 1}
# cells of the full pass-key grid: len(FULL["passkey_lengths"]) x len(passkey_depths of harness.evaluate_methods)
KV_PASSKEY_CELLS = 9
# the RULER-style long-context suite bench kv runs with --tasks: tuple(evaluation.tasks.TASKS), and the lengths and
# items per cell of evaluation.TaskSuiteOptions()
TASK_NAMES = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe")
TASK_LENGTHS = (2048, 4096, 8192)
TASK_ITEMS = 8

SPLIT_LAYOUTS = ("default", "conditional-keys")  # tuple(bench.bit_split.SPLIT_LAYOUTS)
SPLIT_OFFSETS = (-0.5, -0.25, 0.0, 0.25, 0.5)  # bench.bit_split.DEFAULT_OFFSETS
DECODE_CONTEXTS = (1024, 4096, 8192)  # bench.decode.DECODE_CONTEXTS
DECODE_STEPS = 132  # bench.decode.DECODE_STEPS
WEIGHT_METHODS = ("fp32", "rtn-w8", "rtn-w4", "rtn-w3", "rtn-w2", "rtn-w4-g32", "rtn-w3-g32", "rtn-w2-g32", "bnb-nf4",
                  "bnb-int8", "quanto-int4", "quanto-int2")  # bench.weights.METHOD_NAMES

# The GSRQ cache options `demo` offers: GSRQCacheConfig.option_names(cli=True), in field order, each with the type
# argparse converts it with (the field's type without its None), its default, choices and help. GSRQCacheConfig still
# checks the values when the command builds the cache.
GSRQ_CACHE_OPTIONS = {
    "bits": {"type": float, "default": 2.0, "choices": None,
             "help": "bits per KV element, the per-vector scale included"},
    "key_bits": {"type": float, "default": None, "choices": None,
                 "help": "bits per key element, overriding the rate of --bits (default: --bits)"},
    "value_bits": {"type": float, "default": None, "choices": None,
                   "help": "bits per value element, overriding the rate of --bits (default: --bits)"},
    "window_length": {"type": int, "default": 32, "choices": None,
                      "help": "most recent tokens the GSRQ cache keeps exact"},
    "flush_interval": {"type": int, "default": 32, "choices": None,
                       "help": "tokens that accumulate beyond the exact window before they are coded together"},
    "num_sink_tokens": {"type": int, "default": 4, "choices": None,
                        "help": "first tokens the GSRQ cache keeps exact (attention sinks)"},
    "attention": {"type": str, "default": "auto", "choices": ("auto", "codes", "dequantize"),
                  "help": "how attention reads the coded history: 'codes' reads the codes, 'dequantize' decodes them "
                          "for the model's own attention, 'auto' picks 'codes' when the model runs the code-reading "
                          "attention"},
    "beam_width": {"type": int, "default": 8, "choices": None,
                   "help": "code paths the encoder keeps per group of stages (1: greedy, up to 64)"},
    "gain": {"type": str, "default": "norm", "choices": ("norm", "least_squares", "rms"),
             "help": "how each coded vector's scale is chosen once its codes are"},
}
