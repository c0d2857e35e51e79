"""What a cache stores, as one value (`jc.Stored`, pallas_kernels/storage.py): codes and their scales together, the
one place that asks whether a cache is quantized; a model's state saved with its storage format and refused under
another."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from jcascade.models.state import restored, saved_arrays

import jcascade as jc

ROOT = pathlib.Path(__file__).parent.parent


def test_a_stored_value_holds_codes_with_their_scales_or_floats_without():
    codes = jnp.zeros((2, 3, 4), jnp.int8)
    with pytest.raises(ValueError, match="8-bit codes with their scales"):
        jc.Stored(codes)
    with pytest.raises(ValueError, match="8-bit codes with their scales"):
        jc.Stored(jnp.zeros((2, 3, 4)), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"Stored.scale must have shape \[2, 3\]"):
        jc.Stored(codes, jnp.ones((3, 2)))
    stack = jc.Stored(jnp.zeros((5, 2, 3, 4), jnp.int8), jnp.ones((2, 3)))  # a layer's view: its own scales
    assert stack.of_layer(jnp.int32(1)).shape == (2, 3, 4)


@pytest.mark.parametrize("fmt", ["model", "int8", "float8_e4m3fn"])
def test_a_tokens_scale_moves_with_its_codes(fmt):
    """Writing, moving (`map`) and slicing keep each slot's codes beside their scale: every slot decodes to the token
    written there, within the format's error bound."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 6, 8)) * np.exp(rng.uniform(-4, 4, size=(2, 6, 1))), jnp.float32)
    cache = jc.Stored.empty((2, 10, 8), fmt, jnp.float32)
    assert cache.quantized == (fmt != "model")
    dest = jnp.array([9, 0, 4, 2, 7, 5])
    cache = cache.set((slice(None), dest), cache.encode(x))
    order = jnp.argsort(dest)
    moved = cache.map(lambda a: a[:, jnp.sort(dest)])  # the written slots, in slot order
    top = jnp.max(jnp.abs(x), -1, keepdims=True)
    bound = {"model": 0.0, "int8": 1 / 254, "float8_e4m3fn": 2.0**-4}[fmt]
    error = np.abs(np.asarray(moved.decode() - x[:, order]))
    assert np.all(error <= np.asarray(top[:, order]) * bound * (1 + 1e-6)), error.max()
    assert cache.slots_from(4).decode().shape == (2, 6, 8)
    other = jc.Stored.empty((2, 6, 8), "int8" if fmt == "model" else "model", jnp.float32).encode(x)
    with pytest.raises(ValueError, match="x must be in this value's format"):
        cache.set((slice(None), dest), other)


