"""SCD codes at equal bytes per token: today's flat codes (rank r, one float16 max-abs scale per token, 4 or 8 bits per
component) against whitened codes with water-filled bits per component (hf_kvcodecs.codecs.bit_allocation).

Pre-RoPE keys and values of every layer of the default model are captured on real text (k_proj / v_proj outputs):
the PCA of each layer is fitted on CPython's pydoc topics and the codes are evaluated on Debian licence texts. For each
byte budget (a fraction of the 16-bit states) every scheme gets the same bytes per token and per layer, and the
relative squared reconstruction error ``Σ ||x - x̂||² / Σ ||x - mean||²`` is measured in the original space.

    python benchmarks/scd_code_bits.py --threads 1 --out benchmarks/results/scd_code_bits
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from hf_kvcodecs.cli.defaults import CALIBRATION_TEXT, EVALUATION_TEXT
from hf_kvcodecs.codecs import bit_allocation
from hf_kvcodecs.codecs.lowrank import CrossMoments, dequantize_codes, fit_pca_map, quantize_codes
from hf_kvcodecs.evaluation import fixed_windows
from hf_kvcodecs.models import load_model
from hf_kvcodecs.scd.model_access import prefill_with_taps
from hf_kvcodecs.text import load_corpus, tokenize_corpus

KINDS = ("keys", "values")
SCALE_BYTES = 2  # today's codes: one float16 max-abs scale per token
GAIN_BYTES = bit_allocation.GAIN_BYTES  # whitened codes with a per-token gain: one byte


def capture(model, windows, on_layer) -> None:
    for window in windows:
        prefill_with_taps(model, window[None], None, on_layer)


def schemes(quantizers: list[str]) -> list[dict]:
    found = [{"name": "flat-4", "family": "flat", "bits": 4}, {"name": "flat-8", "family": "flat", "bits": 8}]
    for quantizer in quantizers:
        for gain in (False, True):
            found.append({"name": f"wf-{quantizer}" + ("+gain" if gain else ""), "family": "whitened",
                          "quantizer": quantizer, "gain": gain})
    # ablation: the per-token gain set to the RMS of the whitened components sent instead of searched
    found.append({"name": f"wf-{quantizers[0]}+rms-gain", "family": "whitened", "quantizer": quantizers[0],
                  "gain": "rms"})
    return found


def rms_gain(codes: torch.Tensor, variances: torch.Tensor, allocation: torch.Tensor) -> torch.Tensor:
    whitened = codes[..., allocation > 0] / variances[allocation > 0].sqrt()
    rms = whitened.square().mean(-1).sqrt().clamp_min(1e-30)
    index = torch.round(torch.log2(rms) * bit_allocation.GAIN_STEPS_PER_OCTAVE) + bit_allocation.GAIN_ZERO
    return index.clamp(0, 255).to(torch.uint8)


def reconstruct(mapping, states: torch.Tensor, scheme: dict, budget: int) -> tuple[torch.Tensor, dict]:
    """States rebuilt from a code of at most ``budget`` bytes per token, and what the code used."""
    if scheme["family"] == "flat":
        bits = scheme["bits"]
        rank = min(mapping.rank, (budget - SCALE_BYTES) * 8 // bits)
        truncated = mapping.truncated(rank)
        quantized, scales = quantize_codes(truncated.encode(states), bits)
        rebuilt = truncated.decode(dequantize_codes(quantized, scales))
        return rebuilt, {"rank": rank, "bytes": math.ceil(rank * bits / 8) + SCALE_BYTES}
    side = GAIN_BYTES if scheme["gain"] else 0
    # an error in component i costs |decoder row i|² in the original space (≈ 1 for PCA with a small ridge)
    weights = mapping.decoder.double().square().sum(1)
    allocation = bit_allocation.allocate_bits(mapping.component_energy, (budget - side) * 8, weights=weights,
                                              quantizer=scheme["quantizer"])
    codes = mapping.encode(states)
    gain = rms_gain(codes, mapping.component_energy, allocation) if scheme["gain"] == "rms" else scheme["gain"]
    packed, gain = bit_allocation.encode(codes, mapping.component_energy, allocation, gain=gain,
                                         quantizer=scheme["quantizer"])
    codes = bit_allocation.decode(packed, mapping.component_energy, allocation, gain, quantizer=scheme["quantizer"])
    used = int((allocation > 0).sum())
    rebuilt = mapping.truncated(used).decode(codes[..., :used])
    histogram = torch.bincount(allocation, minlength=bit_allocation.MAX_BITS + 1).tolist()
    return rebuilt, {"rank": used, "bytes": packed.shape[-1] + side, "bits_histogram": histogram}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fit-windows", type=int, default=8, help="512-token windows of the fitting text")
    parser.add_argument("--eval-windows", type=int, default=4, help="512-token windows of the evaluation text")
    parser.add_argument("--window-tokens", type=int, default=512)
    parser.add_argument("--fractions", type=float, nargs="+", default=[1 / 32, 1 / 16, 1 / 8, 1 / 4],
                        help="byte budgets as fractions of the 16-bit states")
    parser.add_argument("--quantizers", nargs="+", default=list(bit_allocation.QUANTIZERS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/scd_code_bits"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    loaded = load_model("default")
    model, tokenizer = loaded.model, loaded.tokenizer
    fitting, evaluation = load_corpus(None, default=CALIBRATION_TEXT), load_corpus(None, default=EVALUATION_TEXT)

    moments: dict[tuple[int, str], CrossMoments] = {}

    def accumulate(layer) -> None:
        for kind in KINDS:
            states = getattr(layer, kind).float().reshape(-1, getattr(layer, kind).shape[-1])
            moments.setdefault((layer.index, kind), CrossMoments(states.shape[-1], paired=False)).update(states)

    capture(model, fixed_windows(tokenize_corpus(tokenizer, fitting), args.fit_windows, args.window_tokens),
            accumulate)
    maps = {key: fit_pca_map(value, value.input_dim) for key, value in moments.items()}
    layers = 1 + max(index for index, _ in maps)
    width = moments[(0, "keys")].input_dim

    held: dict[tuple[int, str], list[torch.Tensor]] = {}

    def keep(layer) -> None:
        for kind in KINDS:
            states = getattr(layer, kind).float()
            held.setdefault((layer.index, kind), []).append(states.reshape(-1, states.shape[-1]).clone())

    capture(model, fixed_windows(tokenize_corpus(tokenizer, evaluation), args.eval_windows, args.window_tokens), keep)
    evaluated = {key: torch.cat(value) for key, value in held.items()}
    print(f"captured and fitted {layers} layers (width {width}) in {time.perf_counter() - started:.0f} s", flush=True)

    full_bytes = width * 2  # 16-bit states per token
    budgets = sorted({max(SCALE_BYTES + 1, round(full_bytes * fraction)) for fraction in args.fractions})
    tried = schemes(args.quantizers)
    rows = []
    for (index, kind), states in sorted(evaluated.items()):
        mapping = maps[(index, kind)]
        centred = states - states.mean(0)
        energy = float(centred.square().sum())
        codes = mapping.encode(states)
        # how far the evaluation text's spectrum is from the fitted one (what the fixed per-component scales assume)
        spread = (codes.var(0) / mapping.component_energy.clamp_min(1e-30))
        for budget in budgets:
            for scheme in tried:
                clock = time.perf_counter()
                rebuilt, used = reconstruct(mapping, states, scheme, budget)
                used["seconds"] = time.perf_counter() - clock
                assert used["bytes"] <= budget, (scheme, budget, used)
                error = float((states - rebuilt).square().sum()) / energy
                rows.append({"layer": index, "kind": kind, "budget_bytes": budget, "scheme": scheme["name"],
                             "relative_error": error, **used,
                             "eval_over_fit_variance_median": float(spread.median())})
        print(f"layer {index:2d} {kind:6s} " + "  ".join(
            f"{row['scheme']}@{row['budget_bytes']}={row['relative_error']:.4f}"
            for row in rows if row["layer"] == index and row["kind"] == kind and row["budget_bytes"] == budgets[1]),
            flush=True)

    summary = []
    for budget in budgets:
        for scheme in tried:
            for kind in KINDS:
                chosen = [row for row in rows if row["budget_bytes"] == budget and row["scheme"] == scheme["name"]
                          and row["kind"] == kind]
                summary.append({"budget_bytes": budget, "fraction_of_16bit": budget / full_bytes,
                                "scheme": scheme["name"], "kind": kind,
                                "mean_relative_error": sum(r["relative_error"] for r in chosen) / len(chosen),
                                "mean_rank": sum(r["rank"] for r in chosen) / len(chosen),
                                "seconds": sum(r["seconds"] for r in chosen)})
    result = {
        "model": loaded.description, "fit_text": fitting.description, "eval_text": evaluation.description,
        "fit_tokens": args.fit_windows * args.window_tokens, "eval_tokens": args.eval_windows * args.window_tokens,
        "width": width, "layers": layers, "budgets_bytes": budgets, "schemes": tried, "threads": args.threads,
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "seconds": time.perf_counter() - started, "summary": summary, "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scd_code_bits.json").write_text(json.dumps(result, indent=1))
    (args.out / "scd_code_bits.md").write_text(markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    names = [scheme["name"] for scheme in result["schemes"]]
    width = result["width"]
    lines = [
        "# SCD codes at equal bytes: flat per-token scale vs whitened, water-filled bits",
        "",
        f"Model: {result['model']}. PCA per layer (keys and values separately, pre-RoPE, width {width}) fitted on "
        f"{result['fit_tokens']} tokens of {result['fit_text']}; errors on {result['eval_tokens']} tokens of "
        f"{result['eval_text']}.",
        "",
        "Relative squared reconstruction error `Σ||x - x̂||² / Σ||x - mean||²` in the original space, averaged over "
        f"the {result['layers']} layers; every scheme gets the same bytes per token and layer (16-bit states: "
        f"{2 * width} bytes).",
        "",
        "- `flat-b`: today's SCD code: the first r PCA components, one float16 max-abs scale per token "
        "(`quantize_codes`), b bits per component, r = (bytes − 2) · 8 / b.",
        "- `wf-Q`: whitened components, bits per component by reverse water-filling (`allocate_bits`), the unit-Gaussian "
        "quantizer Q at each width (`lloyd-max` or `uniform`), packed with no padding but the last byte; `+gain` also "
        "sends one per-token gain byte (1 of the bytes), searched per token to minimise its error; `+rms-gain` "
        "(ablation) sets that byte to the RMS of the token's whitened components instead.",
        "",
    ]
    for kind in KINDS:
        lines += [f"## {kind.capitalize()}: mean relative error (mean rank sent)", "",
                  "| bytes/token | of 16-bit | " + " | ".join(names) + " |",
                  "|---:|---:|" + "---:|" * len(names)]
        for budget in result["budgets_bytes"]:
            cells = []
            entries = {row["scheme"]: row for row in result["summary"]
                       if row["budget_bytes"] == budget and row["kind"] == kind}
            best = min(entry["mean_relative_error"] for entry in entries.values())
            for name in names:
                entry = entries[name]
                text = f"{entry['mean_relative_error']:.4f} ({entry['mean_rank']:.0f})"
                cells.append(f"**{text}**" if entry["mean_relative_error"] == best else text)
            lines.append(f"| {budget} | 1/{2 * width / budget:.0f} | " + " | ".join(cells) + " |")
        lines.append("")
    ratios = {kind: sorted(row["eval_over_fit_variance_median"] for row in result["rows"]
                           if row["kind"] == kind and row["scheme"] == names[0]
                           and row["budget_bytes"] == result["budgets_bytes"][0]) for kind in KINDS}
    lines += ["The evaluation text is louder than the fitting text: per layer, the median over components of "
              "(variance of the evaluation codes / fitted variance) has a median over layers of "
              + " and ".join(f"{values[len(values) // 2]:.2f} for {kind}" for kind, values in ratios.items())
              + ". Fixed per-component quantizers clip such tokens unless a gain rescales them.", ""]
    seconds = {name: sum(row["seconds"] for row in result["summary"] if row["scheme"] == name) for name in names}
    lines += ["Encode + decode time of all layers, budgets and both kinds (CPU, "
              f"{result['eval_tokens']} tokens each): " + ", ".join(f"{name} {value:.1f} s"
                                                                    for name, value in seconds.items()) + ".", ""]
    budget = result["budgets_bytes"][len(result["budgets_bytes"]) // 2]
    lines += [f"## Per layer at {budget} bytes/token", "",
              "| layer | " + " | ".join(f"K {name}" for name in names) + " | "
              + " | ".join(f"V {name}" for name in names) + " |",
              "|---:|" + "---:|" * (2 * len(names))]
    for layer in range(result["layers"]):
        cells = []
        for kind in KINDS:
            for name in names:
                match = [row for row in result["rows"] if row["layer"] == layer and row["kind"] == kind
                         and row["scheme"] == name and row["budget_bytes"] == budget]
                cells.append(f"{match[0]['relative_error']:.4f}")
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    lines += ["", f"Run: {result['threads']} thread(s), torch {result['torch']}, {result['seconds']:.0f} s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
