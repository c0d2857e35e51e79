"""Pallas kernels (Triton-style, Mosaic GPU and TPU interpret modes on the CPU) against the XLA reference,
and lowering of every kernel for GPU and TPU from the CPU."""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcascade as jc
import tiny
from jcascade import pallas_kernels as pk

SMALL = {"triton": pk.gpu.GpuConfig(16, 16, 16, 32, 16, decode_programs=8), "mosaic_tpu": pk.tpu.TpuConfig(16, 32)}


def random_inputs(rng, B, T, Hq, Hkv, D, S, dtype, per_head_positions=False, weights=True):
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    lengths = rng.integers(0, T + 1, size=B)
    lengths[0] = T
    w = rng.random((B, T)).astype(np.float32) * (np.arange(T)[None] < lengths[:, None])
    return dict(
        q=f(B, T, Hq, D), k=f(B, T, Hkv, D), v=f(B, T, Hkv, D), k_cache=f(B, Hkv, S, D), v_cache=f(B, Hkv, S, D),
        cache_valid=jnp.asarray(rng.random((B, Hkv, S)) < 0.8),
        cache_positions=jnp.asarray(rng.integers(0, 5000, (B, Hkv if per_head_positions else 1, S)), jnp.int32),
        lengths=jnp.asarray(lengths, jnp.int32),
        query_weights=jnp.asarray(w) if weights else None,
    )


def assert_close(got, want, dtype, name):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f"{name}: -inf pattern")
    err = np.linalg.norm(got[finite] - want[finite]) / max(np.linalg.norm(want[finite]), 1e-30)
    assert err < (1e-2 if dtype == jnp.bfloat16 else 1e-5), f"{name}: relative error {err:.2e}"


