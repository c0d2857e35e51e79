"""What a decode step's matrix products cost one GPU, stored apart or joined (`models.weights.FUSED`): the GPU time
of the cuBLAS kernels of each product of a Llama-3.1-8B layer for 1 and 16 rows, at the shard shapes of tensor
parallelism over 1, 2 and 4 devices (each product over 32 layers' weights stacked, read in a `lax.scan` as the
decoder reads them; kernel time from the JAX profiler, so launch gaps are not counted). Prints a table, writes JSON.

    python3 benchmarks/bench_products.py --out results/products.json
"""

from __future__ import annotations

import argparse
import tempfile

import decode_breakdown
import harness
import jax
import jax.numpy as jnp
from bench_model import LLAMA31_8B

import jcascade as jc

LAYERS = 32
PRODUCTS = "matrix products (cuBLAS)"


def shapes(tp: int) -> dict[str, tuple[int, int]]:
    """[in, out] of each product of one device's shard at tensor parallelism `tp` (o and down split by rows)."""
    c = LLAMA31_8B
    q, kv, mlp = c.num_heads * c.head_dim // tp, c.num_kv_heads * c.head_dim // tp, c.intermediate_size // tp
    h = c.hidden_size
    return {
        "q": (h, q),
        "k or v": (h, kv),
        "o": (q, h),
        "gate or up": (h, mlp),
        "down": (mlp, h),
        "q, k, v joined": (h, q + 2 * kv),
        "gate, up joined": (h, 2 * mlp),
    }


def kernel_us(k: int, n: int, rows: int, calls: int = 5) -> float:
    """us of cuBLAS kernels per product: x [rows, k] @ w [k, n] for each of LAYERS stacked bf16 weights."""
    weights = jax.random.normal(jax.random.key(0), (LAYERS, k, n), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
    run = jax.jit(lambda w, x: jax.lax.scan(lambda c, w: (c, x @ w), None, w)[1], compiler_options=jc.COMPILER_OPTIONS)
    for _ in range(2):
        run(weights, x).block_until_ready()
    trace = tempfile.mkdtemp()
    with jax.profiler.trace(trace):
        for _ in range(calls):
            run(weights, x).block_until_ready()
    kernels = decode_breakdown.kernels_of_trace(trace)
    return sum(us for name, us in kernels if decode_breakdown.kind_of(name) == PRODUCTS) / calls / LAYERS


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for tp in (1, 2, 4):
        for batch in (1, 16):
            us = {name: kernel_us(k, n, batch) for name, (k, n) in shapes(tp).items()}
            apart = us["q"] + 2 * us["k or v"] + us["o"] + 2 * us["gate or up"] + us["down"]
            joined = us["q, k, v joined"] + us["o"] + us["gate, up joined"] + us["down"]
            rows.append(dict(tp=tp, batch=batch, us_per_product=us, layer_us_apart=apart, layer_us_joined=joined))
            print(
                f"TP {tp}, batch {batch:>2}: "
                + ", ".join(f"{name} {t:.1f}" for name, t in us.items())
                + f" us; a layer's products {apart:.1f} us apart, {joined:.1f} joined "
                f"({LAYERS} layers: {apart * LAYERS / 1e3:.2f} / {joined * LAYERS / 1e3:.2f} ms)",
                flush=True,
            )
    if a.out:
        harness.write_json(a.out, dict(benchmark="bench_products", rows=rows))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
