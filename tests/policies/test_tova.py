"""TOVA against a numpy oracle that keeps, after each chunk, the `cache_size` tokens (held and new) the chunk's
last query attends to most (mean over the query heads of a KV head), from the raw q, k, v."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from oracle import np_softmax_rows

import jcascade as jc

ATTEND = jax.jit(jc.attend, static_argnums=0)
UPDATE = jax.jit(jc.update, static_argnums=0)


@pytest.mark.parametrize("T", [1, 4])
def test_tova_keeps_what_the_newest_query_attends_to_most(T):
    C, B, Hkv, G, D = 5, 2, 2, 2, 8
    policy = jc.TOVA(cache_size=C, stride=T)
    rng = np.random.default_rng(T)
    state = jc.init_cache(policy, B, Hkv, D)
    keys = [[{} for _ in range(Hkv)] for _ in range(B)]  # position -> key, per row and KV head
    held = [[set() for _ in range(Hkv)] for _ in range(B)]
    seen = np.zeros(B, int)
    for step in range(12):
        lengths = np.array([T, rng.integers(0, T + 1)])
        q = rng.normal(size=(B, T, Hkv * G, D)).astype(np.float32)
        k = rng.normal(size=(B, T, Hkv, D)).astype(np.float32)
        v = rng.normal(size=(B, T, Hkv, D)).astype(np.float32)
        _, scores = ATTEND(policy, state, q, k, v, jnp.asarray(lengths), None)
        state = UPDATE(policy, state, k, v, scores, jnp.asarray(lengths))
        for b in range(B):
            n = int(lengths[b])
            for h in range(Hkv):
                keys[b][h].update({int(seen[b]) + j: k[b, j, h] for j in range(n)})
                if not n:
                    continue
                candidates = sorted(held[b][h]) + [int(seen[b]) + j for j in range(n)]
                logits = np.stack(
                    [[q[b, n - 1, h * G + g] @ keys[b][h][p] / np.sqrt(D) for p in candidates] for g in range(G)]
                )
                attention = np_softmax_rows(logits).mean(0)
                held[b][h] = set(np.asarray(candidates)[np.argsort(-attention, kind="stable")[:C]].tolist())
            seen[b] += n
        pos = np.asarray(state.pos)
        for b in range(B):
            for h in range(Hkv):
                assert set(pos[b, h][pos[b, h] >= 0].tolist()) == held[b][h], (step, b, h)


def test_tova_runs_through_a_model_and_keeps_its_size():
    model = tiny.model(97, num_layers=2)
    tokens = np.random.default_rng(0).integers(0, 97, (2, 60))
    policy = jc.TOVA(cache_size=16, stride=8)
    logps = np.asarray(jc.score(model, tokens, policy, lengths=np.array([60, 41])))
    assert np.isfinite(logps[0]).all() and np.isfinite(logps[1, :40]).all()
    big = np.asarray(jc.score(model, tokens, jc.TOVA(cache_size=64, stride=8)))
    np.testing.assert_allclose(big, np.asarray(jc.score(model, tokens, jc.Full(stride=8))), atol=1e-5)
    assert model.init_cache(policy, 2).cache.k.shape[-2] == 16
    out = jc.generate(model, tokens[:, :20], policy, max_new_tokens=5)
    assert out.shape == (2, 5)
