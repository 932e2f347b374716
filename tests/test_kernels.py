"""Parity of the GSRQ kernels: Triton (interpreted on CPU) vs the CPU implementation vs the PyTorch reference vs a
float64 dequantize-then-attend computation. Error budgets are relative to plain PyTorch's error in the same dtype."""

import functools
import math
import os
import platform
import shutil

import pytest
import torch

from hf_kvcodecs.kernels import backend_for, ops, reference, residual_encode
from hf_kvcodecs.kernels.cpu import (
    FixedPointKeyTable,
    coded_attention_cpu,
    conditional_key_table,
    folded_key_table,
    fuses_value_prediction,
)
from hf_kvcodecs.kernels.cpu_native import build_error, native_ops

triton = pytest.importorskip("triton")
from hf_kvcodecs.kernels.triton_attention import coded_attention_triton  # noqa: E402
from hf_kvcodecs.kernels.triton_encode import residual_encode_beam_triton, residual_encode_triton  # noqa: E402


def random_codec(kv_heads, dim, stages, size, group_dim, generator, joint=False):
    """Per-head operands, or with ``joint`` a joint-head codec's: synthesis ``[H, H*D, D]`` (head slices of one
    orthogonal matrix), groups over the ``H*D`` transform components."""
    mean = 0.3 * torch.randn(kv_heads, dim, generator=generator)
    if joint:
        full = torch.linalg.qr(torch.randn(kv_heads * dim, kv_heads * dim, generator=generator))[0]
        synthesis = full.reshape(kv_heads * dim, kv_heads, dim).permute(1, 0, 2).contiguous()
    else:
        synthesis = torch.linalg.qr(torch.randn(kv_heads, dim, dim, generator=generator))[0]
    codebooks = 0.5 * torch.randn(stages, size, group_dim, generator=generator)
    groups = torch.randint(0, synthesis.shape[1] // group_dim, (stages,), generator=generator)
    return mean, synthesis, codebooks, groups


def random_conditional_codec(kv_heads, dim, stages, size, group_dim, generator):
    """Operands of keys coded conditionally across heads (``ConditionalHeadResidualVQ.attention_operands``): each
    head's own codebooks and groups, mean and synthesis pairs ``[source, target]`` zero where source > target."""
    mean = 0.3 * torch.randn(kv_heads, kv_heads, dim, generator=generator)
    synthesis = 0.5 * torch.linalg.qr(torch.randn(kv_heads, kv_heads, dim, dim, generator=generator))[0]
    later = torch.arange(kv_heads)[:, None] > torch.arange(kv_heads)[None, :]
    mean[later], synthesis[later] = 0.0, 0.0
    codebooks = 0.5 * torch.randn(kv_heads, stages, size, group_dim, generator=generator)
    groups = torch.randint(0, dim // group_dim, (kv_heads, stages), generator=generator)
    return mean, synthesis, codebooks, groups


def make_problem(batch=2, kv_heads=2, group_count=3, query_length=1, tokens=70, dim=64, stages=5, size=16,
                 group_dim=8, rope=True, padded=True, seed=0, joint=False, conditional=False):
    """``joint``: False (per-head codes), True (joint-head keys and values) or "values" (the default layout);
    ``conditional``: keys coded conditionally across heads (values as ``joint`` says)."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * group_count, query_length, dim, generator=generator)
    key_joint, value_joint = joint is True, joint in (True, "values")
    if conditional:
        key_codec = random_conditional_codec(kv_heads, dim, stages, size, group_dim, generator)
        if conditional == "own_codebooks":  # per_head_codebooks keys: no block reads another head's codes
            mean, synthesis, *rest = key_codec
            other = ~torch.eye(kv_heads, dtype=torch.bool)
            mean[other], synthesis[other] = 0.0, 0.0
            key_codec = (mean, synthesis, *rest)
    else:
        key_codec = random_codec(kv_heads, dim, stages, size, group_dim, generator, key_joint)
    value_codec = random_codec(kv_heads, dim, stages + 1, size, group_dim, generator, value_joint)

    def codes(count, shared):  # joint-head codes: one row per token, shared by the heads
        rows = 1 if shared else kv_heads
        return torch.randint(0, size, (batch, rows, tokens, count), generator=generator).to(torch.uint8)

    def scales():
        return (0.5 + torch.rand(batch, kv_heads, tokens, generator=generator)).half()

    positions = inv_freq = None
    if rope:
        positions = (torch.arange(tokens) + 4)[None].expand(batch, tokens).to(torch.int32).contiguous()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    mask = None
    if padded:  # the first row is left-padded: its first 7 coded tokens are hidden
        mask = torch.zeros(batch, query_length, tokens)
        mask[0, :, :7] = -math.inf
    return dict(query=query, key_codes=codes(stages, key_joint), key_scales=scales(),
                value_codes=codes(stages + 1, value_joint),
                value_scales=scales(), key_codec=key_codec, value_codec=value_codec, positions=positions,
                inv_freq=inv_freq, attention_scaling=1.0, mask=mask, scaling=dim**-0.5)


def arguments(problem):
    return (problem["query"], problem["key_codes"], problem["key_scales"], problem["value_codes"],
            problem["value_scales"], *problem["key_codec"], *problem["value_codec"], problem["positions"],
            problem["inv_freq"], problem["attention_scaling"], problem["mask"], problem["scaling"])


def grouped(positional) -> tuple:
    """The op's arguments from the implementations' positional ones (``ops.positional_arguments`` is the inverse):
    the op takes each codec's operands, the rotary inputs, the exact tokens and the scale levels as lists."""
    args = list(positional) + [None] * (27 - len(positional))
    value_operands = args[9:13] + ([args[26]] if args[26] is not None else [])
    return (*args[:5], args[5:9], value_operands, args[13:18], args[21:24], args[24:26], args[19], args[18], args[20])


def coded_attention(*positional):
    """The ``hf_kvcodecs::coded_attention`` op, called with the implementations' positional arguments."""
    return ops.coded_attention(*grouped(positional))


def op_arguments(problem):
    args = list(arguments(problem))
    return args[:13] + [None, None, None] + args[13:]


def dequantize_then_attend(problem, dtype, key_dtype=None):
    """Plain PyTorch: decode every coded vector in ``dtype``, rotate, and attend in ``dtype`` (with ``key_dtype``, the
    coded keys are rounded to it first, and values coded given the keys are predicted from the keys so held)."""
    dequantize_keys = (reference.conditional_dequantize_reference if reference.is_conditional(problem["key_codec"][1])
                       else reference.dequantize_reference)
    keys = dequantize_keys(problem["key_codes"], problem["key_scales"], *problem["key_codec"], torch.float64)
    values = reference.dequantize_reference(problem["value_codes"], problem["value_scales"], *problem["value_codec"],
                                            torch.float64)
    if "value_predictor" in problem:  # values coded given the keys: residual + prediction from the keys as coded
        batch, kv_heads, tokens, dim = keys.shape
        held = keys.to(key_dtype).double() if key_dtype is not None else keys
        flat = torch.cat([held.permute(0, 2, 1, 3).reshape(batch, tokens, -1), keys.new_ones(batch, tokens, 1)], -1)
        predicted = flat @ problem["value_predictor"].double()
        values = values + predicted.reshape(batch, tokens, kv_heads, dim).permute(0, 2, 1, 3)
    if problem["positions"] is not None:
        freqs = problem["positions"].double()[..., None] * problem["inv_freq"].double()[None, None]
        angles = torch.cat([freqs, freqs], dim=-1)
        keys = reference._rotate(keys, angles.cos()[:, None], angles.sin()[:, None])
    query = problem["query"].to(dtype)
    keys, values = keys.to(key_dtype or dtype).to(dtype), values.to(dtype)
    group_count = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group_count, 1), values.repeat_interleave(group_count, 1)
    scores = (query @ keys.transpose(-1, -2)).to(torch.float64 if dtype == torch.float64 else dtype) * problem["scaling"]
    if problem["mask"] is not None:
        scores = scores + problem["mask"][:, None].to(scores.dtype)
    if "exact" in problem:  # sinks and window: attended exact, in the same softmax
        exact_keys, exact_values, exact_mask = problem["exact"]
        exact_keys = exact_keys.to(dtype).repeat_interleave(group_count, 1)
        exact_scores = (query @ exact_keys.transpose(-1, -2)).to(scores.dtype) * problem["scaling"]
        scores = torch.cat([scores, exact_scores + exact_mask[:, None].to(scores.dtype)], dim=-1)
        values = torch.cat([values, exact_values.to(dtype).repeat_interleave(group_count, 1)], dim=-2)
    lse = torch.logsumexp(scores.double(), dim=-1)
    return (torch.softmax(scores, dim=-1) @ values).double(), lse


def cpu_with(kernels: str):
    """The CPU implementation with HF_KVCODECS_KERNELS set to ``kernels`` ("auto": compiled loops; "pytorch": none)."""

    def run(*args):
        previous = os.environ.get("HF_KVCODECS_KERNELS")
        os.environ["HF_KVCODECS_KERNELS"] = kernels
        try:
            return coded_attention_cpu(*(list(args[:13]) + [None, None, None] + list(args[13:])))
        finally:
            if previous is None:
                del os.environ["HF_KVCODECS_KERNELS"]
            else:
                os.environ["HF_KVCODECS_KERNELS"] = previous

    return run


def implementations():
    return {
        "reference": lambda *a: reference.coded_attention_reference(*a),
        "cpu-native": cpu_with("auto"),
        "cpu-pytorch": cpu_with("pytorch"),
        "triton": lambda *a: coded_attention_triton(*a, block_n=16, tokens_per_split=32),
    }


needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler on this machine")


@needs_compiler
def test_compiled_cpu_loops_build_and_are_used():
    assert native_ops() is not None, build_error()
    assert backend_for("cpu") == "cpu-native"


@needs_compiler
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set levels")
def test_compiled_cpu_loops_compile_for_every_x86_vector_width():
    """The loops are built with -march=native, so the machine running the suite compiles only its own vector width
    (4, 8 or 16 float lanes); code that only one width instantiates once failed to compile on AVX-512 CPUs while
    AVX2 machines passed. Check the other widths too (syntax and template instantiation, no code generation)."""
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    from hf_kvcodecs.kernels.cpu_native import SOURCE

    compiler = shutil.which("c++") or shutil.which("g++")
    headers = [flag for path in [*include_paths(), sysconfig.get_paths()["include"]] for flag in ("-isystem", path)]
    levels = {"16 lanes (AVX-512)": "x86-64-v4", "8 lanes (AVX2)": "x86-64-v3", "4 lanes (SSE2)": "x86-64"}
    checks = {name: subprocess.Popen([compiler, "-std=c++20", "-fsyntax-only", "-fopenmp", f"-march={level}", *headers,
                                      str(SOURCE)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for name, level in levels.items()}
    failures = {}
    for name, check in checks.items():
        _, errors = check.communicate(timeout=300)
        if check.returncode != 0:
            failures[name] = "\n".join(line for line in errors.splitlines() if "error" in line)[:2000]
    assert not failures, failures


def test_a_failed_build_falls_back_to_pytorch_ops_and_says_so(monkeypatch, caplog):
    from hf_kvcodecs.kernels import cpu_native

    def no_compiler():
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpu_native, "_state", {})
    monkeypatch.setattr(cpu_native, "_load", no_compiler)
    with caplog.at_level("WARNING", logger="hf_kvcodecs.kernels.cpu_native"):
        assert cpu_native.native_ops() is None
        assert cpu_native.native_ops() is None  # tried once, not on every call
    assert caplog.text.count("could not be built") == 1 and "c++: command not found" in caplog.text
    assert backend_for("cpu") == "cpu" and isinstance(cpu_native.build_error(), RuntimeError)
    problem = make_problem(rope=True)
    out, _ = coded_attention_cpu(*op_arguments(problem))
    expected, _ = reference.coded_attention_reference(*arguments(problem))
    assert torch.allclose(out, expected, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("dim", [48, 64, 128])
def test_compiled_cpu_loops_match_reference_for_any_even_head_dim(dim):
    # 64 and 128 take the vectorized loops, 48 the generic one; both rotary halves and GQA rows are exercised.
    problem = make_problem(dim=dim, group_count=3, tokens=300, stages=4, size=32, rope=True)
    expected, expected_lse = reference.coded_attention_reference(*arguments(problem))
    out, lse = cpu_with("auto")(*arguments(problem))
    assert torch.allclose(out, expected, atol=1e-5) and torch.allclose(lse, expected_lse, atol=1e-5)


SHAPES = [
    dict(dim=64, group_count=3, tokens=70),  # SmolLM2-like: 3 query heads per KV head, length not a block multiple
    dict(dim=128, group_count=4, tokens=37),
    dict(dim=64, group_count=1, tokens=33, batch=1, padded=False),
    dict(dim=64, group_count=2, tokens=50, query_length=3),  # several queries per head (speculative decoding)
    dict(dim=64, kv_heads=3, group_count=3, tokens=70, stages=12, joint=True),  # joint-head codes (SmolLM2-like)
    dict(dim=32, kv_heads=3, group_count=2, tokens=41, stages=9, joint=True),  # 96 transform components: padded
    dict(dim=64, kv_heads=3, group_count=3, tokens=70, stages=12, joint="values"),  # keys per head, values joint
]


@pytest.mark.parametrize("rope", [True, False], ids=["keys-pre-rope", "keys-post-rope"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_coded_attention_matches_float64_within_pytorch_error(shape, rope, dtype):
    assert_within_pytorch_error(make_problem(rope=rope, **shape), dtype)


def assert_within_pytorch_error(problem, dtype):
    """Every implementation against float64 dequantize-then-attend, with the query in ``dtype``."""
    problem["query"] = problem["query"].to(dtype)
    truth, truth_lse = dequantize_then_attend(problem, torch.float64)
    plain, _ = dequantize_then_attend(problem, dtype)
    pytorch_error = (plain - truth).abs().max().item()
    for name, implementation in implementations().items():
        out, lse = implementation(*arguments(problem))
        assert out.shape == truth.shape and out.dtype == torch.float32, name
        error = (out.double() - truth).abs().max().item()
        # as flash-attention's tests: within twice plain PyTorch's error in this dtype (+ an fp32 rounding floor)
        assert error <= 2 * pytorch_error + 1e-5, (name, error, pytorch_error)
        assert torch.allclose(lse.double(), truth_lse, atol=1e-4), name


def add_exact_tokens(problem, dtype=torch.float32):
    """The cache's sinks and window: 6 exact tokens per head, the first row's first two hidden (padding)."""
    generator = torch.Generator().manual_seed(9)
    batch, kv_heads, query_length = problem["query"].shape[0], problem["key_scales"].shape[1], problem["query"].shape[2]
    dim = problem["query"].shape[-1]
    exact_mask = torch.zeros(batch, query_length, 6)
    exact_mask[0, :, :2] = -math.inf
    problem["exact"] = (torch.randn(batch, kv_heads, 6, dim, generator=generator).to(dtype),
                        torch.randn(batch, kv_heads, 6, dim, generator=generator).to(dtype), exact_mask)


def assert_every_op_implementation_matches(args, truth, truth_lse, extra=()):
    """Every implementation of the op, given its full argument list (exact tokens included), against the truth;
    ``extra``: further (name, callable) pairs."""
    triton_small_grid = functools.partial(coded_attention_triton, block_n=16, tokens_per_split=32)
    for name, implementation in [
        ("reference", lambda: ops._reference(*args)),
        ("cpu-native", lambda: cpu_with("auto")(*(args[:13] + args[16:]))),
        ("cpu-pytorch", lambda: cpu_with("pytorch")(*(args[:13] + args[16:]))),
        ("triton", lambda: ops._joined(triton_small_grid, args)),
        ("op", lambda: coded_attention(*args)),
        *extra,
    ]:
        out, lse = implementation()
        assert (out.double() - truth).abs().max() < 1e-5, name
        assert torch.allclose(lse.double(), truth_lse, atol=1e-5), name
    torch.library.opcheck(ops.coded_attention, grouped(args), test_utils=("test_schema", "test_faketensor"))


CONDITIONAL_SHAPES = [
    dict(dim=64, kv_heads=3, group_count=3, tokens=70, stages=12, joint="values"),  # SmolLM2-like
    dict(dim=128, kv_heads=2, group_count=4, tokens=37, query_length=2),
    dict(dim=32, kv_heads=3, group_count=2, tokens=41, stages=6),  # a head size the compiled loop is not built for
]


@pytest.mark.parametrize("shape", CONDITIONAL_SHAPES, ids=["dim64-gqa3", "dim128-queries2", "dim32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_conditional_keys_match_float64_within_pytorch_error(shape, dtype):
    """Keys coded conditionally across heads: every implementation (compiled loop where it is built for the shape,
    the reference elsewhere on CPU, Triton) against float64 dequantize-then-attend."""
    assert_within_pytorch_error(make_problem(conditional=True, rope=True, **shape), dtype)


@pytest.mark.parametrize("shape", CONDITIONAL_SHAPES[::2], ids=["dim64-gqa3", "dim32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_with_each_heads_own_codebooks_match_float64_within_pytorch_error(shape, dtype):
    """Conditional operands without cross-head blocks (the per_head_codebooks layout): the Triton kernel and the
    reference read only each head's own pair, and every implementation still matches float64."""
    problem = make_problem(conditional="own_codebooks", rope=True, **shape)
    assert not reference.has_cross_head_blocks(problem["key_codec"][1])
    assert reference.has_cross_head_blocks(make_problem(conditional=True, rope=True, **shape)["key_codec"][1])
    assert_within_pytorch_error(problem, dtype)


def test_cross_head_check_takes_operands_built_in_inference_mode():
    with torch.inference_mode():  # as the cache builds its codecs' operands during generate()
        own = make_problem(conditional="own_codebooks", rope=True, **CONDITIONAL_SHAPES[2])["key_codec"][1].clone()
        predicted = make_problem(conditional=True, rope=True, **CONDITIONAL_SHAPES[2])["key_codec"][1].clone()
    assert own.is_inference() and not reference.has_cross_head_blocks(own)
    assert reference.has_cross_head_blocks(predicted)


def test_cross_head_check_follows_in_place_changes():
    synthesis = make_problem(conditional="own_codebooks", rope=True, **CONDITIONAL_SHAPES[0])["key_codec"][1]
    assert not reference.has_cross_head_blocks(synthesis)
    synthesis[0, 2, 3, 4] = 0.5  # head 2 now reads head 0's codes
    assert reference.has_cross_head_blocks(synthesis)
    synthesis[2, 0, 3, 4] = 0.5  # a later head's block for an earlier one is never read: not a cross-head block
    synthesis[0, 2, 3, 4] = 0.0
    assert not reference.has_cross_head_blocks(synthesis)


def test_conditional_keys_join_exact_tokens_read_scale_levels_and_a_shared_table():
    """The cache's call: exact tokens in the same softmax, 8-bit scale indices with their levels, and the compiled
    loop's table built for a higher rate (lower rates read a prefix of each block)."""
    problem = make_problem(conditional=True, rope=True, **CONDITIONAL_SHAPES[0])
    add_exact_tokens(problem)
    generator = torch.Generator().manual_seed(3)
    batch, kv_heads, tokens = 2, 3, 70
    levels = {name: torch.rand(kv_heads, 256, generator=generator) + 0.5 for name in ("key", "value")}
    index = {name: torch.randint(0, 256, (batch, kv_heads, tokens), generator=generator, dtype=torch.uint8)
             for name in ("key", "value")}
    problem["key_scales"], problem["value_scales"] = (reference.scale_values_from_levels(levels[n], index[n])
                                                      for n in ("key", "value"))
    truth, truth_lse = dequantize_then_attend(problem, torch.float64)
    mean, synthesis, codebooks, groups = problem["key_codec"]
    args = op_arguments(problem) + list(problem["exact"]) + [levels["key"], levels["value"]]
    args[2], args[4] = index["key"], index["value"]
    with_table = list(args)
    with_table[13] = conditional_key_table(synthesis, torch.cat([codebooks, codebooks[:, :3]], 1),
                                           torch.cat([groups, groups[:, :3]], 1))
    assert_every_op_implementation_matches(args, truth, truth_lse, extra=[
        ("cpu-native-higher-rate-table", lambda: coded_attention_cpu(*with_table)),
        ("op-higher-rate-table", lambda: coded_attention(*with_table)),
    ])


def float16_table_problems():
    """(id, problem) for every shape the compiled loops read a key table in: per-head, joint and conditional keys,
    GQA, several queries, padding, exact tokens, values coded given the keys, more query rows than are scored in
    groups of tokens."""
    problems = [(f"shape{i}", make_problem(rope=True, **shape)) for i, shape in enumerate(SHAPES)]
    # more query rows per KV head (12) than the key loop scores 8 tokens at a time for: scored token by token
    problems.append(("many-rows", make_problem(rope=True, dim=64, group_count=4, tokens=45, query_length=3)))
    problems += [(f"conditional{i}", make_problem(conditional=True, rope=True, **shape))
                 for i, shape in enumerate(CONDITIONAL_SHAPES[:2])]
    for keys in ("per-head", "joint", "conditional"):
        problem = make_problem(rope=True, joint=True if keys == "joint" else "values",
                               conditional=keys == "conditional", kv_heads=3, group_count=3, tokens=75, dim=64)
        add_exact_tokens(problem)
        width = 3 * 64
        generator = torch.Generator().manual_seed(5)
        problem["value_predictor"] = torch.randn(width + 1, width, generator=generator) / width**0.5
        problems.append((f"values-given-{keys}-keys", problem))
    return problems


@needs_compiler
@pytest.mark.parametrize("table", ["int16", "float16"])
@pytest.mark.parametrize("index", range(len(SHAPES) + 1 + 2 + 3))
def test_16_bit_key_tables_stay_within_pytorch_error_with_float16_keys(index, table, monkeypatch):
    """The compiled loops with 16-bit key tables (int16 fixed point, the default, or float16) against float64
    dequantize-then-attend: within twice the error of plain PyTorch holding the dequantized keys in float16 (the rest
    in float32), for outputs and log-sum-exps; and they do round: the float32 tables give a different, closer result."""
    name, problem = float16_table_problems()[index]
    truth, truth_lse = dequantize_then_attend(problem, torch.float64)
    plain, plain_lse = dequantize_then_attend(problem, torch.float32, key_dtype=torch.float16)
    budget = 2 * (plain - truth).abs().max().item() + 1e-5
    lse_budget = 2 * (plain_lse - truth_lse).abs().max().item() + 1e-5
    args = op_arguments(problem)
    if "exact" in problem:
        args += list(problem["exact"]) + [None, None, problem.get("value_predictor")]
    results = {}
    for dtype in (table, "float32"):
        monkeypatch.setenv("HF_KVCODECS_KEY_TABLE", dtype)
        results[dtype] = coded_attention(*args)
    (out, lse), (exact_out, _) = results[table], results["float32"]
    error = (out.double() - truth).abs().max().item()
    assert error <= budget, (name, error, budget)
    assert (lse.double() - truth_lse).abs().max().item() <= lse_budget, name
    assert not torch.equal(out, exact_out) and (exact_out.double() - truth).abs().max().item() <= error, name


def test_fixed_point_key_table_bounds_every_key_and_rounds_finely():
    """Every sum of one row per stage stays inside int16 (the loops add without overflow checks), the worst case
    included, and each entry is within half a step of the float table."""
    generator = torch.Generator().manual_seed(3)
    stages, size = 15, 256
    table = torch.randn(2, stages * size, 64, generator=generator) * torch.logspace(0, -2, stages).repeat_interleave(
        size)[None, :, None]
    table[1, 5, 7] = 40.0  # an outlier codeword: its dimension gets a coarser step, the others do not
    fixed = FixedPointKeyTable(table, size)
    assert fixed.rows.dtype == torch.int16 and fixed.step.shape == (2, 64)
    worst = fixed.rows.int().abs().reshape(2, stages, size, 64).amax(dim=2).sum(dim=1)
    assert worst.max().item() <= 32767
    assert worst.max().item() >= 32767 - 2 * stages  # and the range is used: the finest step that is safe
    # half a step of rounding, and float32 rounding of rows * step (up to 32767 steps)
    assert ((fixed.float() - table).abs() <= fixed.step[:, None, :] * (0.5 + 32767 * 2**-23)).all()
    assert fixed.step[1, 7] > 3 * fixed.step[1, 8] and fixed.step[0, 7] < 1.5 * fixed.step[0, 8]
    with pytest.raises(ValueError, match="not whole stages"):
        FixedPointKeyTable(table[:, :100], size)


def test_an_unknown_key_table_dtype_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_KVCODECS_KEY_TABLE", "bfloat16")
    with pytest.raises(ValueError, match=r"HF_KVCODECS_KEY_TABLE='bfloat16' is not a key table dtype; use one of"):
        coded_attention(*op_arguments(make_problem(rope=True)))


@pytest.mark.parametrize("keys", ["per-head", "per-head-dim-32", "joint", "conditional"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_given_keys_match_float64_within_pytorch_error(keys, dtype):
    """Values coded given the keys (``value_predictor``): the op's reference adds the prediction from
    attention-weighted sums of the coded keys, the Triton kernel from every source key head's codes; both against
    float64 decode-predict-then-attend. On CPU, keys per head at head_dim 64 and conditional keys take the compiled
    loop that forms the key sums while rebuilding the keys; joint keys and head_dim 32 its histogram of the key codes."""
    dim = 32 if keys == "per-head-dim-32" else 64
    assert fuses_value_prediction(keys == "conditional", 1 if keys == "joint" else 3, dim, 3) == (
        keys in ("per-head", "conditional"))
    shape = dict(kv_heads=3, group_count=3, tokens=75, dim=dim)
    problem = make_problem(rope=True, joint=True if keys == "joint" else "values", conditional=keys == "conditional",
                           **shape)
    add_exact_tokens(problem)
    width = 3 * dim
    generator = torch.Generator().manual_seed(5)
    problem["value_predictor"] = torch.randn(width + 1, width, generator=generator) / width**0.5
    problem["query"] = problem["query"].to(dtype)
    truth, truth_lse = dequantize_then_attend(problem, torch.float64)
    plain, _ = dequantize_then_attend(problem, dtype)
    pytorch_error = (plain - truth).abs().max().item()
    args = op_arguments(problem) + list(problem["exact"]) + [None, None, problem["value_predictor"]]
    triton_small_grid = functools.partial(coded_attention_triton, block_n=16, tokens_per_split=32,
                                          value_predictor=problem["value_predictor"])
    for name, implementation in [("reference", lambda: ops._reference(*args)), ("op", lambda: coded_attention(*args)),
                                 ("triton", lambda: ops._joined(triton_small_grid, args)), ("op-on-meta", None)]:
        if implementation is None:
            meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
            out, lse = coded_attention(*meta)
            assert out.shape == truth.shape and lse.shape == truth_lse.shape
            continue
        out, lse = implementation()
        error = (out.double() - truth).abs().max().item()
        assert error <= 2 * pytorch_error + 1e-5, (name, error, pytorch_error)
        assert torch.allclose(lse.double(), truth_lse, atol=1e-4), name
    # without the prediction the same operands give a clearly different output: the term is really added
    without, _ = coded_attention(*args[:-1])
    assert (without.double() - truth).abs().max() > 100 * (2 * pytorch_error + 1e-5)
    torch.library.opcheck(ops.coded_attention, grouped(args), test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match=r"value_predictor must be \[Hkv\*D \+ 1, Hkv\*D\]"):
        ops._reference(*(args[:-1] + [problem["value_predictor"][:-1]]))
    with pytest.raises(ValueError, match=r"value_predictor must be \[Hkv\*D \+ 1, Hkv\*D\]"):
        reference.fold_value_prediction(problem["value_predictor"][:-1], *problem["key_codec"])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("conditional", [True, False], ids=["conditional-keys", "keys-per-head"])
def test_values_given_keys_fuse_the_prediction_into_the_key_loop_across_tiles(threads, conditional):
    """The compiled CPU loop for conditional keys, and for keys per head, forms the prediction's weighted key sums
    tile by tile (each tile exponentiated against its own peak, then rescaled to the row's): more than one tile, a
    tile that a padding mask hides entirely, a row hidden entirely (coded and exact tokens) and two queries per step,
    against float64."""
    if native_ops() is None:
        pytest.skip(f"compiled CPU loops unavailable: {build_error()}")
    problem = make_problem(rope=True, joint="values", conditional=conditional, kv_heads=3, group_count=3, tokens=2200,
                           query_length=2, padded=False)
    add_exact_tokens(problem)
    mask = torch.zeros(2, 2, 2200)
    mask[0, :, :1300] = -math.inf  # the first of the two 1104-token tiles entirely, the second partly
    mask[1, 1] = -math.inf  # the second query of the second row sees nothing coded ...
    problem["mask"] = mask
    problem["exact"][2][1, 1] = -math.inf  # ... and nothing exact
    width = 3 * 64
    problem["value_predictor"] = torch.randn(width + 1, width, generator=torch.Generator().manual_seed(5)) / width**0.5
    truth, truth_lse = dequantize_then_attend(problem, torch.float64)
    plain, _ = dequantize_then_attend(problem, torch.float32)
    visible = torch.ones_like(truth, dtype=torch.bool)
    visible[1, :, 1] = False
    pytorch_error = (plain - truth)[visible].abs().max().item()
    args = op_arguments(problem) + list(problem["exact"]) + [None, None, problem["value_predictor"]]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = coded_attention_cpu(*args)
    finally:
        torch.set_num_threads(previous)
    assert torch.isfinite(out).all()
    error = (out.double() - truth)[visible].abs().max().item()
    assert error <= 2 * pytorch_error + 1e-5, (error, pytorch_error)
    torch.testing.assert_close(lse.double()[visible[..., 0]], truth_lse[visible[..., 0]], rtol=0, atol=1e-4)
    reference_out, _ = ops._reference(*args)
    torch.testing.assert_close(out[1, :, 1], reference_out[1, :, 1])  # a row that sees nothing: as the reference


@pytest.mark.parametrize("kv_heads,group_count", [(2, 1), (3, 1), (2, 2), (1, 5), (1, 7), (2, 4)],
                         ids=["2-rows", "3-rows", "4-rows", "5-rows", "7-rows", "8-rows"])
def test_fused_key_sums_cover_every_row_count(kv_heads, group_count):
    """The fused loop sums the keys for several query rows at once (blocks of 6 with AVX-512, else 4): row counts
    that leave each remainder of a block, keys per head and values given the keys, against float64."""
    if native_ops() is None:
        pytest.skip(f"compiled CPU loops unavailable: {build_error()}")
    problem = make_problem(rope=True, joint="values", kv_heads=kv_heads, group_count=group_count, tokens=90)
    add_exact_tokens(problem)
    width = kv_heads * 64
    problem["value_predictor"] = torch.randn(width + 1, width, generator=torch.Generator().manual_seed(7)) / width**0.5
    truth, _ = dequantize_then_attend(problem, torch.float64)
    plain, _ = dequantize_then_attend(problem, torch.float32)
    args = op_arguments(problem) + list(problem["exact"]) + [None, None, problem["value_predictor"]]
    out, _ = coded_attention_cpu(*args)
    error = (out.double() - truth).abs().max().item()
    assert error <= 2 * (plain - truth).abs().max().item() + 1e-5, error
    without, _ = coded_attention_cpu(*args[:-1])  # the prediction is really added, for every row
    assert ((without.double() - truth).abs().amax(dim=-1) > 10 * (error + 1e-6)).all()


def test_triton_folds_a_value_predictor_once_per_predictor_and_key_operands():
    from hf_kvcodecs.kernels.triton_attention import _folded_prediction

    problem = make_problem(kv_heads=2, dim=32, conditional=True)
    predictor = torch.randn(65, 64, generator=torch.Generator().manual_seed(1))
    first = _folded_prediction(predictor, problem["key_codec"])
    assert _folded_prediction(predictor, problem["key_codec"]) is first  # the next step reuses it
    expected = reference.fold_value_prediction(predictor, *problem["key_codec"])
    for got, want in zip(first, expected):
        torch.testing.assert_close(got.to(want.dtype), want)
    other_keys = tuple(t.clone() for t in problem["key_codec"])
    assert _folded_prediction(predictor, other_keys) is not first  # other key operands (another rate): refolded
    refolded = _folded_prediction(predictor, problem["key_codec"])
    predictor.mul_(2)  # changed in place: never served stale
    changed = _folded_prediction(predictor, problem["key_codec"])
    assert changed is not refolded
    torch.testing.assert_close(changed[3], 2 * refolded[3])  # the folded synthesis is linear in the predictor


def test_conditional_keys_need_positions():
    problem = make_problem(conditional=True, rope=False)
    with pytest.raises(ValueError, match="coded before RoPE"):
        reference.coded_attention_reference(*arguments(problem))
    with pytest.raises(ValueError, match="coded before RoPE"):
        coded_attention_triton(*arguments(problem))


@pytest.mark.parametrize("conditional", [True, False], ids=["conditional-keys", "per-head-keys"])
@pytest.mark.parametrize("kind", ["key", "value"])
def test_codebooks_with_other_stage_counts_than_the_codes_are_refused(conditional, kind):
    """Codes index one codebook per stage: codebooks of another rate would be read at the wrong offsets (the Triton
    kernel steps through conditional keys' per-head codebooks by the codes' stage count). Every implementation says
    so instead."""
    problem = make_problem(conditional=conditional, rope=True, batch=1, tokens=20)
    mean, synthesis, codebooks, groups = problem[f"{kind}_codec"]
    stage_axis = codebooks.ndim - 3
    problem[f"{kind}_codec"] = (mean, synthesis, torch.cat([codebooks, codebooks.narrow(stage_axis, 0, 2)], stage_axis),
                                torch.cat([groups, groups.narrow(-1, 0, 2)], -1))
    args = arguments(problem)
    for _name, implementation in [("reference", lambda: reference.coded_attention_reference(*args)),
                                 ("cpu", lambda: coded_attention_cpu(*op_arguments(problem))),
                                 ("triton", lambda: coded_attention_triton(*args)),
                                 ("op", lambda: coded_attention(*op_arguments(problem)))]:
        with pytest.raises(ValueError, match=f"{kind}_codebooks have .* stages but the {kind} codes have"):
            implementation()


@pytest.mark.parametrize("rope", [True, False], ids=["keys-pre-rope", "keys-post-rope"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], SHAPES[6]], ids=["gqa3", "queries3", "joint-values"])
@pytest.mark.parametrize("exact_dtype", [torch.float32, torch.bfloat16])
def test_exact_tokens_join_the_coded_attention_in_one_softmax(shape, rope, exact_dtype):
    """With the cache's exact tokens (sinks, window) passed in, every implementation returns attention over coded and
    exact tokens together: the CPU one with a single softmax, the others by a log-sum-exp merge."""
    problem = make_problem(rope=rope, **shape)
    add_exact_tokens(problem, exact_dtype)
    truth, truth_lse = dequantize_then_attend(problem, torch.float64)
    assert_every_op_implementation_matches(op_arguments(problem) + list(problem["exact"]), truth, truth_lse)


@pytest.mark.parametrize("rope", [True, False], ids=["keys-pre-rope", "keys-post-rope"])
def test_scale_level_indices_give_the_same_attention_as_scale_values(rope):
    """The cache passes 8-bit scales as level indices plus a table; every implementation must treat them exactly as
    the looked-up values (the compiled loops look them up per token, the others convert first)."""
    problem = make_problem(rope=rope, **SHAPES[6])
    generator = torch.Generator().manual_seed(3)
    kv_heads = problem["key_scales"].shape[1]
    levels = {name: torch.rand(kv_heads, 256, generator=generator) + 0.5 for name in ("key", "value")}
    index = {name: torch.randint(0, 256, problem[f"{name}_scales"].shape, generator=generator, dtype=torch.uint8)
             for name in ("key", "value")}
    by_value = op_arguments(problem)
    by_value[2], by_value[4] = (reference.scale_values_from_levels(levels[n], index[n]) for n in ("key", "value"))
    by_index = op_arguments(problem)
    by_index[2], by_index[4] = index["key"], index["value"]
    by_index += [None, None, None, levels["key"], levels["value"]]
    for name, run in {"cpu-native": cpu_with("auto"), "cpu-pytorch": cpu_with("pytorch")}.items():
        expected = run(*(by_value[:13] + by_value[16:]))
        got = run(*(by_index[:13] + by_index[16:]))
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), name
    assert torch.equal(ops._reference(*by_index)[0], ops._reference(*by_value)[0])
    torch.library.opcheck(ops.coded_attention, grouped(by_index), test_utils=("test_schema", "test_faketensor"))


def test_fully_masked_rows_give_zero_output_and_minus_infinite_lse():
    problem = make_problem(rope=True)
    problem["mask"][1] = -math.inf
    for name, implementation in implementations().items():
        out, lse = implementation(*arguments(problem))
        assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1])), name
        assert torch.isfinite(out[0]).all() and torch.isfinite(lse[0]).all(), name


def test_lookup_and_reconstruction_paths_agree_for_long_query_blocks():
    problem = make_problem(rope=False, group_count=2, query_length=40, tokens=45, padded=False)  # M = 80 > 64
    decode_sized = reference.coded_attention_reference(*arguments(make_problem(rope=False)))
    assert decode_sized[0].shape[2] == 1
    out, _ = reference.coded_attention_reference(*arguments(problem))
    truth, _ = dequantize_then_attend(problem, torch.float64)
    assert (out.double() - truth).abs().max() < 1e-5


def test_cpu_key_table_is_a_prefix_shared_with_higher_rates():
    problem = make_problem(rope=True, batch=1, padded=False)
    mean, synthesis, codebooks, groups = problem["key_codec"]
    full_table = folded_key_table(synthesis, torch.cat([codebooks, codebooks[:2]]), torch.cat([groups, groups[:2]]))
    args = list(arguments(problem))
    with_table = coded_attention_cpu(*(args[:13] + [full_table, None, None] + args[13:]))
    without = coded_attention_cpu(*(args[:13] + [None, None, None] + args[13:]))
    assert torch.allclose(with_table[0], without[0], atol=1e-6)


def test_op_dispatches_to_cpu_implementation_and_has_meta_shapes(monkeypatch):
    problem = make_problem(rope=True)
    assert backend_for("cpu") in ("cpu-native", "cpu") and backend_for("cuda") in ("triton", "reference")
    out, lse = coded_attention(*op_arguments(problem))
    expected, _ = coded_attention_cpu(*op_arguments(problem))
    assert torch.equal(out, expected)
    monkeypatch.setenv("HF_KVCODECS_KERNELS", "reference")
    assert backend_for("cpu") == "reference"
    reference_out, _ = coded_attention(*op_arguments(problem))
    assert torch.allclose(reference_out, expected, atol=1e-5)
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in op_arguments(problem)]
    meta_out, meta_lse = coded_attention(*meta)
    assert meta_out.shape == out.shape and meta_lse.shape == lse.shape and meta_out.device.type == "meta"
    torch.library.opcheck(ops.coded_attention, grouped(op_arguments(problem)), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dim,stages", [(64, 6), (128, 3)])
def test_encoder_kernel_matches_reference(dim, stages):
    generator = torch.Generator().manual_seed(3)
    z = torch.randn(45, dim, generator=generator)
    codebooks = torch.randn(stages, 16, 8, generator=generator)
    groups = torch.tensor([0, 1, 0, 2, dim // 8 - 1, 1][:stages])
    expected = reference.residual_encode_reference(z, codebooks, groups)
    got = residual_encode_triton(z, codebooks, groups)
    # greedy stages: a near-tie decided differently would change later stages too, so compare whole rows
    assert (got == expected).all(dim=1).float().mean() >= 0.97
    on_cpu = residual_encode(z, codebooks, groups)  # the compiled loop at beam width 1, or the reference
    assert (on_cpu == expected).all(dim=1).float().mean() >= 0.97
    meta = residual_encode(z.to("meta"), codebooks.to("meta"), groups.to("meta"))
    assert meta.shape == expected.shape and meta.dtype == torch.uint8


def _coding_error(z, codebooks, groups, codes):
    residual = z.reshape(z.shape[0], -1, codebooks.shape[2]).clone()
    for stage, group in enumerate(groups.tolist()):
        residual[:, group] -= codebooks[stage][codes[:, stage].long()]
    return residual.pow(2).sum((1, 2))


def test_beam_search_finds_the_exhaustive_optimum_when_the_beam_holds_every_path():
    generator = torch.Generator().manual_seed(5)
    z = torch.randn(300, 16, generator=generator)
    codebooks = torch.randn(3, 4, 8, generator=generator)
    groups = torch.tensor([1, 0, 1])  # group 1 has two stages: 16 paths; group 0 one stage
    codes = reference.residual_encode_beam_reference(z, codebooks, groups, beam_width=16)
    paths = torch.cartesian_prod(torch.arange(4), torch.arange(4))  # (stage 0 word, stage 2 word)
    decoded = codebooks[0][paths[:, 0]] + codebooks[2][paths[:, 1]]
    optimum = torch.cdist(z[:, 8:], decoded).argmin(dim=1)
    assert torch.equal(codes[:, [0, 2]].long(), paths[optimum])
    assert torch.equal(codes[:, 1].long(), torch.cdist(z[:, :8], codebooks[1]).argmin(dim=1))
    greedy = reference.residual_encode_reference(z, codebooks, groups)
    assert torch.equal(reference.residual_encode_beam_reference(z, codebooks, groups, beam_width=1), greedy)
    optimal_error, greedy_error = (_coding_error(z, codebooks, groups, c) for c in (codes, greedy))
    assert torch.all(optimal_error <= greedy_error + 1e-5) and optimal_error.sum() < greedy_error.sum()


# 52 at 8 beams: the beam fills on codewords 0-7, then two 16-codeword SIMD blocks, then a scalar tail
# 16 beams: more than one register of lanes on an AVX2 build, so the ranked list is filled without a bound there;
# 6 codewords: fewer than a register of lanes, no bound either, and more beams than candidates at the first stage
@pytest.mark.parametrize("beam_width,size", [(1, 32), (3, 32), (8, 32), (8, 52), (16, 40), (8, 6)])
def test_compiled_beam_encoder_matches_reference(beam_width, size):
    generator = torch.Generator().manual_seed(6)
    z = torch.randn(257, 64, generator=generator) * torch.linspace(2, 0.2, 64)
    codebooks = torch.randn(9, size, 8, generator=generator) * 0.7
    groups = torch.tensor([0, 0, 1, 0, 2, 1, 3, 7, 0])
    expected = reference.residual_encode_beam_reference(z, codebooks, groups, beam_width)
    got = residual_encode(z, codebooks, groups, beam_width)  # compiled loop when it builds, else the reference
    assert (got == expected).all(dim=1).float().mean() >= 0.97  # near-ties may go either way
    got_error, expected_error = (_coding_error(z, codebooks, groups, c).sum() for c in (got, expected))
    assert abs(got_error - expected_error) <= 1e-3 * expected_error
    with pytest.raises(ValueError, match="beam_width must be between 1"):
        residual_encode(z, codebooks, groups, 0)
    torch.library.opcheck(ops.residual_encode, (z, codebooks, groups, beam_width), test_utils=("test_schema", "test_faketensor"))


@needs_compiler
@pytest.mark.parametrize("beam_width", [1, 2, 8, 16])
def test_compiled_beam_encoder_breaks_ties_toward_the_first_codeword(beam_width):
    # Every codeword appears twice (k and k + 24): equal errors, bit for bit. The search must keep the first of each
    # pair, whichever part of it ranks the candidates (the bounded ranked list, the one past a register of lanes,
    # the last stage's running least error with its tail beyond whole registers).
    generator = torch.Generator().manual_seed(11)
    z = torch.randn(200, 32, generator=generator)
    half = torch.randn(5, 24, 8, generator=generator)
    codebooks = torch.cat([half, half], dim=1)
    groups = torch.tensor([0, 1, 0, 2, 3])
    codes = residual_encode(z, codebooks, groups, beam_width)
    assert int(codes.max()) < 24
    if beam_width == 1:  # (a beam spends slots on the copies, so wider searches differ from those over `half`)
        assert torch.equal(codes, residual_encode(z, half, groups, beam_width))


@needs_compiler
@pytest.mark.parametrize("beam_width", [1, 8, 16])
def test_compiled_beam_encoder_gives_real_codes_for_non_finite_input(beam_width):
    # NaN or infinite keys/values make every error of a row non-finite: the search must still pick real codewords
    # (the codes are meaningless, but they must index the codebooks) and leave the other rows' codes as they were.
    generator = torch.Generator().manual_seed(12)
    z = torch.randn(40, 32, generator=generator)
    codebooks = torch.randn(5, 32, 8, generator=generator)
    groups = torch.tensor([0, 1, 0, 2, 3])
    clean = residual_encode(z, codebooks, groups, beam_width)
    z[3, :] = float("nan")
    z[7, 8:16] = float("inf")
    codes = residual_encode(z, codebooks, groups, beam_width)
    assert int(codes.max()) < 32
    finite_rows = torch.ones(40, dtype=torch.bool)
    finite_rows[[3, 7]] = False
    assert torch.equal(codes[finite_rows], clean[finite_rows])


@pytest.mark.parametrize("beam_width,size", [(1, 16), (3, 16), (8, 32), (4, 2)])
def test_triton_beam_encoder_matches_reference(beam_width, size):
    generator = torch.Generator().manual_seed(9)
    z = torch.randn(24, 32, generator=generator) * torch.linspace(2, 0.3, 32)
    codebooks = torch.randn(6, size, 8, generator=generator) * 0.7
    groups = torch.tensor([2, 0, 2, 1, 0, 2])  # interleaved: the kernel visits each group's stages together
    expected = reference.residual_encode_beam_reference(z, codebooks, groups, beam_width)
    got = residual_encode_beam_triton(z, codebooks, groups, beam_width)
    assert (got == expected).all(dim=1).float().mean() >= 0.95  # near-ties may go either way
    got_error, expected_error = (_coding_error(z, codebooks, groups, c).sum() for c in (got, expected))
    assert abs(got_error - expected_error) <= 1e-3 * expected_error


@needs_compiler
def test_compiled_beam_encoder_is_used_on_cpu(monkeypatch):
    assert native_ops() is not None, build_error()
    generator = torch.Generator().manual_seed(8)
    z, codebooks, groups = torch.randn(40, 16, generator=generator), torch.randn(2, 8, 8, generator=generator), torch.tensor([0, 1])
    calls = []
    monkeypatch.setattr(reference, "residual_encode_beam_reference", lambda *args: calls.append(args) or torch.zeros(40, 2, dtype=torch.uint8))
    residual_encode(z, codebooks, groups, 4)
    assert not calls
    monkeypatch.setenv("HF_KVCODECS_KERNELS", "reference")
    residual_encode(z, codebooks, groups, 4)
    assert len(calls) == 1


def test_encoder_picks_the_nearest_codeword_per_stage():
    generator = torch.Generator().manual_seed(4)
    z = torch.randn(200, 16, generator=generator)
    codebooks = torch.randn(1, 32, 8, generator=generator)
    codes = reference.residual_encode_reference(z, codebooks, torch.tensor([1]))
    distances = torch.cdist(z[:, 8:], codebooks[0])
    assert torch.equal(codes[:, 0].long(), distances.argmin(dim=1))


@pytest.mark.parametrize("rope", [True, False])
def test_cpu_chunking_does_not_change_results(monkeypatch, rope):
    from hf_kvcodecs.kernels import cpu

    args = list(arguments(make_problem(rope=rope, tokens=70)))
    whole = coded_attention_cpu(*(args[:13] + [None, None, None] + args[13:]))
    monkeypatch.setattr(cpu, "CHUNK_TOKENS", 16)
    chunked = coded_attention_cpu(*(args[:13] + [None, None, None] + args[13:]))
    assert torch.allclose(whole[0], chunked[0], atol=1e-6) and torch.allclose(whole[1], chunked[1], atol=1e-6)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 3, 5, 9, 17])
@pytest.mark.parametrize("shared_codes", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_value_sums_match_scatter_add(rows, shared_codes, threads):
    """The compiled loops pad query rows to SIMD widths, split stages across threads and read only the coded
    columns of a wider probability row; every row count (padding 1 -> 4, 5 -> 8, 9 -> 12 or 16, 17 -> 32; two stages
    per pass where the bins fit, one for the widest rows) and thread split must give the float64 scatter-add
    histogram times the codebooks, placed in each stage's group."""
    ops_native = native_ops()
    assert ops_native is not None, build_error()
    generator = torch.Generator().manual_seed(rows)
    batch, heads, tokens, stages, size, group_dim, groups = 2, 3, 301, 7, 16, 4, 3
    probabilities = torch.rand(batch, heads, rows, tokens + 5, generator=generator)  # 5 exact tokens after the coded
    codes = torch.randint(0, size, (batch, 1 if shared_codes else heads, tokens, stages), generator=generator)
    scales = 0.5 + torch.rand(batch, heads, tokens, generator=generator)
    codebooks = torch.randn(stages, size, group_dim, generator=generator)
    stage_groups = torch.tensor([0, 2, 0, 1, 2, 2, 0])
    weights = probabilities[..., :tokens] * scales[:, :, None, :]
    bins = (codes.expand(batch, heads, tokens, stages) + torch.arange(stages) * size)  # [B, H, N, S]
    histogram = torch.zeros(batch, heads, rows, stages * size, dtype=torch.float64)
    index = bins.reshape(batch, heads, 1, tokens * stages).expand(batch, heads, rows, -1)
    source = weights.double()[..., None].expand(-1, -1, -1, -1, stages).reshape(batch, heads, rows, -1)
    histogram.scatter_add_(-1, index, source)
    per_stage = torch.einsum("bhmsk,skg->bhmsg", histogram.reshape(batch, heads, rows, stages, size), codebooks.double())
    expected = torch.zeros(batch, heads, rows, groups, group_dim, dtype=torch.float64)
    expected.index_add_(3, stage_groups, per_stage)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        z, weight_sum = ops_native.value_transform_sums(probabilities, codes.to(torch.uint8).contiguous(), scales,
                                                        None, codebooks, stage_groups, groups * group_dim)
        # 8-bit scales: level indices looked up per token give the same sums as their values
        levels = torch.rand(heads, 256, generator=generator) + 0.5
        index = torch.randint(0, 256, (batch, heads, tokens), generator=generator, dtype=torch.uint8)
        by_index = ops_native.value_transform_sums(probabilities, codes.to(torch.uint8).contiguous(), index, levels,
                                                   codebooks, stage_groups, groups * group_dim)
        by_value = ops_native.value_transform_sums(probabilities, codes.to(torch.uint8).contiguous(),
                                                   reference.scale_values_from_levels(levels, index), None, codebooks,
                                                   stage_groups, groups * group_dim)
    finally:
        torch.set_num_threads(previous)
    assert z.shape == (batch, heads, rows, groups * group_dim)
    # fp32 sums of ~300 terms of size ~1 against float64: a few ulps of the largest entry
    torch.testing.assert_close(z.double(), expected.reshape(z.shape), rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    torch.testing.assert_close(weight_sum.double(), weights.double().sum(-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(by_index[0], by_value[0]) and torch.equal(by_index[1], by_value[1])


@pytest.mark.parametrize("dim", [-1, 0])
def test_softmax_with_lse_matches_torch_and_drops_fully_masked_slices(dim):
    generator = torch.Generator().manual_seed(5)
    scores = 4 * torch.randn(3, 5, 40, generator=generator, dtype=torch.float64)
    scores[1, 2] = -math.inf  # a fully masked row (dim -1)
    scores[:, 3, 7] = -math.inf  # a fully masked column (dim 0)
    scores[0, 0, :10] = -math.inf  # partly masked
    probabilities, lse = reference.softmax_with_lse(scores, dim=dim)
    expected_lse = torch.logsumexp(scores, dim=dim)
    expected = torch.softmax(scores, dim=dim).nan_to_num(0.0)
    torch.testing.assert_close(probabilities, expected, rtol=1e-12, atol=1e-15)
    assert torch.equal(lse.isneginf(), expected_lse.isneginf()) and lse.isneginf().any()
    finite = ~expected_lse.isneginf()
    torch.testing.assert_close(lse[finite], expected_lse[finite], rtol=1e-12, atol=1e-12)
    masked = probabilities.sum(dim)[~finite]
    assert masked.numel() > 0 and (masked == 0).all()
