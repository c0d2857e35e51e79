"""Quantized KV storage (`kv_dtype`, pallas_kernels/storage.py): the error bounds of the formats, every kernel
backend reading a quantized cache as the XLA reference reads it dequantized, the scales moving with their tokens
through insertion, eviction, the cascade's moves and compaction, and a model scoring with it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from jcascade.models.config import FAMILY_FEATURES, Rotary
from jcascade.pallas_kernels import storage
from kernel_inputs import SMALL, XLA, assert_close, random_inputs, stored

import jcascade as jc
from jcascade import pallas_kernels as pk

FORMATS = ["int8", "float8_e4m3fn"]


def test_the_formats_keep_their_error_bounds():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 128)) * np.exp(rng.uniform(-8, 8, size=(64, 1)))  # rows over 7 decades
    x[1] = 0.0
    x[2, :100] *= 1e-6  # a row mostly far below its largest element (float8 subnormals)
    x = jnp.asarray(x, jnp.float32)
    top = jnp.max(jnp.abs(x), -1, keepdims=True)
    codes, scale = storage.quantize(x, jnp.int8)
    assert codes.dtype == jnp.int8 and scale.dtype == jnp.float32 and int(jnp.max(jnp.abs(codes))) == 127
    assert bool(jnp.all(jnp.abs(storage.dequantize(codes, scale) - x) <= top / 254 * (1 + 1e-6)))
    codes, scale = storage.quantize(x, jnp.float8_e4m3fn)
    error = jnp.abs(storage.dequantize(codes, scale) - x)
    assert bool(jnp.all(error <= jnp.maximum(2.0**-4 * jnp.abs(x), 2.0**-10 * scale[:, None]) * (1 + 1e-6)))
    for dtype in (jnp.int8, jnp.float8_e4m3fn):
        codes, scale = storage.quantize(x.at[3, 5].set(jnp.nan), dtype)
        back = storage.dequantize(codes, scale)
        assert float(scale[1]) == 0 and bool(jnp.all(back[1] == 0))  # zeros stay zeros
        assert bool(jnp.all(jnp.isnan(back[3]))) and bool(jnp.all(jnp.isfinite(back[jnp.arange(64) != 3])))


def quantized_inputs(inputs, fmt, layer_of=None):
    """inputs with the cache as codes and scales (`Stored`); returns (those inputs, the cache dequantized in q's dtype
    as plain arrays)."""
    dtype = storage.storage_dtype(fmt, jnp.float32)
    (k, k_scale), (v, v_scale) = (storage.quantize(inputs[n], dtype) for n in ("k_cache", "v_cache"))
    q_dtype = inputs["q"].dtype
    plain = inputs | dict(
        k_cache=storage.dequantize(k, k_scale, q_dtype), v_cache=storage.dequantize(v, v_scale, q_dtype)
    )
    return inputs | dict(k_cache=pk.Stored(k, k_scale), v_cache=pk.Stored(v, v_scale)), plain


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 9], ids=["decode", "chunk"])
@pytest.mark.parametrize("backend", ["xla", "triton", "mosaic_tpu"])
def test_every_backend_reads_a_quantized_stacked_cache_as_the_reference_reads_it_dequantized(backend, T, fmt):
    """Codes and scales in a model's stack [L, B, Hkv, C, D] read at a layer from a first slot: output, log-sum-exp
    and score increments (from the dequantized keys) equal the XLA reference on the dequantized slots."""
    rng = np.random.default_rng(T)
    inputs, plain = quantized_inputs(random_inputs(rng, 2, T, 8, 2, 64, 45, jnp.float32, per_head_positions=True), fmt)
    first = 7
    stacked = dict(inputs)
    for name in ("k_cache", "v_cache"):  # the stack's codes, the layer's own scales (all C slots)
        B, H, S, D = inputs[name].shape
        stacked[name] = pk.Stored(
            jnp.zeros((3, B, H, first + S, D), inputs[name].dtype).at[1, :, :, first:].set(inputs[name].data),
            jnp.concatenate([jnp.ones((B, H, first)), inputs[name].scale], axis=-1),
        )
    rope = jc.RoPE(10000.0)
    got = jax.jit(
        lambda x: SMALL.get(backend, XLA).chunk_attention(**x, rope=rope, layer=jnp.int32(1), first_slot=first)
    )(stacked)
    want = jax.jit(lambda x: XLA.chunk_attention(**x, rope=rope))(stored(plain))
    for name, g, w in zip(["out", "lse", "inc_cache", "inc_chunk"], got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_triton_decode_dequantizes_bfloat16_queries_codes_in_registers(fmt):
    """bfloat16 queries: the decode kernel converts the codes exactly to bfloat16 and applies the scales to the
    logits and probabilities; it agrees with the reference on the dequantized cache to bfloat16's precision."""
    inputs, plain = quantized_inputs(
        random_inputs(np.random.default_rng(5), 3, 1, 8, 2, 64, 70, jnp.bfloat16, per_head_positions=True), fmt
    )
    rope = jc.RoPE(10000.0)
    got = jax.jit(lambda x: SMALL["triton"].chunk_attention(**x, rope=rope))(inputs)
    want = jax.jit(lambda x: XLA.chunk_attention(**x, rope=rope))(stored(plain))
    for name, g, w in zip(["out", "lse", "inc_cache", "inc_chunk"], got, want):
        assert_close(g, w, jnp.bfloat16, name)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rope", [jc.RoPE(10000.0), None], ids=["fused", "none"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_triton_decode_reads_a_stack_as_int16_pairs_as_the_reference_reads_it_dequantized(
    monkeypatch, fmt, rope, dtype
):
    """The pairs path (`triton.as_pairs`: the same bytes as half as many int16 elements, taken by stacks of 2**31 to
    2**32 codes) on a small stack with every 8-bit array treated as unaddressable: each pair split into its two
    codes, the keys' halves rotated in even and odd columns, the values' columns put back in order; output,
    log-sum-exp and score increments equal the reference on the dequantized slots (the order of the sums aside)."""
    monkeypatch.setattr(pk.triton, "addresses_fit", lambda array: jnp.dtype(array.dtype).itemsize != 1)
    inputs, plain = quantized_inputs(
        random_inputs(np.random.default_rng(6), 3, 1, 8, 2, 64, 70, dtype, per_head_positions=True), fmt
    )
    kernels = SMALL["triton"]
    assert kernels.quantized_decode_path(inputs["k_cache"], rope=rope) == "in place as pairs"
    text = jax.jit(lambda x: kernels.chunk_attention(**x, rope=rope)).lower(inputs).as_text()
    assert "tensor<1x3x2x70x32xi16>" in text  # the kernel's operand: the codes as int16 pairs
    got = jax.jit(lambda x: kernels.chunk_attention(**x, rope=rope))(inputs)
    want = jax.jit(lambda x: XLA.chunk_attention(**x, rope=rope))(stored(plain))
    for name, g, w in zip(["out", "lse", "inc_cache", "inc_chunk"], got, want):
        assert_close(g, w, dtype, name)


