"""GPU check of the compiled Pallas kernels against the XLA reference (run once in every GPU session).

The CPU tests run the kernels in interpret mode, which shares their logic but not the compiler's behaviour (NaN handling
of Triton's max, masked loads, tiling at real sizes). This script runs `Kernels.chunk_attention` on each GPU backend
("triton"; "mosaic_gpu", for chunks, on a Hopper GPU, refusing what it cannot run; and `Kernels.default()`, the
platform's, which must pick a kernel that takes the shape) at a layer shape (`--shape`: Llama-3.1-8B's 32 query heads, 8
KV heads, D = 128, or Gemma 3 270M's 4 / 1 / D = 256, Qwen3.5's global layers' 16 / 4 / D = 256, Gemma 4's 8 / 4 / D =
512; bf16, RoPE fused) and compares out, lse and both score increments with the XLA reference's: decode at batch 1 and
32 over a 16K + 64 cache read in place from a stacked cache (and at batch 2 with positions near 1M), chunks of 512 and
4096 tokens (one batch with a row of fewer valid tokens), and caches that hold a NaN key (the NaN pattern must match on
the valid slots); the same on int8 and float8_e4m3fn caches (codes and per-slot scales: a decode step dequantizes them
in the Triton kernel's registers, a chunk in a copy of the attended slots), against the reference on the same codes,
decode over 64 rows of 8-bit codes at the 2**31-code boundary of in-place addressing (`triton.addresses_fit`), and the
single-token insertion kernel moving a quantized Cascade cache's codes and scales exactly as the XLA insertion does.
Relative error (norm over the finite entries) must stay under 1e-2, the bf16 tolerance; exits 1 otherwise.

    python benchmarks/check_kernels_gpu.py [--shape gemma-3-270m|qwen3.5|gemma-4]
        [--out benchmarks/results/check-kernels-<device>.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import harness
import jax
import jax.numpy as jnp
import numpy as np

import jcascade as jc
from jcascade import pallas_kernels as pk

# query heads, KV heads, head_dim (the global layers of Qwen3.5's and Gemma 4's default configs)
SHAPES = {"llama-3.1-8b": (32, 8, 128), "gemma-3-270m": (4, 1, 256), "qwen3.5": (16, 4, 256), "gemma-4": (8, 4, 512)}
HQ, HKV, D = SHAPES["llama-3.1-8b"]  # set by --shape
LAYERS, LAYER = 4, 2
TOLERANCE = 1e-2


def inputs(key, batch, T, S, nan_key=False, ragged=False, far=False):
    """Random bf16 q/k/v, a stacked cache [LAYERS, B, Hkv, S, D] with 80 % of its slots valid, positions and
    per-query weights; with `nan_key`, one cached key of row 0, head 0 in the attended layer is NaN; with
    `ragged`, the last row has 37 valid tokens fewer; with `far`, the slots' positions end at 2**20 (RoPE angles
    up to 1e6 radians, which the decode kernel reduces itself) instead of starting at 0."""
    ks = jax.random.split(key, 7)
    rand = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16)
    k_cache = rand(ks[3], (LAYERS, batch, HKV, S, D))
    valid = jax.random.uniform(ks[5], (batch, HKV, S)) < 0.8
    if nan_key:
        k_cache, valid = k_cache.at[LAYER, 0, 0, 5, 0].set(jnp.nan), valid.at[0, 0, 5].set(True)
    return dict(
        q=rand(ks[0], (batch, T, HQ, D)),
        k=rand(ks[1], (batch, T, HKV, D)),
        v=rand(ks[2], (batch, T, HKV, D)),
        k_cache=k_cache,
        v_cache=rand(ks[4], (LAYERS, batch, HKV, S, D)),
        cache_valid=valid,
        cache_positions=jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) + ((1 << 20) - S if far else 0), (batch, 1, S)),
        lengths=jnp.full((batch,), T, jnp.int32).at[-1].add(-37 if ragged else 0),
        query_weights=jax.random.uniform(ks[6], (batch, T)),
    )


def relative_error(got, want) -> tuple[float, bool]:
    """(relative error over the entries finite in `want`, whether the finite patterns agree)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    same_pattern = bool(np.array_equal(np.isfinite(got), finite) and np.array_equal(np.isnan(got), np.isnan(want)))
    err = np.linalg.norm(got[finite] - want[finite]) / max(np.linalg.norm(want[finite]), 1e-30)
    return float(err), same_pattern


