"""Passkey retrieval (§4.4 of the Cascading KV Cache paper, arXiv 2406.17808): a random 5-digit key
hidden in filler text, asked for at the end.

A prompt is: [chat template head] intro, filler, the key sentence, filler, the question [template tail]
then the answer primed with "The pass key is " (so the next token is a digit). The key sentence sits at a
unit boundary of the filler (a sentence or a word) whose *depth* — the fraction of the filler tokens
before it — falls in the chosen one of `num_buckets` equal buckets of [0, 1]. Prompts are assembled from
token ids (each filler unit tokenised with its leading space), so their length in the model's tokens is
known exactly: at most `context_length`, short of it by less than one filler unit.

Everything is deterministic given the seed: the sample (context length, bucket, index) seeds its own
generator, so prompts do not depend on which policies or lengths are swept with them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jcascade as jc
from jcascade import compilation
from jcascade.eval import processes, stats
from jcascade.eval.checkpointing import Checkpointing, complete, finished, prompts_sha256
from jcascade.eval.perplexity import cache_capacity
from jcascade.eval.protocol import QUERY_AGNOSTIC, QUERY_AWARE, check, generate, padded
from jcascade.eval.texts import REPEAT_SENTENCES, distinct
from jcascade.generation import decode

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key?"
PRIME = "The pass key is "
FILLERS = ("repeat", "words")
KEY_DIGITS = 5
_MARK = "@@PASSKEY-CONTENT@@"


@dataclasses.dataclass(frozen=True)
class PasskeyPrompt:
    tokens: np.ndarray  # int32 [n], n <= context_length
    key: str  # the 5-digit pass key
    bucket: int  # depth bucket in [0, num_buckets)
    depth: float  # fraction of the filler tokens before the key sentence, inside the bucket
    needle_start: int  # index in `tokens` of the key sentence's first token
    key_positions: np.ndarray  # int32 [k]: indices in `tokens` of the key sentence's tokens that hold digits
    question_start: int  # index in `tokens` of the question's first token


def digit_accuracy(answer: str, key: str) -> float:
    """Fraction of the key's digits that `answer` (leading whitespace dropped) has at the same place.

    digit_accuracy("12345.", "12345") == 1.0; digit_accuracy("12945", "12345") == 0.8;
    digit_accuracy("2345", "12345") == 0.0 (a shifted answer scores by place). Random digits score 0.1.
    """
    if not key or not key.isdigit():
        raise ValueError(f"key must be a non-empty string of digits, got {key!r}")
    answer = answer.lstrip()
    return sum(a == k for a, k in zip(answer, key)) / len(key)


def depth_bucket(depth: float, num_buckets: int = 5) -> int:
    """The bucket of a depth in [0, 1]: bucket b covers [b/n, (b+1)/n), the last one includes 1."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    return min(int(depth * num_buckets), num_buckets - 1)


