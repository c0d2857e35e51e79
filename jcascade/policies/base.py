"""The cache-policy protocol: the hooks a policy implements and the generic code calls.

A policy is a frozen dataclass (hashable, hence static under `jit`) subclassing `Policy`, validated in
`__post_init__`, with a `stride` field (tokens per chunk of the strided prefill, docs/semantics.md §9). The generic
entry points call only these hooks:

  jc.init_cache  -> cache_slots(max_tokens)                  slots of a fresh cache
  jc.attend      -> attend(state, q, k, v, lengths, rope)
                    (default: the chunk against every held slot at key_positions(state), with score
                    increments weighted by query_weights(lengths, T))
  jc.update      -> update(state, k, v, scores, lengths)
  jc.compress, and generate / score at the end of a prompt -> observation_window, compress(state, room)
  generate / score at the end of a prompt, before compress -> after_prompt(model, state, tokens, lengths, ...)
  jc.share_prefix, jc.attend_shared -> key_positions(state)
  a model's layer loop -> step_branch(state, chunk_len, lengths)   (default: None)

and read four class attributes: `bounded`, `keeps_scores`, `needs_prompt`, `shareable`.
`jcascade.policies.ring.RingPolicy` implements attend/update for ring-layout caches (sinks + rings), which
most policies are; a policy with another storage rule subclasses `Policy` and writes `update` itself.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import jax
import jax.numpy as jnp

from jcascade.rope import rotate_chunk
from jcascade.slots import CLOCK_LIMIT, CacheState, Scores, rank_by_position

HEAD_REDUCTIONS = ("max", "mean")
POSITION_MODES = ("cache", "original")


def check_int(policy: object, name: str, value: object, minimum: int) -> None:
    """Raises ValueError naming `Policy.name` unless value is an int in [minimum, 2**31 - 1] (token counts and
    slots are int32)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{type(policy).__name__}.{name} must be an int, got {value!r}")
    if not minimum <= value <= CLOCK_LIMIT:
        raise ValueError(f"{type(policy).__name__}.{name} must be >= {minimum} (and at most {CLOCK_LIMIT}), "
                         f"got {value}")


def check_choice(policy: object, name: str, value: object, choices: tuple[str, ...]) -> None:
    """Raises ValueError naming `Policy.name` unless value is one of choices."""
    if value not in choices:
        raise ValueError(f"{type(policy).__name__}.{name} must be one of {choices}, got {value!r}")


def last_queries(lengths: jax.Array, chunk_len: int, count: int) -> jax.Array:
    """f32 [B, T]: 1 for the last `count` valid queries of each row, 0 elsewhere (an observation window)."""
    q = jnp.arange(chunk_len, dtype=jnp.int32)[None, :]
    return ((q < lengths[:, None]) & (q >= lengths[:, None] - count)).astype(jnp.float32)


