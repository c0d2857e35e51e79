"""SnapKV, PyramidKV and Recycled against small dense numpy references of their rules, and through the
model: equal to Full while the sequence fits, `score(prefix=)` consistent with `generate`, Recycled's branch
decided once per decode step, clear errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jcascade as jc
import tiny
from oracle import np_rope

THETA = 100.0
ROPE = jc.RoPE(THETA)
ATTEND = jax.jit(jc.attend, static_argnums=(0, 6))
UPDATE = jax.jit(jc.update, static_argnums=0)


def np_pool(x: np.ndarray, kernel: int, pooling: str) -> np.ndarray:
    """torch's max_pool1d / avg_pool1d (count_include_pad) with padding kernel // 2, stride 1, in numpy."""
    pad = kernel // 2
    fill = -np.inf if pooling == "max" else 0.0
    padded = np.concatenate([np.full(pad, fill), x, np.full(pad, fill)])
    windows = np.stack([padded[i : i + len(x)] for i in range(kernel)])
    return windows.max(0) if pooling == "max" else windows.sum(0) / kernel


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


def np_softmax_rows(logits):
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def snapkv_reference(policy, q, k, length, layer=0, num_layers=1):
    """Kept positions per KV head for one row: q [S, Hq, D], k [S, Hkv, D] un-rotated, float64."""
    Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    G = Hq // Hkv
    w = min(policy.window, length)
    pos = np.arange(length)
    qr, kr = np_rope(q[:length], pos[:, None], THETA), np_rope(k[:length], pos[:, None], THETA)
    budget = reference_kept_prefix(policy, length, layer, num_layers)
    kept = []
    for h in range(Hkv):
        if budget is None:
            kept.append(list(range(length)))
            continue
        sums = []
        for g in range(G):
            logits = qr[length - w :, h * G + g] @ kr[:, h].T / np.sqrt(D)  # [w, length]
            logits = np.where(pos[None, :] <= pos[length - w :, None], logits, -np.inf)
            sums.append(np_softmax_rows(logits)[:, : length - w].sum(0))
        reduced = np.max(sums, 0) if policy.head_reduction == "max" else np.mean(sums, 0)
        pooled = np_pool(reduced, policy.kernel, policy.pooling)
        top = np.argsort(-pooled, kind="stable")[:budget]
        kept.append(sorted(top.tolist()) + list(range(length - w, length)))
    return kept


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


def random_qkv(key, B, S, Hq, Hkv, D):
    kq, kk, kv = jax.random.split(key, 3)
    return (jax.random.normal(kq, (B, S, Hq, D)), jax.random.normal(kk, (B, S, Hkv, D)),
            jax.random.normal(kv, (B, S, Hkv, D)))


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
        want = dense_attention(np.asarray(q1[b, 0], np.float64), [ck[b, h][held[h]] for h in range(Hkv)],
                               [cv[b, h][held[h]] for h in range(Hkv)], [pos[b, h][held[h]] for h in range(Hkv)],
                               lengths[b])
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
        refs.append([snapkv_reference(policy, np.asarray(q[b], np.float64), np.asarray(k[b], np.float64),
                                      lengths[b], layer, L) for b in range(B)])
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


