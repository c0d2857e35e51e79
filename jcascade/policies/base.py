"""The cache-policy protocol: the hooks a policy implements and the generic code calls.

A policy is a frozen dataclass (hashable, hence static under `jit`) subclassing `Policy`, validated at
construction, with a `stride` (tokens per chunk of the strided prefill, docs/semantics.md §9). The generic
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

Fields. `Policy.__post_init__` checks every field against its declared type (`check_field`: a `Literal`'s values,
bools, token ids, policies, ints and floats within the `Ints` or `Reals` rule an `Annotated` type adds, e.g.
`Positive`); a policy with a rule across fields extends it. The fields that policies share are declared once,
keyword-only, by the base a policy subclasses: `Strided` (stride and kv_dtype: every policy but AdaKV, whose are
its scorer's), `Positioned` (+ positions), `HeadReduced` (+ head_reduction). A policy whose default differs says so
with `dataclasses.field(default=..., kw_only=True)`.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
import types
import typing
from typing import Annotated, ClassVar, Literal

import jax
import jax.numpy as jnp

from jcascade.cache_state import CacheState, Scores, read_rotation
from jcascade.checks import CLOCK_LIMIT
from jcascade.rope import rotate_chunk
from jcascade.slot_order import rank_by_position


@dataclasses.dataclass(frozen=True)
class Ints:
    """The rule of an int field (`Annotated[int, Ints(...)]`): low <= value <= high (token counts and slots are int32),
    and odd when `odd`."""

    low: int
    high: int = CLOCK_LIMIT
    odd: bool = False

    def problem(self, value: int) -> str | None:
        """None when `value` keeps the rule, else what it must be."""
        if not self.low <= value <= self.high:
            return f">= {self.low} (and at most {self.high})"
        return "odd" if self.odd and value % 2 == 0 else None


@dataclasses.dataclass(frozen=True)
class Reals:
    """The rule of a float field (`Annotated[float, Reals(...)]`): a number in [low, high], or in (low, high) when
    `open`."""

    low: float
    high: float = math.inf
    open: bool = False

    def problem(self, value: float | None) -> str | None:
        """None when `value` keeps the rule, else what it must be (value None: a value of another type)."""
        if value is not None and (self.low < value < self.high if self.open else self.low <= value <= self.high):
            return None
        if self.high == math.inf:
            return f"a number {'>' if self.open else '>='} {self.low:g}"
        return f"a number in {'(' if self.open else '['}{self.low:g}, {self.high:g}{')' if self.open else ']'}"


Positive = Annotated[int, Ints(1)]
NonNegative = Annotated[int, Ints(0)]
OddPositive = Annotated[int, Ints(1, odd=True)]  # a pooling kernel: pooling keeps the length
Positions = Literal["cache", "original"]
HeadReduction = Literal["max", "mean"]
KvDtype = Literal["model", "int8", "float8_e4m3fn"]  # jcascade.pallas_kernels.storage.KV_DTYPES
TokenIds = tuple[int, ...]


def check_field(policy: object, name: str, hint) -> None:
    """Raises ValueError naming `Policy.name` and what it must be unless the field's value is of its declared type
    `hint`: one of a `Literal`'s values; True or False (bool); a tuple of token ids, ints >= 0 (`TokenIds`); an
    instance of the policy classes named (a class or a union); an int (not a bool) for int, an int or float for float,
    within the rules an `Annotated` type adds (`Ints`, `Reals`). Other types are not checked."""
    value = getattr(policy, name)
    hint, *rules = typing.get_args(hint) if typing.get_origin(hint) is Annotated else (hint,)
    rules = [rule for rule in rules if isinstance(rule, (Ints, Reals))]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    classes = args if origin in (typing.Union, types.UnionType) else (hint,)
    if origin is Literal:
        problem = None if value in args else f"one of {args}"
    elif hint is bool:
        problem = None if isinstance(value, bool) else "True or False"
    elif origin is tuple:
        ids = isinstance(value, tuple) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
        problem = None if ids else "a tuple of token ids (ints >= 0)"
    elif hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, int if hint is int else (int, float)):
            problems = ["an int"] if hint is int else [rule.problem(None) for rule in rules] + ["a number"]
        else:
            problems = [rule.problem(value) for rule in rules]
        problem = next((p for p in problems if p), None)
    elif all(isinstance(c, type) and issubclass(c, Policy) for c in classes):
        names = " or ".join(("jc." if c.__module__.startswith("jcascade.") else "") + c.__name__ for c in classes)
        problem = None if isinstance(value, classes) else f"a {names}"
    else:
        problem = None
    if problem:
        raise ValueError(f"{type(policy).__name__}.{name} must be {problem}, got {value!r}")


@functools.cache
def field_types(cls: type) -> dict[str, object]:
    """The declared type of each dataclass field of a policy class, `Annotated` rules kept."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def last_queries(lengths: jax.Array, chunk_len: int, count: int) -> jax.Array:
    """f32 [B, T]: 1 for the last `count` valid queries of each row, 0 elsewhere (an observation window)."""
    q = jnp.arange(chunk_len, dtype=jnp.int32)[None, :]
    return ((q < lengths[:, None]) & (q >= lengths[:, None] - count)).astype(jnp.float32)


