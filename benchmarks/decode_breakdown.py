"""Where a decode step's or a prefill segment's GPU time goes, for `bench_model.py --profile-step`: the kernels of
one step recorded by the JAX profiler, summed by kind, per step and per layer. Given the step's wall time (timed
without the profiler), the time between and around the kernels (launch gaps, host waits) is the step minus the sum
of the kernels. `device_activity` says, per GPU, how long its kernels run and how long it waits between them
(profile_data_parallel.py).
"""

from __future__ import annotations

import pathlib

# (kind, substrings of a kernel's name); the longest match wins, the rest are XLA's own fusions
KINDS = (
    ("attention: chunk kernels (Triton: attention, scores)", ("jcascade_chunk",)),
    ("attention: chunk kernels (Mosaic GPU: attention, scores)", ("mosaic_gpu",)),
    ("attention: split-K decode kernel", ("jcascade_decode",)),
    ("attention: merge + scores (finish kernel)", ("jcascade_decode_finish",)),
    ("cache: one-token insertion kernel", ("jcascade_insert_one",)),
    ("matrix products (cuBLAS)", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas")),
    (
        "collectives (NCCL, XLA's all-reduce)",
        ("nccl", "all_reduce", "allreduce", "all-reduce", "all_gather", "allgather", "reduce_scatter", "reducescatter"),
    ),
)
OTHER = "XLA fusions (norms, residuals, score decay, the layer's slots and positions, sampling)"


def kind_of(name: str) -> str:
    matches = [(len(part), kind) for kind, parts in KINDS for part in parts if part in name.lower()]
    return max(matches)[1] if matches else OTHER


def _gpu_kernels(trace_dir: str | pathlib.Path) -> dict[str, list[tuple[str, float, float]]]:
    """{GPU plane name: [(kernel name, start ns, duration ns)] on its streams} of the newest profile under
    trace_dir, for every GPU whose streams hold any (by device number); raises ValueError where none does."""
    from jax.profiler import ProfileData

    paths = sorted(pathlib.Path(trace_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not paths:
        raise ValueError(f"no *.xplane.pb under {trace_dir}")
    found, lines = {}, []
    gpus = [p for p in ProfileData.from_file(str(paths[-1])).planes if p.name.startswith("/device:GPU")]
    for plane in sorted(gpus, key=lambda p: int(p.name.rsplit(":", 1)[-1])):
        kernels = []
        for line in plane.lines:
            lines.append(line.name)
            if line.name.startswith("Stream"):  # the kernels; "XLA Ops" / "XLA Modules" lines repeat them by op
                kernels += [(event.name, event.start_ns, event.duration_ns) for event in line.events]
        if kernels:
            found[plane.name] = kernels
    if not found:
        raise ValueError(f"the profile {paths[-1]} holds no kernels on a GPU stream (GPU lines: {lines})")
    return found


def kernels_of_trace(trace_dir: str | pathlib.Path) -> list[tuple[str, float]]:
    """(kernel name, microseconds) of every kernel on the first GPU's streams in the newest profile under trace_dir
    (on a mesh, each device runs the same program: device 0's kernels are one device's step)."""
    first = next(iter(_gpu_kernels(trace_dir).values()))
    return [(name, duration / 1e3) for name, _, duration in first]


def device_activity(trace_dir: str | pathlib.Path) -> dict[str, dict]:
    """Per GPU of the newest profile under trace_dir: its kernels (count, summed ms), the time at least one of them
    runs (busy ms: overlapping kernels count once), the span from its first kernel's start to its last one's end,
    and the idle time inside that span (span - busy: the device waits, e.g. for the host's launches, and, as
    recorded, the profiler's own cost). A GPU without kernels in the profile is left out."""
    activity = {}
    for device, kernels in _gpu_kernels(trace_dir).items():
        intervals = sorted((start, start + duration) for _, start, duration in kernels)
        busy, (run_start, run_end) = 0, intervals[0]
        for start, end in intervals[1:]:
            if start > run_end:
                busy, run_start, run_end = busy + run_end - run_start, start, end
            else:
                run_end = max(run_end, end)
        busy += run_end - run_start
        span = run_end - intervals[0][0]  # the last run of overlapping kernels ends last
        activity[device] = dict(
            kernels=len(kernels),
            kernel_ms=sum(d for _, _, d in kernels) / 1e6,
            busy_ms=busy / 1e6,
            span_ms=span / 1e6,
            idle_ms=(span - busy) / 1e6,
        )
    return activity


def breakdown(kernels: list[tuple[str, float]], layers: int, step_ms: float | None) -> dict:
    """Kernels summed by kind: launches, us per step and per layer, share of the step; the costliest XLA fusions
    (XLA's names: the optimized HLO, `XLA_FLAGS=--xla_dump_to=...`, says what each computes)."""
    kinds: dict[str, list] = {}
    for name, us in kernels:
        k = kinds.setdefault(kind_of(name), [0, 0.0])
        k[0] += 1
        k[1] += us
    total = sum(us for _, us in kinds.values())
    rows = [
        dict(kind=kind, launches=n, us_per_step=us) for kind, (n, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1])
    ]
    fusions: dict[str, list] = {}
    for name, us in kernels:
        if kind_of(name) == OTHER:
            f = fusions.setdefault(name, [0, 0.0])
            f[0] += 1
            f[1] += us
    top = [
        dict(name=name, launches=n, us_per_step=us)
        for name, (n, us) in sorted(fusions.items(), key=lambda kv: -kv[1][1])
    ]
    whole = total if step_ms is None else step_ms * 1e3
    if step_ms is not None:
        rows.append(dict(kind="between kernels (step - sum of kernels)", launches=0, us_per_step=whole - total))
    for r in rows:
        r.update(us_per_layer=r["us_per_step"] / layers, share=r["us_per_step"] / whole)
    return dict(layers=layers, kernels=len(kernels), kernel_us=total, step_us=whole, rows=rows, top_fusions=top[:12])


def table(result: dict) -> list[str]:
    lines = [
        f"{result['kernels']} kernels, {result['kernel_us']:.0f} us of kernels in a {result['step_us']:.0f} us step",
        f"   {'kind':<72} {'launches':>8} {'us/step':>8} {'us/layer':>8} {'share':>6}",
    ]
    lines += [
        f"   {r['kind']:<72} {r['launches']:>8} {r['us_per_step']:8.0f} {r['us_per_layer']:8.1f} {r['share']:6.1%}"
        for r in result["rows"]
    ]
    lines.append("   the XLA fusions taking the most time: launches, us/step, name")
    lines += [f"      {f['launches']:>5} {f['us_per_step']:8.0f}  {f['name']}" for f in result["top_fusions"]]
    return lines