class Policy(abc.ABC):
    """A KV-cache policy. Subclasses are frozen dataclasses with a `stride` field.

    Class attributes (override them as plain class attributes, not dataclass fields, where they differ):
      bounded       the cache has a fixed number of slots; False: init_cache needs max_tokens and the
                    policy may keep every token (then generate warns past the model's trained positions).
      keeps_scores  attend returns `Scores` and update needs them (else both use None).
      needs_prompt  acts once a prompt ends (compression, decode-time recycling): jc.score needs
                    prefix=, streaming perplexity refuses the policy.
      shareable     its cache after a prompt can serve as a frozen shared prefix (jc.share_prefix,
                    generate's num_samples).
    Defaults of fields a policy may not have: positions "original", head_reduction "max",
    observation_window 0 (no compression after the prompt).
    """

    bounded: ClassVar[bool] = True
    keeps_scores: ClassVar[bool] = False
    needs_prompt: ClassVar[bool] = False
    shareable: ClassVar[bool] = True
    stride: int
    positions: str = "original"
    head_reduction: str = "max"
    observation_window: int = 0

    @property
    def label(self) -> str:
        """A short name for tables and figure legends (e.g. "Cascade 384x2"); the repr is the full spec."""
        return type(self).__name__

    @abc.abstractmethod
    def cache_slots(self, max_tokens: int | None) -> int:
        """Slots of a fresh cache. max_tokens: the tokens it must be able to receive (a positive int,
        checked by init_cache, when the policy is not `bounded`; bounded policies ignore it)."""

    @abc.abstractmethod
    def update(self, state: CacheState, k: jax.Array, v: jax.Array, scores: Scores | None,
               lengths: jax.Array) -> CacheState:
        """The cache after a chunk: k, v [B, T, Hkv, D] un-rotated (the chunk attend just saw), scores what
        attend returned (checked by jc.update: `Scores` when keeps_scores, else None), lengths int32 [B]
        valid tokens per row (padding must leave a row untouched). Must add lengths to `state.seen`."""

    def query_weights(self, lengths: jax.Array, chunk_len: int) -> jax.Array | None:
        """f32 [B, T] weight of each query in the score increments; None for policies that keep no scores."""
        return None

    def key_positions(self, state: CacheState) -> tuple[jax.Array, jax.Array]:
        """RoPE positions (docs/semantics.md §4): of the held keys, int32 [B, 1 or Hkv, capacity] (-1 for empty slots),
        and of the chunk's first token, int32 [B]. "original": the token indices; "cache": the rank among
        the row's held tokens by position (each head counting its own)."""
        if self.positions != "cache":
            return state.pos, state.seen
        return rank_by_position(state.pos), jnp.sum(state.pos[:, 0, :] >= 0, axis=-1).astype(jnp.int32)

    def attend(self, state: CacheState, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
               rope) -> tuple[jax.Array, Scores | None]:
        """The chunk's queries q [B, T, Hq, D] against every held slot and causally against the chunk
        (k, v [B, T, Hkv, D] un-rotated); arguments checked by jc.attend. Returns out [B, T, Hq, D] and the
        score increments (`Scores`, or None when query_weights is None)."""
        weights = self.query_weights(lengths, q.shape[1])
        key_pos, start = self.key_positions(state)
        q, k = rotate_chunk(rope, q, k, start)
        out, _, inc_cache, inc_chunk = state.kernels.chunk_attention(
            q, k, v, state.k, state.v, state.pos >= 0, key_pos, lengths, weights, self.head_reduction, rope,
            layer=state.layer,
        )
        return out, None if inc_cache is None else Scores(cache=inc_cache, chunk=inc_chunk)

    def step_branch(self, state: CacheState, chunk_len: int, lengths: jax.Array) -> tuple[jax.Array, tuple[Policy, ...]] | None:
        """A data-dependent branch that every layer of a model takes alike in a step, decided once per step
        instead of once per layer: None (the default), or (index, policies), an int32 scalar and the
        policies whose attend and update assume each branch; the model runs all its layers with
        policies[index] under one `lax.switch`. state: the first layer's view of the cache; lengths: int32 [B]
        valid tokens of the chunk per row. On a GPU each `lax.cond` waits for its predicate on the host, so a
        branch inside every layer stalls the step once per layer."""
        return None

    def after_prompt(self, model, state, tokens: jax.Array, lengths: jax.Array):
        """The model's cache after the prompt (tokens int32 [B, S], lengths int32 [B]), before `compress`: a
        policy that scores the prompt with a pass of its own through `model` (KVzip's reconstruction) returns the
        scored cache. Default: the state as it is. Called only for policies with observation_window > 0."""
        return state

    def compress(self, state: CacheState, room: int) -> CacheState:
        """The cache after the prompt (its last chunk being the observation window), with `room` free slots
        for decoding. Called only for policies with observation_window > 0, which must define it."""
        raise NotImplementedError(f"{type(self).__name__} has an observation window but does not define compress")


def check_policy(policy: object) -> None:
    """Raises TypeError unless `policy` is a `Policy`."""
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be one of jcascade's policies (jc.Cascade, jc.Sink, ...) or another "
                        f"jcascade.Policy subclass, got {type(policy).__name__}")