def test_the_triton_decode_converts_every_int8_code_exactly():
    """The decode kernel's int8 conversion by integer add (no int-to-float instruction) gives every code's value."""
    codes = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
    np.testing.assert_array_equal(pk.triton._int8_to_f32(codes), np.arange(-128, 128, dtype=np.float32))


def test_stacks_the_triton_kernels_cannot_address_by_the_byte_are_read_as_pairs():
    """jax 0.11's Triton lowering offsets elements in signed 32 bits below 2**32 bytes, so the in-place Triton decode
    and insertion kernels are not handed an 8-bit stack of more than 2**31 codes: decode reads it as int16 pairs of
    codes (half the elements: two layers of 64 rows x 8 heads x 16,385 slots x 128, and one layer of 32,785 slots,
    the shape that faulted; a head_dim under 64 is dequantized in a copy), insertion writes it as int16 pairs (any
    even head_dim). At 2**31 codes (32,768 slots) both take the stack of codes as it is (checked on the traced
    programs; nothing is allocated)."""
    assert pk.triton.addresses_fit(jax.ShapeDtypeStruct((2**31,), jnp.int8))
    assert not pk.triton.addresses_fit(jax.ShapeDtypeStruct((2**31 + 1,), jnp.int8))
    assert not pk.triton.addresses_fit(jax.ShapeDtypeStruct((2**32,), jnp.float8_e4m3fn))
    assert pk.triton.addresses_fit(jax.ShapeDtypeStruct((2**32 + 1,), jnp.int8))
    assert pk.triton.addresses_fit(jax.ShapeDtypeStruct((2**31 + 1,), jnp.bfloat16))
    B, H = 64, 8
    s = jax.ShapeDtypeStruct
    kernels = pk.Kernels("triton")

    def equations(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for value in eqn.params.values():
                if hasattr(value, "eqns") or hasattr(value, "jaxpr"):
                    yield from equations(getattr(value, "jaxpr", value))

    def codes_read_by_kernels(layers, slots, D=128, heads=H):
        """{Triton kernel: the shapes and dtypes of the 8- or 16-bit stacks it is handed} for a stack of `layers` x
        B x heads x slots x D codes."""
        stack, slot = s((layers, B, heads, slots, D), jnp.int8), s((B, heads, slots), jnp.float32)
        q, k = s((B, 1, 4 * heads, D), jnp.bfloat16), s((B, 1, heads, D), jnp.bfloat16)
        attend = lambda *a, **kw: kernels.chunk_attention(*a, rope=jc.RoPE(5e5), layer=jnp.int32(0), **kw)
        layout = pk.schedule.RingLayout(sinks=4, ring_size=slots - 4, num_rings=1)
        insert = lambda *a: kernels.insert(layout, *a)
        codes, scale = s((B, 1, heads, D), jnp.int8), s((B, 1, heads), jnp.float32)
        programs = [
            jax.make_jaxpr(attend)(
                q,
                k,
                k,
                pk.Stored(stack, slot),
                pk.Stored(stack, slot),
                s((B, heads, slots), jnp.bool_),
                s((B, heads, slots), jnp.int32),
                s((B,), jnp.int32),
                s((B, 1), jnp.float32),
            ),
            jax.make_jaxpr(insert)(
                pk.Stored(stack, slot),
                pk.Stored(stack, slot),
                jnp.int32(0),
                slot,
                s((B, heads, slots), jnp.int32),
                s((B,), jnp.int32),
                pk.Stored(codes, scale),
                pk.Stored(codes, scale),
                s((B, heads, 1), jnp.float32),
                s((B,), jnp.int32),
                s((B,), jnp.int32),
            ),
        ]
        return {
            eqn.params["name"]: {
                (x.aval.shape, str(x.aval.dtype))
                for x in eqn.invars
                if x.aval.dtype in (jnp.int8, jnp.int16) and x.aval.ndim == 5
            }
            for program in programs
            for eqn in equations(program.jaxpr)
            if eqn.primitive.name == "pallas_call"
        }

    assert codes_read_by_kernels(1, 32768) == {
        "jcascade_decode": {((1, B, H, 32768, 128), "int8")},
        "jcascade_decode_finish": set(),
        "jcascade_insert_one": {((1, B, H, 32768, 128), "int8")},
    }
    for layers, slots in ((2, 16385), (1, 32785)):
        codes = pk.Stored(s((layers, B, H, slots, 128), jnp.int8), s((B, H, slots), jnp.float32))
        assert kernels.quantized_decode_path(codes) == "in place as pairs"
        pairs = {((layers, B, H, slots, 64), "int16")}
        assert codes_read_by_kernels(layers, slots) == {
            "jcascade_decode": pairs,
            "jcascade_decode_finish": set(),
            "jcascade_insert_one": pairs,
        }
    codes = pk.Stored(s((1, B, 4 * H, 32785, 32), jnp.int8), s((B, 4 * H, 32785), jnp.float32))
    assert kernels.quantized_decode_path(codes) == "dequantized copy"
    assert codes_read_by_kernels(1, 32785, D=32, heads=4 * H) == {
        "jcascade_decode": set(),
        "jcascade_decode_finish": set(),
        "jcascade_insert_one": {((1, B, 4 * H, 32785, 16), "int16")},
    }


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_triton_insertion_writes_a_stack_as_int16_pairs_as_xla_writes_its_codes(monkeypatch, fmt):
    """The single-token insertion kernel (interpret mode) with every 8-bit stack treated as unaddressable, so that
    it copies rows of int16 pairs: codes, scales, scores and positions equal the XLA insertion's bit for bit, from
    the empty cache into the steady phase."""
    monkeypatch.setattr(pk.triton, "addresses_fit", lambda array: jnp.dtype(array.dtype).itemsize != 1)
    policy = jc.Cascade(cache_size=12, sinks=2, num_cascades=2, kv_dtype=fmt)
    B, H, D = 2, 2, 16
    update = jax.jit(jc.update, static_argnums=0)
    xla = jc.init_cache(policy, B, H, D, jnp.float32)
    kernel = jc.init_cache(policy, B, H, D, jnp.float32, kernels=SMALL["triton"])
    zeros = jc.Scores(jnp.zeros((B, H, kernel.capacity)), jnp.zeros((B, H, 1)))
    text = (
        jax.jit(lambda s, k: jc.update(policy, s, k, k, zeros, jnp.ones((B,), jnp.int32)))
        .lower(kernel, jnp.zeros((B, 1, H, D)))
        .as_text()
    )
    assert f"tensor<1x{B}x{H}x{kernel.capacity}x{D // 2}xi16>" in text  # the kernel's operand: the codes as pairs
    rng = np.random.default_rng(7)
    for _ in range(30):
        k = jnp.asarray(rng.normal(size=(B, 1, H, D)), jnp.float32)
        lengths = jnp.asarray(rng.integers(0, 2, B), jnp.int32)
        scores = jc.Scores(
            jnp.asarray(rng.choice([0.0, 0.25, 0.5], (B, H, xla.capacity)), jnp.float32),
            jnp.asarray(rng.choice([0.0, 0.5, 1.0], (B, H, 1)), jnp.float32),
        )
        xla, kernel = (update(policy, state, k, -k, scores, lengths) for state in (xla, kernel))
    for a, b in zip(jax.tree.leaves(xla), jax.tree.leaves(kernel)):
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1 else np.asarray(a),
            np.asarray(b).view(np.uint8) if b.dtype.itemsize == 1 else np.asarray(b),
        )
    assert int(np.asarray(xla.seen).max()) > xla.capacity