class PromptBuilder:
    """Builds passkey prompts in the tokens of `tokenizer` (a Hugging Face tokenizer).

    filler: "repeat" (REPEAT_SENTENCES, cycled) or "words" (uniformly random words of `words`).
    The tokenizer's chat template is used when it has one (the user turn holds intro, filler, key and
    question); the answer is primed with PRIME either way.
    """

    def __init__(self, tokenizer, filler: str = "repeat", words: Sequence[str] | None = None):
        if filler not in FILLERS:
            raise ValueError(f"filler must be one of {FILLERS}, got {filler!r}")
        if filler == "words" and not words:
            raise ValueError("filler='words' needs a non-empty word list (words=...)")
        self.tokenizer, self.filler, self.words = tokenizer, filler, list(words or ())
        if getattr(tokenizer, "chat_template", None):
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": _MARK}], add_generation_prompt=True, tokenize=False
            )
            head, tail = chat.split(_MARK)
            self.prefix = self._ids(head + INTRO)
            self.suffix = self._ids(QUESTION + tail + PRIME)
        else:
            self.prefix = np.asarray(tokenizer(INTRO)["input_ids"], np.int32)  # with the tokenizer's BOS, if any
            self.suffix = self._ids(QUESTION + " " + PRIME)
        self._unit_ids: dict[str, np.ndarray] = {}

    def _ids(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)

    def _units(self, rng: np.random.Generator, budget: int) -> list[np.ndarray]:
        """Filler units (token ids of " unit") in order, as many as fit in `budget` tokens."""
        units, used = [], 0
        while True:
            if self.filler == "repeat":
                texts = [REPEAT_SENTENCES[(len(units) + i) % len(REPEAT_SENTENCES)] for i in range(64)]
            else:
                texts = [self.words[i] for i in rng.integers(0, len(self.words), 64)]
            new = [t for t in dict.fromkeys(texts) if t not in self._unit_ids]
            if new:
                encoded = self.tokenizer([" " + t for t in new], add_special_tokens=False)["input_ids"]
                self._unit_ids.update({t: np.asarray(ids, np.int32) for t, ids in zip(new, encoded)})
            for t in texts:
                ids = self._unit_ids[t]
                if used + len(ids) > budget:
                    return units
                units.append(ids)
                used += len(ids)

    def fixed_tokens(self, key: str = "0" * KEY_DIGITS) -> int:
        """Tokens of a prompt without filler (template, intro, key sentence, question, prime)."""
        return len(self.prefix) + len(self._ids(NEEDLE.format(key=key))) + len(self.suffix)

    def prompt(self, context_length: int, bucket: int, rng: np.random.Generator, num_buckets: int = 5) -> PasskeyPrompt:
        """A prompt of at most `context_length` tokens with a random key at a random depth in `bucket`."""
        if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 1:
            raise ValueError(f"num_buckets must be a positive int, got {num_buckets!r}")
        if isinstance(bucket, bool) or not isinstance(bucket, int) or not 0 <= bucket < num_buckets:
            raise ValueError(f"bucket must be an int in [0, {num_buckets}), got {bucket!r}")
        key = str(rng.integers(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS))
        needle = self._ids(NEEDLE.format(key=key))
        budget = context_length - len(self.prefix) - len(needle) - len(self.suffix)
        units = self._units(rng, budget) if budget > 0 else []
        if not units:
            raise ValueError(
                f"context_length={context_length} is too short: the passkey prompt without filler "
                f"takes {context_length - budget} tokens and leaves no room for filler"
            )
        bounds = np.concatenate([[0], np.cumsum([len(u) for u in units])])  # filler tokens before each boundary
        depths = bounds / bounds[-1]
        inside = np.flatnonzero([depth_bucket(d, num_buckets) == bucket for d in depths])
        if inside.size == 0:
            raise ValueError(
                f"context_length={context_length} leaves {bounds[-1]} filler tokens in "
                f"{len(units)} units: none of their boundaries lies in depth bucket {bucket} of "
                f"{num_buckets}; use a longer context"
            )
        at = int(rng.choice(inside))
        tokens = np.concatenate([self.prefix, *units[:at], needle, *units[at:], self.suffix]).astype(np.int32)
        needle_start = len(self.prefix) + int(bounds[at])
        digits = [i for i, t in enumerate(needle) if any(c.isdigit() for c in self.tokenizer.decode([int(t)]))]
        return PasskeyPrompt(
            tokens=tokens,
            key=key,
            bucket=bucket,
            depth=float(depths[at]),
            needle_start=needle_start,
            key_positions=needle_start + np.asarray(digits, np.int32),
            question_start=len(tokens) - len(self.suffix),
        )


def prompts(
    builder: PromptBuilder, context_length: int, samples: int, seed: int, num_buckets: int = 5
) -> list[PasskeyPrompt]:
    """`samples` prompts for each depth bucket (bucket-major), each from its own seeded generator."""
    return [
        builder.prompt(context_length, b, np.random.default_rng([seed, context_length, b, i]), num_buckets)
        for b in range(num_buckets)
        for i in range(samples)
    ]


def check_context_lengths(lengths: Sequence[int]) -> list[int]:
    """The context lengths of a sweep as a list of ints >= 1, each once (`texts.distinct`: n counts each
    length's prompts once); raises ValueError naming the bad or repeated value."""
    bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1]
    if bad or not len(lengths):
        raise ValueError(f"context_lengths must be a non-empty list of ints >= 1, got {list(lengths)}")
    return [int(n) for n in distinct("context_lengths", lengths)]