def test_only_the_storage_type_asks_whether_a_cache_is_quantized():
    """No code outside pallas_kernels/storage.py tests a cache's scales for None, or passes or reads them apart from
    their codes (a `k_scale` / `v_scale` field or argument): it asks the value (`Stored.quantized`, `encode`,
    `decode`, `map`)."""
    found = []
    for folder in ("jcascade", "models", "pallas_kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() == "pallas_kernels/storage.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                tested = (
                    isinstance(node, ast.Compare)
                    and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
                    and any(isinstance(n, ast.Attribute) and n.attr == "scale" for n in (node.left, *node.comparators))
                )
                named = (isinstance(node, ast.Attribute) and node.attr in ("k_scale", "v_scale")) or (
                    isinstance(node, ast.keyword) and node.arg in ("k_scale", "v_scale")
                )
                if tested or named:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


@pytest.mark.parametrize("fmt", ["int8", "model"])
def test_a_saved_state_records_its_storage_and_is_refused_under_another(fmt, tmp_path):
    """A model's state saved by name (`saved_arrays`: codes and scales, or keys and values in the model's dtype) reads
    back equal under the run that made it, and is refused, naming the arrays that differ, by a run whose policy
    stores another format."""
    model = tiny.model(64, num_layers=2)
    policy = jc.SnapKV(budget=8, window=4, stride=8, kv_dtype=fmt)
    state = model.init_cache(policy, 1, max_tokens=24)
    _, state = model(policy, state, jnp.arange(8, dtype=jnp.int32)[None] + 3, jnp.array([8], jnp.int32))
    jc.save_stream(tmp_path, {"state": saved_arrays(state)}, {})
    arrays, _ = jc.load_stream(tmp_path)
    like = jax.eval_shape(lambda: model.init_cache(policy, 1, max_tokens=24))
    back = restored(arrays["state"], like, "the checkpoint")
    for want, got in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert back.cache.kernels == state.cache.kernels
    other = jc.SnapKV(budget=8, window=4, stride=8, kv_dtype="float8_e4m3fn" if fmt == "int8" else "int8")
    like = jax.eval_shape(lambda: model.init_cache(other, 1, max_tokens=24))
    with pytest.raises(ValueError, match=r"the checkpoint: holds another state .* cache\.k\.data \(saved "):
        restored(arrays["state"], like, "the checkpoint")


ROPE = jc.RoPE(10000.0)
ROTATING = [
    jc.Full(stride=8),
    jc.SlidingWindow(window=10, stride=8),
    jc.Sink(window=8, sinks=2, stride=8),
    jc.Sink(window=8, sinks=2, stride=8, positions="original"),
    jc.Cascade(cache_size=12, sinks=2, num_cascades=2, stride=8),
    jc.H2O(heavy=6, recent=6, stride=8),
    jc.TOVA(cache_size=12, stride=8),
    jc.SnapKV(budget=12, window=4, stride=8),
    jc.KNorm(budget=12, stride=8),
    jc.ExpectedAttention(budget=12, window=4, future=16, sinks=2, stride=8),
    jc.Recycled(top_k=6, refresh_every=3, stride=8),
]


@pytest.mark.parametrize("policy", ROTATING, ids=lambda p: f"{p.label}-{p.positions}")
def test_keys_stored_rotated_attend_as_keys_rotated_when_read(policy):
    """A cache storing its keys rotated at their own positions (`init_cache(rope=)`) attends as one rotating them
    as it reads them, at the policy's key positions (the tokens' own, or their ranks: Sink and SlidingWindow with
    one query rotation per segment; Cascade, H2O and TOVA with ranks keep their keys un-rotated), through
    evictions, a compression and decode steps, ragged rows; `cached_kv` gives the keys un-rotated."""
    rng = np.random.default_rng(0)
    B, Hq, Hkv, D = 2, 4, 2, 16
    states = [jc.init_cache(policy, B, Hkv, D, jnp.float32, max_tokens=48, rope=r) for r in (ROPE, None)]
    assert states[0].rope == (ROPE if policy.stores_rotated else None) and states[1].rope is None
    assert policy.stores_rotated == (policy.positions == "original" or isinstance(policy, jc.SlidingWindow))
    steps = [8, 8, 8, "compress", 1, 1, 1, 1, 1]

    @jax.jit
    def step(state, q, k, v, lengths):  # one program per chunk length and storage (eager ops compile one each)
        out = jc.attend(policy, state, q, k, v, lengths, ROPE)
        return out, jc.update(policy, state, k, v, out[1], lengths)

    for T in steps:
        if T == "compress":
            if policy.observation_window:
                states = [jax.jit(jc.compress, static_argnums=(0, 2))(policy, s, 8) for s in states]
            continue
        x = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
        q, k, v = x(B, T, Hq, D), x(B, T, Hkv, D), x(B, T, Hkv, D)
        lengths = jnp.array([T, max(T - 3, 0) if T > 1 else 1], jnp.int32)
        outs, states = zip(*(step(s, q, k, v, lengths) for s in states))
        np.testing.assert_allclose(np.asarray(outs[0][0]), np.asarray(outs[1][0]), rtol=1e-5, atol=1e-5)
        if outs[0][1] is not None:
            for got, want in zip(jax.tree.leaves(outs[0][1]), jax.tree.leaves(outs[1][1])):
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(states[0].pos), np.asarray(states[1].pos))
    for got, want in zip(jc.cached_kv(states[0]), jc.cached_kv(states[1])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_cache_storing_rotated_keys_refuses_another_rope_and_writes_without_positions():
    policy = jc.Full(stride=8)
    state = jc.init_cache(policy, 1, 1, 8, max_tokens=8, rope=ROPE)
    x = jnp.ones((1, 2, 1, 8))
    with pytest.raises(ValueError, match=r"rope must be the RoPE this cache stores its keys rotated by"):
        jc.attend(policy, state, x, x, x, rope=jc.RoPE(500000.0))
    with pytest.raises(ValueError, match=r"rope must be the RoPE this cache stores its keys rotated by"):
        jc.attend(policy, state, x, x, x)
    with pytest.raises(ValueError, match="positions must be given"):
        jc.write_kv(state, (), jnp.zeros((1, 1, 8, 8)), jnp.zeros((1, 1, 8, 8)))