def test_mosaic_gpu_chunks_read_a_quantized_cache_dequantized():
    """Mosaic GPU (interpret mode, bfloat16, fallback=False so its own kernel runs) on int8 codes and scales
    against the XLA reference on the dequantized slots (not against itself)."""
    inputs, plain = quantized_inputs(
        random_inputs(np.random.default_rng(4), 1, 64, 4, 2, 64, 64, jnp.bfloat16, weights=False), "int8"
    )
    got = pk.Kernels("mosaic_gpu", fallback=False).chunk_attention(**inputs)[:2]
    want = pk.reference.chunk_attention(**plain)[:2]
    for g, w, name in zip(got, want, ("out", "lse")):
        assert_close(g, w, jnp.bfloat16, name)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rope", [None, jc.RoPE(100.0)], ids=["rotated", "fused"])
@pytest.mark.parametrize("backend", ["xla", "triton", "mosaic_gpu", "mosaic_tpu"])
def test_every_backend_reads_a_quantized_shared_prefix_as_the_reference_reads_it_dequantized(backend, rope, fmt):
    """A shared prefix's codes and scales (`jc.share_prefix` of a quantized cache): the Triton kernel dequantizes
    them in registers (every GPU backend; keys stored rotated, or rotated in the kernel), the other backends in a
    copy: output and log-sum-exp equal the XLA reference on the dequantized prefix."""
    rng = np.random.default_rng(len(fmt))
    P, R, Hq, Hkv, D, S = 2, 5, 8, 2, 64, 70
    q = jnp.asarray(rng.normal(size=(P, R, Hq, D)), jnp.bfloat16)
    dtype = storage.storage_dtype(fmt, jnp.float32)
    (k, k_scale), (v, v_scale) = (
        storage.quantize(jnp.asarray(rng.normal(size=(P, Hkv, S, D)), jnp.float32), dtype) for _ in range(2)
    )
    valid = jnp.asarray(rng.random((P, Hkv, S)) < 0.8)
    positions = jnp.asarray(rng.integers(0, 1000, (P, Hkv, S)), jnp.int32)
    plain = [storage.dequantize(c, scale, jnp.bfloat16) for c, scale in ((k, k_scale), (v, v_scale))]
    want = pk.Kernels("xla").prefix_attention(q, *map(pk.Stored, plain), valid, positions, rope)
    got = pk.Kernels(backend).prefix_attention(q, pk.Stored(k, k_scale), pk.Stored(v, v_scale), valid, positions, rope)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_cache_is_shared_as_codes(fmt):
    """`share_prefix` keeps a quantized cache's codes and scales as they are (zero in empty slots), its keys
    un-rotated even when given a rope (the requests rotate them as they read: no second rounding); `dtype` stores
    them dequantized instead (rotated when given a rope); a prefix's scales are checked against its codes."""
    rope = jc.RoPE(100.0)
    policy = jc.Full(stride=8, kv_dtype=fmt)
    k = jnp.asarray(np.random.default_rng(1).normal(size=(1, 6, 2, 16)), jnp.float32)
    state = jc.update(policy, jc.init_cache(policy, 1, 2, 16, jnp.float32, max_tokens=8), k, -k, None, jnp.array([5]))
    held = np.asarray(state.pos >= 0)
    for prefix in (jc.share_prefix(policy, state), jc.share_prefix(policy, state, rope=rope)):
        assert prefix.rope is None and prefix.k.dtype == state.k.dtype
        for shared, kept in ((prefix.k, state.k), (prefix.v, state.v)):
            np.testing.assert_array_equal(
                np.asarray(shared.data, np.float32), np.where(held[..., None], np.asarray(kept.data, np.float32), 0)
            )
            np.testing.assert_array_equal(np.asarray(shared.scale), np.where(held, np.asarray(kept.scale), 0))
    floats = jc.share_prefix(policy, state, rope=rope, dtype=jnp.float32)
    assert floats.k.scale is None and floats.k.dtype == jnp.float32 and floats.rope == rope
    exact = rope(jc.cached_kv(state)[0], floats.key_pos)
    np.testing.assert_allclose(np.asarray(floats.k.data), np.where(held[..., None], np.asarray(exact), 0), atol=1e-6)
    q = jnp.ones((1, 1, 2, 16), jnp.float32)
    prefix = jc.share_prefix(policy, state)
    with pytest.raises(ValueError, match="Stored holds 8-bit codes with their scales"):
        jc.Stored(prefix.v.data)  # codes without their scales
    bad = dataclasses.replace(prefix, v=prefix.v.map_scale(lambda scale: scale[0]))  # scales of another shape
    requests = jc.init_cache(jc.Full(), 1, 2, 16, jnp.float32, max_tokens=4)
    with pytest.raises(ValueError, match=r"prefixes\[0\]\.v\.scale must have shape \[1, 2, \d+\], got \[2, \d+\]"):
        jc.attend_shared(jc.Full(), requests, q, q, q, [bad])
    with pytest.raises(TypeError, match=r"prefixes\[0\]\.k must be a jc\.Stored value"):
        jc.attend_shared(jc.Full(), requests, q, q, q, [dataclasses.replace(prefix, k=prefix.k.data)])
    with pytest.raises(ValueError, match="dtype must be None .* or a floating dtype"):
        jc.share_prefix(policy, state, dtype=jnp.int8)


