"""A streaming demo on random data: which original positions a Sink and a Cascade cache hold.

Random queries and keys, except that every `heavy_every`-th token has a key aligned with all queries,
so it draws a large share of attention. Both caches see the same stream in strided chunks; the demo
prints, per policy, the positions held by KV head 0 and how many of the heavy tokens survived.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jcascade import attention, cache, policies


@dataclasses.dataclass(frozen=True)
class DemoResult:
    policy: policies.Policy
    positions: np.ndarray  # sorted original positions held by row 0, KV head 0
    heavy_kept: int  # heavily attended tokens still held (sinks excluded)
    heavy_in_span: int  # heavily attended tokens between the oldest held non-sink token and the last one
    seconds: float


def compress_ranges(positions: np.ndarray) -> str:
    """[0 1 2 3 7 9 10 11] -> '0-3 7 9-11'."""
    parts, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            parts.append(str(start) if start == p else f"{start}-{p}")
            start = None
    return " ".join(parts)


def run_stream(policy: policies.Policy, num_tokens: int, heavy_every: int, seed: int = 0,
               num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32) -> DemoResult:
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=head_dim).astype(np.float32)
    direction *= 4.0 / np.linalg.norm(direction)
    T = policy.stride
    state = cache.init_cache(policy, 1, num_kv_heads, head_dim, jnp.float32)

    @jax.jit
    def step(state, q, k, v, lengths):
        out, scores = attention.attend(policy, state, q, k, v, lengths)
        return cache.update(policy, state, k, v, scores, lengths), out

    start = time.perf_counter()
    for first in range(0, num_tokens, T):
        n = min(T, num_tokens - first)
        q = rng.normal(size=(1, T, num_heads, head_dim)).astype(np.float32) * 0.3 + direction
        k = rng.normal(size=(1, T, num_kv_heads, head_dim)).astype(np.float32) * 0.3
        heavy = (first + np.arange(T)) % heavy_every == heavy_every - 1
        k[0, heavy] += direction
        v = rng.normal(size=(1, T, num_kv_heads, head_dim)).astype(np.float32)
        state, _ = step(state, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray([n], jnp.int32))
    held = np.asarray(cache.cached_positions(state))[0, 0]
    held = np.sort(held[held >= 0])
    rest = held[held >= policy.layout().sinks]
    is_heavy = lambda p: p % heavy_every == heavy_every - 1
    span = np.arange(rest[0], num_tokens) if rest.size else np.arange(0)
    return DemoResult(policy, held, int(is_heavy(rest).sum()), int(is_heavy(span).sum()),
                      time.perf_counter() - start)


def main(num_tokens: int = 4096, cache_size: int = 128, sinks: int = 4, stride: int = 256, heavy_every: int = 97):
    print(f"Streaming {num_tokens} random tokens in chunks of {stride}; every {heavy_every}th token is a key that "
          f"all queries attend to.\nEach cache holds {sinks} sinks + {cache_size} tokens. Original positions held "
          "by KV head 0:\n")
    for policy in (
        policies.Sink(window=cache_size, sinks=sinks, stride=stride),
        policies.Cascade(cache_size=cache_size, sinks=sinks, num_cascades=4, gamma=0.999, stride=stride),
    ):
        r = run_stream(policy, num_tokens, heavy_every)
        oldest = r.positions[sinks] if r.positions.size > sinks else num_tokens
        print(f"{type(policy).__name__}: holds {r.positions.size} tokens; its non-sink tokens span positions "
              f"{oldest}-{num_tokens - 1} ({num_tokens - oldest} tokens); heavy tokens held: {r.heavy_kept} "
              f"of the {r.heavy_in_span} in that span ({r.seconds:.1f} s)")
        print("  " + compress_ranges(r.positions) + "\n")
