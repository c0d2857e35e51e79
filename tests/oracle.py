"""Numpy references written for the tests: the token-by-token cascading-cache oracle (docs/semantics.md §3), H2O's,
RoPE, softmax and pooling; and the tagged inputs the cache oracles are fed.

One `CascadeOracle` per (batch row, KV head). Items are [position, score]; rings are Python lists from
oldest to newest. This is the rule as written, one token at a time, with no shared code with jcascade.
"""

from __future__ import annotations

import numpy as np


class CascadeOracle:
    def __init__(self, sinks: int, ring_size: int, num_rings: int, gamma: float | None):
        self.num_sinks, self.ring_size, self.gamma = sinks, ring_size, gamma
        self.sinks: list[list] = []
        self.rings: list[list[list]] = [[] for _ in range(num_rings)]
        self.clock = 0  # non-sink tokens inserted so far
        self.seen = 0

    @property
    def capacity_after_sinks(self) -> int:
        return self.ring_size * len(self.rings)

    def update(self, chunk_scores, cache_increments: dict[int, float], n: int) -> None:
        """chunk_scores: f32 [>= n]; cache_increments: position -> increment of each held ring token."""
        if n == 0:
            return
        if self.gamma is not None:
            decay = np.float32(self.gamma) ** np.float32(n)
            for ring in self.rings:
                for item in ring:
                    item[1] = np.float32(decay * item[1] + np.float32(cache_increments[item[0]]))
        for j in range(n):
            self.insert([self.seen + j, np.float32(chunk_scores[j])])
        self.seen += n

    def insert(self, x: list) -> None:
        if len(self.sinks) < self.num_sinks:
            self.sinks.append(x)
            return
        t = self.clock
        self.clock += 1
        for i, ring in enumerate(self.rings):
            if len(ring) < self.ring_size:
                ring.append(x)
                return
            # Fill phase (t < C): every ring accepts, so nothing is dropped before the cache is full.
            if t < self.capacity_after_sinks or t % 2**i == 0:
                ring.append(x)
                x = ring.pop(0)
                continue
            if x[1] > ring[-1][1]:
                ring[-1] = x
            return

    def held_positions(self) -> list[int]:
        return sorted(p for p, _ in self.sinks + [it for r in self.rings for it in r])


def sink_window_positions(seen: int, sinks: int, window: int) -> list[int]:
    """What StreamingLLM holds after `seen` tokens: the first `sinks` and the last `window` of the rest."""
    first = list(range(min(seen, sinks)))
    rest = list(range(min(seen, sinks), seen))
    return first + rest[-window:] if window else first


def np_rope(x: np.ndarray, pos, theta: float) -> np.ndarray:
    """Rotate-half RoPE in float64: x [..., D], integer positions broadcastable to x.shape[:-1]."""
    D = x.shape[-1]
    inv = theta ** (-np.arange(0, D, 2) / D)
    ang = np.asarray(pos, np.float64)[..., None] * inv
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


class H2OOracle:
    """H2O for one (row, KV head): a FIFO of `recent` tokens; the tokens it pushes out during a chunk join
    the heavy set, which keeps the `heavy` largest accumulated scores (scores fixed within the chunk)."""

    def __init__(self, heavy: int, recent: int):
        self.num_heavy, self.num_recent = heavy, recent
        self.recent: list[list] = []
        self.heavy: list[list] = []
        self.seen = 0

    def update(self, chunk_scores, cache_increments: dict[int, float], n: int) -> None:
        if n == 0:
            return
        for item in self.recent + self.heavy:
            item[1] = np.float32(item[1] + np.float32(cache_increments[item[0]]))
        pushed = []
        for j in range(n):
            self.recent.append([self.seen + j, np.float32(chunk_scores[j])])
            if len(self.recent) > self.num_recent:
                pushed.append(self.recent.pop(0))
        self.seen += n
        ranked = sorted(self.heavy + pushed, key=lambda item: -item[1])  # stable: residents first on ties
        self.heavy = ranked[: self.num_heavy]


