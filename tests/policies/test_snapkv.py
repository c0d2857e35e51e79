"""SnapKV and PyramidKV against small dense numpy references of the KVCache-Factory rules: the tokens kept
per layer and KV head, attention over them, decoding after a compression (XLA and the Triton kernels).
Through a model (equal to Full while the sequence fits, score(prefix=) consistent with generate):
tests/test_generation.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from hypothesis import given
from hypothesis import strategies as st
from oracle import assert_decode_steps_match_xla, np_pool, np_rope, np_softmax_rows, random_qkv

import jcascade as jc

THETA = 100.0
ROPE = jc.RoPE(THETA)
ATTEND = jax.jit(jc.attend, static_argnums=(0, 6))
UPDATE = jax.jit(jc.update, static_argnums=0)


def reference_kept_prefix(policy, q_len: int, layer: int, num_layers: int) -> int | None:
    """The KVCache-Factory clusters' rules transcribed literally: prompt tokens kept before the window, or
    None when the prompt is kept whole."""
    C, w = policy.budget, policy.window
    if q_len < C:
        return None
    if isinstance(policy, jc.SnapKV):
        return C - w
    min_num = (C - w) // policy.beta
    max_num = (C - w) * 2 - min_num
    if max_num >= q_len - w:
        max_num = q_len - w
        min_num = (C - w) * 2 - max_num
    steps = (max_num - min_num) // (num_layers - 1)
    if q_len < (C - w) * 2:
        return C - w
    return max_num - layer * steps


def pooled_reference(policy, q, k, length):
    """Per KV head, the window's attention to each token before it, reduced over the group and pooled:
    [Hkv, length - window] for one row (q [S, Hq, D], k [S, Hkv, D] un-rotated, float64)."""
    Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    G = Hq // Hkv
    w = min(policy.window, length)
    pos = np.arange(length)
    qr, kr = np_rope(q[:length], pos[:, None], THETA), np_rope(k[:length], pos[:, None], THETA)
    pooled = []
    for h in range(Hkv):
        sums = []
        for g in range(G):
            logits = qr[length - w :, h * G + g] @ kr[:, h].T / np.sqrt(D)  # [w, length]
            logits = np.where(pos[None, :] <= pos[length - w :, None], logits, -np.inf)
            sums.append(np_softmax_rows(logits)[:, : length - w].sum(0))
        reduced = np.max(sums, 0) if policy.head_reduction == "max" else np.mean(sums, 0)
        pooled.append(np_pool(reduced, policy.kernel, policy.pooling))
    return np.stack(pooled)


def snapkv_reference(policy, q, k, length, layer=0, num_layers=1):
    """Kept positions per KV head for one row: q [S, Hq, D], k [S, Hkv, D] un-rotated, float64."""
    w = min(policy.window, length)
    budget = reference_kept_prefix(policy, length, layer, num_layers)
    if budget is None:
        return [list(range(length))] * k.shape[1]
    return [
        sorted(np.argsort(-pooled, kind="stable")[:budget].tolist()) + list(range(length - w, length))
        for pooled in pooled_reference(policy, q, k, length)
    ]


def adakv_reference(policy, q, k, length):
    """AdaKV's kept positions per KV head for one row: each head's top int(floor * P) by the scorer's pooled
    scores, then the top H * P of all heads' candidates (those first), plus the window."""
    scorer, Hkv = policy.scorer, k.shape[1]
    w = min(scorer.window, length)
    budget = reference_kept_prefix(scorer, length, 0, 1)
    if budget is None:
        return [list(range(length))] * Hkv
    pooled = pooled_reference(scorer, q, k, length)
    ranked = pooled.copy()
    for h in range(Hkv):
        ranked[h, np.argsort(-pooled[h], kind="stable")[: int(policy.floor * budget)]] = np.inf
    chosen = np.argsort(-ranked.reshape(-1), kind="stable")[: Hkv * budget]
    return [
        sorted((chosen[chosen // pooled.shape[1] == h] % pooled.shape[1]).tolist()) + list(range(length - w, length))
        for h in range(Hkv)
    ]


def dense_attention(q, keys, vals, key_pos, q_pos):
    """One query [Hq, D] against explicit keys/values [Hkv][n, D] at positions, float64 -> [Hq, D]."""
    Hq, D = q.shape
    Hkv = len(keys)
    G = Hq // Hkv
    out = np.zeros((Hq, D))
    for h in range(Hkv):
        kr = np_rope(keys[h], np.asarray(key_pos[h]), THETA)
        for g in range(G):
            qr = np_rope(q[h * G + g], q_pos, THETA)
            out[h * G + g] = np_softmax_rows(kr @ qr / np.sqrt(D)) @ vals[h]
    return out


def snapkv_prompt(policy, q, k, v, lengths, stride):
    """The prompt through attend/update as `generate` feeds it: stride chunks up to each row's window,
    then the window as its own chunk. Returns the uncompressed state."""
    B, S, _, D = k.shape
    state = jc.init_cache(policy, B, k.shape[2], D, max_tokens=S)
    window = np.minimum(policy.window, lengths)
    for start in range(0, S, stride):
        n = np.clip(lengths - window - start, 0, stride)
        sl = slice(start, start + stride)
        out, scores = ATTEND(policy, state, q[:, sl], k[:, sl], v[:, sl], jnp.asarray(n, jnp.int32), ROPE)
        state = UPDATE(policy, state, k[:, sl], v[:, sl], scores, jnp.asarray(n, jnp.int32))
    at = np.clip(lengths[:, None] - window[:, None] + np.arange(policy.window)[None], 0, S - 1)
    take = lambda x: jnp.take_along_axis(x, jnp.asarray(at)[:, :, None, None], axis=1)
    out, scores = ATTEND(policy, state, take(q), take(k), take(v), jnp.asarray(window, jnp.int32), ROPE)
    return UPDATE(policy, state, take(k), take(v), scores, jnp.asarray(window, jnp.int32))


@pytest.mark.parametrize(
    "policy",
    [
        jc.SnapKV(budget=16, window=4, kernel=3),
        jc.SnapKV(budget=12, window=3, kernel=5, pooling="avg", head_reduction="max"),
        jc.SnapKV(budget=10, window=2, kernel=1),
    ],
)
def test_snapkv_keeps_the_reference_selection_and_attends_to_it(policy):
    B, S, Hq, Hkv, D = 3, 40, 4, 2, 8
    lengths = np.array([40, 29, 11])  # the last one is shorter than the budget: kept whole
    q, k, v = random_qkv(jax.random.key(0), B, S, Hq, Hkv, D)
    state = jc.compress(policy, snapkv_prompt(policy, q, k, v, lengths, stride=16), room=2)
    assert state.capacity == policy.budget + 2
    pos = np.asarray(jc.cached_positions(state))
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    for b in range(B):
        want = snapkv_reference(policy, qn[b], kn[b], lengths[b])
        for h in range(Hkv):
            assert pos[b, h][pos[b, h] >= 0].tolist() == want[h]
    # Decoding appends after the kept tokens and attends to them at their original positions.
    q1, k1, v1 = random_qkv(jax.random.key(1), B, 1, Hq, Hkv, D)
    out, scores = ATTEND(policy, state, q1, k1, v1, None, ROPE)
    state = UPDATE(policy, state, k1, v1, scores, None)
    ck, cv = (np.asarray(x, np.float64) for x in jc.cached_kv(state))
    pos = np.asarray(jc.cached_positions(state))
    for b in range(B):
        held = [pos[b, h] >= 0 for h in range(Hkv)]
        assert all(pos[b, h][held[h]][-1] == lengths[b] for h in range(Hkv))  # the new token, last
        want = dense_attention(
            np.asarray(q1[b, 0], np.float64),
            [ck[b, h][held[h]] for h in range(Hkv)],
            [cv[b, h][held[h]] for h in range(Hkv)],
            [pos[b, h][held[h]] for h in range(Hkv)],
            lengths[b],
        )
        np.testing.assert_allclose(np.asarray(out[b, 0]), want, atol=2e-5)


@given(st.integers(2, 300), st.integers(1, 40), st.integers(1, 30), st.integers(2, 12), st.integers(1, 600))
def test_pyramid_budgets_follow_the_reference_code(budget, window, beta, num_layers, q_len):
    if window >= budget:
        return
    policy = jc.PyramidKV(budget=budget, window=window, beta=beta)
    for layer in range(num_layers):
        got = int(policy.prefix_budget(jnp.array([q_len]), layer, num_layers)[0])
        want = reference_kept_prefix(policy, q_len, layer, num_layers)
        assert got == (q_len if want is None else want)


def test_pyramidkv_compresses_each_layer_to_its_budget():
    policy = jc.PyramidKV(budget=12, window=3, beta=4, kernel=3)
    L, B, S, Hq, Hkv, D = 4, 2, 48, 4, 2, 8
    lengths = np.array([48, 30])
    layers, refs = [], []
    for layer in range(L):
        q, k, v = random_qkv(jax.random.key(10 + layer), B, S, Hq, Hkv, D)
        layers.append(snapkv_prompt(policy, q, k, v, lengths, stride=20))
        refs.append(
            [
                snapkv_reference(
                    policy, np.asarray(q[b], np.float64), np.asarray(k[b], np.float64), lengths[b], layer, L
                )
                for b in range(B)
            ]
        )
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    state = jc.compress(policy, stacked, room=0)
    pos = np.asarray(state.pos)
    counts = set()
    for layer in range(L):
        for b in range(B):
            for h in range(Hkv):
                assert pos[layer, b, h][pos[layer, b, h] >= 0].tolist() == refs[layer][b][h]
            counts.add((b, int((pos[layer, b, 0] >= 0).sum())))
    assert len({c for b, c in counts if b == 0}) == L  # row 0 (48 >= 2(C - w)): a real pyramid


def test_decode_after_a_compression_through_the_triton_kernels_matches_xla():
    """Interpret mode: the insertion kernel appending after a compression."""
    B, S, Hq, Hkv, D = 2, 40, 4, 2, 8
    lengths = np.array([40, 23])
    q, k, v = random_qkv(jax.random.key(3), B, S, Hq, Hkv, D)
    policy = jc.SnapKV(budget=12, window=3)
    state = jc.compress(policy, snapkv_prompt(policy, q, k, v, lengths, stride=16), room=4)
    assert_decode_steps_match_xla(policy, state, q, k, v, lengths, ROPE, ATTEND, UPDATE)


def test_invalid_parameters_raise_clear_errors():
    with pytest.raises(ValueError, match="SnapKV.window .* must be < budget"):
        jc.SnapKV(budget=32, window=32)
    with pytest.raises(ValueError, match="SnapKV.kernel must be odd"):
        jc.SnapKV(budget=64, kernel=4)
    with pytest.raises(ValueError, match="SnapKV.pooling must be one of"):
        jc.SnapKV(budget=64, pooling="mean")
    with pytest.raises(ValueError, match="PyramidKV.beta must be >= 1"):
        jc.PyramidKV(budget=64, beta=0)
    with pytest.raises(ValueError, match="SnapKV cache needs max_tokens"):
        jc.init_cache(jc.SnapKV(budget=64), 1, 2, 8)
    with pytest.raises(ValueError, match=r"prefix must be None or an int in \[1, 8\]"):
        jc.score(tiny.model(97), np.zeros((1, 8), int), jc.SnapKV(budget=64), prefix=9)
    with pytest.raises(TypeError, match="compress applies to policies with an observation window"):
        jc.compress(jc.Full(), jc.init_cache(jc.Full(), 1, 2, 8, max_tokens=4), room=1)


@pytest.mark.parametrize("floor", [0.2, 1.0])
def test_adakv_shares_a_layers_budget_across_its_heads(floor):
    """Against `adakv_reference`; heads keep different counts, the layer the scorer's total (floor 1: SnapKV)."""
    policy = jc.AdaKV(jc.SnapKV(budget=14, window=4, kernel=3), floor=floor)
    B, S, Hq, Hkv, D = 3, 40, 8, 4, 8
    lengths = np.array([40, 29, 11])
    q, k, v = random_qkv(jax.random.key(2), B, S, Hq, Hkv, D)
    state = jc.compress(policy, snapkv_prompt(policy, q, k, v, lengths, stride=16), room=2)
    pos = np.asarray(jc.cached_positions(state))
    assert state.capacity == policy.kept_slots(Hkv) + 2 == 10 + 3 * (10 - int(floor * 10)) + 4 + 2
    qn, kn = np.asarray(q, np.float64), np.asarray(k, np.float64)
    for b in range(B):
        want = adakv_reference(policy, qn[b], kn[b], lengths[b])
        assert [pos[b, h][pos[b, h] >= 0].tolist() for h in range(Hkv)] == want
    counts = (pos[0] >= 0).sum(-1)
    assert counts.sum() == Hkv * 14 and (len(set(counts.tolist())) > 1) == (floor < 1)
    if floor == 1.0:
        snap = jc.compress(policy.scorer, snapkv_prompt(policy.scorer, q, k, v, lengths, stride=16), room=2)
        held = lambda s: [sorted(p[p >= 0].tolist()) for p in np.asarray(s.pos).reshape(-1, s.pos.shape[-1])]
        assert held(state) == held(snap)
    resident, allocated = jc.cache_occupancy(state)
    assert resident == int((pos >= 0).sum()) and allocated == B * Hkv * state.capacity


def test_adakv_through_a_model_keeps_pyramid_budgets_per_layer():
    model = tiny.model(97, num_layers=3, num_heads=4, num_kv_heads=2)
    tokens = np.random.default_rng(1).integers(0, 97, (2, 48))
    policy = jc.AdaKV(jc.PyramidKV(budget=16, window=4, stride=16))
    logps = np.asarray(jc.score(model, tokens, policy, prefix=40))
    assert np.isfinite(logps).all()
    whole = jc.AdaKV(jc.SnapKV(budget=64, window=4, stride=16))  # a prompt shorter than the budget: kept whole
    np.testing.assert_allclose(
        np.asarray(jc.score(model, tokens, whole, prefix=40)),
        np.asarray(jc.score(model, tokens, jc.Full(stride=16))),
        atol=1e-5,
    )
    assert jc.generate(model, tokens[:, :40], policy, max_new_tokens=4).shape == (2, 4)
    with pytest.raises(ValueError, match="AdaKV.scorer must be a jc.SnapKV or jc.PyramidKV"):
        jc.AdaKV(jc.H2O(heavy=4, recent=4))
    with pytest.raises(ValueError, match=r"AdaKV.floor must be a number in \[0, 1\]"):
        jc.AdaKV(jc.SnapKV(budget=64), floor=1.5)
