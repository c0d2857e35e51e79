"""`attend` against a dense float64 numpy reference: outputs, exact score increments, positions, masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import np_rope

import jcascade as jc

ATTEND = jax.jit(jc.attend, static_argnums=(0, 6))
UPDATE = jax.jit(jc.update, static_argnums=0)


def dense_reference(policy, state, q, k, v, lengths, gamma, reduction):
    """Per row and KV head: the visible keys listed explicitly, softmax in float64. gamma None: H2O's
    weights (every valid query counts 1)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    pos = np.asarray(state.pos)
    ck, cv = (np.asarray(x, np.float64) for x in jc.cached_kv(state))
    seen = np.asarray(state.seen)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    out = np.zeros((B, T, Hq, D))
    inc_cache = np.zeros(pos.shape)
    inc_chunk = np.zeros((B, Hkv, T))
    for b in range(B):
        n = lengths[b]
        w = (1 - gamma) * gamma ** (n - 1 - np.arange(T)) if gamma is not None else (np.arange(T) < n) * 1.0
        for h in range(Hkv):
            slots = np.nonzero(pos[b, h] >= 0)[0]
            if policy.positions == "cache":  # rank of each held token in age (= original position) order
                key_pos = np.argsort(np.argsort(pos[b, h, slots]))
                start = len(slots)
            else:
                key_pos, start = pos[b, h, slots], seen[b]
            keys = np.concatenate(
                [np_rope(ck[b, h, slots], key_pos, 100.0), np_rope(k[b, :, h], start + np.arange(T), 100.0)]
            )
            vals = np.concatenate([cv[b, h, slots], v[b, :, h]])
            probs = np.zeros((G, T, len(slots) + T))
            for g in range(G):
                hq = h * G + g
                for i in range(n):
                    visible = len(slots) + i + 1
                    logits = keys[:visible] @ np_rope(q[b, i, hq], start + i, 100.0) / np.sqrt(D)
                    p = np.exp(logits - logits.max())
                    p /= p.sum()
                    probs[g, i, :visible] = p
                    out[b, i, hq] = p @ vals[:visible]
            weighted = np.einsum("gik,i->gk", probs, w)
            red = weighted.max(0) if reduction == "max" else weighted.mean(0)
            inc_cache[b, h, slots] = red[: len(slots)]
            inc_chunk[b, h] = red[len(slots) :]
    return out, inc_cache, inc_chunk


def filled_state(policy, B, Hkv, D, rng, chunks, dtype=jnp.float32):
    """A cache after a few ragged chunks of random data (with evictions, holes and compares)."""
    rope = jc.RoPE(100.0)
    state = jc.init_cache(policy, B, Hkv, D, dtype)
    for _ in range(chunks):
        T = 5
        q = jnp.asarray(rng.normal(size=(B, T, Hkv, D)), dtype)
        k = jnp.asarray(rng.normal(size=(B, T, Hkv, D)), dtype)
        lengths = jnp.asarray(rng.integers(0, T + 1, size=B), jnp.int32)
        _, scores = ATTEND(policy, state, q, k, k, lengths, rope)
        state = UPDATE(policy, state, k, k, scores, lengths)
    return state


@pytest.mark.parametrize("positions", ["cache", "original"])
@pytest.mark.parametrize("group,reduction", [(1, "max"), (4, "mean"), (7, "max")])
def test_attend_equals_dense_reference(positions, group, reduction):
    rng = np.random.default_rng(group)
    policy = jc.Cascade(cache_size=9, sinks=2, num_cascades=3, gamma=0.7, head_reduction=reduction, positions=positions)
    B, Hkv, D, T = 3, 2, 8, 6
    state = filled_state(policy, B, Hkv, D, rng, chunks=5)
    assert (np.asarray(state.pos) < 0).any() or np.asarray(state.seen).max() > 11  # holes or evictions
    q = rng.normal(size=(B, T, Hkv * group, D)).astype(np.float32)
    k = rng.normal(size=(B, T, Hkv, D)).astype(np.float32)
    v = rng.normal(size=(B, T, Hkv, D)).astype(np.float32)
    lengths = np.array([T, 0, 4], np.int32)
    out, scores = ATTEND(
        policy, state, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), jc.RoPE(100.0)
    )
    ref_out, ref_cache, ref_chunk = dense_reference(policy, state, q, k, v, lengths, 0.7, reduction)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores.cache, ref_cache, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(scores.chunk, ref_chunk, rtol=1e-5, atol=1e-9)
    assert not np.asarray(out[1]).any()  # an all-padding row gives zeros


@pytest.mark.parametrize("positions", ["cache", "original"])
def test_h2o_attend_sums_attention_like_the_dense_reference(positions):
    rng = np.random.default_rng(9)
    policy = jc.H2O(heavy=4, recent=3, positions=positions)
    B, Hkv, D, T = 2, 2, 8, 5
    state = filled_state(policy, B, Hkv, D, rng, chunks=5)
    q = rng.normal(size=(B, T, Hkv * 2, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, T, Hkv, D)).astype(np.float32) for _ in range(2))
    lengths = np.array([T, 3], np.int32)
    out, scores = ATTEND(policy, state, *(jnp.asarray(x) for x in (q, k, v, lengths)), jc.RoPE(100.0))
    ref_out, ref_cache, ref_chunk = dense_reference(policy, state, q, k, v, lengths, None, "mean")
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores.cache, ref_cache, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(scores.chunk, ref_chunk, rtol=1e-5, atol=1e-9)