def np_softmax_rows(logits):
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_pool(x: np.ndarray, kernel: int, pooling: str) -> np.ndarray:
    """torch's max_pool1d / avg_pool1d (count_include_pad) with padding kernel // 2, stride 1, in numpy."""
    pad = kernel // 2
    fill = -np.inf if pooling == "max" else 0.0
    padded = np.concatenate([np.full(pad, fill), x, np.full(pad, fill)])
    windows = np.stack([padded[i : i + len(x)] for i in range(kernel)])
    return windows.max(0) if pooling == "max" else windows.sum(0) / kernel


# ---- inputs -------------------------------------------------------------------------------------------

HEAD_DIM = 4  # of tagged chunks


def tagged_chunk(seen: np.ndarray, T: int, H: int):
    """K/V whose rows name their token: k = (position, head, row, 1), v = -k."""
    import jax.numpy as jnp

    B = seen.shape[0]
    pos = seen[:, None] + np.arange(T)[None]  # [B, T]
    k = np.zeros((B, T, H, HEAD_DIM), np.float32)
    k[..., 0] = pos[:, :, None]
    k[..., 1] = np.arange(H)[None, None, :]
    k[..., 2] = np.arange(B)[:, None, None]
    k[..., 3] = 1.0
    return jnp.asarray(k), jnp.asarray(-k)


def random_scores(rng, B, H, cap, T, tied: bool):
    """jc.Scores of a chunk: few distinct values (exact in float32, so that ties really happen) if `tied`."""
    import jax.numpy as jnp

    import jcascade as jc

    if tied:
        values = np.array([0.0, 0.25, 0.5, 1.0], np.float32)
        return jc.Scores(
            cache=jnp.asarray(rng.choice(values[:2], size=(B, H, cap))),
            chunk=jnp.asarray(rng.choice(values, size=(B, H, T))),
        )
    return jc.Scores(
        cache=jnp.asarray(rng.random((B, H, cap), np.float32) * 0.1),
        chunk=jnp.asarray(rng.random((B, H, T), np.float32)),
    )


def random_qkv(key, B, S, Hq, Hkv, D):
    import jax

    kq, kk, kv = jax.random.split(key, 3)
    return (
        jax.random.normal(kq, (B, S, Hq, D)),
        jax.random.normal(kk, (B, S, Hkv, D)),
        jax.random.normal(kv, (B, S, Hkv, D)),
    )


def assert_decode_steps_match_xla(policy, state, q, k, v, lengths, rope, attend, update, backend="triton"):
    """From `state` (an XLA cache), feeds each row's tokens lengths-5, -4 and -3 of q, k, v [B, S, H, D] one decode
    step at a time on the `backend` kernels and on XLA's (attend, update: jitted `jc.attend`, `jc.update`); the
    outputs, cache positions and keys must agree at every step."""
    import dataclasses

    import jax.numpy as jnp

    import jcascade as jc

    for step in range(3):
        at = jnp.asarray(lengths - 5 + step)[:, None, None, None]
        q1, k1, v1 = (jnp.take_along_axis(x, at, axis=1) for x in (q, k, v))
        results = []
        for kernels in (jc.Kernels("xla"), jc.Kernels(backend)):
            on = dataclasses.replace(state, kernels=kernels)
            out, scores = attend(policy, on, q1, k1, v1, None, rope)
            results.append((out, update(policy, on, k1, v1, scores, None)))
        (out_x, state), (out_t, state_t) = results
        np.testing.assert_allclose(np.asarray(out_t), np.asarray(out_x), atol=2e-5)
        np.testing.assert_array_equal(np.asarray(state_t.pos), np.asarray(state.pos))
        np.testing.assert_allclose(np.asarray(state_t.k.data), np.asarray(state.k.data))
