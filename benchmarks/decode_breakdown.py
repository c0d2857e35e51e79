"""Where a decode step's GPU time goes: the kernels of one step recorded by the JAX profiler
(`bench_model.py --only b --profile-step` records and prints this), summed by kind, per step and per layer.

    python benchmarks/decode_breakdown.py TRACE_DIR --step-ms 8.84 [--layers 32] [--out breakdown.json]

TRACE_DIR holds the `*.xplane.pb` that `jax.profiler.trace` wrote. --step-ms (the step's wall time, timed
without the profiler) gives the time between and around the kernels (launch gaps, host waits) as the step
minus the sum of the kernels.
"""

from __future__ import annotations

import argparse
import json
import pathlib

# (kind, substrings of a kernel's name); the longest match wins, the rest are XLA's own fusions
KINDS = (
    ("attention: split-K decode kernel", ("jcascade_decode",)),
    ("attention: merge + scores (finish kernel)", ("jcascade_decode_finish",)),
    ("cache: one-token insertion kernel", ("jcascade_insert_one",)),
    ("matrix products (cuBLAS)", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas")),
)
OTHER = "XLA fusions (norms, residuals, score decay, the layer's slots and positions, sampling)"


def kind_of(name: str) -> str:
    matches = [(len(part), kind) for kind, parts in KINDS for part in parts if part in name.lower()]
    return max(matches)[1] if matches else OTHER


def kernels_of_trace(trace_dir: str | pathlib.Path) -> tuple[list[tuple[str, float]], dict[str, dict]]:
    """(kernel name, microseconds) of every kernel on the GPU's streams in the newest profile under trace_dir, and
    what the profile says of each XLA op by name (its "XLA Ops" events' text stats: the JAX op behind a fusion)."""
    from jax.profiler import ProfileData

    paths = sorted(pathlib.Path(trace_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not paths:
        raise ValueError(f"no *.xplane.pb under {trace_dir}")
    kernels, ops, lines = [], {}, []
    for plane in ProfileData.from_file(str(paths[-1])).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            lines.append(line.name)
            if line.name.startswith("Stream"):  # the kernels; "XLA Ops" / "XLA Modules" lines repeat them by op
                kernels += [(event.name, event.duration_ns / 1e3) for event in line.events]
            elif line.name == "XLA Ops":
                for event in line.events:
                    ops.setdefault(event.name, {k: str(v)[:300] for k, v in event.stats if isinstance(v, str)})
    if not kernels:
        raise ValueError(f"the profile {paths[-1]} holds no kernels on a GPU stream (GPU lines: {lines})")
    return kernels, ops


def breakdown(kernels: list[tuple[str, float]], layers: int, step_ms: float | None, ops: dict | None = None) -> dict:
    """Kernels summed by kind: launches, us per step and per layer, share of the step; the costliest XLA fusions
    with what `ops` (from `kernels_of_trace`) says of them."""
    kinds: dict[str, list] = {}
    for name, us in kernels:
        k = kinds.setdefault(kind_of(name), [0, 0.0])
        k[0] += 1
        k[1] += us
    total = sum(us for _, us in kinds.values())
    rows = [dict(kind=kind, launches=n, us_per_step=us) for kind, (n, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1])]
    fusions: dict[str, list] = {}
    for name, us in kernels:
        if kind_of(name) == OTHER:
            f = fusions.setdefault(name, [0, 0.0])
            f[0] += 1
            f[1] += us
    top = [dict(name=name, launches=n, us_per_step=us, op=(ops or {}).get(name, {}))
           for name, (n, us) in sorted(fusions.items(), key=lambda kv: -kv[1][1])]
    whole = total if step_ms is None else step_ms * 1e3
    if step_ms is not None:
        rows.append(dict(kind="between kernels (step - sum of kernels)", launches=0, us_per_step=whole - total))
    for r in rows:
        r.update(us_per_layer=r["us_per_step"] / layers, share=r["us_per_step"] / whole)
    return dict(layers=layers, kernels=len(kernels), kernel_us=total, step_us=whole, rows=rows, top_fusions=top[:12])


def table(result: dict) -> list[str]:
    lines = [f"{result['kernels']} kernels, {result['kernel_us']:.0f} us of kernels in a {result['step_us']:.0f} us step",
             f"   {'kind':<72} {'launches':>8} {'us/step':>8} {'us/layer':>8} {'share':>6}"]
    lines += [f"   {r['kind']:<72} {r['launches']:>8} {r['us_per_step']:8.0f} {r['us_per_layer']:8.1f} {r['share']:6.1%}"
              for r in result["rows"]]
    lines.append("   the XLA fusions taking the most time: launches, us/step, name")
    for f in result["top_fusions"]:
        said = f["op"].get("tf_op") or f["op"].get("long_name") or ""
        lines.append(f"      {f['launches']:>5} {f['us_per_step']:8.0f}  {f['name'][:40]:<40} {said[:150]}")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_dir")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--step-ms", type=float, default=None, help="the step's wall time, timed without the profiler")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    try:
        kernels, ops = kernels_of_trace(a.trace_dir)
        result = breakdown(kernels, a.layers, a.step_ms, ops)
    except ValueError as e:
        p.error(str(e))
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(result, indent=2))
    print("\n".join(table(result)))


if __name__ == "__main__":
    main()