def stored(x: dict) -> dict:
    """`inputs` with the stacked cache in the model's dtype as `Stored` values, as `Kernels` and the Triton entry
    points take it."""
    return x | {name: jc.Stored(x[name]) for name in ("k_cache", "v_cache")}


def quantized(x: dict, kv_dtype: str) -> dict:
    """`inputs` with the stacked cache as codes of `kv_dtype` with the attended layer's per-slot scales (`Stored`)."""
    dtype = pk.storage.storage_dtype(kv_dtype, jnp.bfloat16)
    (k, k_scale), (v, v_scale) = (pk.storage.quantize(x[n], dtype) for n in ("k_cache", "v_cache"))
    return x | dict(k_cache=jc.Stored(k, k_scale[LAYER]), v_cache=jc.Stored(v, v_scale[LAYER]))


def check_insert(
    kv_dtype: str,
    batch: int = 4,
    steps: int = 40,
    cache_size: int = 24,
    sinks: int = 2,
    num_cascades: int = 3,
    spread: bool = False,
) -> dict:
    """Single tokens into a quantized Cascade cache on the Triton insertion kernel and on the XLA insertion: every
    array of the two states must be equal. The default cache is 2 sinks and 3 rings of 8 filled from empty; with
    `spread` each row's clock starts past its sinks at the row's own offset, so that a few steps reach every part
    of a large cache (2**31 to 2**32 codes, `cache_size=32768, sinks=64, num_cascades=4` at 64 rows, is written as
    int16 pairs)."""
    policy = jc.Cascade(cache_size=cache_size, sinks=sinks, num_cascades=num_cascades, stride=1, kv_dtype=kv_dtype)
    kernels = [jc.Kernels("triton"), jc.Kernels("xla")]
    states = [jc.init_cache(policy, batch, HKV, D, jnp.bfloat16, kernels=k) for k in kernels]
    capacity = states[0].capacity
    if spread:
        seen = (sinks + 7919 * jnp.arange(batch, dtype=jnp.int32) % (4 * capacity)).astype(jnp.int32)
        states = [dataclasses.replace(s, seen=seen) for s in states]
    path = "pairs" if not pk.triton.addresses_fit(states[0].k.data) else "in place"
    step = jax.jit(lambda s, k, v, sc: jc.update(policy, s, k, v, sc))
    for i in range(steps):
        ks = jax.random.split(jax.random.key(i), 4)
        k, v = (jax.random.normal(key, (batch, 1, HKV, D), jnp.bfloat16) for key in ks[:2])
        scores = jc.Scores(
            cache=jax.random.uniform(ks[2], (batch, HKV, capacity)), chunk=jax.random.uniform(ks[3], (batch, HKV, 1))
        )
        states = [step(s, k, v, scores) for s in states]
    same = all(
        bool(jnp.array_equal(a, b, equal_nan=True))
        for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1]))
    )
    return dict(
        case=f"insert {kv_dtype}, {batch * HKV * capacity * D / 2**31:.4f} x 2**31 codes ({path})",
        implementation="Triton insert_one vs XLA",
        batch=batch,
        T=1,
        S=capacity,
        reduction="-",
        ok=same,
        out=0.0 if same else 1.0,
        lse=0.0,
        inc_cache=0.0,
        inc_chunk=0.0,
    )


