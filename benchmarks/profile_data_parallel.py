"""Where a data mesh's `jc.generate` call spends its time (GPU). Every device of `data=D` gets the same `--rows`
prompts (so each device's work is one device's work at D = 1), and every call decodes `--new-tokens` tokens
(unless `--eos-id`), under Full and Cascade (a quarter of `--length` plus 64 sinks, 4 cascades). Per policy and D:
the median wall time of `--calls` calls after one that compiles, then one more call under the JAX profiler: per
device its kernels (count, summed time), the time they run (busy) and the time the device waits inside the call
(idle: launches the host has not made yet, waits at collectives, the profiler's own cost). The prompts are random
token ids; the model defaults to the packaged SmolLM2-135M-Instruct.

    python benchmarks/profile_data_parallel.py --data 1,2,4 --out results/profile-data-parallel.json
    # one process per GPU, timed together (each waits at the barrier until 4 processes have compiled):
    for i in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$i python benchmarks/profile_data_parallel.py --data 1 --no-profile \\
        --calls 20 --barrier /tmp/barrier:4 --out results/process$i.json & done; wait
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

import decode_breakdown
import harness
import jax
import jax.numpy as jnp
import numpy as np
from jcascade.models import sharding

import jcascade as jc
from jcascade.cli.options import count


def sizes(text: str) -> list[int]:
    """--data: "1,2,4" -> [1, 2, 4], each a `count`."""
    return [count(d) for d in text.split(",")]


def barrier_spec(text: str) -> tuple[str, int]:
    """--barrier: "DIR:N" -> (DIR, N)."""
    folder, _, n = text.rpartition(":")
    if not folder or not n.isdigit() or int(n) < 1:
        raise argparse.ArgumentTypeError(f"expected DIR:N with N a positive int (e.g. /tmp/barrier:4), got {text!r}")
    return folder, int(n)


def barrier(spec: tuple[str, int], name: str) -> None:
    """Waits until N processes have reached `name` in DIR (spec (DIR, N)): each leaves a file named by its pid."""
    folder, n = spec
    here = pathlib.Path(folder) / name
    here.mkdir(parents=True, exist_ok=True)
    (here / str(os.getpid())).touch()
    while len(list(here.iterdir())) < n:
        time.sleep(0.01)


def table_row(name: str, data: int, run: dict) -> str:
    """One printed line: policy, D, call ms, then the first device's kernels, kernel, busy and idle ms and every
    device's idle ms (or why there is no profile)."""
    head = f"  {name:8s} {data:4d} {run['call_ms']:9.1f}  "
    if "devices" not in run:
        return head + run.get("profile_error", "(not profiled)")[:80]
    first = next(iter(run["devices"].values()))
    return head + (
        f"{first['kernels']:8d} {first['kernel_ms']:9.1f} {first['busy_ms']:8.1f} {first['idle_ms']:8.1f}  "
        + " ".join(f"{d['idle_ms']:.0f}" for d in run["devices"].values())
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory or .gguf file (default: SmolLM2-135M-Instruct from PyPI)")
    p.add_argument("--length", type=count, default=4096, help="prompt length (e.g. 4K; rows are 0-199 tokens shorter)")
    p.add_argument("--rows", type=count, default=8, help="rows per device per call")
    p.add_argument("--new-tokens", type=count, default=48)
    p.add_argument(
        "--eos-id",
        type=int,
        help="stop rows at this token id, as evaluations do: the decode loop's "
        "condition then reduces over the devices at every step, and calls may decode fewer steps "
        "(default: none, every call decodes --new-tokens)",
    )
    p.add_argument("--policies", default="full,cascade", help="full and/or cascade (a quarter of --length)")
    p.add_argument("--data", type=sizes, default="1,2,4", help="comma-separated data-axis sizes")
    p.add_argument("--calls", type=count, default=5, help="timed calls per policy and mesh")
    p.add_argument("--no-profile", action="store_true", help="time only")
    p.add_argument(
        "--barrier",
        type=barrier_spec,
        metavar="DIR:N",
        help="time together with N processes (see above); DIR new or empty for each run",
    )
    p.add_argument("--out", default=None)
    a = p.parse_args()
    policies = dict(full=jc.Full(), cascade=jc.Cascade(cache_size=a.length // 4, sinks=64, num_cascades=4))
    names = a.policies.split(",")
    if unknown := set(names) - set(policies):
        raise SystemExit(f"--policies: expected full and/or cascade, got {sorted(unknown)}")
    if max(a.data) > jax.device_count():
        raise SystemExit(f"--data: {max(a.data)} devices asked for, {jax.device_count()} present")
    path = pathlib.Path(a.model) if a.model else jc.models.fetch(jc.models.SMOLLM2_135M_INSTRUCT)
    rng = np.random.default_rng(0)
    vocab = min(40000, jc.models.read_config(path).vocab_size)  # ordinary ids (as docs/results' runs drew)
    prompts = rng.integers(100, vocab, size=(a.rows, a.length)).astype(np.int32)
    lengths = a.length - rng.integers(0, 200, size=a.rows).astype(np.int32)
    result = dict(
        benchmark="profile_data_parallel",
        model=path.name,
        length=a.length,
        rows_per_device=a.rows,
        new_tokens=a.new_tokens,
        eos_id=a.eos_id,
        calls=a.calls,
        runs={},
    )
    rows = []
    for name in names:
        for data in a.data:
            model = jc.load_pretrained(path, mesh=sharding.device_mesh((data, 1), batched=True))
            tokens, lens = jnp.asarray(np.tile(prompts, (data, 1))), jnp.asarray(np.tile(lengths, data))

            def call(model=model, tokens=tokens, lens=lens, policy=policies[name]):
                return jc.generate(model, tokens, policy, max_new_tokens=a.new_tokens, lengths=lens, eos_id=a.eos_id)

            first = np.asarray(call())  # compiles
            if a.barrier:
                barrier(a.barrier, f"{name}-{data}")
            timing = harness.time_it(call, warmup=0, repeats=a.calls)
            run = result["runs"][f"{name} data={data}"] = dict(
                call_ms=timing.median * 1e3,
                times_ms=[t * 1e3 for t in timing.seconds],
                outputs_equal_across_devices=bool((first.reshape(data, a.rows, -1) == first[: a.rows]).all()),
            )
            if not a.no_profile:
                with tempfile.TemporaryDirectory() as trace_dir:
                    with jax.profiler.trace(trace_dir):
                        jax.block_until_ready(call())
                    try:
                        run["devices"] = decode_breakdown.device_activity(trace_dir)
                    except ValueError as e:  # no GPU kernels (e.g. on the CPU)
                        run["profile_error"] = str(e)
            rows.append(table_row(name, data, run))
            print(rows[-1], flush=True)
            del model
            if a.out:  # after each run: a run stopped later keeps what it measured
                harness.write_json(a.out, result)
    print(
        f"\npolicy, data, call ms (median of {a.calls}), first device under the profiler: kernels, kernel ms, "
        f"busy ms, idle ms; every device's idle ms ({path.name}, {a.rows} rows x {a.length} per device, "
        f"{a.new_tokens} new tokens)"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
