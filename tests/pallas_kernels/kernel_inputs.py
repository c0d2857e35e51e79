"""Inputs and comparisons shared by the kernel tests: random chunk_attention inputs (and their caches as `Stored`
values), abstract (shape-only) inputs for lowering, small block sizes for interpret mode, and an abstract H100 to
lower for."""

import jax
import jax.numpy as jnp
import numpy as np

from jcascade import pallas_kernels as pk

XLA = pk.Kernels("xla")
SMALL = {
    "triton": pk.Kernels("triton", triton=pk.TritonConfig(16, 16, 16, 32, 16, decode_programs=8)),
    "mosaic_tpu": pk.Kernels("mosaic_tpu", tpu=pk.TpuConfig(16, 32)),
}  # small blocks: interpret mode is slow


def random_inputs(rng, B, T, Hq, Hkv, D, S, dtype, per_head_positions=False, weights=True):
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    lengths = rng.integers(0, T + 1, size=B)
    lengths[0] = T
    w = rng.random((B, T)).astype(np.float32) * (np.arange(T)[None] < lengths[:, None])
    return dict(
        q=f(B, T, Hq, D),
        k=f(B, T, Hkv, D),
        v=f(B, T, Hkv, D),
        k_cache=f(B, Hkv, S, D),
        v_cache=f(B, Hkv, S, D),
        cache_valid=jnp.asarray(rng.random((B, Hkv, S)) < 0.8),
        cache_positions=jnp.asarray(rng.integers(0, 5000, (B, Hkv if per_head_positions else 1, S)), jnp.int32),
        lengths=jnp.asarray(lengths, jnp.int32),
        query_weights=jnp.asarray(w) if weights else None,
    )


def stored(inputs):
    """`random_inputs` with the caches as `Stored` values in the model's dtype, as `Kernels` and the Triton and
    Mosaic TPU entry points take them (the XLA `reference` takes the plain arrays)."""
    return inputs | {name: pk.Stored(inputs[name]) for name in ("k_cache", "v_cache") if name in inputs}


def assert_close(got, want, dtype, name):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f"{name}: -inf pattern")
    err = np.linalg.norm(got[finite] - want[finite]) / max(np.linalg.norm(want[finite]), 1e-30)
    assert err < (1e-2 if dtype == jnp.bfloat16 else 1e-5), f"{name}: relative error {err:.2e}"


LOWERING_SHAPES = [  # B, T, Hq, Hkv, D, S: the benchmark shapes, odd sizes, decode
    (1, 4096, 32, 8, 128, 16448),
    (2, 37, 28, 4, 64, 45),
    (32, 1, 32, 8, 128, 16448),
    (2, 1, 7, 1, 64, 45),
]


def abstract_inputs(B, T, Hq, Hkv, D, S):
    s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    return (
        s(B, T, Hq, D),
        s(B, T, Hkv, D),
        s(B, T, Hkv, D),
        s(B, Hkv, S, D),
        s(B, Hkv, S, D),
        s(B, Hkv, S, dtype=jnp.bool_),
        s(B, 1, S, dtype=jnp.int32),
        s(B, dtype=jnp.int32),
        s(B, T, dtype=jnp.float32),
    )


def h100_mesh():
    """An abstract one-device mesh of an H100, to lower GPU kernels from the CPU under."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
