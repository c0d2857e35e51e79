"""The Mosaic GPU kernels (pallas_kernels/mosaic_gpu.py): in GPU interpret mode against the reference, NaN
pattern included, and through a bf16 model; lowered for an H100 from the CPU."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from kernel_inputs import LOWERING_SHAPES, abstract_inputs, assert_close, random_inputs, stored

import jcascade as jc
from jcascade import pallas_kernels as pk

MOSAIC_GPU_CASES = [  # B, T, Hq, Hkv, D, S, dtype, reduction: ragged rows, several key and query blocks
    (2, 100, 8, 2, 64, 150, jnp.bfloat16, "max"),  # group 4; a NaN key in row 0, KV head 1
    (1, 130, 4, 4, 128, 70, jnp.float16, "mean"),  # group 1, head_dim 128, two pairs of query blocks
]


@pytest.mark.parametrize("case", MOSAIC_GPU_CASES, ids=lambda c: f"B{c[0]}T{c[1]}G{c[2] // c[3]}D{c[4]}S{c[5]}")
def test_mosaic_gpu_kernels_equal_reference(case):
    """The Mosaic GPU chunk kernels in GPU interpret mode (TMA copies, barriers, wgmma and the warpgroups
    simulated on the CPU) against the reference, NaN pattern included."""
    B, T, Hq, Hkv, D, S, dtype, reduction = case
    inputs = random_inputs(np.random.default_rng(T), B, T, Hq, Hkv, D, S, dtype, per_head_positions=True)
    if B > 1:
        inputs["k_cache"] = inputs["k_cache"].at[0, 1, 7, 3].set(jnp.nan)
        inputs["cache_valid"] = inputs["cache_valid"].at[0, 1, 7].set(True)
    rope = jc.RoPE(10000.0)
    want = pk.Kernels("xla").chunk_attention(**stored(inputs), head_reduction=reduction, rope=rope)
    got = pk.Kernels("mosaic_gpu", fallback=False).chunk_attention(
        **stored(inputs), head_reduction=reduction, rope=rope
    )
    valid = np.asarray(inputs["cache_valid"])
    for name, g, w in zip(["out", "lse", "inc_cache", "inc_chunk"], got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if name == "inc_cache":  # empty slots' scores are unused (0 here, NaN in the reference next to a NaN key)
            g, w = np.where(valid, g, 0.0), np.where(valid, w, 0.0)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=name)
        assert_close(g, w, jnp.bfloat16, name)
    assert np.isnan(np.asarray(got[0])).any() == (B > 1)


@pytest.mark.parametrize("shape", [s for s in LOWERING_SHAPES if s[1] > 1], ids=str)
@pytest.mark.parametrize("scores", [True, False], ids=["scores", "no-scores"])
def test_mosaic_gpu_kernels_lower_for_gpu(shape, scores):
    """The Mosaic GPU kernels through Pallas's Mosaic GPU lowering (the CUDA plugin's, installed by the README's test
    command; no GPU needed): one kernel for the forward, one more for the scores."""
    assert importlib.util.find_spec("jax_cuda13_plugin"), "the README's test command installs jax-cuda13-plugin"
    inputs = abstract_inputs(*shape)
    f = jax.jit(lambda *a: pk.mosaic_gpu.chunk_attention(*a[:8], a[8] if scores else None, "max", jc.RoPE(500000.0)))
    text = f.trace(*inputs).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu_v2") == (2 if scores else 1)


def test_mosaic_gpu_prefix_kernel_equals_reference():
    """The shared-prefix pass on Mosaic GPU (keys stored rotated, empty slots zero) in GPU interpret mode against
    the reference: 2 prefix rows of 300 slots (padded to 3 key blocks, each a part of its own) read by 40 requests x
    4 heads of a group; one (row, KV head) with no valid slot gives (0, -inf)."""
    P, R, Hq, Hkv, D, S = 2, 40, 8, 2, 64, 300
    keys = jax.random.split(jax.random.key(3), 4)
    valid = jax.random.bernoulli(keys[3], 0.7, (P, Hkv, S)).at[1, 0].set(False)
    q, k, v = (
        jax.random.normal(key, shape).astype(jnp.bfloat16)
        for key, shape in zip(keys, [(P, R, Hq, D), (P, Hkv, S, D), (P, Hkv, S, D)])
    )
    k, v = (jnp.where(valid[..., None], x, 0) for x in (k, v))
    assert pk.mosaic_gpu.supports_prefix(q, k)
    want = pk.Kernels("xla").prefix_attention(q, pk.Stored(k), pk.Stored(v), valid, None, None)
    got = pk.Kernels("mosaic_gpu").prefix_attention(q, pk.Stored(k), pk.Stored(v), valid, None, None)
    for name, g, w in zip(["out", "lse"], got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w), err_msg=name)
        assert_close(np.where(np.isneginf(w), 0, g), np.where(np.isneginf(w), 0, w), jnp.bfloat16, name)
    assert np.isneginf(np.asarray(got[1])[1, :, :4]).all() and not np.asarray(got[0])[1, :, :4].any()


def test_mosaic_gpu_prefix_kernel_lowers_for_gpu():
    """The prefix pass at the benchmark's shape (32K slots, 64 requests x 4 heads per KV head): one Mosaic GPU
    kernel, lowered for the GPU from the CPU."""
    s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    f = jax.jit(lambda q, k, v, valid: pk.mosaic_gpu.prefix_attention(q, k, v, valid))
    args = (s(1, 64, 32, 128), s(1, 8, 32768, 128), s(1, 8, 32768, 128), s(1, 8, 32768, dtype=jnp.bool_))
    assert f.trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("mosaic_gpu_v2") == 1


def test_a_model_scores_alike_on_mosaic_gpu_and_xla():
    """jc.score through a bf16 model (strided prefill: attend, then update, per chunk and layer) with the Mosaic
    GPU chunk kernels in GPU interpret mode gives the reference's log-likelihoods."""
    model = tiny.model(97, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64, num_layers=1)
    model = jc.CausalLM(model.config, {name: w.astype(jnp.bfloat16) for name, w in model.weights().items()})
    tokens = np.random.default_rng(0).integers(0, 97, (2, 120))
    policy = jc.Cascade(cache_size=64, sinks=4, stride=64)
    logps = {
        backend: np.asarray(
            jc.score(
                model.with_kernels(jc.Kernels(backend, fallback=False)), tokens, policy, lengths=np.array([120, 101])
            )
        )
        for backend in ("xla", "mosaic_gpu")
    }
    assert_close(logps["mosaic_gpu"], logps["xla"], jnp.bfloat16, "log-likelihoods")
