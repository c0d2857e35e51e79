"""The stacked cache is held once: jc.generate compiled inside a user's jit needs, beyond the cache itself,
at most half a byte of temporaries per cache byte (the layer loop carries the cache and updates each
layer's slice in place; it used to take the cache as scan input and emit a new one). A model with sliding
layers keeps a window cache for them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from flax import nnx
from jcascade.models.config import FAMILY_FEATURES, Attention, Rotary

import jcascade as jc

GEMMA3 = dict(
    architecture="gemma3",
    **FAMILY_FEATURES["gemma3"],
    layer_types=("sliding",) * 4 + ("global",) * 4,
    sliding_window=64,
    rotary=Rotary(theta=10000.0, local_theta=10000.0),
)


@pytest.mark.parametrize("family", [{}, GEMMA3], ids=["llama", "gemma3"])
def test_generate_holds_the_cache_once(family):
    """(Gemma 3: both caches, through the `lax.cond` on the layer type.)"""
    model = tiny.model(97, num_layers=8, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64, **family)
    tokens = jnp.zeros((2, 256), jnp.int32)
    measured = []
    for cache_size in (1024, 4096):
        policy = jc.Cascade(cache_size=cache_size, sinks=16, stride=16)
        generate = jax.jit(lambda t: jc.generate(model, t, policy, max_new_tokens=16))
        temp = generate.lower(tokens).compile().memory_analysis().temp_size_in_bytes
        state = jax.eval_shape(lambda: model.init_cache(policy, 2))
        measured.append((sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)), temp))
    (cache_0, temp_0), (cache_1, temp_1) = measured
    slope = (temp_1 - temp_0) / (cache_1 - cache_0)
    assert slope <= 1.5, f"{slope:.2f} bytes of temporaries per cache byte (the cache itself is 1)"


def test_sliding_layers_get_a_window_cache_of_their_own():
    """Gemma 3's layer types: the global layers get the policy's cache, the sliding layers one of window - 1
    slots (the query itself makes the window), each stacked over its own layers; ragged rows equal each row
    alone, across the window."""
    model = tiny.model(
        97,
        seed=2,
        architecture="gemma3",
        **FAMILY_FEATURES["gemma3"],
        num_layers=3,
        sliding_window=8,
        layer_types=("sliding", "global", "sliding"),
        rotary=Rotary(theta=10000.0, local_theta=10000.0),
        attention=Attention(query_scale=0.3),
    )
    policy = jc.Cascade(cache_size=16, sinks=2, num_cascades=2, stride=8)
    state = model.init_cache(policy, 2)
    assert state.cache.k.shape == (1, 2, 2, 18, 8) and state.window.k.shape == (2, 2, 2, 7, 8)
    tokens = np.random.default_rng(3).integers(0, 97, (2, 40))
    both = np.asarray(jc.score(model, tokens, policy, lengths=np.array([40, 23])))
    alone = np.asarray(jc.score(model, tokens[1:, :23], policy))
    np.testing.assert_allclose(both[1, :22], alone[0], rtol=1e-6, atol=1e-5)  # log-probs down to -29: 8 ulps
    assert not both[1, 22:].any()
    with pytest.raises(ValueError, match="num_samples is not supported yet for models with sliding or linear layers"):
        jc.generate(model, tokens[:1], policy, max_new_tokens=4, num_samples=2)


def _chunk_after_a_first_one(policy, seed=0, B=2, Hkv=2, G=2, D=8, T=6):
    """A cache under `policy` after a first 9-token chunk (row 1 holds 5 of them) and a second chunk's
    q [B, T, Hkv*G, D], k, v [B, T, Hkv, D] and lengths."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    rope = jc.RoPE(10000.0)
    state = jc.init_cache(policy, B, Hkv, D, jnp.float32, max_tokens=16)
    q, k, v, lengths = normal(B, 9, Hkv * G, D), normal(B, 9, Hkv, D), normal(B, 9, Hkv, D), jnp.array([9, 5])
    _, scores = jc.attend(policy, state, q, k, v, lengths, rope)
    state = jc.update(policy, state, k, v, scores, lengths)
    return state, normal(B, T, Hkv * G, D), normal(B, T, Hkv, D), normal(B, T, Hkv, D), jnp.array([T, 4]), rope


def test_window_attention_with_a_window_past_every_token_is_the_policys_attention():
    """Outputs and score increments equal `jc.attend`'s (cache positions, max over a KV head's queries)."""
    from jcascade.models.layers.window import window_attention

    policy = jc.Cascade(cache_size=8, sinks=2, num_cascades=2, stride=16)
    state, q, k, v, lengths, rope = _chunk_after_a_first_one(policy)
    out, scores = window_attention(policy, state, q, k, v, lengths, rope, window=10**6)
    want_out, want = jc.attend(policy, state, q, k, v, lengths, rope)
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    np.testing.assert_allclose(scores.cache, want.cache, atol=1e-5)
    np.testing.assert_allclose(scores.chunk, want.chunk, atol=1e-5)