def recycled_reference(policy, q, k, v, prompt_len, steps):
    """Recycled Attention for one row, token by token: outputs [steps, Hq, D] of the decode queries
    q[prompt_len + i] (keys/values of all positions given), float64."""
    Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    G = Hq // Hkv

    def probs(t, keys_at):  # attention of query t to positions keys_at, per query head
        out = []
        for hq in range(Hq):
            kr = np_rope(k[keys_at, hq // G], keys_at, THETA)
            out.append(np_softmax_rows(kr @ np_rope(q[t, hq], t, THETA) / np.sqrt(D)))
        return np.array(out)

    def select(t):
        everything = np.arange(t + 1)
        p = probs(t, everything).reshape(Hkv, G, -1).max(1)
        chosen = []
        for h in range(Hkv):
            pooled = np_pool(p[h], policy.kernel, "max")
            chosen.append(np.sort(np.argsort(-pooled, kind="stable")[: policy.top_k]))
        return chosen

    chosen, since, outs = select(prompt_len - 1), [], []
    for i in range(steps):
        t = prompt_len + i
        full = len(since) >= policy.refresh_every - 1
        out = np.zeros((Hq, D))
        for h in range(Hkv):
            keys_at = np.arange(t + 1) if full else np.array(sorted(set(chosen[h]) | set(since) | {t}))
            p = probs(t, keys_at)[h * G : (h + 1) * G]
            out[h * G : (h + 1) * G] = p @ v[keys_at, h]
        outs.append(out)
        if full:
            chosen, since = select(t), []
        else:
            since.append(t)
    return np.array(outs)


@pytest.mark.parametrize("policy", [jc.Recycled(top_k=6, refresh_every=4), jc.Recycled(top_k=5, refresh_every=3, kernel=3)])
def test_recycled_attends_to_the_reference_sets(policy):
    B, S, Hq, Hkv, D, steps = 2, 40, 4, 2, 8, 10
    lengths = np.array([30, 21])
    q, k, v = random_qkv(jax.random.key(2), B, S, Hq, Hkv, D)
    state = jc.init_cache(policy, B, Hkv, D, max_tokens=S)
    for start in range(0, 32, 16):
        n = jnp.asarray(np.clip(lengths - start, 0, 16), jnp.int32)
        sl = slice(start, start + 16)
        _, scores = ATTEND(policy, state, q[:, sl], k[:, sl], v[:, sl], n, ROPE)
        state = UPDATE(policy, state, k[:, sl], v[:, sl], scores, n)
    outs = []
    for i in range(steps):
        at = jnp.asarray(lengths + i)[:, None, None, None]
        q1, k1, v1 = (jnp.take_along_axis(x, at, axis=1) for x in (q, k, v))
        out, scores = ATTEND(policy, state, q1, k1, v1, None, ROPE)
        state = UPDATE(policy, state, k1, v1, scores, None)
        outs.append(np.asarray(out[:, 0]))
    for b in range(B):
        want = recycled_reference(policy, *(np.asarray(x[b], np.float64) for x in (q, k, v)), lengths[b], steps)
        np.testing.assert_allclose(np.stack([o[b] for o in outs]), want, atol=2e-5)


def test_decode_steps_through_the_triton_kernels_match_xla():
    """Interpret mode: the insertion kernel appending after a compression, and Recycled's two attentions."""
    B, S, Hq, Hkv, D = 2, 40, 4, 2, 8
    lengths = np.array([40, 23])
    q, k, v = random_qkv(jax.random.key(3), B, S, Hq, Hkv, D)
    snap = jc.SnapKV(budget=12, window=3)
    recycled = jc.Recycled(top_k=6, refresh_every=2)
    states = {snap: jc.compress(snap, snapkv_prompt(snap, q, k, v, lengths, stride=16), room=4),
              recycled: jc.init_cache(recycled, B, Hkv, D, max_tokens=S)}
    n = jnp.asarray(lengths - 5, jnp.int32)
    _, scores = jc.attend(recycled, states[recycled], q[:, :S - 5], k[:, :S - 5], v[:, :S - 5], n, ROPE)
    states[recycled] = jc.update(recycled, states[recycled], k[:, :S - 5], v[:, :S - 5], scores, n)
    for policy, state in states.items():
        for step in range(3):  # recycled, full, recycled
            at = jnp.asarray(lengths - 5 + step)[:, None, None, None]
            q1, k1, v1 = (jnp.take_along_axis(x, at, axis=1) for x in (q, k, v))
            results = []
            for impl in ("xla", "triton"):
                out, scores = jc.attend(policy, state, q1, k1, v1, None, ROPE, implementation=impl)
                results.append((out, jc.update(policy, state, k1, v1, scores, None, implementation=impl)))
            (out_x, state), (out_t, state_t) = results
            np.testing.assert_allclose(np.asarray(out_t), np.asarray(out_x), atol=2e-5)
            np.testing.assert_array_equal(np.asarray(state_t.pos), np.asarray(state.pos))
            np.testing.assert_allclose(np.asarray(state_t.k), np.asarray(state.k))


# ---------------------------------------------------------------------------------------------------
# Through the model.


@pytest.fixture(scope="module")
def model():
    return tiny.model(97, seed=0, scale=0.2, hidden_size=64, intermediate_size=96, num_layers=3,
                      head_dim=16, max_position_embeddings=512)


FITTING = [jc.SnapKV(budget=128, window=8, stride=16), jc.PyramidKV(budget=128, window=4, stride=16),
           jc.Recycled(top_k=128, refresh_every=5, stride=16), jc.SnapKV(budget=128, positions="cache", stride=16),
           jc.Recycled(top_k=128, refresh_every=3, positions="cache", stride=16)]


@pytest.mark.parametrize("policy", FITTING, ids=lambda p: f"{type(p).__name__}-{p.positions}")
def test_policies_equal_full_while_the_sequence_fits(model, policy):
    tokens = np.random.default_rng(5).integers(0, 97, (2, 70))
    lengths = np.array([70, 52])
    full = jc.score(model, tokens, jc.Full(stride=16), lengths=lengths)
    np.testing.assert_allclose(jc.score(model, tokens, policy, lengths=lengths, prefix=40), full, atol=2e-5)
    want = jc.generate(model, tokens[:, :40], jc.Full(stride=16), max_new_tokens=12)
    np.testing.assert_array_equal(jc.generate(model, tokens[:, :40], policy, max_new_tokens=12), want)


@pytest.mark.parametrize(
    "policy",
    [jc.SnapKV(budget=24, window=4, stride=16), jc.PyramidKV(budget=24, window=4, beta=4, stride=16),
     jc.Recycled(top_k=12, refresh_every=4, stride=16, kernel=3)],
    ids=lambda p: type(p).__name__,
)
def test_score_with_a_prefix_replays_generate(model, policy):
    """Teacher-forced scoring after a prompt sees what decoding saw: every greedy token is at least as
    likely under score(prefix=) as any substitute at its step, and the policy differs from Full."""
    rng = np.random.default_rng(6)
    prompt = rng.integers(0, 97, (1, 60))
    new = np.asarray(jc.generate(model, prompt, policy, max_new_tokens=8))[0]
    seq = np.concatenate([prompt[0], new])
    rows, where = [seq], []
    for i in range(8):
        for token in rng.integers(0, 97, 4):
            row = seq.copy()
            row[60 + i] = token
            rows.append(row)
            where.append(i)
    logp = np.asarray(jc.score(model, np.stack(rows), policy, prefix=60))
    chosen = logp[0, 59:]
    for r, i in enumerate(where, start=1):
        assert logp[r, 59 + i] <= chosen[i] + 1e-6
    full = np.asarray(jc.score(model, seq[None], jc.Full(stride=16)))[0, 59:]
    assert not np.allclose(chosen, full, atol=1e-4)  # the policy really dropped something


@dataclasses.dataclass(frozen=True)
class RecycledPerLayer(jc.Recycled):
    """Recycled deciding its decode step's branch in every layer (a `lax.cond` per layer), as it does when
    called through jc.attend / jc.update."""

    def step_branch(self, state, chunk_len, lengths):
        return None


def eqns_within(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from eqns_within(inner)


def test_recycled_decides_a_decode_step_once_for_all_layers(model):
    """Through the model, whether a decode step is full or recycled is one lax.switch around the layer
    loop, with no branch left inside it, and gives what deciding it in every layer gives."""
    tokens = np.random.default_rng(7).integers(0, 97, (2, 60))
    lengths = np.array([60, 47])
    policy, per_layer = (cls(top_k=12, refresh_every=3, stride=16) for cls in (jc.Recycled, RecycledPerLayer))
    np.testing.assert_array_equal(jc.generate(model, tokens[:, :40], policy, max_new_tokens=10),
                                  jc.generate(model, tokens[:, :40], per_layer, max_new_tokens=10))
    np.testing.assert_allclose(jc.score(model, tokens, policy, lengths=lengths, prefix=40),
                               jc.score(model, tokens, per_layer, lengths=lengths, prefix=40), atol=1e-6)

    def conds_in_layer_loop(p):
        state = model.init_cache(p, 2, max_tokens=64)
        step = jax.make_jaxpr(lambda s, t: model(p, s, t, jnp.ones((2,), jnp.int32)))(state, tokens[:, :1])
        loops = [eqn for eqn in eqns_within(step.jaxpr) if eqn.primitive.name == "scan"]
        assert loops
        return sum(eqn.primitive.name == "cond" for loop in loops for eqn in eqns_within(loop.params["jaxpr"].jaxpr))

    assert conds_in_layer_loop(policy) == 0
    assert conds_in_layer_loop(per_layer) > 0


def test_invalid_parameters_raise_clear_errors(model):
    with pytest.raises(ValueError, match="SnapKV.window .* must be < budget"):
        jc.SnapKV(budget=32, window=32)
    with pytest.raises(ValueError, match="SnapKV.kernel must be odd"):
        jc.SnapKV(budget=64, kernel=4)
    with pytest.raises(ValueError, match="SnapKV.pooling must be one of"):
        jc.SnapKV(budget=64, pooling="mean")
    with pytest.raises(ValueError, match="PyramidKV.beta must be >= 1"):
        jc.PyramidKV(budget=64, beta=0)
    with pytest.raises(ValueError, match="Recycled.top_k must be >= 1"):
        jc.Recycled(top_k=0, refresh_every=50)
    with pytest.raises(ValueError, match="Recycled.refresh_every must be an int"):
        jc.Recycled(top_k=8, refresh_every=2.5)
    with pytest.raises(ValueError, match="SnapKV cache needs max_tokens"):
        jc.init_cache(jc.SnapKV(budget=64), 1, 2, 8)
    with pytest.raises(ValueError, match="pass prefix=<prompt length> to score"):
        jc.score(model, np.zeros((1, 8), int), jc.Recycled(top_k=8, refresh_every=4))
    with pytest.raises(ValueError, match=r"prefix must be None or an int in \[1, 8\]"):
        jc.score(model, np.zeros((1, 8), int), jc.SnapKV(budget=64), prefix=9)
    with pytest.raises(TypeError, match="compress applies to SnapKV and PyramidKV"):
        jc.compress(jc.Full(), jc.init_cache(jc.Full(), 1, 2, 8, max_tokens=4), room=1)
    state = jc.init_cache(jc.Recycled(top_k=4, refresh_every=2), 1, 2, 8, max_tokens=3)
    k = jnp.zeros((1, 4, 2, 8))
    _, scores = jc.attend(jc.Recycled(top_k=4, refresh_every=2), state, jnp.zeros((1, 4, 2, 8)), k, k)
    with pytest.raises(ValueError, match="Recycled cache of 3 slots overflows by \\[1\\]"):
        jc.update(jc.Recycled(top_k=4, refresh_every=2), state, k, k, scores)