POLICIES = [  # each at cache pressure (48 tokens into fewer slots): the cascade's moves, heavy slots, compaction
    lambda d: jc.Cascade(cache_size=24, sinks=2, num_cascades=3, stride=8, kv_dtype=d),
    lambda d: jc.H2O(heavy=8, recent=8, stride=8, kv_dtype=d),
    lambda d: jc.SnapKV(budget=16, window=4, stride=8, kv_dtype=d),
    lambda d: jc.AdaKV(jc.SnapKV(budget=16, window=4, stride=8, kv_dtype=d)),
]


@pytest.mark.parametrize(
    "policy,fmt",
    [(p, "int8") for p in POLICIES] + [(POLICIES[0], "float8_e4m3fn")],
    ids=lambda x: x if isinstance(x, str) else type(x("model")).__name__,
)
def test_scales_move_with_their_tokens(policy, fmt):
    """The same chunks (then single tokens) and the same scores into a cache in the model's dtype and into a
    quantized one (on the Triton kernels in interpret mode: the single-token insertion kernel moves the scales
    too): every slot holds the same token in both, and the quantized one's dequantized keys and values lie within
    the format's bound of the others' (a scale left behind by its token would break it); the compressing
    policies compress alike. (A scale is float32 whatever the codes: float8 once, on Cascade's moves.)"""
    plain, quantized = policy("model"), policy(fmt)
    B, H, D = 2, 2, 16
    states = [
        jc.init_cache(p, B, H, D, jnp.float32, max_tokens=64, kernels=SMALL["triton"]) for p in (plain, quantized)
    ]
    assert states[1].k.dtype == storage.storage_dtype(fmt, jnp.float32) and states[1].k.scale is not None

    @jax.jit
    def step(states, q, k, v, n):
        _, scores = jc.attend(plain, states[0], q, k, v, n)
        return [jc.update(p, s, k, v, scores, n) for p, s in zip((plain, quantized), states)]

    rng = np.random.default_rng(0)
    for chunk_len in [8] * 6 + [1] * 4:
        q, k, v = (jnp.asarray(rng.normal(size=(B, chunk_len, h, D)), jnp.float32) for h in (4, H, H))
        states = step(states, q, k, v, jnp.array([8, 5] if chunk_len > 1 else [1, 0], jnp.int32))
        if plain.observation_window and chunk_len > 1 and int(states[0].seen[0]) == 48:
            states = [jc.compress(p, s, 8) for p, s in zip((plain, quantized), states)]
    np.testing.assert_array_equal(states[0].pos, states[1].pos)
    bound = 1 / 254 if fmt == "int8" else 2.0**-4
    for want, got in zip(jc.cached_kv(states[0]), jc.cached_kv(states[1])):
        top = jnp.max(jnp.abs(want), -1, keepdims=True)
        assert bool(jnp.all(jnp.abs(got - want) <= bound * top * (1 + 1e-5)))


