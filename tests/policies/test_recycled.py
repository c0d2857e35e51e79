"""Recycled Attention against a token-by-token numpy reference of its rule (decode steps attend to the top-k
tokens chosen at the last full step plus the tokens since; every `refresh_every` steps one full step
chooses again), its decode steps through the Triton kernels, and its branch decided once per decode step
for all layers. Through a model: tests/test_generation.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from oracle import assert_decode_steps_match_xla, np_pool, np_rope, np_softmax_rows, random_qkv

import jcascade as jc

THETA = 100.0
ROPE = jc.RoPE(THETA)
ATTEND = jax.jit(jc.attend, static_argnums=(0, 6))
UPDATE = jax.jit(jc.update, static_argnums=0)


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


@pytest.mark.parametrize(
    "policy", [jc.Recycled(top_k=6, refresh_every=4), jc.Recycled(top_k=5, refresh_every=3, kernel=3)]
)
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
    """Interpret mode: Recycled's two attentions (recycled, full, recycled)."""
    B, S, Hq, Hkv, D = 2, 40, 4, 2, 8
    lengths = np.array([40, 23])
    q, k, v = random_qkv(jax.random.key(3), B, S, Hq, Hkv, D)
    policy = jc.Recycled(top_k=6, refresh_every=2)
    state = jc.init_cache(policy, B, Hkv, D, max_tokens=S)
    n = jnp.asarray(lengths - 5, jnp.int32)
    _, scores = ATTEND(policy, state, q[:, : S - 5], k[:, : S - 5], v[:, : S - 5], n, ROPE)
    state = UPDATE(policy, state, k[:, : S - 5], v[:, : S - 5], scores, n)
    assert_decode_steps_match_xla(policy, state, q, k, v, lengths, ROPE, ATTEND, UPDATE)  # recycled, full, recycled


@pytest.fixture(scope="module")
def model():
    return tiny.model(
        97,
        seed=0,
        scale=0.2,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        head_dim=16,
        max_position_embeddings=512,
    )


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
    np.testing.assert_array_equal(
        jc.generate(model, tokens[:, :40], policy, max_new_tokens=10),
        jc.generate(model, tokens[:, :40], per_layer, max_new_tokens=10),
    )
    np.testing.assert_allclose(
        jc.score(model, tokens, policy, lengths=lengths, prefix=40),
        jc.score(model, tokens, per_layer, lengths=lengths, prefix=40),
        atol=1e-6,
    )

    def conds_in_layer_loop(p):
        state = model.init_cache(p, 2, max_tokens=64)
        step = jax.make_jaxpr(lambda s, t: model(p, s, t, jnp.ones((2,), jnp.int32)))(state, tokens[:, :1])
        loops = [eqn for eqn in eqns_within(step.jaxpr) if eqn.primitive.name == "scan"]
        assert loops
        return sum(eqn.primitive.name == "cond" for loop in loops for eqn in eqns_within(loop.params["jaxpr"].jaxpr))

    assert conds_in_layer_loop(policy) == 0
    assert conds_in_layer_loop(per_layer) > 0


def test_invalid_parameters_raise_clear_errors():
    with pytest.raises(ValueError, match="Recycled.top_k must be >= 1"):
        jc.Recycled(top_k=0, refresh_every=50)
    with pytest.raises(ValueError, match="Recycled.refresh_every must be an int"):
        jc.Recycled(top_k=8, refresh_every=2.5)
    with pytest.raises(ValueError, match=r"pass prefix=<prompt length> \(or context=\) to score"):
        jc.score(tiny.model(97), np.zeros((1, 8), int), jc.Recycled(top_k=8, refresh_every=4))
    state = jc.init_cache(jc.Recycled(top_k=4, refresh_every=2), 1, 2, 8, max_tokens=3)
    k = jnp.zeros((1, 4, 2, 8))
    _, scores = jc.attend(jc.Recycled(top_k=4, refresh_every=2), state, jnp.zeros((1, 4, 2, 8)), k, k)
    with pytest.raises(ValueError, match="Recycled cache of 3 slots overflows by \\[1\\]"):
        jc.update(jc.Recycled(top_k=4, refresh_every=2), state, k, k, scores)
