"""Decode attention over a shared 32K-token prefix: one layer of the Llama-3.1-8B shape (32 query heads,
8 KV heads, head_dim 128, bf16, RoPE in the kernels), batch 1, 8, 64, 256.

  shared      `jc.attend_shared`: the prefix cache stored once (batch 1) and read once per step by all
              requests' queries (the multi-query Pallas pass), each request's own 16 tokens in a Full
              cache, the two states merged;
  replicated  `jc.attend` on a Full cache holding prefix + own tokens for every request (what
              generating from B copies of the prompt does).

Both outputs are compared (bf16). Times are medians over --iters calls after a warm-up. --kv-dtypes: the shared
prefix also stored in 8 bits (`share_prefix` of a quantized cache: codes and scales, read in the kernel's
registers), timed beside the bf16 one and compared with the replicated bf16 output.

    python benchmarks/bench_shared.py [--kv-dtypes model,int8] [--out benchmarks/results/shared-<device>.json]
    python benchmarks/bench_shared.py --tiny      # a dry run with small shapes
"""

from __future__ import annotations

import argparse
import pathlib
import warnings

import harness
import jax
import jax.numpy as jnp

import jcascade as jc


def full_cache(k, v, own_k, own_v):
    """A Full cache [B, H, S + own + 1, D] holding k/v (batch 1, broadcast) then each row's own tokens."""
    B, H, own, D = own_k.shape
    S = k.shape[2]
    cap = S + own + 1
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 1), (0, 0)))
    return jc.CacheState(
        k=jc.Stored(pad(jnp.concatenate([jnp.broadcast_to(k, (B, H, S, D)), own_k], 2))),
        v=jc.Stored(pad(jnp.concatenate([jnp.broadcast_to(v, (B, H, S, D)), own_v], 2))),
        score=jnp.zeros((B, H, cap), jnp.float32),
        pos=jnp.broadcast_to(jnp.where(jnp.arange(cap) < S + own, jnp.arange(cap), -1).astype(jnp.int32), (B, H, cap)),
        seen=jnp.full((B,), S + own, jnp.int32),
        kernels=jc.Kernels.default(),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--kv-dtypes",
        default="model",
        help="comma-separated storage formats of the shared prefix "
        f"(among {', '.join(jc.pallas_kernels.storage.KV_DTYPES)})",
    )
    a = p.parse_args()
    formats = a.kv_dtypes.split(",")
    warnings.filterwarnings("ignore")
    S, Hq, H, D, own, batches = (256, 8, 2, 64, 4, [1, 8]) if a.tiny else (32768, 32, 8, 128, 16, [1, 8, 64, 256])
    dtype = jnp.bfloat16
    rope, policy = jc.RoPE(500000.0), jc.Full()
    keys = jax.random.split(jax.random.key(0), 2)
    k = jax.random.normal(keys[0], (1, H, S, D), dtype)
    v = jax.random.normal(keys[1], (1, H, S, D), dtype)
    prefixes = {}
    for fmt in formats:
        stored = jc.pallas_kernels.storage.storage_dtype(fmt, dtype)  # a clear error for an unknown format
        kv = (
            dict(k=jc.Stored(k), v=jc.Stored(v))
            if stored == dtype
            else dict(  # codes and their scales
                k=jc.Stored(*jc.pallas_kernels.storage.quantize(k, stored)),
                v=jc.Stored(*jc.pallas_kernels.storage.quantize(v, stored)),
            )
        )
        prefix_state = jc.CacheState(
            score=jnp.zeros((1, H, S), jnp.float32),
            pos=jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (1, H, S)),
            seen=jnp.full((1,), S, jnp.int32),
            kernels=jc.Kernels.default(),
            **kv,
        )
        prefixes[fmt] = jc.share_prefix(policy, prefix_state)
    shared_fn = jax.jit(
        lambda own_state, q, k1, v1, prefix: jc.attend_shared(policy, own_state, q, k1, v1, [prefix], None, rope)
    )
    replicated_fn = jax.jit(lambda state, q, k1, v1: jc.attend(policy, state, q, k1, v1, None, rope)[0])
    device = jax.devices()[0]
    result = dict(benchmark="shared_prefix", prefix_tokens=S, own_tokens=own, heads=[Hq, H, D], rows=[])
    out = pathlib.Path(a.out or f"benchmarks/results/shared-{device.device_kind.replace(' ', '_')}.json")
    for B in batches:
        ks = jax.random.split(jax.random.key(B), 5)
        own_k = jax.random.normal(ks[0], (B, H, own, D), dtype)
        own_v = jax.random.normal(ks[1], (B, H, own, D), dtype)
        q = jax.random.normal(ks[2], (B, 1, Hq, D), dtype)
        k1 = jax.random.normal(ks[3], (B, 1, H, D), dtype)
        v1 = jax.random.normal(ks[4], (B, 1, H, D), dtype)
        own_state = full_cache(jnp.zeros((1, H, 0, D), dtype), jnp.zeros((1, H, 0, D), dtype), own_k, own_v)
        shared = {}
        for fmt, prefix in prefixes.items():
            shared[fmt] = (
                1e3 * harness.time_it(shared_fn, own_state, q, k1, v1, prefix, repeats=a.iters).median,
                shared_fn(own_state, q, k1, v1, prefix),
            )
        del own_state
        flat = jax.jit(full_cache)(k, v, own_k, own_v)
        replicated_ms = 1e3 * harness.time_it(replicated_fn, flat, q, k1, v1, repeats=a.iters).median
        want = replicated_fn(flat, q, k1, v1)
        del flat
        for fmt, (shared_ms, got) in shared.items():
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            row = dict(
                batch=B,
                kv_dtype=fmt,
                shared_ms=shared_ms,
                replicated_ms=replicated_ms,
                speedup=replicated_ms / shared_ms,
                max_abs_difference=err,
            )
            result["rows"].append(row)
            print(
                f"   batch {B}, prefix {fmt}: shared {shared_ms:.3f} ms, replicated bf16 {replicated_ms:.3f} ms",
                flush=True,
            )
        harness.write_json(out, result)
    print(
        f"\n{device.device_kind}, {S}-token shared prefix + {own} own tokens, one decode step of one layer: "
        "batch, prefix format, shared ms, replicated bf16 ms, speed-up, max |difference| from it"
    )
    for r in result["rows"]:
        print(
            f"   {r['batch']:>4} {r['kv_dtype']:>14} {r['shared_ms']:9.3f} {r['replicated_ms']:9.3f} "
            f"{r['speedup']:7.1f} {r['max_abs_difference']:.1e}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
