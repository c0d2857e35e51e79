"""Streaming perplexity (§4.2 of the Cascading KV Cache paper, arXiv 2406.17808): each book is streamed
from start to end in `policy.stride`-token
chunks through one cache, token log-likelihoods are collected per chunk; the device holds one cache and
one chunk whatever the book's length. As in the paper, only books longer than the cache are scored.

`stream` is the chunk loop (also used by `jcascade.eval.attention_map`): the same computation as `jc.score`,
one jitted call per chunk, so that long books report progress and callers can look at the cache between
chunks. Under Full it keeps every token, also past the model's trained positions (where its perplexity
breaks down: that is the point of comparing); Full's memory and time grow with the book.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import warnings
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

import jcascade as jc
from jcascade import compilation
from jcascade.eval import stats
from jcascade.eval.checkpointing import Checkpointing, complete, finished
from jcascade.generation import chunk_size, token_log_probs, warn_nonfinite
from jcascade.models.state import ModelState, restored, saved_arrays


def cache_capacity(policy) -> int | None:
    """Slots of a bounded policy's cache (sinks included); None for policies that are not bounded."""
    return policy.cache_slots(None) if policy.bounded else None


def check_streaming(policy) -> None:
    """Raises ValueError for policies that act only after a prompt (`needs_prompt`), naming the others."""
    jc.policies.check_policy(policy)
    if policy.needs_prompt:
        raise ValueError(
            f"{type(policy).__name__} compresses or recycles after a prompt; streaming a book "
            f"needs a streaming policy ({', '.join(jc.policies.policy_names(needs_prompt=False))})"
        )


@compilation.jit(static_argnames="policy")
def _step(model, policy, state, chunk, targets, n):
    hidden, state = model(policy, state, chunk, n)
    return state, token_log_probs(model, hidden, targets)


def step_compilations() -> int:
    """Programs compiled so far for `stream`'s chunk step in this process (one per model structure, policy and
    chunk shape): a stream of any length adds at most one, and a stream that recompiled would show here."""
    return _step.top_level._cache_size()


StreamPoint = tuple[jc.CacheState, np.ndarray, int]  # (cache, log-probs so far [S - 1], next position)