def policies_by_length(
    policies: Mapping[str, object] | Callable[[int], Mapping[str, object]], context_lengths: Sequence[int]
) -> Callable[[int], dict[str, object]]:
    """A sweep's `policies` as a function of the context length. `policies`: {label: policy}, the same at every
    length, or a function context_length -> {label: policy} for policies scaled with the length (e.g.
    `ruler.policy_grid`), whose labels must be the same at every length. Raises ValueError for anything
    else, no policy, or labels that change with the length."""
    if not (callable(policies) or isinstance(policies, Mapping)):
        raise ValueError(
            f"policies must be {{label: policy}} or a function of the context length returning one, got {policies!r}"
        )
    at = policies if callable(policies) else lambda n: policies
    labels = [list(at(n)) for n in context_lengths]
    if not labels[0]:
        raise ValueError("policies must name at least one policy")
    if any(other != labels[0] for other in labels):
        raise ValueError(f"policies: the labels must be the same at every context length, got {labels}")
    return lambda n: dict(at(n))


@contextlib.contextmanager
def progress_bar(progress: Callable[[int], None] | None, total: int, name: str, unit: str):
    """Yields `progress`, or when it is None the update of a tqdm bar (stderr) of `total` `unit`s."""
    if progress is not None:
        yield progress
        return
    from tqdm import tqdm

    with tqdm(
        total=total, desc=name, unit=unit, unit_scale=True, dynamic_ncols=True, mininterval=0.5, file=sys.stderr
    ) as bar:
        yield bar.update


def plan(
    builder: PromptBuilder, context_lengths: Sequence[int], samples: int, seed: int, num_buckets: int = 5
) -> dict[int, list[PasskeyPrompt]]:
    """{context_length: `prompts`} of a sweep, all built (and so checked: a length too short for its prompts
    or depth buckets raises ValueError) before any model time is spent."""
    return {n: prompts(builder, n, samples, seed, num_buckets) for n in check_context_lengths(context_lengths)}


