"""Strided prefill, scoring and generation around a model and a cache policy (docs/semantics.md §9).

Prompts are right-padded: row b's tokens are tokens[b, :lengths[b]], the rest is padding. Prefill is a
`lax.scan` over `policy.stride`-token chunks (the last one padded and masked through lengths; a prompt narrower
than the stride is one chunk cut to its width: `chunk_size`); decode is a `lax.while_loop` over single tokens.
Everything is jit-able, compiles once per shape and nests inside a user's `jit`.

Entry points: `generate` (greedy or sampled continuations; `num_samples=`: several continuations of one prompt
whose cache is shared), `score` (per-token log-likelihoods; `prefix=`: a prompt, then teacher forcing), `prefill`
(the strided prefill on a cache of one's own), `decode` (the decode loop after it). `generate` and `score` take
`context=` (compress once, ask many): a context, one for every row ([1, S]) or one per row ([B, S] with
`context_lengths`), prefilled and compressed under the policy without seeing the questions, then frozen as a
shared prefix; tokens are each row's question, prefilled after it in a cache of the row's own.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jcascade import checks, compilation
from jcascade.checks import int_array
from jcascade.models.config import ModelConfig
from jcascade.models.decoder import CausalLM
from jcascade.models.state import ModelState
from jcascade.policies import Full, check_policy
from jcascade.shared import share_prefix


def as_model(model, config: ModelConfig | None = None) -> CausalLM:
    """The CausalLM that `model` stands for: a CausalLM; the (graphdef, state) pair that `flax.nnx.split(model)`
    returns; or a weights pytree ({name: array}, as `CausalLM.weights()` returns them) with `config` its
    ModelConfig. Works on traced arrays, inside a user's jit. Anything else: a TypeError saying what to pass."""
    from flax import nnx

    if isinstance(model, CausalLM) and config is None:
        return model
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], nnx.GraphDef) and config is None:
        merged = nnx.merge(*model)
        if isinstance(merged, CausalLM):
            return merged
    if isinstance(model, dict) and isinstance(config, ModelConfig):
        return CausalLM(config, model)
    hint = (
        " (a dict of weights also needs config=, its ModelConfig)"
        if isinstance(model, dict)
        else " (an nnx.State alone lacks its graph: pass the pair nnx.split returns)"
        if isinstance(model, nnx.State)
        else " (config= goes only with a dict of weights)"
        if config is not None
        else ""
    )
    raise TypeError(
        "model must be a jcascade CausalLM, the (graphdef, state) pair of flax.nnx.split(model), or a "
        f"dict of weights by name with config=ModelConfig(...); got {type(model).__name__}{hint}"
    )


def _check_tokens(
    model: CausalLM, tokens, lengths, least: int = 1, targets=None, names: tuple[str, str] = ("tokens", "lengths")
):
    """tokens [B, S], lengths [B] and targets [B, S] (if given) as int32, checked by `int_array`: lengths in
    [least, S], ids in [0, vocab_size) at each row's valid positions. Padding ids become 0: the embedding of
    an id outside the vocabulary is NaN, and a chunk's masked positions still multiply by it. `names`: the
    arguments that tokens and lengths stand for, as errors name them (("context", "context_lengths"))."""
    shape = np.shape(tokens)
    if len(shape) != 2:
        raise ValueError(f"{names[0]} must be an integer array of shape [batch, length], got shape {list(shape)}")
    B, S = shape
    if S == 0:
        raise ValueError(f"{names[0]} is empty: a prompt needs at least one token")
    # values at hand are masked on the host (no program compiled per shape for it); traced ones in the user's jit
    host = checks.concrete(tokens, lengths, targets)
    xp = np if host else jnp
    if lengths is None:
        lengths = np.full((B,), S, np.int32)
    else:
        rule = f"each must lie in [{least}, {S}]" + (" (a prompt needs at least one token)" if least else "")
        lengths = int_array(lengths, names[1], (B,), least, S + 1, rule, host=host)
    valid = xp.arange(S)[None, :] < lengths[:, None]
    rule = f"token ids must lie in [0, vocab_size={model.config.vocab_size})"
    tokens, targets = (
        None
        if ids is None
        else jnp.asarray(
            xp.where(valid, int_array(ids, name, (B, S), 0, model.config.vocab_size, rule, valid, host=host), 0)
        )
        for name, ids in ((names[0], tokens), ("targets", targets))
    )
    return tokens, jnp.asarray(lengths), targets