CASES = [  # B, T, Hq, Hkv, D, S, dtype, reduction, per-head positions
    (2, 23, 4, 4, 64, 45, jnp.float32, "max", False),  # group 1
    (2, 37, 8, 2, 128, 70, jnp.float32, "mean", True),  # group 4, head_dim 128
    (1, 19, 7, 1, 64, 33, jnp.bfloat16, "max", False),  # group 7
    (3, 1, 8, 2, 64, 45, jnp.float32, "max", True),  # decode
    (2, 1, 7, 1, 128, 70, jnp.bfloat16, "mean", False),  # decode, group 7
]


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}G{c[2] // c[3]}D{c[4]}S{c[5]}-{jnp.dtype(c[6]).name}")
def test_kernel_equals_reference(backend, case):
    B, T, Hq, Hkv, D, S, dtype, reduction, per_head = case
    rng = np.random.default_rng(hash(case) % 2**32)
    inputs = random_inputs(rng, B, T, Hq, Hkv, D, S, dtype, per_head)
    rope = jc.RoPE(10000.0)
    run = lambda impl, cfg: jax.jit(
        lambda x: pk.chunk_attention(**x, head_reduction=reduction, rope=rope, implementation=impl, config=cfg)
    )(inputs)
    want = run("xla", None)
    got = run(backend, SMALL[backend])
    for name, g, w in zip(["out", "lse", "inc_cache", "inc_chunk"], got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert_close(g, w, dtype, name)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("T", [9, 1], ids=["chunk", "decode"])
def test_kernel_without_scores_or_rope(backend, T):
    rng = np.random.default_rng(1)
    inputs = random_inputs(rng, 2, T, 4, 2, 64, 21, jnp.float32, weights=False)
    want = pk.chunk_attention(**inputs, implementation="xla")
    got = pk.chunk_attention(**inputs, implementation=backend, config=SMALL[backend])
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
    want = pk.chunk_attention(**inputs, rope=rope, implementation="xla")
    got = pk.chunk_attention(**inputs, rope=rope, implementation=backend, config=SMALL[backend])
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
    attend = jax.jit(functools.partial(jc.attend, policy, rope=jc.RoPE(500.0)), static_argnames="implementation")
    state = jc.init_cache(policy, B, Hkv, D)
    for T in (5, 7, 1, 6, 1):
        q, k, v = (jnp.asarray(rng.normal(size=(B, T, h, D)), jnp.float32) for h in (Hq, Hkv, Hkv))
        lengths = jnp.asarray(rng.integers(0, T + 1, size=B), jnp.int32)
        want_out, want_scores = attend(state, q, k, v, lengths, implementation="xla")
        got_out, got_scores = attend(state, q, k, v, lengths, implementation=backend)
        assert_close(got_out, want_out, jnp.float32, "out")
        assert_close(got_scores.cache, want_scores.cache, jnp.float32, "scores.cache")
        assert_close(got_scores.chunk, want_scores.chunk, jnp.float32, "scores.chunk")
        state = jc.update(policy, state, k, v, want_scores, lengths)


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
    want = pk.chunk_attention(**inputs, head_reduction=reduction, rope=rope, implementation="xla")
    got = pk.chunk_attention(**inputs, head_reduction=reduction, rope=rope, implementation="mosaic_gpu")
    valid = np.asarray(inputs["cache_valid"])
    for name, g, w in zip(["out", "lse", "inc_cache", "inc_chunk"], got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if name == "inc_cache":  # empty slots' scores are unused (0 here, NaN in the reference next to a NaN key)
            g, w = np.where(valid, g, 0.0), np.where(valid, w, 0.0)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=name)
        assert_close(g, w, jnp.bfloat16, name)
    assert np.isnan(np.asarray(got[0])).any() == (B > 1)


def test_implementation_names_are_checked():
    with pytest.raises(ValueError, match="implementation must be one of"):
        pk.resolve("cuda")
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="needs a GPU or TPU"):
            pk.resolve("pallas")
        assert pk.resolve(None) == ("xla", False)
        assert pk.resolve("triton") == ("triton", True)
        assert pk.resolve("mosaic_gpu") == ("mosaic_gpu", True)
    inputs = random_inputs(np.random.default_rng(0), 1, 8, 4, 2, 64, 16, jnp.float32)
    with pytest.raises(ValueError, match="implementation=.mosaic_gpu. runs chunks with q and the cache in bfloat16"):
        pk.chunk_attention(**inputs, implementation="mosaic_gpu")


LOWERING_SHAPES = [  # B, T, Hq, Hkv, D, S: the benchmark shapes, odd sizes, decode
    (1, 4096, 32, 8, 128, 16448),
    (2, 37, 28, 4, 64, 45),
    (32, 1, 32, 8, 128, 16448),
    (2, 1, 7, 1, 64, 45),
]


def _abstract_inputs(B, T, Hq, Hkv, D, S):
    s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    return (s(B, T, Hq, D), s(B, T, Hkv, D), s(B, T, Hkv, D), s(B, Hkv, S, D), s(B, Hkv, S, D),
            s(B, Hkv, S, dtype=jnp.bool_), s(B, 1, S, dtype=jnp.int32), s(B, dtype=jnp.int32), s(B, T, dtype=jnp.float32))


@pytest.mark.parametrize("shape", LOWERING_SHAPES, ids=str)
def test_kernels_lower_for_gpu(shape):
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    f = jax.jit(lambda *a: pk.gpu.chunk_attention(*a, "max", jc.RoPE(500000.0)))
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(*_abstract_inputs(*shape)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == (2 if shape[1] == 1 else 3)  # decode: split-K + finish; chunk: forward + 2 scores


@pytest.mark.parametrize("shape", [s for s in LOWERING_SHAPES if s[1] > 1], ids=str)
@pytest.mark.parametrize("scores", [True, False], ids=["scores", "no-scores"])
def test_mosaic_gpu_kernels_lower_for_gpu(shape, scores):
    """The Mosaic GPU kernels through Pallas's Mosaic GPU lowering (the CUDA plugin's, installed by the README's test
    command; no GPU needed): one kernel for the forward, one more for the scores."""
    assert importlib.util.find_spec("jax_cuda13_plugin"), "the README's test command installs jax-cuda13-plugin"
    inputs = _abstract_inputs(*shape)
    f = jax.jit(lambda *a: pk.mosaic_gpu.chunk_attention(*a[:8], a[8] if scores else None, "max", jc.RoPE(500000.0)))
    text = f.trace(*inputs).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu_v2") == (2 if scores else 1)


@pytest.mark.parametrize("shape", LOWERING_SHAPES, ids=str)
def test_kernels_lower_for_tpu(shape):
    f = jax.jit(lambda *a: pk.tpu.chunk_attention(*a, "max", jc.RoPE(500000.0)))
    text = f.trace(*_abstract_inputs(*shape)).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 4


@pytest.mark.parametrize("policy", [
    jc.Cascade(cache_size=12, sinks=2, num_cascades=3, gamma=0.5),
    jc.Cascade(cache_size=8, sinks=0, num_cascades=4, gamma=0.9),
    jc.Sink(window=5, sinks=1),
], ids=["cascade3", "cascade4-nosinks", "sink"])
def test_single_token_insertion_kernel_equals_xla_update(policy):
    """Decode-time updates through the Triton insertion kernel (interpret mode) equal the vectorised
    update bit for bit, ties included, from the empty cache deep into the steady phase."""
    rng = np.random.default_rng(3)
    B, H, D = 3, 2, 16
    update = jax.jit(jc.update, static_argnums=0, static_argnames="implementation")
    xla = kernel = jc.init_cache(policy, B, H, D)
    for _ in range(60):
        k = jnp.asarray(rng.normal(size=(B, 1, H, D)), jnp.float32)
        lengths = jnp.asarray(rng.integers(0, 2, B), jnp.int32)
        scores = None
        if isinstance(policy, jc.Cascade):
            scores = jc.Scores(jnp.asarray(rng.choice([0.0, 0.25, 0.5], (B, H, xla.capacity)), jnp.float32),
                               jnp.asarray(rng.choice([0.0, 0.5, 1.0], (B, H, 1)), jnp.float32))
        xla = update(policy, xla, k, -k, scores, lengths, implementation="xla")
        kernel = update(policy, kernel, k, -k, scores, lengths, implementation="triton")
        for a, b in zip(jax.tree.leaves(xla), jax.tree.leaves(kernel)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(np.asarray(xla.seen).max()) > xla.capacity


@pytest.mark.parametrize("implementation", ["xla", "triton", "mosaic_tpu"])
@pytest.mark.parametrize("T", [1, 9])
def test_a_stacked_cache_is_read_at_its_layer(implementation, T):
    """With `layer` and `first_slot`, the kernels take a model's stacked cache [L, B, Hkv, C, D] and attend
    to slots [first_slot, C) of that layer exactly as to those slots alone (the Triton decode kernel reads
    the stack in place)."""
    rng = np.random.default_rng(T)
    inputs = random_inputs(rng, 2, T, 8, 2, 64, 45, jnp.float32, per_head_positions=True)
    stacked, first = dict(inputs), 7
    for name in ("k_cache", "v_cache"):
        B, H, S, D = inputs[name].shape
        others = jnp.asarray(rng.normal(size=(3, B, H, first + S, D)), jnp.float32)
        stacked[name] = others.at[1, :, :, first:].set(inputs[name])
    config = SMALL.get(implementation)
    run = jax.jit(lambda x, layer, first_slot: pk.chunk_attention(**x, rope=jc.RoPE(10000.0), layer=layer,
                                                                  first_slot=first_slot, implementation=implementation,
                                                                  config=config), static_argnums=2)
    for got, want in zip(run(stacked, jnp.int32(1), first), run(inputs, None, 0)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="first_slot=6 plus the 45 slots of cache_valid must equal it"):
        run(stacked, jnp.int32(1), first - 1)


@pytest.mark.parametrize("implementation", ["xla", "triton"])
@pytest.mark.parametrize("policy", [
    jc.Cascade(cache_size=12, sinks=2, num_cascades=3, gamma=0.5),
    jc.H2O(heavy=6, recent=4),
    jc.Recycled(top_k=4, refresh_every=3),
], ids=["cascade", "h2o", "recycled"])
def test_updates_write_only_their_layer_of_a_stack(implementation, policy):
    """`update` on a layer view of a stacked cache (`CacheState.layer`) writes that layer of the K/V stack
    as the layer alone would be written, in decode steps and chunks, and leaves the other layers alone."""
    rng = np.random.default_rng(4)
    B, H, D, L = 2, 2, 16, 3
    alone = jc.init_cache(policy, B, H, D, max_tokens=64)
    others = lambda: jnp.asarray(rng.normal(size=(L, *alone.k.shape)), jnp.float32)
    stack_k, stack_v = others(), others()
    view = jc.CacheState(k=stack_k.at[1].set(alone.k), v=stack_v.at[1].set(alone.v), score=alone.score, pos=alone.pos,
                         seen=alone.seen, layer=jnp.int32(1))
    update = jax.jit(jc.update, static_argnums=0, static_argnames="implementation")
    for T in [3, 1, 1, 3, 1, 1, 1, 3, 1, 1, 1, 3, 1, 1]:
        k = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
        lengths = jnp.asarray([T, rng.integers(0, T + 1)], jnp.int32)
        scores = jc.Scores(jnp.asarray(rng.choice([0.0, 0.25, 0.5], (B, H, alone.capacity)), jnp.float32),
                           jnp.asarray(rng.choice([0.0, 0.5, 1.0], (B, H, T)), jnp.float32))
        alone = update(policy, alone, k, -k, scores, lengths, implementation=implementation)
        view = update(policy, view, k, -k, scores, lengths, implementation=implementation)
        for name in ("score", "pos", "seen"):
            np.testing.assert_array_equal(np.asarray(getattr(view, name)), np.asarray(getattr(alone, name)))
        for got, want, before in ((view.k, alone.k, stack_k), (view.v, alone.v, stack_v)):
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want))
            np.testing.assert_array_equal(np.asarray(got[::2]), np.asarray(before[::2]))
    assert int(view.layer) == 1 and int(alone.seen[0]) == 22  # past the ring caches' capacities


def test_insertion_kernel_lowers_for_gpu():
    from jcascade.pallas_kernels.insert import insert_one

    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    layout = jc.Cascade(cache_size=16384, sinks=64, num_cascades=4).layout()
    B, H, cap, D = 32, 8, layout.capacity, 128
    s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    args = (s(B, H, cap, dtype=jnp.float32), s(B, H, cap, dtype=jnp.int32), s(B, H, cap, D), s(B, H, cap, D),
            s(B, H, 1, dtype=jnp.float32), s(B, 1, H, D), s(B, 1, H, D), s(B, dtype=jnp.int32), s(B, dtype=jnp.int32),
            s(B, dtype=jnp.int32))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(lambda *a: insert_one(layout, *a)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1


def test_shared_prefix_kernel_lowers_for_gpu():
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    args = (s(1, 64, 32, 128), s(1, 8, 32768, 128), s(1, 8, 32768, 128), s(1, 8, 32768, dtype=jnp.bool_),
            s(1, 1, 32768, dtype=jnp.int32))
    f = jax.jit(lambda *a: pk.gpu.prefix_attention(*a, jc.RoPE(500000.0)))
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1


def test_a_model_scores_alike_on_mosaic_gpu_and_xla():
    """jc.score through a bf16 model (strided prefill: attend, then update, per chunk and layer) with the Mosaic
    GPU chunk kernels in GPU interpret mode gives the reference's log-likelihoods."""
    model = tiny.model(97, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64, num_layers=1)
    model = jc.CausalLM(model.config, {name: w.astype(jnp.bfloat16) for name, w in model.weights().items()})
    tokens = np.random.default_rng(0).integers(0, 97, (2, 120))
    policy = jc.Cascade(cache_size=64, sinks=4, stride=64)
    logps = {impl: np.asarray(jc.score(model, tokens, policy, lengths=np.array([120, 101]), implementation=impl))
             for impl in ("xla", "mosaic_gpu")}
    assert_close(logps["mosaic_gpu"], logps["xla"], jnp.bfloat16, "log-likelihoods")
