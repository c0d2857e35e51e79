"""KNorm against a numpy oracle: after the prompt each KV head keeps the `budget` tokens of smallest key norm."""

import jax.numpy as jnp
import numpy as np
import tiny
from oracle import np_rope, np_softmax_rows

import jcascade as jc


def keys_unrotated(held: np.ndarray, new: np.ndarray) -> np.ndarray:
    return np.concatenate([held, new[None]]).astype(np.float64)


def test_knorm_keeps_the_smallest_keys_of_each_head():
    B, S, H, D, budget = 3, 30, 2, 8, 7
    policy = jc.KNorm(budget=budget, stride=8)
    rng = np.random.default_rng(0)
    k = rng.normal(size=(B, S, H, D)).astype(np.float32) * rng.uniform(0.2, 3.0, size=(B, S, H, 1)).astype(np.float32)
    lengths = np.array([30, 17, 5])  # the last prompt fits: kept whole
    state = jc.init_cache(policy, B, H, D, max_tokens=S)
    for start in range(0, S, 8):
        n = jnp.asarray(np.clip(lengths - start, 0, 8), jnp.int32)
        state = jc.update(policy, state, k[:, start : start + 8], -k[:, start : start + 8], None, n)
    state = jc.compress(policy, state, room=3)
    assert state.capacity == budget + 3
    pos, kept_k = np.asarray(state.pos), np.asarray(state.k.data)
    for b in range(B):
        for h in range(H):
            norms = np.linalg.norm(k[b, : lengths[b], h], axis=-1)
            want = sorted(np.argsort(norms, kind="stable")[:budget].tolist())
            held = pos[b, h] >= 0
            assert pos[b, h][held].tolist() == want
            np.testing.assert_array_equal(kept_k[b, h][held], k[b, want, h])  # keys travel with their tokens
    # a query after the prompt attends to each head's own tokens at their own positions
    q = rng.normal(size=(B, 1, 2 * H, D)).astype(np.float32)
    new_k = rng.normal(size=(B, 1, H, D)).astype(np.float32)
    out, _ = jc.attend(policy, state, q, new_k, -new_k, None, jc.RoPE(100.0))
    for b in range(B):
        for h in range(H):
            held = pos[b, h] >= 0
            at = np.append(pos[b, h][held], lengths[b])
            keys = np_rope(np.concatenate([kept_k[b, h][held], new_k[b, 0, h][None]]).astype(np.float64), at, 100.0)
            for g in range(2):
                qr = np_rope(q[b, 0, 2 * h + g].astype(np.float64), lengths[b], 100.0)
                want = np_softmax_rows(keys @ qr / np.sqrt(D)) @ -keys_unrotated(kept_k[b, h][held], new_k[b, 0, h])
                np.testing.assert_allclose(out[b, 0, 2 * h + g], want, atol=1e-4)


def test_knorm_through_a_model():
    model = tiny.model(97, num_layers=2)
    tokens = np.random.default_rng(2).integers(0, 97, (2, 40))
    policy = jc.KNorm(budget=12, stride=16)
    assert np.isfinite(np.asarray(jc.score(model, tokens, policy, prefix=32))).all()
    whole = np.asarray(jc.score(model, tokens, jc.KNorm(budget=64, stride=16), prefix=32))
    np.testing.assert_allclose(whole, np.asarray(jc.score(model, tokens, jc.Full(stride=16))), atol=1e-5)
    assert jc.generate(model, tokens[:, :32], policy, max_new_tokens=4).shape == (2, 4)