def test_attend_bf16_is_close_to_float64_reference():
    rng = np.random.default_rng(11)
    policy = jc.Cascade(cache_size=8, sinks=1, num_cascades=2, gamma=0.9)
    B, Hkv, D, T = 2, 2, 16, 4
    state = filled_state(policy, B, Hkv, D, rng, chunks=4, dtype=jnp.bfloat16)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, h, D)), jnp.bfloat16) for h in (4, Hkv, Hkv))
    lengths = np.array([T, 3], np.int32)
    out, scores = ATTEND(policy, state, q, k, v, jnp.asarray(lengths), jc.RoPE(100.0))
    ref_out, ref_cache, _ = dense_reference(
        policy, state, q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), lengths, 0.9, "max"
    )
    assert out.dtype == jnp.bfloat16
    rel = np.linalg.norm(np.asarray(out, np.float64) - ref_out) / np.linalg.norm(ref_out)
    assert rel < 2e-2
    np.testing.assert_allclose(scores.cache, ref_cache, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize(
    "policy",
    [
        jc.Cascade(cache_size=12, sinks=3, num_cascades=3, gamma=0.9),  # 3 rings: needs the eager fill
        jc.Sink(window=15, sinks=0),
        jc.H2O(heavy=6, recent=9),
        jc.Full(),
    ],
)
def test_attend_then_update_equals_full_attention_while_the_stream_fits(policy):
    rng = np.random.default_rng(5)
    B, Hkv, G, D, T = 2, 2, 2, 8, 4
    rope = jc.RoPE(100.0)
    state = jc.init_cache(policy, B, Hkv, D, max_tokens=15)
    rows_q, rows_k, rows_v, rows_out = ([[] for _ in range(B)] for _ in range(4))
    while int(np.asarray(state.seen).max()) < 15:
        q = rng.normal(size=(B, T, Hkv * G, D)).astype(np.float32)
        k, v = (rng.normal(size=(B, T, Hkv, D)).astype(np.float32) for _ in range(2))
        room = 15 - np.asarray(state.seen)
        lengths = np.minimum(rng.integers(1, T + 1, size=B), room).astype(np.int32)
        out, scores = ATTEND(policy, state, *(jnp.asarray(x) for x in (q, k, v, lengths)), rope)
        state = UPDATE(policy, state, jnp.asarray(k), jnp.asarray(v), scores, jnp.asarray(lengths))
        for b in range(B):
            for rows, x in ((rows_q, q), (rows_k, k), (rows_v, v), (rows_out, np.asarray(out))):
                rows[b].append(x[b, : lengths[b]])
    for b in range(B):
        q, k, v, out = (np.concatenate(r[b]) for r in (rows_q, rows_k, rows_v, rows_out))
        S = q.shape[0]
        qr = np_rope(q.transpose(1, 0, 2), np.arange(S), 100.0).reshape(Hkv, G, S, D)
        kr = np_rope(k.transpose(1, 0, 2), np.arange(S), 100.0)
        logits = np.einsum("hgid,hjd->hgij", qr, kr) / np.sqrt(D)
        logits = np.where(np.tril(np.ones((S, S), bool)), logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        ref = np.einsum("hgij,hjd->ihgd", p, v.transpose(1, 0, 2)).reshape(S, Hkv * G, D)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_no_nan_with_empty_cache_or_all_padding_chunk():
    policy = jc.Cascade(cache_size=4, sinks=2, num_cascades=2)
    state = jc.init_cache(policy, 2, 1, 4)
    x = jnp.ones((2, 3, 1, 4))
    for lengths in ([0, 0], [0, 3]):
        out, scores = ATTEND(policy, state, x, x, x, jnp.asarray(lengths), jc.RoPE())
        for a in (out, scores.cache, scores.chunk):
            assert np.isfinite(np.asarray(a)).all()
        assert not np.asarray(out[0]).any() and not np.asarray(scores.chunk[0]).any()
        state2 = UPDATE(policy, state, x, x, scores, jnp.asarray(lengths))
        assert np.isfinite(np.asarray(state2.score)).all()


def test_increments_sum_to_the_ema_weight_of_the_chunk():
    """Each query's probabilities sum to 1, so with one query head the increments total sum_q w_q."""
    rng = np.random.default_rng(2)
    policy = jc.Cascade(cache_size=6, sinks=1, num_cascades=2, gamma=0.8)
    state = filled_state(policy, 1, 1, 4, rng, chunks=3)
    x = jnp.asarray(rng.normal(size=(1, 5, 1, 4)), jnp.float32)
    _, scores = ATTEND(policy, state, x, x, x, jnp.asarray([5]), None)
    total = float(scores.cache.sum() + scores.chunk.sum())
    np.testing.assert_allclose(total, 1 - 0.8**5, rtol=1e-5)


def test_policies_without_scores_return_none_and_bad_q_is_refused():
    policy = jc.Sink(window=4, sinks=1)
    state = jc.init_cache(policy, 1, 2, 4)
    x = jnp.ones((1, 3, 2, 4))
    out, scores = jc.attend(policy, state, jnp.ones((1, 3, 6, 4)), x, x)
    assert scores is None and out.shape == (1, 3, 6, 4)
    with pytest.raises(ValueError, match="Hq a multiple of num_kv_heads=2"):
        jc.attend(policy, state, jnp.ones((1, 3, 5, 4)), x, x)
    with pytest.raises(ValueError, match="k must have shape"):
        jc.attend(policy, state, x, jnp.ones((1, 3, 2, 8)), x)
