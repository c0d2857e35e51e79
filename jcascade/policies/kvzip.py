"""KVzip (Kim et al. 2025): after the prompt, the model re-reads it behind a "repeat the context" instruction, and
each cached token is scored by the most attention any re-reading query pays it; each KV head keeps the best."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from jcascade.cache_state import CacheState, Scores, stored_kv
from jcascade.policies.base import NonNegative, Positive, Strided, TokenIds
from jcascade.policies.selection import ScorerPolicy, keep_in_position_order, top_per_head

MARKED = -2.0  # the score of the held slots the current reconstruction chunk re-reads, until it scores them

INSTRUCTION = "\n\nRepeat the previous context exactly."
CONTINUATION = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclasses.dataclass(frozen=True)
class KVzip(ScorerPolicy):
    """Full attention over the prompt; then a reconstruction pass scores it and each KV head keeps the `budget`
    prompt tokens with the highest scores (the first `sinks` always), in position order; decoding appends.

    The pass (`after_prompt`, run by `generate` and `score(prefix=)`): the prompt from token `skip` on in chunks of
    `chunk` tokens, each fed to the model after the prompt as `instruction` + `turn` + the chunk (later chunks:
    `continuation` + the previous chunk's last `overlap` tokens + `turn` + the chunk), at positions following
    the prompt, reading the cache without adding to it. A held token's score is the largest softmax weight
    that any of the chunk's queries of the KV head's query heads gives it, the softmax taken over the sinks, the
    chunk's own held tokens and (causally) the pass's tokens, as kvpress's KVzipPress computes it; the first
    `skip` tokens other than the sinks score 0 (kvpress skips the chat template's opening this way). Each chunk
    costs a forward pass of about its length: the pass doubles the prefill.

    `KVzip.for_tokenizer(tokenizer, budget)` fills the token fields and `skip` as kvpress does (its instructions,
    the chat template's end of the user turn and start of the assistant's, the length of the template's opening);
    left empty, the pass re-reads the bare chunks.

    allocation "head" (labelled "KVzip-head"; the command line's `kvzip-head`): each KV head keeps `budget` (a
    cache of `budget` + decoding slots). "global" (labelled "KVzip"; kvpress's default, the paper's, the command
    line's `kvzip`): each row keeps the budget x layers x KV heads best tokens of the whole model, so layers and
    heads keep different counts; the cache then stays allocated at the prompt's length (`jc.cache_occupancy`:
    resident vs allocated), as kvpress masks rather than frees. Positions are the original ones. On models with
    sliding or linear layers (Gemma 3 and 4, Qwen3.5), which kvpress refuses, the pass scores the global layers'
    cache (`after_prompt`).
    """

    instruction: TokenIds = dataclasses.field(default=(), repr=False)
    continuation: TokenIds = dataclasses.field(default=(), repr=False)
    turn: TokenIds = dataclasses.field(default=(), repr=False)
    chunk: Positive = 2048
    overlap: NonNegative = 8
    sinks: NonNegative = 4
    skip: NonNegative = 0
    allocation: Literal["head", "global"] = "head"

    @classmethod
    def for_tokenizer(cls, tokenizer, budget: int, **fields) -> KVzip:
        """KVzip with kvpress's reconstruction prompts in `tokenizer`'s tokens (a Hugging Face tokenizer)."""
        if not callable(getattr(tokenizer, "encode", None)):
            raise TypeError(
                "KVzip.for_tokenizer: tokenizer must be a Hugging Face tokenizer (its reconstruction "
                f"prompts are token ids), got {type(tokenizer).__name__}"
            )
        encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))
        opening, turn = "", "\n"  # kvpress's for a tokenizer without a chat template
        if getattr(tokenizer, "chat_template", None):
            marker = "\n" + "#" * 13
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "dummy context" + marker}], add_generation_prompt=True, tokenize=False
            )
            opening, turn = text.split("dummy context")[0], text.split(marker)[1]
        return cls(
            budget=budget,
            instruction=encode(INSTRUCTION),
            continuation=encode(CONTINUATION),
            turn=encode(turn),
            skip=len(encode(opening)),
            **fields,
        )

    @property
    def label(self) -> str:
        if self.allocation == "global":
            return super().label
        name, _, rest = super().label.partition(" ")  # "KVzip 2048" -> "KVzip-head 2048"
        return f"{name}-head {rest}".rstrip()

    def __post_init__(self):
        super().__post_init__()
        if self.overlap > self.chunk:
            raise ValueError(f"KVzip.overlap must be <= chunk ({self.chunk}), got {self.overlap}")

    def after_prompt(self, model, state, tokens: jax.Array, lengths: jax.Array):
        """The prompt's cache with every held token scored by the reconstruction pass. tokens int32 [B, S], lengths
        int32 [B]: the prompt (right-padded); state: the model's `ModelState` after it. The pass scores the global
        layers' cache (`ModelState.cache`); the other layers' states (sliding, linear) stay as the prompt left them."""
        reader = _Reconstruction(chunk=self.chunk, sinks=self.sinks, stride=self.stride)
        S = tokens.shape[1]

        def one_chunk(c, cache):
            first = self.skip + c * self.chunk
            count = jnp.clip(lengths - first, 0, self.chunk)  # [B] prompt tokens this chunk re-reads
            row, row_len = self._reconstruction_rows(tokens, c, count)
            pos = cache.pos  # [L, B, H, cap]
            reread = (pos >= first) & (pos < (first + count)[None, :, None, None])
            cache = dataclasses.replace(cache, score=jnp.where(reread, MARKED, cache.score))
            return model(reader, dataclasses.replace(state, cache=cache), row, row_len)[1].cache

        cache = dataclasses.replace(state.cache, score=jnp.zeros_like(state.cache.score))
        cache = jax.lax.fori_loop(0, max(0, -(-(S - self.skip) // self.chunk)), one_chunk, cache)
        return dataclasses.replace(state, cache=cache)

    def _reconstruction_rows(self, tokens: jax.Array, c: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
        """int32 [B, W] tokens of chunk c's pass (instruction or continuation + overlap, turn, the chunk's `count`
        tokens, then padding) and int32 [B] their number (0 where the row's prompt has no chunk c)."""
        B, S = tokens.shape
        overlap = min(self.overlap, S)
        head_width = max(len(self.instruction), len(self.continuation) + overlap)
        width = head_width + len(self.turn) + min(self.chunk, S - self.skip)  # a chunk re-reads at most S - skip
        first = self.skip + c * self.chunk
        previous = jax.lax.dynamic_slice_in_dim(tokens, jnp.clip(first - overlap, 0, S - overlap), overlap, axis=1)
        pad = lambda x: jnp.pad(x, ((0, 0), (0, head_width - x.shape[1])))
        rows_of = lambda ids: jnp.broadcast_to(jnp.asarray(ids, jnp.int32), (B, len(ids)))
        head = jnp.where(
            c == 0, pad(rows_of(self.instruction)), pad(jnp.concatenate([rows_of(self.continuation), previous], axis=1))
        )
        head_len = jnp.where(c == 0, len(self.instruction), len(self.continuation) + overlap)
        j = jnp.arange(width)
        in_chunk = j - head_len - len(self.turn)  # index into the chunk
        context = jnp.take_along_axis(tokens, jnp.clip(first + in_chunk, 0, S - 1)[None, :].repeat(B, 0), axis=1)
        row = jnp.where((in_chunk >= 0)[None, :] & (in_chunk[None, :] < count[:, None]), context, 0)
        if self.turn:
            turn = jnp.asarray(self.turn, jnp.int32)[jnp.clip(j - head_len, 0, len(self.turn) - 1)]
            row = jnp.where(((j >= head_len) & (in_chunk < 0))[None, :], turn[None, :], row)
        row = jnp.where((j < head_len)[None, :], head[:, jnp.minimum(j, head_width - 1)], row)
        return row.astype(jnp.int32), jnp.where(count > 0, head_len + len(self.turn) + count, 0).astype(jnp.int32)

    def score(self, state: CacheState) -> jax.Array:
        """The reconstruction pass's scores (`after_prompt`); the sinks first (inf)."""
        return jnp.where(state.pos < self.sinks, jnp.inf, state.score)

    def compress(self, state: CacheState, room: int) -> CacheState:
        """The sinks and the best-scored prompt tokens in position order, then empty slots: `budget + room` slots
        per (row, KV head), or with allocation "global" the prompt's slots + room, `budget` per layer and KV head
        on average over the state's layers and heads. state: one layer, or layers stacked on a leading axis."""
        if self.allocation == "head":
            return super().compress(state, room)
        stacked = state.seen.ndim == 2
        layers = state if stacked else jax.tree.map(lambda x: x[None], state)
        L, B, H, cap = layers.pos.shape
        prompt = jnp.arange(cap) < layers.seen[:, :, None, None]
        ranked = jnp.where(prompt, self.score(layers), -jnp.inf).transpose(1, 0, 2, 3).reshape(B, 1, L * H * cap)
        keep = top_per_head(ranked, L * H * self.budget).reshape(B, L, H, cap).transpose(1, 0, 2, 3) & prompt
        kept = jax.vmap(lambda layer, k: keep_in_position_order(layer, k, cap + room))(layers, keep)
        return kept if stacked else jax.tree.map(lambda x: x[0], kept)


@dataclasses.dataclass(frozen=True)
class _Reconstruction(Strided):
    """KVzip's reconstruction pass as a policy: attends like Full (the cache is read, never written) and sets the
    score of each held slot marked `MARKED` to the most attention the pass's queries pay it (`KVzip`)."""

    keeps_scores = True
    chunk: Positive
    sinks: NonNegative

    def cache_slots(self, max_tokens: int | None) -> int:
        raise TypeError("KVzip's reconstruction pass reads an existing cache; it makes none")

    def attend(self, state: CacheState, q, k, v, lengths, rope):
        out, _ = super().attend(state, q, k, v, lengths, rope)
        B, T, Hq, D = q.shape
        H, cap = k.shape[2], state.pos.shape[-1]
        f32, window = jnp.float32, min(self.chunk, cap)
        start = jnp.argmax(state.score[:, 0] == MARKED, axis=-1)  # [B] first re-read slot (append layout)
        unclipped = start[:, None] + jnp.arange(window)
        slots = jnp.minimum(unclipped, cap - 1)  # [B, window]
        sinks = jnp.arange(min(self.sinks, cap))
        read = jnp.concatenate([jnp.broadcast_to(sinks, (B, len(sinks))), slots], axis=1)  # [B, sinks + window]
        read_k = jnp.take_along_axis(stored_kv(state)[0].decode(), read[:, None, :, None], axis=2)
        read_pos = jnp.take_along_axis(state.pos, jnp.broadcast_to(read[:, None], (B, H, read.shape[1])), axis=2)
        rot = (lambda x, p: x) if rope is None else rope
        chunk_pos = state.seen[:, None] + jnp.arange(T)
        keys = jnp.concatenate(
            [
                read_k if state.rope is not None else rot(read_k, read_pos),  # only the keys scored are rotated
                rot(k.astype(f32), chunk_pos[:, :, None]).transpose(0, 2, 1, 3),
            ],
            axis=2,
        )
        sink_ok = (state.pos[:, :, sinks] >= 0) & (state.pos[:, :, sinks] < (start[:, None, None]))
        window_ok = (
            jnp.take_along_axis(state.score, jnp.broadcast_to(slots[:, None], (B, H, window)), 2) == MARKED
        ) & (unclipped < cap)[:, None]
        t = jnp.arange(T)
        chunk_ok = (t[None, :] <= t[:, None])[None] & (t < lengths[:, None])[:, None, :]  # [B, Tq, Tk]
        qr = rot(q.astype(f32), chunk_pos[:, :, None]).transpose(0, 2, 1, 3).reshape(B, H, Hq // H, T, D)
        logits = jnp.einsum("bhgtd,bhsd->bhgts", qr, keys, precision=jax.lax.Precision.HIGHEST) / jnp.sqrt(f32(D))
        ok = jnp.concatenate(
            [
                jnp.broadcast_to(sink_ok[:, :, None, :], (B, H, T, len(sinks))),
                jnp.broadcast_to(window_ok[:, :, None, :], (B, H, T, window)),
                jnp.broadcast_to(chunk_ok[:, None], (B, H, T, T)),
            ],
            axis=-1,
        )[:, :, None]
        logits = jnp.where(ok, logits, -jnp.inf)
        top = jnp.max(logits, axis=-1, keepdims=True)
        e = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
        weights = e / jnp.maximum(e.sum(-1, keepdims=True), 1e-30)
        weights = jnp.where((t < lengths[:, None])[:, None, None, :, None], weights, 0.0)
        best = weights[..., len(sinks) : len(sinks) + window].max(axis=(2, 3))  # [B, H, window]
        scores = (
            jnp.zeros((B, H, cap), f32)
            .at[jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None], slots[:, None, :]]
            .max(jnp.where(window_ok, best, 0.0))
        )
        return out, Scores(cache=scores, chunk=jnp.zeros((B, H, T), f32))

    def update(self, state: CacheState, k, v, scores: Scores, lengths) -> CacheState:
        return dataclasses.replace(state, score=jnp.where(state.score == MARKED, scores.cache, state.score))