def check_sharing(argument: str, policy=None, config: ModelConfig | None = None) -> None:
    """Refuses, naming `argument` (num_samples=, context=, --protocol query-agnostic), what cannot hold a prompt's
    cache as a frozen shared prefix: a `policy` that is not `shareable` (Recycled), a model `config` with sliding
    or linear layers (Gemma 3 and 4, Qwen3.5). Either may be None (not checked), so that a command checks them
    before loading a model."""
    if policy is not None and not policy.shareable:
        raise ValueError(
            f"{argument} does not support {type(policy).__name__} (its cache is chosen per request: it "
            "cannot be one frozen prefix shared by the rows)"
        )
    if config is not None and (set(config.types) != {"global"} or config.kv_shared_layers):
        raise ValueError(
            f"{argument} is not supported yet for models with sliding or linear layers (Gemma 3 and 4, "
            "Qwen3.5): it holds the prompt's cache as a shared prefix"
        )


def _check_context(model: CausalLM, policy, context, context_lengths, batch: int):
    """context [1 or batch, S] and context_lengths [1 or batch] (None: every row S tokens) as int32, checked as
    `_check_tokens` checks tokens, by their own names; (None, None) without a context."""
    if context is None:
        if context_lengths is not None:
            raise ValueError("context_lengths goes only with context= (the valid tokens of each context row)")
        return None, None
    shape = np.shape(context)
    if len(shape) != 2 or shape[0] not in (1, batch):
        raise ValueError(
            f"context must be an integer array of shape [1, length] (one context for every row) or "
            f"[{batch}, length] (one per row of tokens), got shape {list(shape)}"
        )
    check_sharing("context=", policy, model.config)
    context, context_lengths, _ = _check_tokens(model, context, context_lengths, names=("context", "context_lengths"))
    return context, context_lengths


def _longest(tokens: jax.Array, lengths: jax.Array) -> int:
    """The longest row's length (the padded width inside a user's jit, where lengths are traced)."""
    return tokens.shape[1] if isinstance(lengths, jax.core.Tracer) else int(jnp.max(lengths))


def _number(name: str, x, kind, rule: str, ok) -> int | float:
    """x as an int (kind numbers.Integral) or a float (numbers.Real) once checked: a TypeError for another
    type (bools included), a ValueError unless ok(x); both name the argument and `rule`."""
    if isinstance(x, bool) or not isinstance(x, kind):
        raise TypeError(f"{name} must be {rule}, got {type(x).__name__} {x!r}")
    if not ok(x):
        raise ValueError(f"{name} must be {rule}, got {x!r}")
    return int(x) if kind is numbers.Integral else float(x)


def _check_key(rng) -> None:
    """A TypeError unless rng is one jax.random key (typed, or a legacy uint32[2] PRNGKey)."""
    if not (
        isinstance(rng, jax.Array)
        and (
            jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
            and rng.shape == ()
            or rng.dtype == jnp.uint32
            and rng.shape == (2,)
        )
    ):
        got = f"{rng.dtype}{list(rng.shape)}" if isinstance(rng, jax.Array) else type(rng).__name__
        raise TypeError(f"rng must be one key from jax.random.key (or jax.random.PRNGKey), got {got}")


def _check_positions(model: CausalLM, policy, total: int) -> None:
    """Warns when a policy that is not bounded (it may keep every prompt token) will use positions past the
    model's trained ones (allowed: showing what happens there is part of evaluating context extension)."""
    limit = model.config.max_position_embeddings
    if not policy.bounded and total > limit:
        warnings.warn(
            f"{total} tokens exceed the model's {limit} trained positions; {type(policy).__name__} keeps "
            "every prompt token at its position, so expect degraded output (a bounded policy such as "
            "Cascade stays within them)",
            stacklevel=3,
        )


SMALLEST_CHUNK = 16