def check_codes_boundary(kv_dtype: str, slots: int, layers: int = 1, batch: int = 64) -> dict:
    """Decode over the last layer of a stack of `layers` x `batch` rows x HKV heads x `slots` 8-bit codes on the GPU
    backend against the XLA reference on the same codes. At 2**31 codes (one layer of 32,768 slots at 64 rows of 8
    heads of 128) the Triton kernel reads the stack in place; past it the lowering's 32-bit offsets could not
    address it by the byte (`triton.addresses_fit`): the kernel reads it as int16 pairs of codes (two layers of
    16,385 slots; one layer of 32,785, the shape that faulted before the guard). Codes span their format's range
    and scales are drawn so that values span about +-2.5 in both formats (scales up to 2.5 / 127 or 2.5 / 448)."""
    ks = jax.random.split(jax.random.key(slots), 7)
    dtype = pk.storage.storage_dtype(kv_dtype, jnp.bfloat16)
    shape = (layers, batch, HKV, slots, D)
    code_max = 127 if dtype == jnp.int8 else 448
    codes = lambda k: (
        jax.random.randint(k, shape, -127, 128, jnp.int8)
        if dtype == jnp.int8
        else jax.random.uniform(k, shape, jnp.float32, -448, 448).astype(dtype)
    )
    scale = lambda k: jax.random.uniform(k, (batch, HKV, slots), jnp.float32, 0, 2.5 / code_max)
    x = dict(
        q=jax.random.normal(ks[0], (batch, 1, HQ, D), jnp.bfloat16),
        k=jax.random.normal(ks[1], (batch, 1, HKV, D), jnp.bfloat16),
        v=jax.random.normal(ks[6], (batch, 1, HKV, D), jnp.bfloat16),
        k_cache=jc.Stored(codes(ks[2]), scale(ks[4])),  # the stack's codes, the last layer's scales
        v_cache=jc.Stored(codes(ks[3]), scale(ks[5])),
        cache_valid=jnp.ones((batch, HKV, slots), bool),
        cache_positions=jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (batch, 1, slots)),
        lengths=jnp.ones((batch,), jnp.int32),
        query_weights=jnp.ones((batch, 1), jnp.float32),
    )
    rope, layer = jc.RoPE(500000.0), jnp.int32(layers - 1)
    got = jax.jit(lambda x: jc.Kernels("triton").chunk_attention(**x, rope=rope, layer=layer))(x)
    want = jax.jit(lambda x: jc.Kernels("xla").chunk_attention(**x, rope=rope, layer=layer))(x)
    path = jc.Kernels("triton").quantized_decode_path(x["k_cache"], rope)
    row = dict(
        case=f"decode {kv_dtype}, {layers} x {batch * HKV * slots * D / 2**31:.4f} x 2**31 codes ({path})",
        implementation="Kernels('triton')",
        batch=batch,
        T=1,
        S=slots,
        reduction="max",
        ok=True,
        kv_dtype=kv_dtype,
    )
    for part, g, w in zip(["out", "lse", "inc_cache", "inc_chunk"], got, want):
        err, same = relative_error(g, w)
        row[part] = err
        row["ok"] &= same and err < TOLERANCE
    return row


