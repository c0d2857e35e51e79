"""Argument checks shared by the cache API and the generation entry points: integer arrays checked before any
narrowing, the int32 token clock, a cache's overflow, lengths and rope (docs/reliability.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

CLOCK_LIMIT = 2**31 - 1  # tokens a row can receive: its clock (`seen`) and positions are int32


def concrete(*arrays) -> bool:
    """Whether every array has a value now (not traced under jit), so that it can be validated."""
    return not any(isinstance(x, jax.core.Tracer) for x in arrays)


def int_array(x, name: str, shape: tuple[int, ...], low: int, high: int, rule: str, where=None, host: bool = False):
    """`x` as int32, once checked: an integer array of any width (not float or bool) of `shape` whose entries
    (where `where` is true, if given) lie in [low, high), `rule` in words; a jax Array, or with `host` a NumPy array
    when x has a value (for a caller that computes on the host, even under an outer trace). The values are compared in
    x's own dtype, before any narrowing (jnp.asarray would turn an int64 2**32 + 5 into 5 without a word). Traced values
    (inside a user's jit) cannot be checked here: there the check is a `checkify.debug_check`, an error
    only under `jax.experimental.checkify.checkify` (docs/reliability.md)."""
    if not isinstance(x, jax.Array):
        x = np.asarray(x)
    wanted = f"{name} must be an integer array of shape {list(shape)}, got {x.dtype}{list(x.shape)}"
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(wanted)
    if x.shape != shape:
        raise ValueError(wanted)
    values = np.asarray(x) if concrete(x) else x
    info = np.iinfo(x.dtype)  # bounds beyond the dtype's range cannot be crossed (and would not convert)
    bad = (values < low if low > info.min else np.zeros(shape, bool)) | (values >= high if high <= info.max else False)
    if where is not None:
        bad = bad & (np.asarray(where) if concrete(where) else where)
    if concrete(bad):
        if bad.any():
            at = [tuple(i) for i in np.argwhere(bad)[:5].tolist()]
            raise ValueError(f"{name}: {rule}, got {values[bad][:5].tolist()} at {at}")
    else:
        first = jnp.argmax(bad.ravel())
        checkify.debug_check(
            ~bad.any(),
            f"{name}: {rule}, got {{value}} at {{at}}",
            value=jnp.ravel(values)[first],
            at=jnp.stack(jnp.unravel_index(first, shape)) if shape else first,
        )
        return jnp.asarray(x, jnp.int32)
    values = values.astype(np.int32)  # narrowed on the host: no program compiled for it
    return values if host else jnp.asarray(values)


def check_clock(seen: jax.Array, n: jax.Array) -> None:
    """Raises ValueError (when the values are concrete) if a row's token clock would pass CLOCK_LIMIT."""
    if concrete(seen, n):
        after = np.asarray(seen, np.int64) + np.asarray(n, np.int64)
        if after.max() > CLOCK_LIMIT:
            rows = np.flatnonzero(after > CLOCK_LIMIT).tolist()
            raise ValueError(
                f"rows {rows} would receive more than {CLOCK_LIMIT} tokens, the limit of the int32 token "
                "clock: start a new cache (init_cache) for a longer stream"
            )


def check_overflow(policy, placed: jax.Array, n: jax.Array, capacity: int) -> None:
    """Raises on concrete inputs when a row would hold more than `capacity` tokens. Under `jit` it cannot
    raise (the policy decides what an overflowing row does: Full returns NaN for the row's attention,
    the others drop the excess tokens); under `jax.experimental.checkify.checkify` it becomes a checkify
    error naming the first such row and how many tokens it would hold."""
    if concrete(placed, n):
        over = np.asarray(placed) + np.asarray(n) - capacity
        if over.max() > 0:
            raise ValueError(
                f"{type(policy).__name__} cache of {capacity} slots overflows by {over.tolist()} tokens per row "
                "(give init_cache a larger max_tokens)"
            )
        return
    total = placed + n
    checkify.debug_check(
        jnp.all(total <= capacity),
        f"{type(policy).__name__} cache of {capacity} slots overflows: "
        "row {row} would hold {tokens} tokens (give init_cache a larger max_tokens)",
        row=jnp.argmax(total),
        tokens=jnp.max(total),
    )


def check_lengths(lengths, batch: int, chunk_len: int) -> jax.Array:
    """int32 [B] valid-token counts (a prefix of each chunk row), checked by `int_array`; None means the whole
    chunk."""
    if lengths is None:
        return jnp.full((batch,), chunk_len, jnp.int32)
    return int_array(
        lengths, "lengths", (batch,), 0, chunk_len + 1, f"each must lie in [0, {chunk_len}] (the chunk's length)"
    )


def check_rope(rope) -> None:
    """Raises TypeError unless rope is None or a callable (x, positions) -> rotated x."""
    if rope is not None and not callable(rope):
        raise TypeError(
            f"rope must be None or a callable (x, positions) -> rotated x, such as jc.RoPE(theta), got "
            f"{type(rope).__name__}"
        )
