"""Expected Attention (kvpress's ExpectedAttentionPress): after the prompt, keep the tokens that future queries
are expected to attend to, from the statistics of the prompt's last queries rotated ahead."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import jax
import jax.numpy as jnp

from jcascade.cache_state import CacheState, Scores, held_keys, stored_kv
from jcascade.policies.base import NonNegative, Positive, Reals, last_queries
from jcascade.policies.selection import ScorerPolicy
from jcascade.rope import RoPE


@dataclasses.dataclass(frozen=True)
class ExpectedAttention(ScorerPolicy):
    """Full attention over the prompt, then each KV head keeps the `budget` prompt tokens with the largest
    expected attention (the first `sinks` always among them); decoding appends.

    The queries of the next `future` positions are modelled from the prompt's last `window` queries (before
    RoPE): mean m and covariance S (population), both rotated by the RoPE rotation averaged over those
    positions, R. A held key k (rotated at its position) then scores softmax_k(R m . k / sqrt(D) +
    k' R S R' k / (2 D)) over the non-sink keys, averaged over the query heads of its KV head and, with
    `value_norm`, times (score + epsilon) * |v|. As kvpress's press, except that its statistics come from
    every prompt query after the sinks. Scores are computed for chunks of at most `window` tokens (the
    observation window that generate and score feed last, and decode steps); a longer chunk scores 0.
    Positions "original". Needs `jc.RoPE` (or no rotation).
    """

    keeps_scores = True
    window: Positive = 64
    future: Positive = 512
    sinks: NonNegative = 4
    covariance: bool = True
    value_norm: bool = True
    epsilon: Annotated[float, Reals(0)] = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.sinks >= self.budget:
            raise ValueError(f"ExpectedAttention.sinks ({self.sinks}) must be < budget ({self.budget})")

    @property
    def observation_window(self) -> int:
        return self.window

    def accumulate(self, score, increments, live, n, layout):
        """The newest chunk's expected attention replaces the old."""
        return jnp.where(live, increments, score)

    def attend(
        self, state: CacheState, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, rope
    ) -> tuple[jax.Array, Scores]:
        if rope is not None and not isinstance(rope, RoPE):
            raise ValueError(
                f"ExpectedAttention needs rope to be a jc.RoPE (its frequencies), got {type(rope).__name__}"
            )
        out, _ = super().attend(state, q, k, v, lengths, rope)  # no query weights: no scores
        B, T, Hq, D = q.shape
        Hkv, cap = k.shape[2], state.pos.shape[-1]
        if T > self.window:
            return out, Scores(cache=jnp.zeros((B, Hkv, cap)), chunk=jnp.zeros((B, Hkv, T)))
        f32 = jnp.float32
        w = last_queries(lengths, T, self.window)  # [B, T]
        n = jnp.maximum(w.sum(-1), 1.0)
        qf = q.astype(f32)
        mean = jnp.einsum("bt,bthd->bhd", w, qf) / n[:, None, None]
        centered = (qf - mean[:, None]) * (w / jnp.sqrt(n)[:, None])[..., None, None]  # sum_t (c_t . k)^2 = k'Sk
        if rope is None:
            cos, sin = jnp.ones((B, D // 2), f32), jnp.zeros((B, D // 2), f32)
        else:
            ahead = (state.seen + lengths)[:, None] + jnp.arange(self.future)[None, :]  # [B, future]
            angles = ahead.astype(f32)[..., None] * jnp.asarray(rope.inv_freq(D))
            cos, sin = jnp.cos(angles).mean(1), jnp.sin(angles).mean(1)  # the averaged rotation, [B, D / 2]

        def rotate(x, c, s):
            x1, x2 = jnp.split(x, 2, axis=-1)
            return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

        mean = rotate(mean, cos[:, None], sin[:, None]).reshape(B, Hkv, Hq // Hkv, D)
        centered = rotate(centered, cos[:, None, None], sin[:, None, None]).reshape(B, T, Hkv, Hq // Hkv, D)
        chunk_pos = state.seen[:, None] + jnp.arange(T)  # [B, T]
        rot = (lambda x, p: x) if rope is None else rope
        keys = jnp.concatenate(
            [held_keys(state, rope, state.pos), rot(k.astype(f32), chunk_pos[:, :, None]).transpose(0, 2, 1, 3)],
            axis=2,
        )
        values = jnp.concatenate([stored_kv(state)[1].decode(), v.astype(f32).transpose(0, 2, 1, 3)], axis=2)
        positions = jnp.concatenate(
            [
                state.pos,
                jnp.broadcast_to(jnp.where(jnp.arange(T) < lengths[:, None], chunk_pos, -1)[:, None], (B, Hkv, T)),
            ],
            axis=2,
        )  # [B, Hkv, S]
        highest = jax.lax.Precision.HIGHEST
        logits = jnp.einsum("bhgd,bhsd->bhgs", mean, keys, precision=highest) / jnp.sqrt(f32(D))
        if self.covariance:
            projected = jnp.einsum("bthgd,bhsd->bhgts", centered, keys, precision=highest)
            logits = logits + jnp.sum(projected**2, axis=3) / (2 * D)
        scored = positions >= self.sinks  # held, not a sink
        logits = jnp.where(scored[:, :, None], logits, -jnp.inf)
        top = jnp.max(logits, axis=-1, keepdims=True)
        e = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
        total = e.sum(-1, keepdims=True)
        expected = jnp.where(total > 0, e / jnp.where(total > 0, total, 1.0), 0.0).mean(2)  # [B, Hkv, S]
        if self.value_norm:
            expected = (expected + self.epsilon) * jnp.linalg.norm(values, axis=-1)
        expected = jnp.where((positions >= 0) & ~scored, jnp.inf, expected)  # sinks stay
        return out, Scores(cache=expected[..., :cap], chunk=expected[..., cap:])

    def score(self, state: CacheState) -> jax.Array:
        """The expected attention `attend` left for each token (sinks: inf)."""
        return state.score
