"""Attention-map reconstruction (§4.6 and Figure 10 of the Cascading KV Cache paper, arXiv 2406.17808):
which original positions each query position can attend to, and with what EMA score they are held, when a text is
streamed through a cache.

With a strided prefill, the queries of a chunk see the cache as it was before the chunk plus the chunk's
own keys up to themselves (causal). `record` streams the text (`jcascade.eval.perplexity.stream`) and keeps,
for one layer and KV head, the original positions and scores of the cache before every chunk; `render`
turns that into an image whose row q covers the keys visible to query q.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import jcascade as jc
from jcascade.eval.perplexity import stream


@dataclasses.dataclass(frozen=True)
class AttentionMap:
    positions: np.ndarray  # int32 [chunks, capacity]: original positions held before each chunk, -1 = empty
    scores: np.ndarray  # float32 [chunks, capacity]: their EMA scores (0 for policies that keep none)
    stride: int  # tokens per chunk
    length: int  # tokens streamed

    def visible(self, query: int) -> np.ndarray:
        """Sorted original positions query `query` attends to: the held ones and its chunk's keys <= it."""
        if not 0 <= query < self.length:
            raise ValueError(f"query must be in [0, {self.length}), got {query}")
        chunk = query // self.stride
        held = self.positions[chunk][self.positions[chunk] >= 0]
        return np.union1d(held, np.arange(chunk * self.stride, query + 1))


def record(model, policy, tokens: np.ndarray, layer: int, kv_head: int = 0, progress=None) -> AttentionMap:
    """Streams tokens [S] under `policy` and records the cache of (layer, kv_head) before each chunk."""
    cfg = model.config
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cfg.num_layers:
        raise ValueError(f"layer must be an int in [0, {cfg.num_layers}), got {layer!r}")
    if isinstance(kv_head, bool) or not isinstance(kv_head, int) or not 0 <= kv_head < cfg.num_kv_heads:
        raise ValueError(f"kv_head must be an int in [0, {cfg.num_kv_heads}), got {kv_head!r}")
    positions, scores = [], []

    def watch(state, first):
        cache, index = model.layer_cache(state, layer)
        positions.append(np.asarray(jc.cached_positions(cache)[index, 0, kv_head]))
        scores.append(np.asarray(jc.cached_scores(cache)[index, 0, kv_head], np.float32))

    stream(model, policy, tokens, watch=watch, progress=progress)
    return AttentionMap(np.stack(positions).astype(np.int32), np.stack(scores), policy.stride, len(tokens))


def render(amap: AttentionMap, pixels: int = 512) -> np.ndarray:
    """float32 [P, P] image, P = min(pixels, length): row i is query q_i = i * (length - 1) // (P - 1),
    column j the keys [j * length / P, (j + 1) * length / P). A pixel holds the largest log10 EMA score of
    the visible held keys it covers, +inf if it covers a visible key without a score (the query's own
    chunk, or a policy that keeps no scores), NaN if no key it covers is visible."""
    if isinstance(pixels, bool) or not isinstance(pixels, int) or pixels < 2:
        raise ValueError(f"pixels must be an int >= 2, got {pixels!r}")
    S = amap.length
    P = min(pixels, S)
    image = np.full((P, P), np.nan, np.float32)
    for i, q in enumerate(np.arange(P) * (S - 1) // (P - 1)):
        chunk = q // amap.stride
        pos, score = amap.positions[chunk], amap.scores[chunk]
        keep = pos >= 0
        values = np.where(score[keep] > 0, np.log10(np.maximum(score[keep], 1e-38)), np.inf)
        keys = np.concatenate([pos[keep], np.arange(chunk * amap.stride, q + 1)])
        values = np.concatenate([values, np.full(q + 1 - chunk * amap.stride, np.inf)])
        np.fmax.at(image[i], keys * P // S, values.astype(np.float32))
    return image


def summary(amap: AttentionMap, sinks: int = 0) -> dict:
    """The last chunk's cache: tokens held, the oldest held position past the first `sinks`, and the
    positions held before every chunk (sorted, empty slots dropped)."""
    last = amap.positions[-1][amap.positions[-1] >= 0]
    rest = last[last >= sinks]
    return {
        "held": int(last.size),
        "oldest_non_sink": int(rest.min()) if rest.size else None,
        "last_chunk_start": (len(amap.positions) - 1) * amap.stride,
        "positions": [sorted(int(p) for p in row if p >= 0) for row in amap.positions],
    }