def test_a_model_scores_with_a_quantized_cache():
    """Within one chunk no token is read from the cache (the chunk attends to itself at the model's precision):
    Full in int8 scores a one-chunk text as in the model's dtype. Across chunks and decode steps Cascade reads
    quantized keys and values: int8 (8 bits of mantissa) lies nearer the model's dtype than float8 (4), and the
    cache prefill leaves holds codes and scales."""
    model = tiny.model(96, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4, scale=0.3)
    tokens = np.random.default_rng(0).integers(0, 96, (2, 40)).astype(np.int32)
    lengths = np.array([40, 31], np.int32)
    score = lambda policy, **kw: np.asarray(jc.score(model, tokens, policy, lengths=lengths, **kw))
    np.testing.assert_array_equal(score(jc.Full(stride=64, kv_dtype="int8")), score(jc.Full(stride=64)))
    plain = jc.Cascade(cache_size=24, sinks=2, num_cascades=2, stride=8)
    want = score(plain, prefix=24)
    error = {d: np.abs(score(dataclasses.replace(plain, kv_dtype=d), prefix=24) - want).mean() for d in FORMATS}
    assert 0 < error["int8"] < error["float8_e4m3fn"], error
    quantized = dataclasses.replace(plain, kv_dtype="int8")
    state, _, _ = jc.prefill(model, quantized, model.init_cache(quantized, 2), tokens, lengths)
    assert state.cache.k.dtype == jnp.int8 and state.cache.k.scale.shape == state.cache.pos.shape


