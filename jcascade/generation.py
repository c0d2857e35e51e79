"""Strided prefill, scoring and generation around a model and a cache policy (DESIGN §9).

Prompts are right-padded: row b's tokens are tokens[b, :lengths[b]], the rest is padding. Prefill is a
`lax.scan` over `policy.stride`-token chunks (the last one padded and masked through lengths); decode
is a `lax.while_loop` over single tokens. Everything is jit-able, compiles once per shape and nests
inside a user's `jit`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jcascade import cache
from jcascade import policies as P
from jcascade.models.decoder import CausalLM


def _check_tokens(model: CausalLM, tokens, lengths):
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an int array of shape [batch, length], got {tokens.dtype}{list(tokens.shape)}")
    B, S = tokens.shape
    if S == 0:
        raise ValueError("tokens is empty: a prompt needs at least one token")
    lengths = cache.check_lengths(lengths, B, S)
    if cache.concrete(tokens, lengths):  # under a user's jit these checks cannot run
        ids, n = np.asarray(tokens), np.asarray(lengths)
        bad = ids[(np.arange(S)[None, :] < n[:, None]) & ((ids < 0) | (ids >= model.config.vocab_size))]
        if bad.size:
            raise ValueError(f"token ids must lie in [0, vocab_size={model.config.vocab_size}), got {bad[:5].tolist()}")
        if n.min() < 1:
            raise ValueError(f"every prompt needs at least one token, got lengths {n.tolist()}")
    return tokens.astype(jnp.int32), lengths


def _check_positions(model: CausalLM, policy, total: int) -> None:
    limit = model.config.max_position_embeddings
    if isinstance(policy, P.Full) and total > limit:
        raise ValueError(f"{total} tokens exceed the model's {limit} positions; Full attention cannot go "
                         "beyond them (use a bounded policy such as Cascade)")


def _new_cache(model: CausalLM, policy, batch: int, total: int) -> cache.CacheState:
    """An empty cache for `total` tokens (the capacity of Full; bounded policies ignore it)."""
    return model.init_cache(policy, batch, max_tokens=total if isinstance(policy, P.Full) else None)


def _chunks(tokens: jax.Array, lengths: jax.Array, stride: int):
    """[n, B, stride] chunks of right-padded tokens and their [n, B] valid lengths."""
    B, S = tokens.shape
    n = -(-S // stride)
    padded = jnp.pad(tokens, ((0, 0), (0, n * stride - S)))
    chunks = padded.reshape(B, n, stride).transpose(1, 0, 2)
    starts = jnp.arange(n, dtype=jnp.int32)[:, None] * stride
    return chunks, jnp.clip(lengths[None, :] - starts, 0, stride)


def prefill(model: CausalLM, policy, state: cache.CacheState, tokens: jax.Array, lengths: jax.Array,
            implementation: str | None = None) -> tuple[cache.CacheState, jax.Array]:
    """Feeds right-padded tokens [B, S] in stride chunks. Returns the cache and the final hidden state at
    each row's last valid token [B, hidden] (rows with length 0 give zeros)."""
    B, _ = tokens.shape
    chunks, chunk_lengths = _chunks(tokens, lengths, policy.stride)

    def step(carry, inputs):
        state, last = carry
        toks, n = inputs
        hidden, state = model(policy, state, toks, n, implementation)
        at = jnp.clip(n - 1, 0, policy.stride - 1)
        here = jnp.take_along_axis(hidden, at[:, None, None], axis=1)[:, 0]
        return (state, jnp.where((n > 0)[:, None], here, last)), None

    init = (state, jnp.zeros((B, model.config.hidden_size), model.dtype))
    (state, last), _ = jax.lax.scan(step, init, (chunks, chunk_lengths))
    return state, last


def score(model: CausalLM, tokens: jax.Array, policy, *, lengths: jax.Array | None = None,
          implementation: str | None = None) -> jax.Array:
    """Per-token log-likelihoods log p(x_t | x_<t) under `policy`, streamed at constant memory.

    tokens: int [B, S] (right-padded, `lengths` [B] valid tokens per row). Returns float32 [B, S - 1]:
    entry t is log p(tokens[:, t + 1] | tokens[:, :t + 1]); entries past a row's length are 0.
    """
    P.check_policy(policy)
    tokens, lengths = _check_tokens(model, tokens, lengths)
    _check_positions(model, policy, tokens.shape[1])
    return _score(model, tokens, policy, lengths, implementation)


