"""Where the decode attention op's time goes (GPU): the op as `bench_kernels.py d` runs it (scores and RoPE on,
a 16K + 64 cache, over the 8 layers of a stacked cache, 64 calls in one jitted loop), timed whole and without
scores or RoPE; with `--ncu`, one loop of 8 calls between cuProfilerStart/Stop for Nsight Compute, which then
lists every launch of the op with its duration.

    python benchmarks/profile_decode.py 1          # us per call: full, no_scores, no_rope (batch 1)
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python benchmarks/profile_decode.py 1 --ncu > ncu.csv
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import bench_kernels
import harness
import jax

import jcascade as jc

LAYERS = 8


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("batch", type=int)
    p.add_argument("--ncu", action="store_true", help="profile one loop of 8 calls of the full op, time nothing")
    a = p.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("profile_decode.py needs a GPU")
    calls = 8 if a.ncu else 64
    policy = jc.Cascade(cache_size=16384, sinks=64, num_cascades=4)
    rope = jc.RoPE(500000.0, jc.Llama3Scaling())
    x = bench_kernels.decode_inputs(policy, a.batch, LAYERS)
    loop = lambda weights, r: bench_kernels.decode_loop(x, weights, r, LAYERS, calls, jc.Kernels.default())
    variants = dict(full=loop(x["weights"], rope), no_scores=loop(None, rope), no_rope=loop(x["weights"], None))
    for f in variants.values():  # compiled before anything is timed or profiled
        jax.block_until_ready(f(x["stack_k"], x["stack_v"]))
    if a.ncu:
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuProfilerStart()
        jax.block_until_ready(variants["full"](x["stack_k"], x["stack_v"]))
        cuda.cuProfilerStop()
        return
    for name, f in variants.items():
        seconds = harness.time_it(f, x["stack_k"], x["stack_v"], warmup=0).median
        print(f"batch {a.batch} {name}: {seconds / calls * 1e6:.1f} us/call")


if __name__ == "__main__":
    main()
