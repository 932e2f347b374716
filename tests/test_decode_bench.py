"""The decode benchmark's measuring tools and the GPU benchmark script (smoke run on CPU, Triton interpreter)."""

import importlib.util
import json
from pathlib import Path

import torch

from hf_kvcodecs.bench.decode import _peak_transient_bytes

ROOT = Path(__file__).resolve().parents[1]


def test_transient_memory_sees_a_temporary_allocation():
    def allocate():
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched, then freed
        return float(block[-1])

    assert _peak_transient_bytes(allocate) >= 56 * 2**20
    assert _peak_transient_bytes(lambda: sum(range(1000))) < 8 * 2**20


def test_gpu_benchmark_script_runs_its_parity_check_and_writes_results(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_decode", ROOT / "benchmarks" / "gpu_decode.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "gpu.json"
    assert script.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert {row["method"] for row in results["rows"]} == {"sdpa-fp16", "gsrq-triton"}
    gsrq = next(row for row in results["rows"] if row["method"] == "gsrq-triton")
    sdpa = next(row for row in results["rows"] if row["method"] == "sdpa-fp16")
    assert gsrq["bytes"] < sdpa["bytes"] / 3  # codes + scales + positions vs fp16 keys and values
    assert (tmp_path / "gpu.md").read_text().startswith("GPU decode attention")