def test_window_attention_over_a_quantized_cache_reads_each_code_times_its_scale():
    """A window cache in int8 (a Gemma model under a policy with kv_dtype="int8") attends as the float32 cache
    that holds its codes times their slots' scales."""
    from jcascade.models.layers.window import window_attention

    policy = jc.Cascade(cache_size=8, sinks=2, num_cascades=2, stride=16, kv_dtype="int8")
    state, q, k, v, lengths, rope = _chunk_after_a_first_one(policy)
    assert state.k.dtype == jnp.int8
    plain = dataclasses.replace(
        state,
        k=jc.Stored(state.k.data.astype(jnp.float32) * state.k.scale[..., None]),
        v=jc.Stored(state.v.data.astype(jnp.float32) * state.v.scale[..., None]),
    )
    out, scores = window_attention(policy, state, q, k, v, lengths, rope, window=7)
    want_out, want = window_attention(dataclasses.replace(policy, kv_dtype="model"), plain, q, k, v, lengths, rope, 7)
    np.testing.assert_allclose(out, want_out, atol=1e-6)
    np.testing.assert_allclose(scores.cache, want.cache, atol=1e-6)
    np.testing.assert_allclose(scores.chunk, want.chunk, atol=1e-6)


def test_window_attention_sees_only_the_window():
    """Each query against a brute-force softmax over the held and chunk keys within `window` positions."""
    from jcascade.models.layers.window import window_attention

    policy, window = jc.Full(stride=16), 5
    state, q, k, v, lengths, rope = _chunk_after_a_first_one(policy, seed=1)
    out, scores = window_attention(policy, state, q, k, v, lengths, rope, window)
    assert scores is None
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    for b in range(B):
        start = int(state.seen[b])
        held = [
            (int(p), np.asarray(state.k.data[b, :, s]), np.asarray(state.v.data[b, :, s]))
            for s, p in enumerate(np.asarray(state.pos[b, 0]))
            if p >= 0
        ]
        chunk = [(start + j, np.asarray(k[b, j]), np.asarray(v[b, j])) for j in range(int(lengths[b]))]
        for i in range(T):
            if i >= lengths[b]:
                assert not np.asarray(out[b, i]).any()
                continue
            p = start + i
            visible = [(pos, kk, vv) for pos, kk, vv in held + chunk[: i + 1] if p - window < pos <= p]
            for h in range(Hq):
                g = h // (Hq // Hkv)
                qr = np.asarray(rope(q[b, i, h][None, None], jnp.array([[p]])))[0, 0]
                logits = np.array(
                    [qr @ np.asarray(rope(kk[g][None, None], jnp.array([[pos]])))[0, 0] for pos, kk, _ in visible]
                ) / np.sqrt(D)
                weights = np.exp(logits - logits.max())
                want = (weights / weights.sum()) @ np.stack([vv[g] for _, _, vv in visible])
                np.testing.assert_allclose(out[b, i, h], want, atol=1e-5)


def test_a_policy_of_the_sliding_layers_serves_them_with_the_window_still_applied():
    """A 7-token sliding window as the sliding layers' policy on a model trained with a 16-token window gives
    the model whose window is 8 token by token (a chunk sees itself whole, as under any policy); a Cascade
    that keeps every token gives the trained window (the scores' path); the policy survives `nnx.split`
    (and `shard`: tests/models/test_sharding.py)."""
    fields = dict(
        architecture="gemma3",
        **FAMILY_FEATURES["gemma3"],
        num_layers=3,
        layer_types=("sliding", "global", "sliding"),
        rotary=Rotary(theta=10000.0, local_theta=10000.0),
        attention=Attention(query_scale=0.3),
    )
    model = tiny.model(97, seed=4, sliding_window=16, **fields)
    narrow = tiny.model(97, seed=4, sliding_window=8, **fields)
    policy = jc.Cascade(cache_size=16, sinks=2, num_cascades=2, stride=8)
    tokens = np.random.default_rng(5).integers(0, 97, (2, 40))
    lengths = np.array([40, 29])
    score = lambda m, policy=policy: np.asarray(jc.score(m, tokens, policy, lengths=lengths))
    seven = model.with_sliding_policy(jc.SlidingWindow(window=7, positions="original"))
    by_token = jc.Cascade(cache_size=16, sinks=2, num_cascades=2, stride=1)
    np.testing.assert_allclose(score(seven, by_token), score(narrow, by_token), atol=1e-4)
    assert np.abs(score(seven, by_token) - score(model, by_token)).max() > 1e-3
    keeps_all = model.with_sliding_policy(jc.Cascade(cache_size=48, sinks=2, num_cascades=2, positions="original"))
    assert keeps_all.init_cache(policy, 2).window.k.shape[3] == 50  # [layers, B, Hkv, slots, D]
    np.testing.assert_allclose(score(keeps_all), score(model), atol=1e-4)
    graph, state = nnx.split(seven)
    np.testing.assert_allclose(
        np.asarray(jc.score((graph, state), tokens, policy, lengths=lengths)), score(seven), atol=1e-4
    )
    with pytest.raises(ValueError, match="sliding_policy must act while tokens stream"):
        model.with_sliding_policy(jc.SnapKV(budget=8, window=4))
    with pytest.raises(ValueError, match="has none"):
        tiny.model(97).with_sliding_policy(jc.Sink(window=8, sinks=2))
