"""`hf-kvcodecs bench kv`: GSRQ against the caches transformers ships and TurboQuant: quality, memory, speed."""

from __future__ import annotations

from pathlib import Path

from .._common import (
    add_command,
    add_gsrq_row_arguments,
    add_model_arguments,
    calibration_text,
    load_model,
    positive_int,
)
from ..defaults import (
    BASELINE_IDS,
    CALIBRATION,
    CODEBOOK_STORE,
    EVALUATION_TEXT,
    GSRQ_LEARNERS,
    GSRQ_RATES,
    KV_PASSKEY_CELLS,
    KV_PASSKEY_TRIALS,
    KV_WINDOWS,
    TASK_ITEMS,
    TASK_LENGTHS,
    TASK_NAMES,
)

# --tasks words besides the task names
ALL_TASKS, NO_TASKS = "all", "none"


def add_parser(bench) -> None:
    kv = add_command(bench, "kv", "GSRQ vs transformers' caches and TurboQuant: quality, memory, speed")
    add_model_arguments(kv)
    kv.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                    help="folder for results.json, results.md, quality_vs_bits.png and, with --tasks, "
                         "long_context_vs_length.png")
    kv.add_argument("--text", nargs="+", default=None, help=f"evaluation text (default: {EVALUATION_TEXT})")
    kv.add_argument("--codebook-store", type=Path, default=None,
                    help=f"where calibrated codebooks are kept and reused (default: {CODEBOOK_STORE})")
    kv.add_argument("--quick", action="store_true", help="tiny settings: checks the pipeline, numbers mean nothing")
    kv.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="calibration seeds: GSRQ is calibrated and measured once per seed and learner")
    kv.add_argument("--learners", nargs="+", default=None, choices=GSRQ_LEARNERS,
                    help="codebook learners to calibrate and measure (default: all of them)")
    kv.add_argument("--bits", type=float, nargs="+", default=None,
                    help=f"bits per element of the GSRQ rows (default: {' '.join(f'{r:g}' for r in GSRQ_RATES)})")
    add_gsrq_row_arguments(kv)
    kv.add_argument("--no-layout-variants", dest="layout_variants", action="store_false",
                    help="skip the rows with other codec layouts on the first seed (they only run when the GSRQ rows "
                         "use the default layout)")
    kv.add_argument("--baselines", nargs="*", default=None, choices=BASELINE_IDS,
                    help="baseline caches to measure: transformers' QuantizedCache (quanto, hqq) and the "
                         "calibration-free TurboQuant-style cache (random rotation + Lloyd-Max codes; -protected: "
                         "first and last layer at full precision) (default: all; the full-precision reference "
                         "always runs)")
    kv.add_argument("--windows", type=positive_int, default=None,
                    help=f"perplexity/KL windows of evaluation text (default: {KV_WINDOWS['full']}, "
                         f"{KV_WINDOWS['quick']} with --quick; more narrows the standard errors, up to what the text "
                         "holds)")
    kv.add_argument("--passkey-trials", type=positive_int, default=None,
                    help=f"pass-key haystacks per (length, depth) cell (default: {KV_PASSKEY_TRIALS['full']}, i.e. "
                         f"{KV_PASSKEY_TRIALS['full'] * KV_PASSKEY_CELLS} haystacks; {KV_PASSKEY_TRIALS['quick']} "
                         "with --quick)")
    kv.add_argument("--no-speed", dest="speed", action="store_false", help="skip the decode speed phase")
    kv.add_argument("--plain-rvq", nargs="*", type=positive_int, default=None, metavar="GROUP_DIM",
                    help="add plain residual VQ (VQLLM-like: codebooks shared by the heads, no transform, greedy "
                         "encoder, RMS scale) with each learner's codebooks, calibrated with the first seed, at the "
                         "same rates, over groups of each GROUP_DIM channels (default: no plain rows; given without "
                         f"GROUP_DIM: {CALIBRATION['group_dim']})")
    kv.add_argument("--tasks", nargs="+", default=[NO_TASKS], choices=(*TASK_NAMES, ALL_TASKS, NO_TASKS),
                    metavar="TASK",
                    help="RULER-style long-context tasks to run every measured method through, on the same items, "
                         "each answer compared with the full-precision reference's item by item: "
                         f"{', '.join(TASK_NAMES)}, {ALL_TASKS}, or {NO_TASKS} (default: {NO_TASKS}). Each item is one "
                         "long prefill of its context length plus up to ~120 greedy tokens, per method: a run adds "
                         "tasks x lengths x items of them to every method. Haystacks come from "
                         f"{EVALUATION_TEXT} whatever --text is")
    kv.add_argument("--task-lengths", nargs="+", default=None, metavar="TOKENS",
                    help="context lengths of the --tasks items, prompt plus answer in the model's tokens, as 4096 or "
                         f"4K (default: {' '.join(map(str, TASK_LENGTHS))})")
    kv.add_argument("--task-items", type=positive_int, default=None,
                    help=f"items per task and context length of --tasks (default: {TASK_ITEMS})")
    kv.set_defaults(func=command)


def _plain_rvq_group_dims(given: list[int] | None) -> tuple[int, ...]:
    """``--plain-rvq [GROUP_DIM ...]``: absent → no plain rows; given without sizes → the default group size."""
    from ...bench.kv import PLAIN_RVQ_GROUP_DIMS

    return () if given is None else tuple(given) or PLAIN_RVQ_GROUP_DIMS


def _task_suite_options(args):
    """The long-context suite ``--tasks``, ``--task-lengths`` and ``--task-items`` ask for (None: no tasks), checked
    before the model loads."""
    from ...evaluation import TaskSuiteOptions

    words = [task for task in args.tasks if task in (ALL_TASKS, NO_TASKS)]
    if words and len(args.tasks) > 1:
        raise ValueError(f"--tasks {' '.join(args.tasks)}: give task names, or '{words[0]}' alone.")
    settings = {"lengths": args.task_lengths, "items_per_cell": args.task_items}
    if args.tasks == [NO_TASKS]:
        if any(value is not None for value in settings.values()):
            raise ValueError(f"--task-lengths and --task-items set the long-context tasks; name them with --tasks "
                             f"({', '.join(TASK_NAMES)} or {ALL_TASKS}).")
        return None
    if args.tasks != [ALL_TASKS]:
        settings["tasks"] = tuple(args.tasks)
    return TaskSuiteOptions(**{name: value for name, value in settings.items() if value is not None})


def command(args) -> int:
    from ...bench import kv as benchmark

    long_context = _task_suite_options(args)
    loaded = load_model(args)
    results = benchmark.run_kv_benchmark(
        loaded, out=args.out, text=args.text or None, calibration_text=calibration_text(args), quick=args.quick,
        seeds=args.seeds, store=args.codebook_store, learners=args.learners, key_layout=args.key_layout,
        value_layout=args.value_layout, layout_variants=args.layout_variants, baselines=args.baselines,
        rates=args.bits or benchmark.GSRQ_RATES, windows=args.windows, passkey_trials=args.passkey_trials,
        speed=args.speed, plain_rvq=_plain_rvq_group_dims(args.plain_rvq), group_dim=args.group_dim,
        long_context=long_context,
    )
    print(Path(results["files"]["markdown"]).read_text())
    print("\nwritten:", ", ".join(results["files"].values()))
    return 0