def check(name, kernels, batch, T, S, reduction, nan_key=False, ragged=False, far=False, kv_dtype="model") -> dict:
    x = inputs(jax.random.key(batch * 7 + T), batch, T, S, nan_key, ragged, far)
    x = stored(x) if kv_dtype == "model" else quantized(x, kv_dtype)
    rope = jc.RoPE(500000.0, jc.Llama3Scaling())

    def run(kernels, x):
        return kernels.chunk_attention(**x, head_reduction=reduction, rope=rope, layer=jnp.int32(LAYER))

    got = jax.jit(lambda x: run(kernels, x))(x)
    want = jax.jit(lambda x: run(jc.Kernels("xla"), x))(x)
    row = dict(
        case=name, implementation=repr(kernels), batch=batch, T=T, S=S, reduction=reduction, ok=True, kv_dtype=kv_dtype
    )
    valid = np.asarray(x["cache_valid"])
    for part, g, w in zip(["out", "lse", "inc_cache", "inc_chunk"], got, want):
        if part == "inc_cache":  # empty slots' scores are unused (the kernels give 0 where the reference gives NaN)
            g, w = np.where(valid, g, 0.0), np.where(valid, w, 0.0)
        err, same = relative_error(g, w)
        row[part] = err
        row["ok"] &= same and err < TOLERANCE and g.shape == w.shape
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, default="llama-3.1-8b")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    global HQ, HKV, D
    HQ, HKV, D = SHAPES[a.shape]
    if jax.default_backend() != "gpu":
        sys.exit("check_kernels_gpu.py needs a GPU (the CPU tests run the same kernels in interpret mode)")
    S = 16384 + 64
    triton, mosaic = jc.Kernels("triton"), jc.Kernels("mosaic_gpu", fallback=False)
    rows = [
        check("decode", triton, 1, 1, S, "max"),
        check("decode", triton, 32, 1, S, "mean"),
        check("decode, positions ~1M", triton, 2, 1, S, "max", far=True),
        check("chunk", triton, 1, 512, 4096 + 64, "max"),
        check("decode, a NaN key", triton, 1, 1, S, "max", nan_key=True),
        check("chunk, default", jc.Kernels.default(), 1, 512, 4096 + 64, "max"),
    ]
    for kv_dtype in pk.storage.FORMATS:
        rows += [
            check(f"decode {kv_dtype}", triton, 32, 1, S, "mean", kv_dtype=kv_dtype),
            check(f"decode {kv_dtype}, NaN", triton, 1, 1, S, "max", nan_key=True, kv_dtype=kv_dtype),
            check(f"chunk {kv_dtype}", jc.Kernels.default(), 1, 512, 4096 + 64, "max", kv_dtype=kv_dtype),
            check_insert(kv_dtype),
        ]
    if a.shape == "llama-3.1-8b":
        rows += [
            check_codes_boundary("int8", 32768),
            check_codes_boundary("int8", 32785),
            check_codes_boundary("int8", 16385, layers=2),
            check_codes_boundary("float8_e4m3fn", 32768),
            check_codes_boundary("float8_e4m3fn", 32785),
            check_insert("int8", batch=64, steps=8, cache_size=32768, sinks=64, num_cascades=4, spread=True),
        ]
    if pk.is_hopper() and D in pk.mosaic_gpu.HEAD_DIMS:
        rows += [
            check("chunk", mosaic, 1, 4096, S, "max"),
            check("chunk, ragged rows", mosaic, 2, 512, 4096 + 64, "mean", ragged=True),
            check("chunk, a NaN key", mosaic, 1, 512, 4096 + 64, "max", nan_key=True),
        ]
    device = jax.devices()[0].device_kind
    print(
        f"{device}, jax {jax.__version__}, {a.shape} (Hq {HQ}, Hkv {HKV}, D {D}): Pallas kernels vs the XLA reference "
        f"(relative error, tolerance {TOLERANCE})"
    )
    print(
        f"{'case':<30} {'kernels':<40} {'batch':>5} {'T':>4} {'S':>6} {'out':>9} {'lse':>9} {'inc_cache':>9} "
        f"{'inc_chunk':>9}  ok"
    )
    for r in rows:
        print(
            f"{r['case']:<30} {r['implementation']:<40} {r['batch']:>5} {r['T']:>4} {r['S']:>6} {r['out']:9.2e} "
            f"{r['lse']:9.2e} {r['inc_cache']:9.2e} {r['inc_chunk']:9.2e}  {r['ok']}"
        )
    out = pathlib.Path(a.out or f"benchmarks/results/check-kernels-{device.replace(' ', '_')}.json")
    harness.write_json(out, dict(benchmark="check_kernels_gpu", shape=a.shape, tolerance=TOLERANCE, rows=rows))
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