def stream(
    model,
    policy,
    tokens: np.ndarray,
    *,
    watch: Callable[[ModelState, int], None] | None = None,
    progress: Callable[[int], None] | None = None,
    start: StreamPoint | None = None,
    after_chunk: Callable[[StreamPoint], None] | None = None,
) -> np.ndarray:
    """Streams one token sequence [S] through `model` under `policy` in `policy.stride` chunks (cut to `chunk_size`).

    Returns float32 [S - 1], entry t = log p(tokens[t + 1] | tokens[:t + 1]).
    watch(state, first) is called before each chunk with the model's state its queries see (a `ModelState`, batch
    1; `CausalLM.layer_cache` gives a layer's cache) and the chunk's first position; progress(n) after each chunk
    with its token count; after_chunk(point) after each chunk but the last with the point to continue from, which
    `start` accepts (the stream then goes on exactly as it would have: checkpoints, `jcascade.eval.checkpointing`).
    Non-finite log-probabilities are reported by a RuntimeWarning (`generation.warn_nonfinite`).
    """
    check_streaming(policy)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size < 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"tokens must be an int array of shape [S] with S >= 2, got {tokens.dtype}{list(tokens.shape)}"
        )
    S, T = tokens.size, chunk_size(policy, tokens.size)
    if S > jc.checks.CLOCK_LIMIT:
        raise ValueError(
            f"tokens: a stream of {S} tokens is longer than the int32 token clock allows "
            f"({jc.checks.CLOCK_LIMIT}); split it"
        )
    if start is None:
        state, logps, begin = model.init_cache(policy, 1, max_tokens=S), np.zeros(S - 1, np.float32), 0
    else:
        state, logps, begin = start
        logps = np.array(logps, np.float32)
        if logps.shape != (S - 1,) or begin % T or not 0 < begin < S:
            raise ValueError(
                f"start does not belong to this stream of {S} tokens in chunks of {T}: log-probs "
                f"{list(logps.shape)}, position {begin}"
            )
    padded = np.zeros(-(-S // T) * T + 1, np.int32)
    padded[:S] = tokens
    for first in range(begin, S, T):
        n = min(T, S - first)
        if watch is not None:
            watch(state, first)
        chunk = jnp.asarray(padded[None, first : first + T])
        targets = jnp.asarray(padded[None, first + 1 : first + T + 1])
        state, logp = _step(model, policy, state, chunk, targets, jnp.array([n], jnp.int32))
        m = min(n, S - 1 - first)  # the last token has no target
        logps[first : first + m] = np.asarray(logp)[0, :m]
        if progress is not None:
            progress(n)
        if after_chunk is not None and first + n < S:
            after_chunk((state, logps, first + n))
    warn_nonfinite(logps[None], np.array([S - 1]))
    return logps


@dataclasses.dataclass(frozen=True)
class BookPerplexity:
    book: str
    policy: str  # label of the policy
    tokens: int  # tokens streamed (the book's, up to max_tokens)
    nll: float  # mean negative log-likelihood per predicted token (nats)
    curve: list[float]  # mean NLL of the predictions at positions [i * bucket, (i + 1) * bucket)
    bucket: int
    block_nll: list[float]  # mean NLL per block of `block` consecutive predictions: the bootstrap's units
    block: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    def interval(self) -> stats.Estimate:
        """The book's perplexity with its 95 % interval (a bootstrap over its blocks)."""
        nll, counts = _units(self)
        return stats.mean(nll, weights=counts, transform=np.exp)


def book_tokens(tokenizer, text: str, max_tokens: int | None = None) -> np.ndarray:
    """int32 [S]: the text's tokens (with the tokenizer's BOS, if it adds one), the first max_tokens."""
    ids = np.asarray(tokenizer(text, verbose=False)["input_ids"], np.int32)
    return ids if max_tokens is None else ids[:max_tokens]


def books(tokenizer, names, max_tokens: int | None = None, log=print) -> dict[str, np.ndarray]:
    """{name: tokens int32 [S]} of packaged books or text files (`texts.load_book`; ["all"]: every packaged
    book), each cut to its first max_tokens. A book is named by its stem ("paradise_lost" for
    paradise_lost.txt); books sharing a stem by the shortest ends of their paths that tell them apart
    ("a/notes.txt", "b/notes.txt"). A book given twice (the same name or file) raises ValueError: n counts
    each book once."""
    from jcascade.eval import texts

    names = texts.book_names(log) if list(names) == ["all"] else [str(b) for b in names]
    paths = [pathlib.Path(b).resolve() if pathlib.Path(b).is_file() else pathlib.Path(b) for b in names]
    texts.distinct("books", [str(p) for p in paths])
    keys = [p.stem for p in paths]
    for stem in {k for k in keys if keys.count(k) > 1}:
        group = [i for i, k in enumerate(keys) if k == stem]
        for ends in range(1, max(len(paths[i].parts) for i in group) + 1):
            tails = {i: "/".join(paths[i].parts[-ends:]) for i in group}
            if len(set(tails.values())) == len(group):
                break
        keys = [tails.get(i, k) for i, k in enumerate(keys)]
    return dict(
        zip(
            texts.distinct("book names", keys),
            (book_tokens(tokenizer, texts.load_book(b, log), max_tokens) for b in names),
        )
    )


BLOCK = 4096  # tokens per bootstrap block: log-likelihoods of tokens this far apart are nearly independent


def warn_few_blocks(streams, block: int) -> None:
    """Warns (RuntimeWarning, with the numbers) when the token streams [S] to be scored hold fewer blocks of
    `block` predictions than an interval needs (`stats.MIN_UNITS`): their perplexity would get no interval."""
    units = sum(-(-(len(t) - 1) // block) for t in streams)
    if streams and units < stats.MIN_UNITS:
        warnings.warn(
            f"the {len(streams)} book(s) to stream hold {sum(len(t) for t in streams)} tokens: {units} "
            f"block(s) of {block} tokens, fewer than the {stats.MIN_UNITS} an interval needs, so their "
            "perplexity gets none; stream more tokens (--max-tokens, more books) or use smaller blocks "
            "(--block)",
            RuntimeWarning,
            stacklevel=3,
        )


def perplexity(
    model,
    books: Mapping[str, np.ndarray],
    policies: Mapping[str, object],
    *,
    bucket: int = 256,
    block: int = BLOCK,
    progress: Callable[[int], None] | None = None,
    checkpointing: Checkpointing | None = None,
) -> tuple[list[BookPerplexity], list[str]]:
    """Streams every book (name -> tokens [S]) longer than the largest bounded cache under every policy.

    Returns the results and the names of the books skipped as not longer than the cache.
    checkpointing: saves the finished results and the running stream (its cache and log-probs) every
    `checkpointing.every` tokens, and continues from its last checkpoint, if any (its finished streams must be
    this run's first ones: `checkpointing.finished`): the results are then identical to an uninterrupted
    run's. Raises a RuntimeError unless the results hold every planned (book, policy) once
    (`checkpointing.complete`).
    """
    for name, value in (("bucket", bucket), ("block", block)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for policy in policies.values():
        check_streaming(policy)
    capacities = [c for c in map(cache_capacity, policies.values()) if c is not None]
    longest = max(capacities, default=1)
    warn_few_blocks([t for t in books.values() if len(t) > longest], block)
    plan = [(name, label) for name, tokens in books.items() if len(tokens) > longest for label in policies]
    key = lambda r: (r.book, r.policy)
    results, skipped, running = [], [], {}  # running: (book, policy label) -> the point its stream resumes at
    found = checkpointing.resume() if checkpointing is not None else None
    if found is not None:
        arrays, saved = found
        results = finished(saved, plan, BookPerplexity, key)
        if arrays is not None:
            S = len(books[saved["book"]])
            like = jax.eval_shape(lambda: model.init_cache(policies[saved["policy"]], 1, max_tokens=S))
            state = restored(arrays["state"], like, f"{checkpointing.directory}: the running stream's state")
            running[saved["book"], saved["policy"]] = (state, np.asarray(arrays["logps"]), saved["position"])
        if progress is not None:
            progress(sum(r.tokens for r in results) + sum(point[2] for point in running.values()))
    done = {key(r) for r in results}

    def save(name: str, label: str, point: StreamPoint) -> None:
        state, logps, position = point
        if checkpointing.due(policies[label].stride):
            checkpointing.save(
                {"state": saved_arrays(state), "logps": logps},
                {
                    "results": [dataclasses.asdict(r) for r in results],
                    "book": name,
                    "policy": label,
                    "position": position,
                },
            )

    for name, tokens in books.items():
        if len(tokens) <= longest:
            skipped.append(name)
            continue
        for label, policy in policies.items():
            if (name, label) in done:
                continue
            after_chunk = None if checkpointing is None else functools.partial(save, name, label)
            nll = -stream(
                model, policy, tokens, progress=progress, start=running.get((name, label)), after_chunk=after_chunk
            )
            edges = np.arange(0, nll.size, bucket)
            curve = np.add.reduceat(nll, edges) / np.diff(np.append(edges, nll.size))
            block_nll, _ = stats.blocks(nll, block)
            results.append(
                BookPerplexity(
                    name, label, int(len(tokens)), float(nll.mean()), curve.tolist(), bucket, block_nll.tolist(), block
                )
            )
    if not results:
        raise ValueError(f"no book is longer than the {longest}-token cache: give longer books or a larger max_tokens")
    complete(results, plan, key, "perplexity")
    return results, skipped


def _units(r: BookPerplexity) -> tuple[np.ndarray, np.ndarray]:
    """(mean NLL, predictions) of each block of a book's stream."""
    counts = np.minimum(r.block, r.tokens - 1 - np.arange(len(r.block_nll)) * r.block)
    return np.asarray(r.block_nll), counts.astype(np.float64)


def summary(results: list[BookPerplexity]) -> dict[str, dict]:
    """Per policy: tokens, mean NLL and perplexity over all predicted tokens of all books, the perplexity's
    95 % interval (`interval`: a bootstrap over blocks of the token streams, redrawn within each book) and
    the per-bucket mean NLL curve over the books that reach each bucket (token-weighted)."""
    out = {}
    for label in dict.fromkeys(r.policy for r in results):
        mine = [r for r in results if r.policy == label]
        counts = [r.tokens - 1 for r in mine]
        nll = sum(r.nll * c for r, c in zip(mine, counts)) / sum(counts)
        width = max(len(r.curve) for r in mine)
        sums, weights = np.zeros(width), np.zeros(width)
        for r, c in zip(mine, counts):
            w = np.minimum(r.bucket, c - np.arange(len(r.curve)) * r.bucket)
            sums[: len(r.curve)] += np.asarray(r.curve) * w
            weights[: len(r.curve)] += w
        units = [_units(r) for r in mine]
        interval = stats.mean(
            np.concatenate([u[0] for u in units]),
            weights=np.concatenate([u[1] for u in units]),
            strata=[r.book for r, u in zip(mine, units) for _ in u[0]],
            transform=np.exp,
        )
        out[label] = {
            "books": len(mine),
            "tokens": sum(r.tokens for r in mine),
            "nll": nll,
            "perplexity": math.exp(nll),
            "interval": interval.as_dict(),
            "bucket": mine[0].bucket,
            "curve": (sums / weights).tolist(),
        }
    return out


def prefix_lengths(results: list[BookPerplexity]) -> list[int]:
    """The stream lengths the paired differences are given at: block x 8, x 16, ... (at least 8 blocks of
    units), below the longest stream."""
    block, longest = results[0].block, max(r.tokens for r in results)
    lengths = [block * 8]
    while lengths[-1] * 2 < longest:
        lengths.append(lengths[-1] * 2)
    return [n for n in lengths if n < longest]


def paired_differences(results: list[BookPerplexity], baseline: str) -> dict[str, dict[int | str, stats.Estimate]]:
    """{policy: {N or "all": perplexity(policy) - perplexity(baseline)}} over the books both streamed, with
    95 % intervals from a bootstrap that redraws the same blocks of the same books for both (within each
    book when the books hold enough blocks: `stats.paired_difference`). N: over the first N tokens of every
    book (the blocks that end by then; `prefix_lengths`), "all": whole streams."""
    by_policy, base = stats.by_policy(results, lambda r: r.book, lambda r: r, baseline)
    table: dict[str, dict[int | str, stats.Estimate]] = {}
    for policy, mine in by_policy.items():
        if policy == baseline:
            continue
        books = stats.shared_units(mine, base, policy, baseline, "book")
        for length in [*prefix_lengths(results), "all"]:
            ours, theirs, names = [], [], []
            for b in books:
                (nll, counts), (their_nll, _) = _units(mine[b]), _units(base[b])
                keep = slice(None) if length == "all" else slice(length // mine[b].block)
                ours.append((nll[keep], counts[keep]))
                theirs.append(their_nll[keep])
                names += [b] * len(nll[keep])
            table.setdefault(policy, {})[length] = stats.paired_difference(
                np.concatenate([u[0] for u in ours]),
                np.concatenate(theirs),
                weights=np.concatenate([u[1] for u in ours]),
                strata=names,
                transform=np.exp,
            )
    return table
