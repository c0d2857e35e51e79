"""Micro-benchmark of `jcascade.update`: one chunk into a full cascading cache, per layer.

Default: the Llama-3.1-8B layer shape (8 KV heads x 128, bf16), a 4096-token chunk into a 16K + 64 sink
cache with 4 cascades (the paper's prefill setting), and a Sink cache of the same size for comparison.
Runs unchanged on the CPU and on a GPU; prints a table and writes JSON.

    python benchmarks/bench_update.py [--batch 1] [--chunk 4096] [--out benchmarks/results/update.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import warnings

import harness
import jax
import jax.numpy as jnp
import numpy as np

import jcascade as jc


def full_state(policy, batch, heads, head_dim, dtype, rng):
    """A cache in the steady phase: every slot held, as after a long stream (seen = 1M tokens)."""
    state = jc.init_cache(policy, batch, heads, head_dim, dtype)
    cap = state.capacity
    return dataclasses.replace(
        state,
        k=state.k.encode(jnp.asarray(rng.normal(size=state.k.shape), dtype)),  # in the policy's storage format
        v=state.v.encode(jnp.asarray(rng.normal(size=state.v.shape), dtype)),
        score=jnp.asarray(rng.random(state.score.shape, np.float32)),
        pos=jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32), state.pos.shape),
        seen=jnp.full((batch,), 1 << 20, jnp.int32),
    )


def time_update(policy, args, rng) -> dict:
    dtype = jnp.dtype(args.dtype)
    B, H, D, T = args.batch, args.kv_heads, args.head_dim, args.chunk
    state = full_state(policy, B, H, D, dtype, rng)
    k = jnp.asarray(rng.normal(size=(B, T, H, D)), dtype)
    v = jnp.asarray(rng.normal(size=(B, T, H, D)), dtype)
    scores = None
    if isinstance(policy, jc.Cascade):
        scores = jc.Scores(
            cache=jnp.asarray(rng.random((B, H, state.capacity), np.float32) * 1e-4),
            chunk=jnp.asarray(rng.random((B, H, T), np.float32) * 1e-4),
        )
    update = jax.jit(jc.update, static_argnums=0, donate_argnums=1)
    state, compile_s = harness.time_once(update, policy, state, k, v, scores)

    def step():  # the state is donated: each call updates the last one's
        nonlocal state
        state = update(policy, state, k, v, scores)
        return state

    ms = harness.time_it(step, warmup=args.warmup, repeats=args.iters).median * 1e3
    return dict(
        policy=jc.policies.spec(policy),
        ms_per_call=ms,
        tokens_per_s=B * T / ms * 1e3,
        compile_s=compile_s,
        kv_bytes=sum(x.nbytes for x in jax.tree.leaves((state.k, state.v))),  # a quantized one's scales too
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--cache-size", type=int, default=16384)
    p.add_argument("--sinks", type=int, default=64)
    p.add_argument("--cascades", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/update-<platform>.json)")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    rng = np.random.default_rng(0)
    policies = [
        jc.Cascade(cache_size=args.cache_size, sinks=args.sinks, num_cascades=args.cascades, stride=args.chunk),
        jc.Sink(window=args.cache_size, sinks=args.sinks, stride=args.chunk),
    ]
    device = jax.devices()[0]
    rows = [time_update(policy, args, rng) for policy in policies]
    out = pathlib.Path(args.out or f"benchmarks/results/update-{device.platform}.json")
    harness.write_json(out, dict(benchmark="update", platform=device.platform, args=vars(args), rows=rows))
    print(
        f"update: {args.chunk}-token chunk into a full {args.cache_size}+{args.sinks} cache, "
        f"B={args.batch}, {args.kv_heads}x{args.head_dim} {args.dtype}, {device.device_kind}"
    )
    print(f"{'policy':<18}{'ms/call':>10}{'Mtok/s':>10}{'compile s':>11}")
    for r in rows:
        print(
            f"{r['policy'].split(':')[0]:<18}{r['ms_per_call']:>10.3f}"
            f"{r['tokens_per_s'] / 1e6:>10.3f}{r['compile_s']:>11.2f}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
