"""GPU decode-attention benchmark: the Triton GSRQ code-reading kernel against PyTorch SDPA on a 16-bit cache.

Run on a machine with a CUDA GPU (one short run, a few minutes):

    python benchmarks/gpu_decode.py --out benchmarks/results/gpu_decode.json

For each context (8K-64K) and batch (1-16), one decode step of attention for a Llama-3-8B-shaped layer (32 query
heads, 8 KV heads, head_dim 128) is timed with CUDA events (median of repeats after warm-up), for
  * ``sdpa-fp16``: ``torch.nn.functional.scaled_dot_product_attention`` over an fp16 KV cache;
  * ``gsrq-triton``: ``hf_kvcodecs::coded_attention`` (Triton) over 2-bit GSRQ codes of the same length;
  * ``gsrq-triton-conditional``: the same codes read as keys coded conditionally across heads
    (``--key-layout conditional_heads``: each head's key rebuilt from the codes of every head up to it);
  * ``gsrq-triton-conditional-values-given-keys``: conditional keys and values coded given the keys
    (``--value-layout given_keys``: each program also adds the values' prediction from every key head's codes).
It reports the bytes each must read from HBM, the achieved bandwidth, and that bandwidth as a fraction of the device's
peak (from a table of datasheet values when the device is known, and of the copy bandwidth measured in the same run).
The codebooks are random (speed does not depend on their values); parity is checked against the reference first.

``--smoke`` runs the same code on CPU under TRITON_INTERPRET=1 with tiny shapes (for the test suite).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

# Datasheet HBM bandwidth, bytes/s (dense, per GPU).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12,
                  "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12, "A10G": 0.6e12, "L4": 0.3e12,
                  "RTX 4090": 1.008e12}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--query-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--bits", type=float, default=2.0, help="bits per KV element incl. the fp16 scale")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="write the results here as JSON (and a Markdown table beside it)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        # two KV heads: the conditional keys' second head reads the first head's codes (cross-head offsets)
        args.contexts, args.batches, args.kv_heads, args.query_heads, args.head_dim, args.repeats = [96], [1], 2, 4, 32, 1

    import torch
    import torch.nn.functional as F

    from hf_kvcodecs.kernels import reference
    from hf_kvcodecs.kernels.triton_attention import coded_attention_triton

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("No CUDA device: this benchmark needs a GPU (use --smoke to check it on CPU).", file=sys.stderr)
        return 2
    generator = torch.Generator(device="cpu").manual_seed(0)
    dim, kv_heads, query_heads = args.head_dim, args.kv_heads, args.query_heads
    group_dim, size = 8, 256
    stages = int((args.bits * dim - 16) // 8)

    def codec(count):
        mean = (0.1 * torch.randn(kv_heads, dim, generator=generator)).to(device)
        synthesis = torch.linalg.qr(torch.randn(kv_heads, dim, dim, generator=generator))[0].to(device)
        codebooks = (0.3 * torch.randn(count, size, group_dim, generator=generator)).to(device)
        groups = (torch.arange(count) % (dim // group_dim)).to(device)
        return mean, synthesis, codebooks, groups

    def conditional_codec(count):  # ConditionalHeadResidualVQ.attention_operands: pairs [source, target]
        mean = 0.1 * torch.randn(kv_heads, kv_heads, dim, generator=generator)
        synthesis = 0.5 * torch.linalg.qr(torch.randn(kv_heads, kv_heads, dim, dim, generator=generator))[0]
        later = torch.arange(kv_heads)[:, None] > torch.arange(kv_heads)[None, :]
        mean[later], synthesis[later] = 0.0, 0.0
        codebooks = 0.3 * torch.randn(kv_heads, count, size, group_dim, generator=generator)
        groups = (torch.arange(count) % (dim // group_dim)).expand(kv_heads, -1).contiguous()
        return tuple(t.to(device) for t in (mean, synthesis, codebooks, groups))

    key_codec, value_codec = codec(stages), codec(stages)
    conditional_key_codec = conditional_codec(stages)
    width = kv_heads * dim  # KeyPredictedValueVQ.predictor: [every head's keys, 1] -> every head's values
    value_predictor = (torch.randn(width + 1, width, generator=generator) / width**0.5).to(device)
    inv_freq = (1.0 / (500000 ** (torch.arange(0, dim, 2).float() / dim))).to(device)

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        if device == "cpu":
            samples = []
            for _ in range(args.repeats):
                began = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - began)
            return statistics.median(samples)
        samples = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1000)
        return statistics.median(samples)

    name = "cpu (smoke)" if device == "cpu" else torch.cuda.get_device_name()
    copy_bandwidth = None
    if device == "cuda":
        buffer = torch.empty(2**28, dtype=torch.uint8, device=device)  # 256 MiB
        copy_seconds = timed(lambda: buffer.clone())
        copy_bandwidth = 2 * buffer.numel() / copy_seconds  # read + write
        del buffer
    datasheet = next((value for key, value in PEAK_BANDWIDTH.items() if key in name), None)

    rows = []
    for batch in args.batches:
        for tokens in args.contexts:
            query = torch.randn(batch, query_heads, 1, dim, generator=generator).to(device)
            key_codes = torch.randint(0, size, (batch, kv_heads, tokens, stages), generator=generator,
                                      dtype=torch.int32).to(torch.uint8).to(device)
            value_codes = torch.randint(0, size, (batch, kv_heads, tokens, stages), generator=generator,
                                        dtype=torch.int32).to(torch.uint8).to(device)
            key_scales = (0.5 + torch.rand(batch, kv_heads, tokens, generator=generator)).half().to(device)
            value_scales = (0.5 + torch.rand(batch, kv_heads, tokens, generator=generator)).half().to(device)
            positions = torch.arange(tokens, dtype=torch.int32, device=device)[None].expand(batch, -1).contiguous()
            timings = {}
            for method, keys_codec, predictor in (
                    ("gsrq-triton", key_codec, None), ("gsrq-triton-conditional", conditional_key_codec, None),
                    ("gsrq-triton-conditional-values-given-keys", conditional_key_codec, value_predictor)):
                arguments = (query, key_codes, key_scales, value_codes, value_scales, *keys_codec, *value_codec,
                             positions, inv_freq, 1.0, None, dim**-0.5)
                if tokens <= 8192 or device == "cpu":  # parity on the first (smallest) sizes: the reference is slow
                    expected, _ = reference.coded_attention_reference(*arguments, value_predictor=predictor)
                    got, _ = coded_attention_triton(*arguments, value_predictor=predictor)
                    error = float((got - expected).abs().max())
                    if error > 1e-3:
                        raise AssertionError(f"{method} differs from the reference by {error} at B={batch} N={tokens}")
                timings[method] = timed(functools.partial(coded_attention_triton, *arguments, value_predictor=predictor))
            # what every GSRQ row must read from memory: codes, scales, positions (the conditional kernel also
            # re-reads a [D, D] pair matrix per source head and token block, mostly from L2: not counted, so its
            # bandwidth column is a lower bound on the traffic, not a comparable efficiency)
            gsrq_bytes = (key_codes.numel() + value_codes.numel() + 2 * (key_scales.numel() + value_scales.numel())
                          + 4 * positions.numel())

            keys = torch.randn(batch, kv_heads, tokens, dim, generator=generator).half().to(device)
            values = torch.randn(batch, kv_heads, tokens, dim, generator=generator).half().to(device)
            query16 = query.half()
            sdpa_seconds = timed(functools.partial(F.scaled_dot_product_attention, query16, keys, values, enable_gqa=True))
            sdpa_bytes = 2 * (keys.numel() + values.numel())
            measured = [("sdpa-fp16", sdpa_seconds, sdpa_bytes)]
            measured += [(method, seconds, gsrq_bytes) for method, seconds in timings.items()]
            for method, seconds, nbytes in measured:
                bandwidth = nbytes / seconds
                rows.append({
                    "method": method, "batch": batch, "context": tokens, "microseconds": seconds * 1e6,
                    "bytes": nbytes, "bandwidth_gb_s": bandwidth / 1e9,
                    "fraction_of_datasheet_peak": bandwidth / datasheet if datasheet else None,
                    "fraction_of_measured_copy": bandwidth / copy_bandwidth if copy_bandwidth else None,
                    "speedup_vs_sdpa": sdpa_seconds / seconds,
                })
            del keys, values, key_codes, value_codes
    results = {"device": name, "datasheet_bandwidth_gb_s": datasheet / 1e9 if datasheet else None,
               "measured_copy_bandwidth_gb_s": copy_bandwidth / 1e9 if copy_bandwidth else None,
               "shape": {"kv_heads": kv_heads, "query_heads": query_heads, "head_dim": dim, "stages": stages,
                         "bits": args.bits}, "date": time.strftime("%Y-%m-%d"), "rows": rows,
               "torch": torch.__version__}
    table = markdown(results)
    print(table)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as handle:
            handle.write(table)
    return 0


def markdown(results: dict) -> str:
    lines = [f"GPU decode attention on {results['device']} ({results['date']}, torch {results['torch']}); "
             f"shape {results['shape']}; datasheet {results['datasheet_bandwidth_gb_s']} GB/s, measured copy "
             f"{results['measured_copy_bandwidth_gb_s'] and round(results['measured_copy_bandwidth_gb_s'])} GB/s. "
             "MB read: what each method must read (GSRQ: codes, scales, positions; the conditional-key rows also "
             "re-read their pair matrices per token block, the given-keys row its prediction matrices: not "
             "counted).", "",
             "| method | batch | context | µs | MB read | GB/s | of datasheet peak | of measured copy | × SDPA |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        fraction = lambda v: "n/a" if v is None else f"{v:.0%}"  # noqa: E731
        lines.append(f"| {row['method']} | {row['batch']} | {row['context']} | {row['microseconds']:.0f} | "
                     f"{row['bytes'] / 1e6:.1f} | {row['bandwidth_gb_s']:.0f} | {fraction(row['fraction_of_datasheet_peak'])} | "
                     f"{fraction(row['fraction_of_measured_copy'])} | {row['speedup_vs_sdpa']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