def chunk_size(policy, width: int) -> int:
    """Tokens per prefill chunk for a prompt `width` tokens wide (padded width, static): the policy's stride,
    cut for a narrower prompt to the next power of two >= width (at least SMALLEST_CHUNK, so that few widths
    compile). The stride bounds it: a prompt wider than the stride is fed in stride chunks as before, and one
    narrower fits one chunk either way (its padding masked), so the cut changes no result, only the padding."""
    return min(policy.stride, max(SMALLEST_CHUNK, 1 << (max(width, 1) - 1).bit_length()))


def _chunks(tokens: jax.Array, lengths: jax.Array, stride: int):
    """[n, B, stride] chunks of right-padded tokens and their [n, B] valid lengths."""
    B, S = tokens.shape
    n = -(-S // stride)
    padded = jnp.pad(tokens, ((0, 0), (0, n * stride - S)))
    chunks = padded.reshape(B, n, stride).transpose(1, 0, 2)
    starts = jnp.arange(n, dtype=jnp.int32)[:, None] * stride
    return chunks, jnp.clip(lengths[None, :] - starts, 0, stride)


def token_log_probs(model: CausalLM, hidden: jax.Array, targets: jax.Array) -> jax.Array:
    """f32 [B, T]: log p(targets) under the logits of hidden [B, T, hidden]."""
    logp = jax.nn.log_softmax(model.logits(hidden), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _last_valid(hidden: jax.Array, n: jax.Array, fallback: jax.Array) -> jax.Array:
    """hidden [B, T, hidden] at each row's last valid token (fallback [B, hidden] where n == 0)."""
    here = jnp.take_along_axis(hidden, jnp.clip(n - 1, 0, hidden.shape[1] - 1)[:, None, None], axis=1)[:, 0]
    return jnp.where((n > 0)[:, None], here, fallback)


def prefill(
    model: CausalLM,
    policy,
    state: ModelState,
    tokens: jax.Array,
    lengths: jax.Array,
    targets: jax.Array | None = None,
    *,
    config: ModelConfig | None = None,
):
    """Feeds right-padded tokens [B, S] in stride chunks (model: as `as_model` takes it, with `config`).
    Returns the model's state (`ModelState`), the final hidden state at each row's last valid token [B, hidden]
    (zeros for rows with length 0) and, when `targets` [B, S] is given, the log-probabilities f32 [B, S] of
    targets[:, t] after tokens[:, :t + 1] (else None). Ids and lengths (in [0, S]) are checked as `generate` checks
    them."""
    model = as_model(model, config)
    tokens, lengths, targets = _check_tokens(model, tokens, lengths, least=0, targets=targets)
    return _prefill(model, policy, state, tokens, lengths, targets)


def prompt_cache(
    model: CausalLM,
    policy,
    tokens: jax.Array,
    lengths: jax.Array | None = None,
    room: int = 0,
    *,
    config: ModelConfig | None = None,
):
    """The cache `generate` decodes from: a fresh cache through right-padded prompts tokens [B, S] (`lengths` [B]
    valid tokens per row, default all S), compressed as `policy` does after a prompt (SnapKV's observation
    window, KVzip's pass, ...), with room for `room` more tokens. Returns (state, the final hidden state at each
    row's last prompt token [B, hidden]). model: as `as_model` takes it; tokens checked as `generate` checks them."""
    check_policy(policy)
    room = _number("room", room, numbers.Integral, "an int >= 0", lambda r: r >= 0)
    model = as_model(model, config)
    tokens, lengths, _ = _check_tokens(model, tokens, lengths)
    return _prompt(model, policy, tokens, lengths, room)[:2]


def _prefill(
    model: CausalLM,
    policy,
    state: ModelState,
    tokens: jax.Array,
    lengths: jax.Array,
    targets: jax.Array | None = None,
    prefixes: tuple = (),
):
    """`prefill` once checked; prefixes: shared-prefix levels that every row's history begins with (the rows'
    own tokens then go to `state`, which must keep no scores: `jcascade.attend_shared`)."""
    B, S = tokens.shape
    chunk = chunk_size(policy, S)
    chunks, chunk_lengths = _chunks(tokens, lengths, chunk)
    target_chunks = None if targets is None else _chunks(targets, lengths, chunk)[0]

    def step(carry, inputs):
        state, last = carry
        toks, n, tgt = inputs
        hidden, state = model(policy, state, toks, n, prefixes)
        logp = None if tgt is None else token_log_probs(model, hidden, tgt)
        return (state, _last_valid(hidden, n, last)), logp

    init = (state, jnp.zeros((B, model.config.hidden_size), model.dtype))
    (state, last), logps = jax.lax.scan(step, init, (chunks, chunk_lengths, target_chunks))
    if logps is not None:
        logps = logps.transpose(1, 0, 2).reshape(B, -1)[:, :S]
    return state, last, logps


def _prompt(
    model: CausalLM, policy, tokens: jax.Array, lengths: jax.Array, room: int, targets: jax.Array | None = None
):
    """A fresh cache through the prompt, ready for `room` more tokens: `prefill`'s (state, last, logps).

    Policies with an observation window (e.g. SnapKV) feed each row's last `observation_window`
    tokens as a chunk of their own, then score the prompt their own way (`after_prompt`: KVzip's pass) and
    compress."""
    B, S = tokens.shape
    w = policy.observation_window
    state = model.init_cache(policy, B, max_tokens=S + (0 if w else room))
    if not w:
        return _prefill(model, policy, state, tokens, lengths, targets)
    window = jnp.minimum(w, lengths)
    state, last, logps = _prefill(model, policy, state, tokens, lengths - window, targets)
    at = jnp.clip(lengths[:, None] - window[:, None] + jnp.arange(w)[None, :], 0, S - 1)  # [B, w]
    hidden, state = model(policy, state, jnp.take_along_axis(tokens, at, axis=1), window)
    last = _last_valid(hidden, window, last)
    if targets is not None:
        in_window = jnp.arange(w)[None, :] < window[:, None]
        window_logps = token_log_probs(model, hidden, jnp.take_along_axis(targets, at, axis=1))
        logps = logps.at[jnp.arange(B)[:, None], jnp.where(in_window, at, S)].set(window_logps, mode="drop")
    state = policy.after_prompt(model, state, tokens, lengths)
    return model.compress(policy, state, room), last, logps


def _shared_prompt(model: CausalLM, policy, tokens: jax.Array, lengths: jax.Array):
    """A prompt [P, S] prefilled and compressed under `policy` alone (`_prompt`), then frozen as one shared-prefix
    level (layers stacked, keys rotated by the model's RoPE; `share_prefix`): the level and the prompt rows' last
    hidden states [P, hidden]."""
    state, last, _ = _prompt(model, policy, tokens, lengths, 0)
    return jax.vmap(lambda layer: share_prefix(policy, layer, rope=model.config.rope))(state.cache), last


def _after_context(
    model: CausalLM,
    policy,
    context: jax.Array,
    context_lengths: jax.Array,
    tokens: jax.Array,
    lengths: jax.Array,
    room: int,
    targets: jax.Array | None = None,
):
    """The context compressed and shared (`_shared_prompt`), then each row's tokens [B, T] prefilled on top of it
    into a Full cache of its own with `room` more slots: (prefixes, that cache, the last hidden state [B, hidden]
    of each row's tokens, `prefill`'s log-probs of targets or None, the context's last hidden states [B, hidden])."""
    prefix, context_last = _shared_prompt(model, policy, context, context_lengths)
    B, T = tokens.shape
    own = Full(stride=policy.stride)  # a short question: one chunk cut to its width (`chunk_size`)
    state = model.init_cache(own, B, max_tokens=T + room)
    state, last, logps = _prefill(model, own, state, tokens, lengths, targets, (prefix,))
    return (prefix,), state, last, logps, jnp.broadcast_to(context_last, (B, context_last.shape[-1]))


def score(
    model: CausalLM,
    tokens: jax.Array,
    policy,
    *,
    lengths: jax.Array | None = None,
    prefix: int | None = None,
    context: jax.Array | None = None,
    context_lengths: jax.Array | None = None,
    config: ModelConfig | None = None,
) -> jax.Array:
    """Per-token log-likelihoods log p(x_t | x_<t) under `policy`, streamed at constant memory. model: a
    CausalLM, the pair `nnx.split(model)` returns, or a weights dict with `config` (`as_model`).

    tokens: int [B, S] (right-padded, `lengths` [B] valid tokens per row). Returns float32 [B, S - 1]:
    entry t is log p(tokens[:, t + 1] | tokens[:, :t + 1]); entries past a row's length are 0. Non-finite
    entries (a NaN or Inf in the inputs or weights) are reported by a RuntimeWarning naming their rows and
    positions (`warn_nonfinite`; not under a user's jit).
    prefix: None feeds everything in stride chunks. An int P treats tokens[:, :P] as a prompt (prefilled
    as `generate` does) and feeds the rest one token per step, as decoding would see it (teacher
    forcing); policies that act after a prompt (`needs_prompt`: e.g. SnapKV compresses, Recycled
    recycles while decoding) need it.
    context: int [1, C] (one for every row) or [B, C] (one per row; `context_lengths` [1 or B] its valid
    tokens, default all C), prefilled and compressed under `policy` alone, then frozen, as `generate`'s context=
    (which says what is shared and what it costs); tokens are then scored after it, in a Full cache of each
    row's own. Returns float32 [B, S]: entry t is log p(tokens[:, t] | context, tokens[:, :t]), the first token
    included; entries from a row's length on are 0. For a [1 or B, C] context of C tokens in every row and a
    policy that evicts nothing after its prompt (Full, and the append caches that compress once: e.g. SnapKV, KVzip)
    this is score(concatenate([context, tokens], axis=1), prefix=C)[:, C - 1:]. No prefix= with a context.
    """
    check_policy(policy)
    model = as_model(model, config)
    tokens, lengths, _ = _check_tokens(model, tokens, lengths)
    S = tokens.shape[1]
    if context is not None and prefix is not None:
        raise ValueError("prefix= and context= do not combine: the context is the prompt that policy compresses")
    if prefix is None and context is None and policy.needs_prompt:
        raise ValueError(
            f"{type(policy).__name__} acts after a prompt: pass prefix=<prompt length> (or context=) to score"
        )
    if prefix is not None:
        prefix = _number("prefix", prefix, numbers.Integral, f"None or an int in [1, {S}]", lambda p: 1 <= p <= S)
    context, context_lengths = _check_context(model, policy, context, context_lengths, tokens.shape[0])
    _check_positions(model, policy, S + (0 if context is None else _longest(context, context_lengths)))
    logps = _score(model, tokens, policy, lengths, prefix, context, context_lengths)
    # checked on the device; rows and positions come to the host only when something is non-finite (padding
    # entries are 0), and not under a user's jit, where there is nothing to look at yet
    if checks.concrete(logps) and not bool(jnp.isfinite(logps).all()):
        warn_nonfinite(np.asarray(logps), np.asarray(lengths) - (1 if context is None else 0))
    return logps


def warn_nonfinite(logps: np.ndarray, valid: np.ndarray) -> None:
    """Warns (RuntimeWarning) with the positions of the non-finite entries among each row's first valid[b]
    log-probabilities (logps [B, S]). A NaN or Inf in the inputs or weights reaches the tokens of its row
    from the start of its chunk until everything it touched has left the cache (never, under Full), and no
    other row (tests/test_nonfinite.py)."""
    bad = ~np.isfinite(logps) & (np.arange(logps.shape[1])[None, :] < valid[:, None])
    rows = [(b, np.flatnonzero(bad[b])) for b in np.flatnonzero(bad.any(axis=1))]
    if rows:
        shown = "; ".join(
            f"row {b}: {len(at)} from position {at[0]} ({', '.join(map(str, at[:5]))}{', ...' if len(at) > 5 else ''})"
            for b, at in rows
        )
        warnings.warn(
            f"non-finite log-probabilities (NaN or Inf in the inputs or weights): {shown}", RuntimeWarning, stacklevel=3
        )


@compilation.jit(static_argnames=("policy", "prefix"))
def _score(model, tokens, policy, lengths, prefix, context, context_lengths):
    B, S = tokens.shape
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    if context is not None:  # the first token after the context's last hidden state, the others after their own rows
        _, _, _, logps, context_last = _after_context(
            model, policy, context, context_lengths, tokens, lengths, 0, targets
        )
        logps = jnp.concatenate([token_log_probs(model, context_last[:, None], tokens[:, :1]), logps[:, :-1]], axis=1)
        return jnp.where(jnp.arange(S)[None, :] < lengths[:, None], logps, 0.0)
    prompt_len = S if prefix is None else prefix
    state, _, logps = _prompt(
        model, policy, tokens[:, :prompt_len], jnp.minimum(lengths, prompt_len), S - prompt_len, targets[:, :prompt_len]
    )
    if prompt_len < S:

        def step(state, inputs):
            tok, tgt, t = inputs
            hidden, state = model(policy, state, tok[:, None], (t < lengths).astype(jnp.int32))
            return state, token_log_probs(model, hidden, tgt[:, None])[:, 0]

        steps = (tokens[:, prompt_len:].T, targets[:, prompt_len:].T, jnp.arange(prompt_len, S, dtype=jnp.int32))
        _, rest = jax.lax.scan(step, state, steps)
        logps = jnp.concatenate([logps, rest.T], axis=1)
    logps = logps[:, : S - 1]
    return jnp.where(jnp.arange(S - 1)[None, :] < (lengths - 1)[:, None], logps, 0.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _DecodeState:
    cache: ModelState
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


def generate(
    model: CausalLM,
    tokens: jax.Array,
    policy,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    rng: jax.Array | None = None,
    lengths: jax.Array | None = None,
    num_samples: int | None = None,
    context: jax.Array | None = None,
    context_lengths: jax.Array | None = None,
    config: ModelConfig | None = None,
) -> jax.Array:
    """Continues right-padded prompts tokens [B, S] (valid prefix `lengths`) by max_new_tokens tokens. model: a
    CausalLM, the pair `nnx.split(model)` returns, or a weights dict with `config` (`as_model`).

    temperature 0 is greedy; otherwise sampling with `rng` (required) and nucleus `top_p`. A row stops at
    `eos_id` (included in its output); its later entries are eos_id. Returns int32 [B, max_new_tokens].

    num_samples: continue one prompt (B = 1) num_samples times, returning [num_samples, max_new_tokens].
    The prompt is prefilled once under `policy`; its cache becomes a shared prefix that every sample's
    queries attend to in one multi-query pass, while each sample's own tokens go to a Full cache
    (`jcascade.shared`). This equals generating from num_samples copies of the prompt whenever the policy
    would not evict during decoding (Full and the append caches, e.g. SnapKV; any policy while prompt and new tokens fit
    its cache); otherwise the prompt's cache is frozen as it was after the prompt. Needs a `shareable`
    policy (not Recycled).

    context: compress once, ask many. int [1, C] is one context for every row, [B, C] one context per row, with
    `context_lengths` int [1 or B] its valid tokens per row (default: all C); tokens [B, S] are then each row's
    question, continued after its context. The context is prefilled and compressed under `policy` alone: its
    compression (SnapKV's observation window, KVzip's reconstruction pass, ...) sees the context, never a
    question. Its cache is then frozen as a shared prefix (as for num_samples; one level of 1 or B rows, so both
    forms have one semantics) that never evicts, and each row's question and new tokens go to a Full cache of its
    own at the positions after the context. Under a policy that keeps every token (Full; SnapKV and the like with
    a budget of at least C) this equals generating from each row's context + question as one prompt; a policy
    that evicts while tokens stream (Cascade, Sink, H2O, ...) evicts only inside the context. Memory: the
    compressed context (once for a [1, C] context, B times for [B, C]) plus B caches of S + max_new_tokens
    slots (question plus new tokens bound a row's own cache). Needs a `shareable` policy (not Recycled), a model
    without sliding or linear layers (not Gemma 3 and 4, Qwen3.5: `check_sharing`), and no num_samples.
    """
    max_new_tokens = _number("max_new_tokens", max_new_tokens, numbers.Integral, "a positive int", lambda n: n >= 1)
    temperature = _number(
        "temperature", temperature, numbers.Real, "a finite float >= 0 (0 is greedy)", lambda t: 0 <= t < math.inf
    )
    top_p = _number("top_p", top_p, numbers.Real, "a float in (0, 1]", lambda p: 0 < p <= 1)
    model = as_model(model, config)
    vocab = model.config.vocab_size
    if eos_id is not None:  # an id the model cannot produce would never stop a row
        eos_id = _number(
            "eos_id", eos_id, numbers.Integral, f"None or an int in [0, vocab_size={vocab})", lambda e: 0 <= e < vocab
        )
    if rng is not None:
        _check_key(rng)
    elif temperature > 0:
        raise ValueError("rng (a jax.random key) is required when temperature > 0")
    check_policy(policy)
    tokens, lengths, _ = _check_tokens(model, tokens, lengths)
    if num_samples is not None:
        num_samples = _number("num_samples", num_samples, numbers.Integral, "a positive int or None", lambda n: n >= 1)
        if context is not None:
            raise ValueError(
                "num_samples and context= do not combine: for several samples of one question, repeat "
                "the question over the rows of tokens with a [1, length] context"
            )
        if tokens.shape[0] != 1:
            raise ValueError(f"num_samples continues one prompt: tokens must have batch 1, got {tokens.shape[0]}")
        check_sharing("num_samples", policy, model.config)
    context, context_lengths = _check_context(model, policy, context, context_lengths, tokens.shape[0])
    before = 0 if context is None else _longest(context, context_lengths)
    _check_positions(model, policy, before + _longest(tokens, lengths) + max_new_tokens)
    rng = jax.random.key(0) if rng is None else rng
    return _generate(
        model,
        tokens,
        policy,
        lengths,
        rng,
        context,
        context_lengths,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        eos_id=eos_id,
        num_samples=num_samples,
    )


@compilation.jit(static_argnames=("policy", "max_new_tokens", "temperature", "top_p", "eos_id", "num_samples"))
def _generate(
    model,
    tokens,
    policy,
    lengths,
    rng,
    context,
    context_lengths,
    *,
    max_new_tokens,
    temperature,
    top_p,
    eos_id,
    num_samples,
):
    decode_policy = Full(stride=policy.stride)  # the rows' own cache under a shared prefix
    if context is not None:  # the context's cache, shared; each row's question and new tokens in a cache of its own
        prefixes, state, last_hidden, _, _ = _after_context(
            model, policy, context, context_lengths, tokens, lengths, max_new_tokens
        )
    elif num_samples is not None:  # the prompt's cache, shared; each sample's tokens in a Full cache of its own
        prefix, last_hidden = _shared_prompt(model, policy, tokens, lengths)
        prefixes = (prefix,)
        state = model.init_cache(decode_policy, num_samples, max_tokens=max_new_tokens)
        last_hidden = jnp.broadcast_to(last_hidden, (num_samples, last_hidden.shape[-1]))
    else:
        state, last_hidden, _ = _prompt(model, policy, tokens, lengths, max_new_tokens)
        decode_policy, prefixes = policy, ()
    return decode(
        model,
        decode_policy,
        state,
        last_hidden,
        rng,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        eos_id=eos_id,
        prefixes=prefixes,
    )


def decode(
    model: CausalLM,
    policy,
    state: ModelState,
    last_hidden: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_id: int | None,
    prefixes=(),
) -> jax.Array:
    """The decode loop after a prefilled cache: samples the first token from last_hidden [B, hidden] (the
    prompt's last hidden state), then feeds one token per step. Returns int32 [B, max_new_tokens] as
    `generate` does. Traceable; `generate` is the checked entry point."""
    B = last_hidden.shape[0]
    rng, first_rng = jax.random.split(rng)
    first = _sample(model.logits(last_hidden), first_rng, temperature, top_p)
    pad = -1 if eos_id is None else eos_id
    init = _DecodeState(
        cache=state,
        last=first,
        out=jnp.full((B, max_new_tokens), pad, jnp.int32).at[:, 0].set(first),
        done=(first == eos_id) if eos_id is not None else jnp.zeros((B,), bool),
        step=jnp.int32(1),
        rng=rng,
    )

    def cond(s: _DecodeState):
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def body(s: _DecodeState):
        active = (~s.done).astype(jnp.int32)
        hidden, new_cache = model(policy, s.cache, s.last[:, None], active, prefixes)
        rng, key = jax.random.split(s.rng)
        nxt = jnp.where(s.done, pad, _sample(model.logits(hidden[:, 0]), key, temperature, top_p))
        done = s.done | (nxt == eos_id) if eos_id is not None else s.done
        return _DecodeState(
            cache=new_cache, last=nxt, out=s.out.at[:, s.step].set(nxt), done=done, step=s.step + 1, rng=rng
        )

    return jax.lax.while_loop(cond, body, init).out
