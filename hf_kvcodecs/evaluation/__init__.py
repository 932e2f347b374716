"""The one paired evaluation: next-token NLL, KL divergence and top-1 agreement of a model against a reference,
paired window by window on the same held-out text. Benchmarks, the compress pipeline and training use it.

:mod:`.tasks` adds RULER-style long-context tasks (needles, variable tracking, common words) scored on greedy answers
through a cache method, compared with a reference method item by item."""

from .paired import (
    WindowScores,
    decode_logprobs,
    decode_nll,
    decode_step,
    divergence_metrics,
    fixed_windows,
    forward_nll,
    kl_divergence,
    paired_comparison,
    paired_difference,
    perplexity_metrics,
    prefill,
    strided_windows,
    token_nll,
)
from .tasks import (
    TaskSuiteOptions,
    compare_task_results,
    generate_task_items,
    run_task_suite,
    run_task_suite_methods,
    task_suite_table,
)

__all__ = ["WindowScores", "decode_logprobs", "decode_nll", "decode_step", "divergence_metrics", "fixed_windows", "forward_nll", "kl_divergence",
           "paired_comparison", "paired_difference", "perplexity_metrics", "prefill", "strided_windows", "token_nll",
           "TaskSuiteOptions", "compare_task_results", "generate_task_items", "run_task_suite", "run_task_suite_methods",
           "task_suite_table"]
