"""Recycled Attention (Xu et al., arXiv 2411.05787): the full cache is kept; most decode steps attend to a small set.

One state holds three regions: [full cache (max_tokens slots, slot = position) | top_k recycled copies |
tokens fed since the last full step]. Its steps are told apart by the state alone: a row is due for a
full step when its newest region holds refresh_every - 1 tokens. Every layer holds the same tokens, so a
model decides once per decode step whether any row takes a full step (`step_branch`) and runs its layers
with a policy that knows (`Recycled._branch`), rather than branching in every layer.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from jcascade import cache_state, checks
from jcascade.cache_state import CacheState, Scores, read_rotation
from jcascade.policies.base import OddPositive, Positioned, Positive, last_queries
from jcascade.policies.selection import pool
from jcascade.rope import rotate_chunk


@dataclasses.dataclass(frozen=True)
class Recycled(Positioned):
    """Recycled Attention (arXiv 2411.05787): the full cache is kept; most decode steps attend to a small set.

    A full-attention step (every chunk of more than one token, and every `refresh_every`-th decode
    step after it) attends to the whole cache and re-selects, per KV head, the `top_k` tokens its last
    query attended most (max over the query heads of the group, as the paper; pooled over positions
    with `kernel` as SnapKV when kernel > 1, max pooling). The decode steps in between attend only to
    that set plus the tokens fed since the full step (the paper's fixed-size variant instead drops the
    lowest-scored recycled token; see docs/semantics.md §5). So with refresh_every=S, after a prompt the
    first token comes from the prompt's full attention, decode steps 1..S-1 are recycled, step S is
    full, and so on.

    Positions: "original" (the paper keeps the full cache with its positions). The cache allocates
    max_tokens + top_k + refresh_every slots: the full cache, the recycled copies, the new tokens.
    A recycled step reads only the slots it attends to (the kernels address them in place).

    `_branch` is internal (set by `step_branch`, never by users): None decides per call with `lax.cond`;
    "recycled" promises that no row of this decode step takes a full step, "full" that some row may.
    """

    bounded = False
    keeps_scores = True
    needs_prompt = True
    shareable = False  # the recycled set is chosen per request
    top_k: Positive
    refresh_every: Positive
    kernel: OddPositive = 1
    _branch: Literal["full", "recycled", None] = dataclasses.field(default=None, repr=False)

    @property
    def label(self) -> str:
        return f"Recycled {self.top_k}/{self.refresh_every}"

    def cache_slots(self, max_tokens: int | None) -> int:
        return max_tokens + self.top_k + self.refresh_every

    def regions(self, capacity: int) -> tuple[int, int]:
        """(M, M + top_k): starts of the recycled-copies region and of the new-tokens region."""
        full = capacity - self.top_k - self.refresh_every
        if full < 1:
            raise ValueError(f"state capacity {capacity} is too small for {self}: was it made by init_cache?")
        return full, full + self.top_k

    def _since_refresh(self, state: CacheState) -> jax.Array:
        """int32 [B]: tokens fed since the row's last full-attention step."""
        _, recent = self.regions(state.capacity)
        return jnp.sum(state.pos[:, 0, recent:] >= 0, axis=-1).astype(jnp.int32)

    def _full_step_rows(self, since: jax.Array, chunk_len: int) -> jax.Array:
        """bool [B]: rows whose chunk is a full-attention step (every chunk longer than one token, and the
        decode step after refresh_every - 1 recycled ones); since: `_since_refresh`."""
        return (since >= self.refresh_every - 1) | (chunk_len > 1)

    def step_branch(self, state: CacheState, chunk_len: int, lengths: jax.Array):
        """A decode step's branch: 1 when some row takes a full step, else 0 (chunks are all full)."""
        if chunk_len > 1 or self._branch is not None:
            return None
        full = self._full_step_rows(self._since_refresh(state), chunk_len) & (lengths > 0)
        branches = (dataclasses.replace(self, _branch="recycled"), dataclasses.replace(self, _branch="full"))
        return jnp.any(full).astype(jnp.int32), branches

    def _branch_on(self, any_full: jax.Array, if_full, otherwise, *operands):
        """`lax.cond(any_full, if_full, otherwise, *operands)`, or, under a `_branch` set by `step_branch`, the
        branch it names."""
        if self._branch is None:
            return jax.lax.cond(any_full, if_full, otherwise, *operands)
        return (if_full if self._branch == "full" else otherwise)(*operands)

    def query_weights(self, lengths: jax.Array, chunk_len: int) -> jax.Array:
        """1 for the last valid query."""
        return last_queries(lengths, chunk_len, 1)

    def attend(
        self, state: CacheState, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, rope
    ) -> tuple[jax.Array, Scores]:
        """Full rows attend to the full region, the others to the recycled copies and the new tokens."""
        B, T, Hkv, _ = k.shape
        n = lengths
        weights = self.query_weights(n, T)
        M, _ = self.regions(state.capacity)
        full = self._full_step_rows(self._since_refresh(state), T)
        slot = jnp.arange(state.capacity)

        def run(held_pos, key_pos, start, w, first_slot=0):
            """The chunk against slots [first_slot, capacity) (their positions held_pos, -1 empty) at key_pos."""
            qr, kr = rotate_chunk(rope, q, k, start)
            cache_rope, cache_pos = read_rotation(
                dataclasses.replace(state, pos=held_pos), rope, key_pos, self.positions != "cache"
            )
            return state.kernels.chunk_attention(
                qr,
                kr,
                v,
                state.k,
                state.v,
                held_pos >= 0,
                cache_pos,
                n,
                w,
                "max",
                cache_rope,
                layer=state.layer,
                first_slot=first_slot,
            )

        def full_attention():
            full_pos = jnp.where(slot < M, state.pos, -1)
            out, _, inc_cache, inc_chunk = run(full_pos, state.pos, state.seen, weights)
            return out, inc_cache, inc_chunk

        if T > 1:
            out, inc_cache, inc_chunk = full_attention()
            return out, Scores(cache=inc_cache, chunk=inc_chunk)

        recent_pos = state.pos[..., M:]  # the recycled copies and the new tokens, read in place
        key_pos, start = super().key_positions(dataclasses.replace(state, pos=recent_pos))  # "cache": their rank
        small, _, _, _ = run(recent_pos, key_pos, start, None, first_slot=M)
        zeros = (jnp.zeros((B, Hkv, state.capacity), jnp.float32), jnp.zeros((B, Hkv, T), jnp.float32))

        def with_full():
            out, inc_cache, inc_chunk = full_attention()
            pick = full[:, None, None]
            return (
                jnp.where(pick[..., None], out, small),
                jnp.where(pick, inc_cache, 0.0),
                jnp.where(pick, inc_chunk, 0.0),
            )

        out, inc_cache, inc_chunk = self._branch_on(jnp.any(full & (n > 0)), with_full, lambda: (small, *zeros))
        return out, Scores(cache=inc_cache, chunk=inc_chunk)

    def update(self, state: CacheState, k: jax.Array, v: jax.Array, scores: Scores, lengths: jax.Array) -> CacheState:
        """Appends the chunk to the full region; full rows then take the attention of their last query as
        the full region's scores, re-select the top_k copies and empty the new-tokens region; the other
        rows append their token to the new-tokens region."""
        B, T, H, _ = k.shape
        n = lengths
        M, recent = self.regions(state.capacity)
        checks.check_overflow(self, state.seen, n, M)
        since = self._since_refresh(state)
        full = self._full_step_rows(since, T) & (n > 0)
        bi, hi = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
        j = jnp.arange(T, dtype=jnp.int32)[None, :]
        ck, cv = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        chunk_pos = jnp.broadcast_to((state.seen[:, None] + j)[:, None, :], (B, H, T))
        chunk_score = jnp.where(full[:, None, None], scores.chunk, 0.0)

        def write(st, dest, score):
            dest = jnp.broadcast_to(dest[:, None, :], (B, H, T))
            put = lambda x, val: x.at[bi, hi, dest].set(val.astype(x.dtype), mode="drop")
            st = cache_state.write_kv(st, (bi, hi, dest), ck, cv, chunk_pos)
            return dataclasses.replace(st, score=put(st.score, score), pos=put(st.pos, chunk_pos))

        if self._branch != "recycled":
            fresh = jnp.where(full[:, None, None] & (jnp.arange(state.capacity) < M), scores.cache, state.score)
            state = dataclasses.replace(state, score=fresh)
        to_full = state.seen[:, None] + j
        state = write(state, jnp.where((j < n[:, None]) & (to_full < M), to_full, state.capacity), chunk_score)
        if T == 1:  # recycled rows also keep their token among the new ones
            state = write(state, jnp.where(~full & (n > 0), recent + since, state.capacity)[:, None], chunk_score)

        def reselect(st):
            held = st.pos[..., :M] >= 0
            pooled = pool(st.score[..., :M], held, self.kernel, "max")
            top, idx = jax.lax.top_k(pooled, min(self.top_k, M))  # lower slot first on ties
            missing = self.top_k - idx.shape[-1]  # a full region smaller than top_k: pad with empty slots
            top = jnp.pad(top, ((0, 0), (0, 0), (0, missing)), constant_values=-jnp.inf)
            idx = jnp.pad(idx, ((0, 0), (0, 0), (0, missing)))
            chosen = top > -jnp.inf
            take = lambda x: jnp.take_along_axis(x, idx.reshape(*idx.shape, *(1,) * (x.ndim - 3)), axis=2)
            pick = full[:, None, None]
            region = slice(M, None)
            new_pos = jnp.concatenate(
                [jnp.where(chosen, take(st.pos), -1), jnp.full((B, H, self.refresh_every), -1)], -1
            )
            new_score = jnp.concatenate([take(st.score), jnp.zeros((B, H, self.refresh_every), jnp.float32)], -1)
            old_k, old_v = cache_state.cached_kv(st)
            new_k = jnp.concatenate([take(old_k), jnp.zeros_like(old_k[..., recent:, :])], -2)
            new_v = jnp.concatenate([take(old_v), jnp.zeros_like(old_v[..., recent:, :])], -2)
            region_pos = jnp.where(pick, new_pos, st.pos[..., region])
            st = cache_state.write_kv(
                st,
                (slice(None), slice(None), region),
                jnp.where(pick[..., None], new_k, old_k[..., region, :]),
                jnp.where(pick[..., None], new_v, old_v[..., region, :]),
                region_pos,
            )
            return dataclasses.replace(
                st,
                score=st.score.at[..., region].set(jnp.where(pick, new_score, st.score[..., region])),
                pos=st.pos.at[..., region].set(region_pos),
            )

        state = self._branch_on(jnp.any(full), reselect, lambda st: st, state)
        return dataclasses.replace(state, seen=state.seen + n)
