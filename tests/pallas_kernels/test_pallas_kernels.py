"""`Kernels.chunk_attention` (pallas_kernels/__init__.py): the Kernels value's checks, and every Pallas backend that
runs on the CPU (Triton and Mosaic TPU, in interpret mode) against the XLA reference: outputs, log-sum-exp and
score increments, NaN patterns, a streamed cache through jc.attend, a model's stacked cache read at its layer.
Mosaic GPU: test_mosaic_gpu.py; lowering for GPU and TPU: test_triton.py, test_mosaic_gpu.py, test_tpu.py."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_inputs import SMALL, XLA, assert_close, random_inputs, stored

import jcascade as jc
from jcascade import pallas_kernels as pk

CASES = [  # B, T, Hq, Hkv, D, S, dtype, reduction, per-head positions
    (2, 23, 4, 4, 64, 45, jnp.float32, "max", False),  # group 1
    (2, 37, 8, 2, 128, 70, jnp.float32, "mean", True),  # group 4, head_dim 128
    (1, 19, 7, 1, 64, 33, jnp.bfloat16, "max", False),  # group 7
    (3, 1, 8, 2, 64, 45, jnp.float32, "max", True),  # decode
    (2, 1, 7, 1, 128, 70, jnp.bfloat16, "mean", False),  # decode, group 7
]


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}G{c[2] // c[3]}D{c[4]}S{c[5]}-{jnp.dtype(c[6]).name}"
)
def test_kernel_equals_reference(backend, case):
    B, T, Hq, Hkv, D, S, dtype, reduction, per_head = case
    rng = np.random.default_rng(hash(case) % 2**32)
    inputs = stored(random_inputs(rng, B, T, Hq, Hkv, D, S, dtype, per_head))
    rope = jc.RoPE(10000.0)
    run = lambda kernels: jax.jit(lambda x: kernels.chunk_attention(**x, head_reduction=reduction, rope=rope))(inputs)
    want = run(XLA)
    got = run(SMALL[backend])
    for name, g, w in zip(["out", "lse", "inc_cache", "inc_chunk"], got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert_close(g, w, dtype, name)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("T", [9, 1], ids=["chunk", "decode"])
def test_kernel_without_scores_or_rope(backend, T):
    rng = np.random.default_rng(1)
    inputs = stored(random_inputs(rng, 2, T, 4, 2, 64, 21, jnp.float32, weights=False))
    want = XLA.chunk_attention(**inputs)
    got = SMALL[backend].chunk_attention(**inputs)
    assert got[2] is None and got[3] is None
    assert_close(got[0], want[0], jnp.float32, "out")
    assert_close(got[1], want[1], jnp.float32, "lse")


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("T", [1, 5], ids=["decode", "chunk"])
def test_a_nan_key_poisons_its_queries_as_in_the_reference(backend, T):
    """A NaN in one valid cached key: the queries of its KV head get NaN out, lse and scores on every valid
    slot, as in the reference; the other heads and rows stay finite and agree. (Empty slots' scores are
    unused; there the kernels give 0 where the reference gives NaN.)"""
    inputs = random_inputs(np.random.default_rng(3), 2, T, 4, 2, 64, 40, jnp.float32)
    inputs["k_cache"] = inputs["k_cache"].at[0, 1, 7, 3].set(jnp.nan)
    inputs["cache_valid"] = inputs["cache_valid"].at[0, 1, 7].set(True)
    rope = jc.RoPE(10000.0)
    want = XLA.chunk_attention(**stored(inputs), rope=rope)
    got = SMALL[backend].chunk_attention(**stored(inputs), rope=rope)
    valid = np.asarray(inputs["cache_valid"])
    assert np.isnan(np.asarray(want[2])[0, 1][valid[0, 1]]).all() and np.isfinite(np.asarray(want[2][1])).all()
    for name, g, w in zip(["out", "lse", "inc_cache", "inc_chunk"], got, want):
        g, w = np.asarray(g), np.asarray(w)
        if name == "inc_cache":
            g, w = np.where(valid, g, 0.0), np.where(valid, w, 0.0)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=name)
        assert_close(g, w, jnp.float32, name)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_attend_with_kernels_equals_xla_on_a_streamed_cache(backend):
    """jc.attend end to end (positions, masks, weights) through the kernels, then update."""
    policy = jc.Cascade(cache_size=12, sinks=2, num_cascades=3, gamma=0.8, positions="original")
    rng = np.random.default_rng(2)
    B, Hq, Hkv, D = 2, 4, 2, 64
    attend = jax.jit(functools.partial(jc.attend, policy, rope=jc.RoPE(500.0)))
    update = jax.jit(functools.partial(jc.update, policy))
    state = jc.init_cache(policy, B, Hkv, D)  # XLA's kernels (the CPU's default)
    for T in (5, 7, 1, 7, 1):  # 21 tokens into 14 slots: evictions; chunks and decode steps
        q, k, v = (jnp.asarray(rng.normal(size=(B, T, h, D)), jnp.float32) for h in (Hq, Hkv, Hkv))
        lengths = jnp.asarray(rng.integers(0, T + 1, size=B), jnp.int32)
        want_out, want_scores = attend(state, q, k, v, lengths)
        got_out, got_scores = attend(dataclasses.replace(state, kernels=SMALL[backend]), q, k, v, lengths)
        assert_close(got_out, want_out, jnp.float32, "out")
        assert_close(got_scores.cache, want_scores.cache, jnp.float32, "scores.cache")
        assert_close(got_scores.chunk, want_scores.chunk, jnp.float32, "scores.chunk")
        state = update(state, k, v, want_scores, lengths)


def test_kernels_and_their_configs_are_checked():
    """A Kernels value names a backend that runs here and carries valid tuning configs of the right classes;
    on the CPU the default is XLA and the Pallas backends run in interpret mode."""
    with pytest.raises(ValueError, match="Kernels.backend must be one of"):
        pk.Kernels("cuda")
    with pytest.raises(ValueError, match="Kernels.triton must be a TritonConfig, got TpuConfig"):
        pk.Kernels("triton", triton=pk.TpuConfig())
    with pytest.raises(ValueError, match="Kernels.fallback must be a bool"):
        pk.Kernels("mosaic_gpu", fallback=1)
    bad_configs = [
        (pk.TritonConfig, "block_k", 24, "a power of two >= 16"),
        (pk.TritonConfig, "num_warps", 0, "a positive int"),
        (pk.MosaicGpuConfig, "block_q", 96, "a positive multiple of 64"),
        (pk.MosaicGpuConfig, "stages", 1, "an int >= 2"),
        (pk.TpuConfig, "block_q", 12, "a positive multiple of 8"),
        (pk.TpuConfig, "block_k", 64.0, "a positive multiple of 8"),
    ]
    for cls, field, value, rule in bad_configs:
        with pytest.raises(ValueError, match=f"{cls.__name__}.{field} must be {rule}, got {value!r}"):
            cls(**{field: value})
    if jax.default_backend() == "cpu":
        assert pk.Kernels.default() == XLA and not XLA.interpret
        assert pk.Kernels("triton").interpret and pk.Kernels("mosaic_gpu").interpret
    inputs = stored(random_inputs(np.random.default_rng(0), 1, 8, 4, 2, 64, 16, jnp.float32))
    with pytest.raises(ValueError, match="fallback=False. runs chunks with q and the cache in bfloat16"):
        pk.Kernels("mosaic_gpu", fallback=False).chunk_attention(**inputs)


@pytest.mark.parametrize("backend", ["xla", "triton", "mosaic_tpu"])
@pytest.mark.parametrize("T", [1, 9])
def test_a_stacked_cache_is_read_at_its_layer(backend, T):
    """With `layer` and `first_slot`, the kernels take a model's stacked cache [L, B, Hkv, C, D] and attend
    to slots [first_slot, C) of that layer exactly as to those slots alone (the Triton decode kernel reads
    the stack in place)."""
    rng = np.random.default_rng(T)
    inputs = stored(random_inputs(rng, 2, T, 8, 2, 64, 45, jnp.float32, per_head_positions=True))
    stacked, first = dict(inputs), 7
    for name in ("k_cache", "v_cache"):
        B, H, S, D = inputs[name].shape
        others = jnp.asarray(rng.normal(size=(3, B, H, first + S, D)), jnp.float32)
        stacked[name] = pk.Stored(others.at[1, :, :, first:].set(inputs[name].data))
    kernels = SMALL.get(backend, XLA)
    run = jax.jit(
        lambda x, layer, first_slot: kernels.chunk_attention(
            **x, rope=jc.RoPE(10000.0), layer=layer, first_slot=first_slot
        ),
        static_argnums=2,
    )
    for got, want in zip(run(stacked, jnp.int32(1), first), run(inputs, None, 0)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="first_slot=6 plus the 45 slots of cache_valid must equal it"):
        run(stacked, jnp.int32(1), first - 1)


@pytest.mark.parametrize("heads_first", [True, False], ids=["heads-first", "rows-first"])
def test_decode_grid_orders_equal_the_reference(heads_first):
    """The Triton decode kernel's grid in either order (TritonConfig.decode_heads_first) against the reference: three
    rows, two KV heads, several splits."""
    inputs = stored(random_inputs(np.random.default_rng(5), 3, 1, 8, 2, 64, 45, jnp.float32, per_head_positions=False))
    config = dataclasses.replace(SMALL["triton"].triton, decode_heads_first=heads_first, decode_programs=24)  # 3 splits
    rope = jc.RoPE(10000.0)
    want = XLA.chunk_attention(**inputs, rope=rope)
    got = pk.Kernels("triton", triton=config).chunk_attention(**inputs, rope=rope)
    for name, g, w in zip(["out", "lse", "inc_cache", "inc_chunk"], got, want):
        assert_close(np.asarray(g, np.float64), np.asarray(w, np.float64), jnp.float32, name)


@pytest.mark.parametrize("reduction", ["max", "mean"])
def test_the_xla_paths_query_blocks_equal_the_reference(reduction):
    """The CPU's XLA path attends a chunk's queries a block at a time (`reference.chunk_attention_blocked`,
    blocks chosen by `xla_query_block`): outputs, log-sum-exp and score increments as the reference's, the last
    block padded, ragged rows and empty queries included; without weights no increments."""
    x = random_inputs(np.random.default_rng(3), 3, 37, 4, 2, 8, 21, jnp.float32, per_head_positions=True)
    rope = jc.RoPE(10000.0)
    want = pk.reference.chunk_attention(**x, head_reduction=reduction, rope=rope)
    for block in (16, 8):  # 37 = 2 x 16 + 5 = 4 x 8 + 5
        got = pk.reference.chunk_attention_blocked(**x, head_reduction=reduction, rope=rope, block=block)
        for g, w, name in zip(got, want, ("out", "lse", "inc_cache", "inc_chunk")):
            assert_close(g, w, jnp.float32, f"{name}, block {block}")
    out, lse, *increments = pk.reference.chunk_attention_blocked(**x | {"query_weights": None}, rope=rope, block=16)
    assert increments == [None, None]
    assert_close(out, want[0], jnp.float32, "out without weights")
    # SmolLM2's chunk of 4,096 queries over 8,192 slots at batch 8: 64 queries a block, 256 MiB of logits
    assert pk.xla_query_block((8, 4096, 9, 64), 4096) == 64
    assert pk.xla_query_block((1, 1, 32, 128), 16384) == 1 and pk.xla_query_block((2, 40, 4, 8), 64) == 40