def equal_batches(count: int, most: int = 32) -> int:
    """The batch size that splits `count` prompts into the fewest batches of at most `most`, as equal as
    possible (80 -> 27: three batches, one padding row), so little of each generate call is padding."""
    return -(-count // -(-count // most))


def context_lengths(shortest: int, longest: int) -> list[int]:
    """shortest, 2 shortest, 4 shortest, ... while <= longest."""
    for name, value in (("shortest", shortest), ("longest", longest)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"the {name} context must be an int >= 1, got {value!r}")
    if longest < shortest:
        raise ValueError(f"the longest context ({longest}) must be >= the shortest ({shortest})")
    lengths = [shortest]
    while lengths[-1] * 2 <= longest:
        lengths.append(lengths[-1] * 2)
    return lengths


@dataclasses.dataclass(frozen=True)
class PasskeyResult:
    policy: str  # label of the policy
    context_length: int
    bucket: int
    sample: int
    key: str
    depth: float
    prompt_tokens: int
    answer: str
    accuracy: float  # digit_accuracy(answer, key)
    key_tokens: int  # tokens of the key sentence that hold digits (both mentions of the key)
    retention: list[list[float]] | None  # [layer][KV head]: fraction of them the question sees; None if not asked


@compilation.jit(static_argnames=("policy", "head", "rest", "max_new_tokens", "eos_id"))
def _answer_and_retention(
    model, policy, tokens, lengths, chunk_starts, key_positions, *, head, rest, max_new_tokens, eos_id
):
    """Greedy answers as `jc.generate` gives them, and which key tokens the question sees.

    The prompt is prefilled in two parts that keep generate's stride chunks: up to the start of the chunk
    holding the question (chunk_starts [B], multiples of the stride), where the cache is read, then the
    rest. The question's queries see that cache plus their own chunk. key_positions int32 [B, k] (-2 pads).
    Returns (answers int32 [B, max_new_tokens], key tokens visible to the question int32 [B, L, Hkv]).
    """
    B, S = tokens.shape
    state, _, _ = jc.prefill(model, policy, model.init_cache(policy, B), tokens[:, :head], chunk_starts)
    caches = [model.layer_cache(state, layer) for layer in range(model.config.num_layers)]
    held = jnp.stack(
        [
            (jc.cached_positions(cache)[index][..., None] == key_positions[:, None, None, :]).any(-2).sum(-1)
            for cache, index in caches
        ]
    )  # [L, B, Hkv]
    in_chunk = (key_positions >= chunk_starts[:, None]).sum(-1)
    rest_tokens = jnp.take_along_axis(tokens, jnp.minimum(chunk_starts[:, None] + jnp.arange(rest), S - 1), axis=1)
    state, last, _ = jc.prefill(model, policy, state, rest_tokens, lengths - chunk_starts)
    answers = decode(
        model,
        policy,
        state,
        last,
        jax.random.key(0),
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        top_p=1.0,
        eos_id=eos_id,
    )
    return answers, jnp.moveaxis(held + in_chunk[None, :, None], 1, 0)


def answer(
    model,
    policy,
    prompts: Sequence[PasskeyPrompt],
    tokens: np.ndarray,
    lengths: np.ndarray,
    *,
    max_new_tokens: int,
    eos_id: int | None,
    retention: bool,
    protocol: str = QUERY_AWARE,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Greedy answers int32 [B, max_new_tokens] to the right-padded prompts tokens [B, S] and, if `retention`,
    the fraction of each prompt's key tokens the question sees, float [B, L, Hkv].

    For bounded caches the retention is read from the cache at the question's chunk (the answers are still
    generate's, see `_answer_and_retention`); policies that are not `bounded` hold every prompt token until the
    prompt ends (they compress or recycle only after it), so they see all of them by construction.
    Under the query-agnostic `protocol` (`jcascade.eval.protocol.generate`) the context before each prompt's
    `question_start` is compressed alone; retention is then refused (it is read inside one prompt). Over
    processes (`processes.splits`), both are this process's part of the rows (`processes.mine`).
    """
    if protocol == QUERY_AGNOSTIC:
        if retention:
            raise ValueError(
                "retention is recorded under the query-aware protocol only (it reads the cache where "
                "the question's chunk starts, inside one prompt), not under query-agnostic"
            )
        return generate(
            model,
            policy,
            [p.tokens for p in prompts],
            [p.question_start for p in prompts],
            protocol,
            width=tokens.shape[1],
            question_width=max(len(p.tokens) - p.question_start for p in prompts),
            max_new_tokens=max_new_tokens,
            eos_id=eos_id,
        ), None
    part = lambda rows: processes.mine(rows, model)  # this process's rows
    if not retention:
        return np.asarray(
            jc.generate(
                model, part(tokens), policy, max_new_tokens=max_new_tokens, lengths=part(lengths), eos_id=eos_id
            )
        ), None
    config = model.config
    if "linear" in config.types or config.kv_heads("global") != config.num_kv_heads:
        raise ValueError(
            f"retention is recorded per layer and KV head of every layer's KV cache; this "
            f"{config.architecture} model has linear layers (no KV cache) or global layers with KV heads "
            "of their own"
        )
    if cache_capacity(policy) is None:
        out = np.asarray(
            jc.generate(
                model, part(tokens), policy, max_new_tokens=max_new_tokens, lengths=part(lengths), eos_id=eos_id
            )
        )
        return out, np.ones((len(out), config.num_layers, config.num_kv_heads), np.float32)
    counts = np.array([len(p.key_positions) for p in prompts], np.float32)
    chunk_starts = np.array([p.question_start // policy.stride * policy.stride for p in prompts], np.int32)
    key_positions = np.full((len(prompts), int(counts.max())), -2, np.int32)
    for r, p in enumerate(prompts):
        key_positions[r, : len(p.key_positions)] = p.key_positions
    out, visible = _answer_and_retention(
        model,
        policy,
        part(tokens),
        part(lengths),
        part(chunk_starts),
        part(key_positions),
        head=max(int(chunk_starts.max()), 1),
        rest=tokens.shape[1] - int(chunk_starts.min()),
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
    )
    return np.asarray(out), np.asarray(visible) / part(counts)[:, None, None]


def sweep(
    model,
    tokenizer,
    policies: Mapping[str, object] | Callable[[int], Mapping[str, object]],
    context_lengths: Sequence[int],
    *,
    samples: int = 1,
    filler: str = "repeat",
    words: Sequence[str] | None = None,
    seed: int = 0,
    num_buckets: int = 5,
    batch_size: int = 5,
    max_new_tokens: int = 8,
    retention: bool = False,
    progress: Callable[[int], None] | None = None,
    checkpointing: Checkpointing | None = None,
    protocol: str = QUERY_AWARE,
) -> list[PasskeyResult]:
    """Passkey retrieval over context lengths x depth buckets x samples x policies ({label: policy}, or a function
    of the context length returning it: `policies_by_length`). The
    prompts of every length are built and checked first (`plan`: distinct lengths, each long enough), and with
    them the `protocol` (`jcascade.eval.protocol`): "query-aware" compresses each prompt whole, "query-agnostic"
    the context before the question (" What is the pass key?", at `question_start`) alone; `retention` is
    recorded under query-aware only (it reads the cache where the question's chunk starts, inside one prompt).

    Greedy answers (`answer`); every batch is padded to [batch_size, context_length] (rows repeated,
    lengths per row), so each (policy, context length) compiles once. `retention` also records which key
    tokens each layer and KV head still holds when the question is fed. `progress(n)` is called after each
    batch with its prompts times the context length (padding rows excluded), so the calls add up to
    len(policies) x num_buckets x samples x sum(context_lengths); None: a tqdm bar of those tokens on stderr
    (`progress_bar`). `checkpointing` saves the results so far every `checkpointing.every` prompt tokens and
    continues from its last checkpoint, if any: its batch size, protocol and prompts must be the same (part of
    the run's identity), its trials must be this sweep's first ones (`checkpointing.finished`), and they are not
    run again, so the results equal an uninterrupted run's.
    Raises a RuntimeError unless the results hold every planned trial once (`checkpointing.complete`).
    """
    for name, value, least in (
        ("samples", samples, 1),
        ("batch_size", batch_size, 1),
        ("seed", seed, 0),
        ("max_new_tokens", max_new_tokens, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    planned = plan(PromptBuilder(tokenizer, filler, words), context_lengths, samples, seed, num_buckets)
    at = policies_by_length(policies, list(planned))
    check(protocol, [p for n in planned for p in at(n).values()], getattr(model, "config", None))
    units = [
        (label, length, b, i)
        for length in planned
        for label in at(length)
        for b in range(num_buckets)
        for i in range(samples)
    ]
    key = lambda r: (r.policy, r.context_length, r.bucket, r.sample)
    with progress_bar(progress, sum(u[1] for u in units), "passkey", "tok") as progress:
        results = []
        found = (
            checkpointing.resume(
                batch_size=batch_size,
                protocol=protocol,
                prompts=prompts_sha256((p.tokens, p.question_start) for n in planned for p in planned[n]),
            )
            if checkpointing is not None
            else None
        )
        if found is not None:
            results = finished(found[1], units, PasskeyResult, key)
            progress(sum(r.context_length for r in results))
        done, reached = len(results), 0  # the units the checkpoint holds, the units up to this batch
        pending = []  # (label, length, first, prompts, this process's answers) of the batches not gathered yet

        def gather_pending():
            for (label, length, first, part, _), (out, held) in zip(
                pending, processes.gather_batches([answers for *_, answers in pending], model)
            ):
                for i, p in enumerate(part):
                    text = tokenizer.decode(out[i][out[i] >= 0], skip_special_tokens=True)
                    results.append(
                        PasskeyResult(
                            label,
                            length,
                            p.bucket,
                            (first + i) % samples,
                            p.key,
                            p.depth,
                            len(p.tokens),
                            text,
                            digit_accuracy(text, p.key),
                            len(p.key_positions),
                            None if held is None else held[i].tolist(),
                        )
                    )
            pending.clear()

        for length, batch in planned.items():
            for label, policy in at(length).items():
                for first in range(0, len(batch), batch_size):
                    part = batch[first : first + batch_size]
                    rows = [part[i % len(part)] for i in range(batch_size)]
                    tokens, lengths = padded([p.tokens for p in rows], length)
                    fed = len(part) * length  # context tokens of this batch's prompts (padding rows excluded)
                    reached += len(part)
                    if reached <= done:
                        continue
                    pending.append(
                        (
                            label,
                            length,
                            first,
                            part,
                            answer(
                                model,
                                policy,
                                rows,
                                tokens,
                                lengths,
                                max_new_tokens=max_new_tokens,
                                eos_id=tokenizer.eos_token_id,
                                retention=retention,
                                protocol=protocol,
                            ),
                        )
                    )
                    progress(fed)
                    if checkpointing is not None and checkpointing.due(fed):
                        gather_pending()
                        checkpointing.save(None, {"results": [dataclasses.asdict(r) for r in results]})
        gather_pending()
        complete(results, units, key, "passkey sweep")
        return results


def accuracy_table(results: Sequence[PasskeyResult]) -> dict[str, dict[int, dict[int, float]]]:
    """Mean accuracy: {policy: {context_length: {bucket: accuracy}}}."""
    groups: dict[tuple[str, int, int], list[float]] = {}
    for r in results:
        groups.setdefault((r.policy, r.context_length, r.bucket), []).append(r.accuracy)
    table: dict[str, dict[int, dict[int, float]]] = {}
    for (policy, length, bucket), accs in groups.items():
        table.setdefault(policy, {}).setdefault(length, {})[bucket] = float(np.mean(accs))
    return table


def estimates(
    results: Sequence[PasskeyResult], value: Callable[[PasskeyResult], float] = lambda r: r.accuracy
) -> dict[str, dict[int, stats.Estimate]]:
    """{policy: {context_length: mean of value(trial) in [0, 1] with its 95 % interval}}: a bootstrap over
    trials (a trial's digits are correlated, so the trial is the unit), redrawn within their depth bucket
    when the buckets hold enough trials (`stats.mean`: its rules for strata and bounded values)."""
    cells: dict[tuple[str, int], list[PasskeyResult]] = {}
    for r in results:
        cells.setdefault((r.policy, r.context_length), []).append(r)
    table: dict[str, dict[int, stats.Estimate]] = {}
    for (policy, length), mine in cells.items():
        table.setdefault(policy, {})[length] = stats.mean(
            [value(r) for r in mine], strata=[r.bucket for r in mine], bounds=(0, 1)
        )
    return table


def retention_estimates(results: Sequence[PasskeyResult]) -> dict[str, dict[int, stats.Estimate]]:
    """`estimates` of the key tokens the question sees (mean over layers and KV heads per trial)."""
    return estimates([r for r in results if r.retention is not None], lambda r: float(np.mean(r.retention)))


def retention_by_layer(results: Sequence[PasskeyResult]) -> dict[str, dict[int, list[float]]]:
    """{policy: {context_length: mean retention per layer (over trials and KV heads)}}."""
    groups: dict[tuple[str, int], list] = {}
    for r in results:
        if r.retention is not None:
            groups.setdefault((r.policy, r.context_length), []).append(np.mean(r.retention, axis=1))
    table: dict[str, dict[int, list[float]]] = {}
    for (policy, length), layers in groups.items():
        table.setdefault(policy, {})[length] = np.mean(layers, axis=0).tolist()
    return table


def paired_differences(results: Sequence[PasskeyResult], baseline: str) -> dict[str, dict[int | str, stats.Estimate]]:
    """{policy: {context_length or "all": accuracy(policy) - accuracy(baseline)}} over the same prompts, with
    95 % intervals (trials redrawn in pairs, within their depth bucket and length when those strata hold
    enough trials: `stats.paired_difference`), for every other policy."""
    by_policy, base = stats.by_policy(
        results, lambda r: (r.context_length, r.bucket, r.sample), lambda r: r.accuracy, baseline
    )
    table: dict[str, dict[int | str, stats.Estimate]] = {}
    for policy, mine in by_policy.items():
        if policy == baseline:
            continue
        trials = sorted(stats.shared_units(mine, base, policy, baseline, "prompt"))
        for length in sorted({t[0] for t in trials}):
            here = [t for t in trials if t[0] == length]
            table.setdefault(policy, {})[length] = stats.paired_difference(
                [mine[t] for t in here], [base[t] for t in here], strata=[t[1] for t in here], bounds=(0, 1)
            )
        table[policy]["all"] = stats.paired_difference(
            [mine[t] for t in trials], [base[t] for t in trials], strata=[t[:2] for t in trials], bounds=(0, 1)
        )
    return table
