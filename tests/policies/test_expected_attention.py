"""Expected Attention against a float64 numpy transcription of kvpress's ExpectedAttentionPress score, with the
statistics of the observation window's queries: the tokens each KV head keeps after the prompt."""

import jax
import numpy as np
import pytest
import tiny
from oracle import np_rope, np_softmax_rows, random_qkv

import jcascade as jc

THETA = 100.0
ATTEND = jax.jit(jc.attend, static_argnums=(0, 6))
UPDATE = jax.jit(jc.update, static_argnums=0)


def expected_reference(policy, q, k, v, length):
    """Kept positions per KV head for one row (q [S, Hq, D], k, v [S, Hkv, D] un-rotated, float64)."""
    Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    G = Hq // Hkv
    if length <= policy.budget:
        return [list(range(length))] * Hkv
    window = q[length - min(policy.window, length) : length]  # [W, Hq, D], before RoPE
    mean = window.mean(0)
    cov = np.einsum("whd,whe->hde", window - mean, window - mean) / len(window)
    future = np.arange(length, length + policy.future)
    inv = THETA ** (-np.arange(0, D, 2) / D)
    cos = np.concatenate([np.cos(future[:, None] * inv)] * 2, -1)  # [F, D]
    sin = np.concatenate([np.sin(future[:, None] * inv)] * 2, -1)
    P = np.zeros((D, D))
    P[D // 2 :, : D // 2], P[: D // 2, D // 2 :] = np.eye(D // 2), -np.eye(D // 2)
    R = (cos[:, :, None] * np.eye(D) + sin[:, :, None] * P).mean(0)
    keys = np_rope(k[:length], np.arange(length)[:, None], THETA)  # [S, Hkv, D]
    kept = []
    for h in range(Hkv):
        scores = []
        for g in range(G):
            m, c = R @ mean[h * G + g], R @ cov[h * G + g] @ R.T
            ks = keys[policy.sinks :, h]
            logits = ks @ m / np.sqrt(D) + np.einsum("sd,de,se->s", ks, c, ks) / D / 2
            scores.append(np_softmax_rows(logits))
        score = np.mean(scores, 0) * np.linalg.norm(v[policy.sinks : length, h], axis=-1)
        top = np.argsort(-score)[: policy.budget - policy.sinks] + policy.sinks
        kept.append(list(range(policy.sinks)) + sorted(top.tolist()))
    return kept


@pytest.mark.parametrize(
    "policy",
    [
        jc.ExpectedAttention(budget=12, window=6, future=32, sinks=2),
        jc.ExpectedAttention(budget=9, window=10, future=8, sinks=0),
    ],
)
def test_expected_attention_keeps_the_reference_selection(policy):
    B, S, Hq, Hkv, D = 3, 40, 4, 2, 8
    lengths = np.array([40, 29, 9])
    q, k, v = random_qkv(jax.random.key(3), B, S, Hq, Hkv, D)
    rope = jc.RoPE(THETA)
    state = jc.init_cache(policy, B, Hkv, D, max_tokens=S)
    window = np.minimum(policy.window, lengths)
    for start in range(0, S, 16):  # the prompt before the window in chunks of 16, then the window
        n = np.clip(lengths - window - start, 0, 16)
        sl = slice(start, start + 16)
        _, scores = ATTEND(policy, state, q[:, sl], k[:, sl], v[:, sl], n, rope)
        state = UPDATE(policy, state, k[:, sl], v[:, sl], scores, n)
    at = np.clip(lengths[:, None] - window[:, None] + np.arange(policy.window)[None], 0, S - 1)
    take = lambda x: np.take_along_axis(np.asarray(x), at[:, :, None, None], axis=1)
    _, scores = ATTEND(policy, state, take(q), take(k), take(v), window, rope)
    state = jc.compress(policy, UPDATE(policy, state, take(k), take(v), scores, window), room=1)
    pos = np.asarray(state.pos)
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    for b in range(B):
        want = expected_reference(policy, qn[b], kn[b], vn[b], lengths[b])
        assert [pos[b, h][pos[b, h] >= 0].tolist() for h in range(Hkv)] == want


def test_expected_attention_through_a_model():
    model = tiny.model(97, num_layers=2)
    tokens = np.random.default_rng(4).integers(0, 97, (2, 48))
    policy = jc.ExpectedAttention(budget=16, window=8, stride=16)
    assert np.isfinite(np.asarray(jc.score(model, tokens, policy, prefix=40))).all()
    whole = jc.ExpectedAttention(budget=64, window=8, stride=16)
    np.testing.assert_allclose(
        np.asarray(jc.score(model, tokens, whole, prefix=40)),
        np.asarray(jc.score(model, tokens, jc.Full(stride=16))),
        atol=1e-5,
    )
    assert jc.generate(model, tokens[:, :40], policy, max_new_tokens=4).shape == (2, 4)
    with pytest.raises(ValueError, match=r"ExpectedAttention.sinks \(4\) must be < budget \(4\)"):
        jc.ExpectedAttention(budget=4)