def test_a_gemma_model_stores_its_window_caches_in_the_policys_format():
    """Gemma 3's sliding layers keep their window caches in the policy's kv_dtype, as its global layers keep
    theirs: after a prompt longer than the window both hold int8 codes, scores lie nearer the model's dtype's in
    int8 than in float8, and a sliding policy cannot name a format of its own."""
    model = tiny.model(
        96,
        architecture="gemma3",
        **FAMILY_FEATURES["gemma3"],
        layer_types=("sliding", "global"),
        sliding_window=8,
        rotary=Rotary(theta=10000.0, local_theta=10000.0),
        scale=0.3,
    )
    tokens = np.random.default_rng(1).integers(0, 96, (2, 40)).astype(np.int32)
    lengths = np.array([40, 27], np.int32)
    plain = jc.Cascade(cache_size=24, sinks=2, num_cascades=2, stride=8)
    quantized = dataclasses.replace(plain, kv_dtype="int8")
    state = jc.prefill(model, quantized, model.init_cache(quantized, 2), tokens, lengths)[0]
    assert state.cache.k.dtype == state.window.k.dtype == jnp.int8
    assert state.window.k.scale.shape == state.window.pos.shape
    want = np.asarray(jc.score(model, tokens, plain, lengths=lengths, prefix=16))
    error = {
        d: np.abs(
            np.asarray(jc.score(model, tokens, dataclasses.replace(plain, kv_dtype=d), lengths=lengths, prefix=16))
            - want
        ).mean()
        for d in FORMATS
    }
    assert 0 < error["int8"] < error["float8_e4m3fn"] < 0.2, error
    with pytest.raises(ValueError, match="sliding_policy's kv_dtype must be 'model', got 'int8'"):
        model.with_sliding_policy(jc.Sink(window=8, sinks=2, kv_dtype="int8"))