@functools.partial(jax.jit, static_argnames=("policy", "implementation"))
def _score(model, tokens, policy, lengths, implementation):
    B, S = tokens.shape
    state = _new_cache(model, policy, B, S)
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    chunks, chunk_lengths = _chunks(tokens, lengths, policy.stride)
    target_chunks, _ = _chunks(targets, lengths, policy.stride)

    def step(state, inputs):
        toks, tgt, n = inputs
        hidden, state = model(policy, state, toks, n, implementation)
        logp = jax.nn.log_softmax(model.logits(hidden), axis=-1)
        return state, jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]

    _, logps = jax.lax.scan(step, state, (chunks, target_chunks, chunk_lengths))
    logps = logps.transpose(1, 0, 2).reshape(B, -1)[:, : S - 1]
    return jnp.where(jnp.arange(S - 1)[None, :] < (lengths - 1)[:, None], logps, 0.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _DecodeState:
    cache: cache.CacheState
    last: jax.Array  # int32 [B] the token to feed next
    out: jax.Array  # int32 [B, max_new_tokens]
    done: jax.Array  # bool [B]
    step: jax.Array  # int32 []
    rng: jax.Array


def _sample(logits: jax.Array, rng, temperature: float, top_p: float) -> jax.Array:
    """Greedy for temperature 0; otherwise nucleus sampling from softmax(logits / temperature)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1)
        cutoff_index = jnp.sum(cum < top_p, axis=-1, keepdims=True)  # keep the smallest prefix reaching top_p
        cutoff = jnp.take_along_axis(ordered, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def generate(model: CausalLM, tokens: jax.Array, policy, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, eos_id: int | None = None, rng: jax.Array | None = None,
             lengths: jax.Array | None = None, implementation: str | None = None) -> jax.Array:
    """Continues right-padded prompts tokens [B, S] (valid prefix `lengths`) by max_new_tokens tokens.

    temperature 0 is greedy; otherwise sampling with `rng` (required) and nucleus `top_p`. A row stops at
    `eos_id` (included in its output); its later entries are eos_id. Returns int32 [B, max_new_tokens].
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature} and {top_p}")
    if temperature > 0 and rng is None:
        raise ValueError("rng (a jax.random key) is required when temperature > 0")
    P.check_policy(policy)
    tokens, lengths = _check_tokens(model, tokens, lengths)
    _check_positions(model, policy, tokens.shape[1] + max_new_tokens)
    rng = jax.random.key(0) if rng is None else rng
    return _generate(model, tokens, policy, lengths, rng, max_new_tokens=max_new_tokens,
                     temperature=float(temperature), top_p=float(top_p), eos_id=eos_id, implementation=implementation)


@functools.partial(jax.jit, static_argnames=("policy", "max_new_tokens", "temperature", "top_p", "eos_id", "implementation"))
def _generate(model, tokens, policy, lengths, rng, *, max_new_tokens, temperature, top_p, eos_id, implementation):
    B, S = tokens.shape
    state = _new_cache(model, policy, B, S + max_new_tokens)
    state, last_hidden = prefill(model, policy, state, tokens, lengths, implementation)
    rng, first_rng = jax.random.split(rng)
    first = _sample(model.logits(last_hidden), first_rng, temperature, top_p)
    pad = -1 if eos_id is None else eos_id
    init = _DecodeState(cache=state, last=first, out=jnp.full((B, max_new_tokens), pad, jnp.int32).at[:, 0].set(first),
                        done=(first == eos_id) if eos_id is not None else jnp.zeros((B,), bool),
                        step=jnp.int32(1), rng=rng)

    def cond(s: _DecodeState):
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def body(s: _DecodeState):
        active = (~s.done).astype(jnp.int32)
        hidden, new_cache = model(policy, s.cache, s.last[:, None], active, implementation)
        rng, key = jax.random.split(s.rng)
        nxt = jnp.where(s.done, pad, _sample(model.logits(hidden[:, 0]), key, temperature, top_p))
        done = s.done | (nxt == eos_id) if eos_id is not None else s.done
        return _DecodeState(cache=new_cache, last=nxt, out=s.out.at[:, s.step].set(nxt), done=done,
                            step=s.step + 1, rng=rng)

    return jax.lax.while_loop(cond, body, init).out
