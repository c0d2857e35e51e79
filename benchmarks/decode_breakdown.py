"""Where a decode step's GPU time goes: reads the CSV of Nsight Compute run over one profiled step of
`bench_model.py --only b --profile-step` and sums the kernels' durations by kind, per step and per layer.

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --print-units base --csv \\
        python3 benchmarks/bench_model.py --only b --batches 1 --profile-step > ncu.csv
    python benchmarks/decode_breakdown.py ncu.csv --step-ms 8.84 [--layers 32] [--out breakdown.json]

--step-ms (the step's wall time, timed without the profiler) gives the time between and around the kernels
(launch gaps, host waits) as step - sum of kernels.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import pathlib
import sys

# (kind, substrings of a kernel's name); the first match wins, the rest are XLA's own fusions
KINDS = (
    ("attention: split-K decode kernel", ("jcascade_decode",)),
    ("attention: merge + scores (finish kernel)", ("jcascade_decode_finish",)),
    ("cache: one-token insertion kernel", ("jcascade_insert_one",)),
    ("matrix products (cuBLAS)", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas")),
)


def kind_of(name: str) -> str:
    for kind, parts in sorted(KINDS, key=lambda k: -max(len(p) for p in k[1])):  # longest name first
        if any(p in name.lower() for p in parts):
            return kind
    return "XLA fusions (norms, RoPE, cache scores and slots, residuals, sampling)"


def read_durations(text: str) -> list[tuple[str, float]]:
    """(kernel name, microseconds) of every profiled launch in an ncu --csv report."""
    start = text.find('"ID"')
    if start < 0:
        raise ValueError("no ncu CSV header (a line starting with \"ID\") in the input")
    rows = []
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value, unit = float(row["Metric Value"].replace(",", "")), row.get("Metric Unit", "")
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit)
        if scale is None:
            raise ValueError(f"unknown duration unit {unit!r}")
        rows.append((row["Kernel Name"], value * scale))
    if not rows:
        raise ValueError("the CSV holds no gpu__time_duration.sum rows")
    return rows


def breakdown(durations, layers: int, step_ms: float | None) -> dict:
    kinds: dict[str, dict] = {}
    for name, us in durations:
        k = kinds.setdefault(kind_of(name), dict(launches=0, us=0.0))
        k["launches"] += 1
        k["us"] += us
    total = sum(k["us"] for k in kinds.values())
    rows = [dict(kind=kind, launches=k["launches"], us_per_step=k["us"], us_per_layer=k["us"] / layers)
            for kind, k in sorted(kinds.items(), key=lambda kv: -kv[1]["us"])]
    if step_ms is not None:
        rows.append(dict(kind="between kernels (step - sum of kernels)", launches=0,
                         us_per_step=step_ms * 1e3 - total, us_per_layer=(step_ms * 1e3 - total) / layers))
    whole = step_ms * 1e3 if step_ms is not None else total
    for r in rows:
        r["share"] = r["us_per_step"] / whole
    return dict(layers=layers, kernels=len(durations), kernel_us=total, step_us=whole, rows=rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu --csv output ('-': standard input)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--step-ms", type=float, default=None, help="the step's wall time, timed without the profiler")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    text = sys.stdin.read() if a.csv == "-" else pathlib.Path(a.csv).read_text()
    try:
        result = breakdown(read_durations(text), a.layers, a.step_ms)
    except ValueError as e:
        p.error(str(e))
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"{result['kernels']} kernels, {result['kernel_us']:.0f} us of kernels in a {result['step_us']:.0f} us step")
    print(f"{'kind':<72} {'launches':>8} {'us/step':>8} {'us/layer':>8} {'share':>6}")
    for r in result["rows"]:
        print(f"{r['kind']:<72} {r['launches']:>8} {r['us_per_step']:8.0f} {r['us_per_layer']:8.1f} {r['share']:6.1%}")


if __name__ == "__main__":
    main()