def test_the_xla_paths_memory_under_a_quantized_cache_stays_near_the_model_dtypes():
    """`jcascade ruler --policy snapkv:budget=64,kv_dtype=int8` on the CPU once asked for 30 GB (SmolLM2, 8 rows of
    4K: the XLA path held every query's logits of a 4K chunk). Scaled down (bfloat16, 4 rows of 2,048 tokens in one
    chunk), the compiled generate's temporaries in int8 are within 1.5x of the model dtype's, and neither holds the
    chunk's logits [B, Hq, T, S + T] at once."""
    config = tiny.model(
        96, hidden_size=128, intermediate_size=128, num_heads=8, num_kv_heads=2, head_dim=64, num_layers=4
    ).config
    weights = jax.eval_shape(lambda: jc.CausalLM.random(config, jax.random.key(0), jnp.bfloat16).weights())
    tokens = jax.ShapeDtypeStruct((4, 2048), jnp.int32)
    temp = {}
    for kv_dtype in ("model", "int8"):
        policy = jc.SnapKV(budget=64, kv_dtype=kv_dtype)
        run = jax.jit(lambda w, t: jc.generate(jc.CausalLM(config, w), t, policy, max_new_tokens=4))
        temp[kv_dtype] = run.lower(weights, tokens).compile().memory_analysis().temp_size_in_bytes
    logits = 4 * 8 * 2048 * (2048 + 2048) * 4
    assert temp["int8"] <= 1.5 * temp["model"] and max(temp.values()) < logits, (temp, logits)


def test_kv_dtype_is_checked_and_written_in_specs():
    with pytest.raises(ValueError, match=r"Cascade.kv_dtype must be one of \('model', 'int8', 'float8_e4m3fn'\)"):
        jc.Cascade(cache_size=64, kv_dtype="int4")
    policy = jc.policies.parse_policy("snapkv:budget=64,kv_dtype=float8_e4m3fn")
    assert policy == jc.SnapKV(budget=64, kv_dtype="float8_e4m3fn")
    assert jc.AdaKV(policy).kv_dtype == "float8_e4m3fn"
    # int8 with its scales: (D + 4) / (2 D) of bfloat16's bytes per slot
    caches = {d: jc.init_cache(jc.Sink(window=60, kv_dtype=d), 1, 8, 128, jnp.bfloat16) for d in ("model", "int8")}
    sizes = {
        d: sum(x.nbytes for x in (s.k.data, s.v.data, s.k.scale, s.v.scale) if x is not None) for d, s in caches.items()
    }
    assert sizes["int8"] / sizes["model"] == (128 + 4) / 256
    jax.jit(lambda state: state, donate_argnums=0)(caches["int8"])  # its buffers are distinct: a cache can be donated
