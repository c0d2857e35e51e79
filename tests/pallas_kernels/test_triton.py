"""The Triton kernels (pallas_kernels/triton.py) lower for an H100 from the CPU (the chunk kernels, decode split-K +
finish, the shared-prefix kernel), and the shared-prefix kernel in interpret mode equals its reference.
Against the reference in interpret mode: test_pallas_kernels.py; the insertion kernel: test_insert.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_inputs import LOWERING_SHAPES, abstract_inputs, assert_close, h100_mesh, random_inputs, stored

import jcascade as jc
from jcascade import pallas_kernels as pk

ROPE = jc.RoPE(100.0)


@pytest.mark.parametrize("shape", LOWERING_SHAPES, ids=str)
def test_kernels_lower_for_gpu(shape):
    f = jax.jit(lambda *a: pk.triton.chunk_attention(*a, "max", jc.RoPE(500000.0)))
    args = list(abstract_inputs(*shape))
    args[3:5] = map(pk.Stored, args[3:5])  # the caches as the kernels take them
    with jax.sharding.use_abstract_mesh(h100_mesh()):
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == (
        2 if shape[1] == 1 else 3
    )  # decode: split-K + finish; chunk: forward + 2 scores


@pytest.mark.parametrize("codes", [jnp.int8, jnp.float8_e4m3fn])
def test_the_decode_lowers_for_gpu_on_a_stack_read_as_int16_pairs(codes):
    """A decode step over one layer of 64 rows x 8 heads x 32,785 slots x 128 codes (past 2**31: read as int16
    pairs, `triton.as_pairs`), scores included."""
    s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    B, H, S, D = 64, 8, 32785, 128
    stack = pk.Stored(s(1, B, H, S, D, dtype=codes), s(B, H, S, dtype=jnp.float32))
    args = (
        s(B, 1, 4 * H, D),
        s(B, 1, H, D),
        s(B, 1, H, D),
        stack,
        stack,
        s(B, H, S, dtype=jnp.bool_),
        s(B, H, S, dtype=jnp.int32),
        s(B, dtype=jnp.int32),
        s(B, 1, dtype=jnp.float32),
    )
    f = jax.jit(lambda *a: pk.triton.chunk_attention(*a, "max", jc.RoPE(500000.0), jnp.int32(0)))
    with jax.sharding.use_abstract_mesh(h100_mesh()):
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 2 and f"tensor<1x{B}x{H}x{S}x{D // 2}xi16>" in text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn])
def test_shared_prefix_kernel_lowers_for_gpu(dtype):
    """In the model's dtype, or a quantized prefix's codes with their scales."""
    s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    scale = None if dtype == jnp.bfloat16 else s(1, 8, 32768, dtype=jnp.float32)
    args = (
        s(1, 64, 32, 128),
        pk.Stored(s(1, 8, 32768, 128, dtype=dtype), scale),
        pk.Stored(s(1, 8, 32768, 128, dtype=dtype), scale),
        s(1, 8, 32768, dtype=jnp.bool_),
        s(1, 1, 32768, dtype=jnp.int32),
    )
    f = jax.jit(lambda *a: pk.triton.prefix_attention(*a, jc.RoPE(500000.0)))
    with jax.sharding.use_abstract_mesh(h100_mesh()):
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1


@pytest.mark.parametrize(
    "P, R, Hq, Hkv, D, S, dtype",
    [(1, 5, 8, 2, 64, 100, jnp.float32), (2, 37, 4, 4, 32, 70, jnp.float32), (1, 16, 8, 2, 64, 129, jnp.bfloat16)],
)
def test_prefix_kernel_matches_the_reference(P, R, Hq, Hkv, D, S, dtype):
    keys = jax.random.split(jax.random.key(P * R + S), 4)
    q = jax.random.normal(keys[0], (P, R, Hq, D)).astype(dtype)
    k = jax.random.normal(keys[1], (P, Hkv, S, D)).astype(dtype)
    v = jax.random.normal(keys[2], (P, Hkv, S, D)).astype(dtype)
    valid = jax.random.bernoulli(keys[3], 0.8, (P, Hkv, S)).at[-1, -1].set(False)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) * 3, (P, 1, S))
    k, v = pk.Stored(k), pk.Stored(v)
    want = pk.Kernels("xla").prefix_attention(q, k, v, valid, positions, ROPE)
    got = pk.Kernels("triton").prefix_attention(q, k, v, valid, positions, ROPE)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=tol, rtol=tol)


@pytest.mark.parametrize("T", [1, 8])
def test_wide_heads_run_their_own_tiles_and_match_the_reference(T):
    """Gemma 4's global layers (head_dim 512) take `Kernels.triton_wide` (the default tiles exceed a GPU's shared
    memory); the kernels with those tiles (interpret mode) give the reference's numbers."""
    kernels = pk.Kernels("triton")
    assert kernels.triton_tiles(256) == kernels.triton and kernels.triton_tiles(512) == pk.triton.WIDE != kernels.triton
    args = stored(random_inputs(np.random.default_rng(0), 1, T, 2, 1, 512, 40, jnp.float32))
    want = pk.Kernels("xla").chunk_attention(**args, head_reduction="max", rope=ROPE)
    got = kernels.chunk_attention(**args, head_reduction="max", rope=ROPE)
    for name, g, w in zip(("out", "lse", "cache scores", "chunk scores"), got, want):
        assert_close(g, w, jnp.float32, name)