class Policy(abc.ABC):
    """A KV-cache policy. Subclasses are frozen dataclasses with a `stride` (most of them through `Strided`).

    Class attributes (override them as plain class attributes, not dataclass fields, where they differ):
      bounded       the cache has a fixed number of slots; False: init_cache needs max_tokens and the
                    policy may keep every token (then generate warns past the model's trained positions).
      keeps_scores  attend returns `Scores` and update needs them (else both use None).
      needs_prompt  acts once a prompt ends (compression, decode-time recycling): jc.score needs
                    prefix=, streaming perplexity refuses the policy.
      shareable     its cache after a prompt can serve as a frozen shared prefix (jc.share_prefix,
                    generate's num_samples).
    Defaults of fields a policy may not have: positions "original", head_reduction "max",
    observation_window 0 (no compression after the prompt), kv_dtype "model" (keys and values stored in the
    model's dtype).
    """

    bounded: ClassVar[bool] = True
    keeps_scores: ClassVar[bool] = False
    needs_prompt: ClassVar[bool] = False
    shareable: ClassVar[bool] = True
    stride: int
    positions = "original"
    head_reduction = "max"
    observation_window = 0
    kv_dtype = "model"

    def __post_init__(self):
        """Checks every field against its declared type (`check_field`); a policy with a rule across fields
        extends this, calling it first."""
        for name, hint in field_types(type(self)).items():
            check_field(self, name, hint)

    @property
    def label(self) -> str:
        """A short name for tables and figure legends (e.g. "Cascade 384x2"); the repr is the full spec."""
        return type(self).__name__

    @abc.abstractmethod
    def cache_slots(self, max_tokens: int | None) -> int:
        """Slots of a fresh cache. max_tokens: the tokens it must be able to receive (a positive int,
        checked by init_cache, when the policy is not `bounded`; bounded policies ignore it)."""

    @abc.abstractmethod
    def update(
        self, state: CacheState, k: jax.Array, v: jax.Array, scores: Scores | None, lengths: jax.Array
    ) -> CacheState:
        """The cache after a chunk: k, v [B, T, Hkv, D] un-rotated (the chunk attend just saw), scores what
        attend returned (checked by jc.update: `Scores` when keeps_scores, else None), lengths int32 [B]
        valid tokens per row (padding must leave a row untouched). Must add lengths to `state.seen`."""

    def query_weights(self, lengths: jax.Array, chunk_len: int) -> jax.Array | None:
        """f32 [B, T] weight of each query in the score increments; None for policies that keep no scores."""
        return None

    @property
    def stores_rotated(self) -> bool:
        """Whether its cache stores keys rotated at their original positions when `init_cache` is given a rope: where
        the attention then reads them without rotating each key (key positions the tokens' own; `SlidingWindow`
        and `Sink` by segments). Ranks that shift token by token (Cascade, H2O, TOVA with positions="cache") keep
        keys un-rotated, rotated to their ranks as they are read: from rotated keys that is the same rotation per
        key plus a per-head position difference to read (1-3 % slower decode steps on an H200,
        docs/results/quantized.md)."""
        return self.positions != "cache"

    def key_positions(self, state: CacheState) -> tuple[jax.Array, jax.Array]:
        """RoPE positions (docs/semantics.md §4): of the held keys, int32 [B, 1 or Hkv, capacity] (-1 for empty slots),
        and of the chunk's first token, int32 [B]. "original": the token indices; "cache": the rank among
        the row's held tokens by position (each head counting its own)."""
        if self.positions != "cache":
            return state.pos, state.seen
        return rank_by_position(state.pos), jnp.sum(state.pos[:, 0, :] >= 0, axis=-1).astype(jnp.int32)

    def attend(
        self, state: CacheState, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, rope
    ) -> tuple[jax.Array, Scores | None]:
        """The chunk's queries q [B, T, Hq, D] against every held slot and causally against the chunk
        (k, v [B, T, Hkv, D] un-rotated); arguments checked by jc.attend. Returns out [B, T, Hq, D] and the
        score increments (`Scores`, or None when query_weights is None). Keys stored rotated at the tokens' own
        positions (`CacheState.rope`) are read as they are when those are the key positions ("original"), and
        rotated from there to their ranks otherwise (`cache_state.read_rotation`)."""
        weights = self.query_weights(lengths, q.shape[1])
        key_pos, start = self.key_positions(state)
        q, k = rotate_chunk(rope, q, k, start)
        cache_rope, cache_pos = read_rotation(state, rope, key_pos, self.positions != "cache")
        out, _, inc_cache, inc_chunk = state.kernels.chunk_attention(
            q,
            k,
            v,
            state.k,
            state.v,
            state.pos >= 0,
            cache_pos,
            lengths,
            weights,
            self.head_reduction,
            cache_rope,
            layer=state.layer,
        )
        return out, None if inc_cache is None else Scores(cache=inc_cache, chunk=inc_chunk)

    def step_branch(
        self, state: CacheState, chunk_len: int, lengths: jax.Array
    ) -> tuple[jax.Array, tuple[Policy, ...]] | None:
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strided(Policy):
    """A policy with `stride`, the tokens per chunk of its strided prefill (docs/semantics.md §9), and `kv_dtype`,
    the storage format of its cache's keys and values (`jcascade.pallas_kernels.storage`: "model", "int8",
    "float8_e4m3fn")."""

    stride: Positive = 4096
    kv_dtype: KvDtype = "model"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Positioned(Strided):
    """+ `positions`, the RoPE positions of the held keys (`key_positions`; docs/semantics.md §4)."""

    positions: Positions = "original"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadReduced(Positioned):
    """+ `head_reduction`, how a token's scores from the query heads of its KV head are reduced."""

    head_reduction: HeadReduction = "mean"


def check_policy(policy: object) -> None:
    """Raises TypeError unless `policy` is a `Policy`."""
    if not isinstance(policy, Policy):
        from jcascade.policies.spec import policy_names

        raise TypeError(
            f"policy must be one of jcascade's policies ({', '.join('jc.' + n for n in policy_names())}) "
            f"or another jcascade.Policy subclass, got {type(policy).__name__}"
        )
