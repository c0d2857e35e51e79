"""The two protocols of a long-context evaluation: does the cache policy know the question when it compresses?

- "query-aware" (the default): context and question are one prompt, prefilled and compressed together (SnapKV's
  observation window, for one, holds the question), then the answer is decoded.
- "query-agnostic" (kvpress's default): the context is prefilled and compressed alone, then frozen; the question
  and the answer go to a cache of the row's own after it (`jc.generate(..., context=)`, one context per row), so
  the compression cannot see the question: a context compressed once could serve any question.

Both protocols read the same token ids: a prompt is split at its question's first token (`question_start`), so
the two are paired on identical inputs and agree wherever the policy keeps every context token (Full).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from jcascade.eval.processes import mine
from jcascade.generation import check_sharing

QUERY_AWARE, QUERY_AGNOSTIC = "query-aware", "query-agnostic"
PROTOCOLS = (QUERY_AWARE, QUERY_AGNOSTIC)


def check(protocol: str, policies: Iterable = (), config=None) -> str:
    """`protocol` once checked: one of PROTOCOLS. Query-agnostic also refuses (ValueError) what cannot hold a
    context's cache as a frozen prefix: a policy that is not `shareable` (Recycled), a model config (ModelConfig)
    with sliding or linear layers (Gemma 3 and 4, Qwen3.5); both can be checked before any model time."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if protocol == QUERY_AGNOSTIC:
        for policy in policies:
            check_sharing(f"protocol {QUERY_AGNOSTIC}", policy)
        check_sharing(f"protocol {QUERY_AGNOSTIC}", config=config)
    return protocol


def padded(rows: Sequence[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Token id rows (int [n_b] each, n_b <= width) right-padded: (tokens int32 [B, width], lengths int32 [B])."""
    tokens = np.zeros((len(rows), width), np.int32)
    for r, ids in enumerate(rows):
        tokens[r, : len(ids)] = ids
    return tokens, np.array([len(ids) for ids in rows], np.int32)


def generate(
    model,
    policy,
    prompts: Sequence[np.ndarray],
    question_starts: Sequence[int],
    protocol: str,
    *,
    width: int,
    question_width: int,
    max_new_tokens: int,
    eos_id: int | None,
) -> np.ndarray:
    """Greedy continuations int32 [B, max_new_tokens] of B prompts (int [n_b] each, n_b <= width) under `protocol`.
    query-aware: the prompts, right-padded to [B, width], are `jc.generate`'s tokens. query-agnostic: each
    prompt[:question_start] is its row's context ([B, width] with context_lengths) and prompt[question_start:]
    its question ([B, question_width], each question_width tokens at most). Fixed widths: one compile per policy
    and widths. Over processes (`processes.splits`), each computes and returns its part of the rows
    (`processes.mine`; `processes.gather_batches` joins them)."""
    import jcascade as jc

    prompts, question_starts = mine(prompts, model), mine(question_starts, model)
    options = dict(max_new_tokens=max_new_tokens, eos_id=eos_id)
    if check(protocol) == QUERY_AWARE:
        tokens, lengths = padded(prompts, width)
        return np.asarray(jc.generate(model, tokens, policy, lengths=lengths, **options))
    starts = [int(q) for q in question_starts]
    bad = [q for p, q in zip(prompts, starts) if not 0 < q < len(p) or len(p) - q > question_width]
    if bad or len(starts) != len(prompts):
        raise ValueError(
            f"question_starts must split each prompt into a context and a question of at most "
            f"question_width={question_width} tokens, got {starts}"
        )
    context, context_lengths = padded([p[:q] for p, q in zip(prompts, starts)], width)
    questions, lengths = padded([p[q:] for p, q in zip(prompts, starts)], question_width)
    return np.asarray(
        jc.generate(
            model, questions, policy, lengths=lengths, context=context, context_lengths=context_lengths, **options
        )
    )
