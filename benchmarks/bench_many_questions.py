"""Many questions over one long document: the document compressed once and shared by every question, against a
compressed copy per question and against re-prefilling the document with each question.

The document is a packaged book cut to `--context` tokens with one needle per question ("The special magic number
for {key} is: {value}.") at evenly spaced, known depths; question i asks for key i. The same token ids feed every
method:

    shared      jc.generate(model, questions, policy, context=document[1, S]): the document prefilled and compressed
                once under the policy, frozen, and read by all questions as one shared prefix (one call)
    replicated  jc.generate(..., context=document repeated [B, S]): each row compresses its own copy (batches of
                --rows questions), the same answers as shared, B copies of the memory and of the prefill
    reprefill   jc.generate(model, document + question [B, S + T], policy): the question is part of the prompt
                the policy compresses (query-aware; --reprefill questions, evenly spread over the depths)

Each (method, policy) runs in a process of its own, so that its peak device memory is its own: one call compiles
(not timed), then every question is answered and timed. Accuracy is the fraction of questions whose answer holds
the value, with a 95 % interval; differences are paired on the same questions.

    python benchmarks/bench_many_questions.py --model qwen.gguf --context 32K --questions 256 \
        --policy full --policy snapkv:budget=8192 --out benchmarks/results/many-questions.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import harness
import numpy as np

NEEDLE = " The special magic number for {key} is: {value}."
INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. I will quiz "
    "you about the numbers afterwards.\n"
)
QUESTION = "\nWhat is the special magic number for {key} mentioned in the provided text?"
PREFIX = " The special magic number for {key} mentioned in the provided text is"
METHODS = ("shared", "replicated", "reprefill")
MARK = "@@DOCUMENT@@"


def tokens_of(text: str, value: str) -> int:
    """ "32K" -> 32768, "300" -> 300 (argparse type)."""
    try:
        number = int(value[:-1]) * 1024 if value[-1:].lower() == "k" else int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text} must be a count such as 32768 or 32K, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text} must be positive, got {value!r}")
    return number


def build(tokenizer, book: str, context: int, questions: int, answer_tokens: int, seed: int):
    """(document int32 [S], questions: list of int32 arrays, values: list of str, depths: list of float).

    The document is the chat template's opening, INTRO and the book's sentences with the needles at depths
    (i + 0.5) / questions of its sentences; it is as long as fits in `context` minus the longest question and
    `answer_tokens`."""
    from jcascade.eval import ruler, texts

    ids = lambda text: np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)
    if getattr(tokenizer, "chat_template", None):
        head, tail = tokenizer.apply_chat_template(
            [{"role": "user", "content": MARK}], add_generation_prompt=True, tokenize=False
        ).split(MARK)
    else:
        head, tail = "", ""
    rng = np.random.default_rng(seed)
    adjectives, nouns = ruler.words("adjective"), ruler.words("noun")
    keys: list[str] = []
    while len(keys) < questions:
        key = f"{adjectives[rng.integers(len(adjectives))]}-{nouns[rng.integers(len(nouns))]}"
        keys += [key] if key not in keys else []
    values = [str(int(rng.integers(1_000_000, 10_000_000))) for _ in keys]
    asked = [np.concatenate([ids(QUESTION.format(key=k) + tail), ids(PREFIX.format(key=k))]) for k in keys]
    room = context - max(map(len, asked)) - answer_tokens
    opening = ids(head + INTRO)
    needles = [ids(NEEDLE.format(key=k, value=v)) for k, v in zip(keys, values)]
    sentences = [ids(" " + s) for s in ruler.sentences(texts.load_book(book))]
    budget = room - len(opening) - sum(map(len, needles))
    lengths = np.cumsum([len(s) for s in sentences])
    count = int(np.searchsorted(lengths, budget, side="right"))
    if count < questions:
        raise SystemExit(
            f"--context {context}: the book {book!r} fills only {count} sentences around {questions} "
            f"needles; use a longer context or fewer questions"
        )
    at = [int((i + 0.5) / questions * count) for i in range(questions)]
    parts, placed = [opening], iter(zip(at, needles))
    following = next(placed, None)
    for j, sentence in enumerate(sentences[:count]):
        while following is not None and following[0] == j:
            parts.append(following[1])
            following = next(placed, None)
        parts.append(sentence)
    document = np.concatenate(parts).astype(np.int32)
    return document, asked, values, [(a + 0.5) / count for a in at]


def worker(a) -> dict:
    """Runs one method under one policy; returns its answers, seconds and peak device memory."""
    import jax

    import jcascade as jc
    from jcascade.eval import runner
    from jcascade.eval.protocol import padded
    from jcascade.policies import parse_policy

    model, tokenizer, name = runner.load(a.model)
    document, asked, values, depths = build(tokenizer, a.book, a.context, a.questions, a.answer_tokens, a.seed)
    policy = parse_policy(a.worker_policy)
    chosen = (
        list(range(a.questions))
        if a.worker_method != "reprefill"
        else np.linspace(0, a.questions - 1, min(a.reprefill, a.questions)).round().astype(int).tolist()
    )
    rows = a.questions if a.worker_method == "shared" else a.rows
    common = dict(max_new_tokens=a.answer_tokens, eos_id=tokenizer.eos_token_id)

    def answer(batch: list[int]) -> np.ndarray:
        if a.worker_method == "reprefill":
            prompts = [np.concatenate([document, asked[i]]) for i in batch]
            tokens, lengths = padded(prompts, max(map(len, prompts)))
            return np.asarray(jc.generate(model, tokens, policy, lengths=lengths, **common))
        questions, lengths = padded([asked[i] for i in batch], max(len(asked[i]) for i in batch))
        context = document[None] if a.worker_method == "shared" else np.repeat(document[None], len(batch), 0)
        return np.asarray(jc.generate(model, questions, policy, context=context, lengths=lengths, **common))

    batches = [chosen[i : i + rows] for i in range(0, len(chosen), rows)]
    batches[-1] += [batches[-1][-1]] * (len(batches[0]) - len(batches[-1]))  # one shape: one compilation
    _, compile_s = harness.time_once(answer, batches[0])
    outputs, seconds = harness.time_once(lambda: [out for batch in batches for out in answer(batch).tolist()])
    texts = [tokenizer.decode([t for t in out if t >= 0], skip_special_tokens=True) for out in outputs[: len(chosen)]]
    return dict(
        method=a.worker_method,
        policy=a.worker_policy,
        model=name,
        document_tokens=len(document),
        questions=chosen,
        answers=texts,
        correct=[values[i] in t for i, t in zip(chosen, texts)],
        depths=[depths[i] for i in chosen],
        seconds=seconds,
        first_call_s=compile_s,
        questions_per_s=len(chosen) / seconds,
        peak_bytes=harness.JAX.peak_bytes(),
        device=jax.devices()[0].device_kind,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory or .gguf file (default: SmolLM2-135M-Instruct from PyPI)")
    p.add_argument("--book", default="paradise_lost", help="a packaged book or a text file")
    p.add_argument(
        "--context",
        type=lambda v: tokens_of("--context", v),
        default=32768,
        help="tokens of document + question + answer",
    )
    p.add_argument("--questions", type=lambda v: tokens_of("--questions", v), default=256)
    p.add_argument(
        "--reprefill",
        type=lambda v: tokens_of("--reprefill", v),
        default=64,
        help="questions the reprefill method answers (evenly spread over the depths)",
    )
    p.add_argument(
        "--rows",
        type=lambda v: tokens_of("--rows", v),
        default=8,
        help="questions per call of replicated and reprefill",
    )
    p.add_argument("--answer-tokens", type=lambda v: tokens_of("--answer-tokens", v), default=12)
    p.add_argument(
        "--policy",
        action="append",
        metavar="SPEC",
        help="NAME[:FIELD=VALUE,...], repeatable (default: full:stride=4096 and snapkv at a quarter of --context)",
    )
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated among {', '.join(METHODS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON file of every answer and figure")
    p.add_argument("--worker-method", help=argparse.SUPPRESS)
    p.add_argument("--worker-policy", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker_method:
        print(json.dumps(worker(a)))
        return
    methods = [m.strip() for m in a.methods.split(",")]
    if not methods or any(m not in METHODS for m in methods) or len(set(methods)) != len(methods):
        p.error(f"--methods must be distinct names among {', '.join(METHODS)}, got {a.methods!r}")
    policies = a.policy or ["full:stride=4096", f"snapkv:budget={a.context // 4},stride=4096"]
    from jcascade.eval import stats
    from jcascade.policies import parse_policy

    for spec in policies:
        try:
            parse_policy(spec)
        except ValueError as e:
            p.error(f"--policy: {e}")
    if a.out and pathlib.Path(a.out).is_dir():
        p.error(f"--out must name a file, got the directory {a.out}")
    argv = sys.argv[1:]
    runs = []
    for spec in policies:
        for method in methods:
            print(f"--- {method} under {spec}", file=sys.stderr, flush=True)
            done = subprocess.run(
                [sys.executable, __file__, *argv, "--worker-method", method, "--worker-policy", spec],
                check=True,
                stdout=subprocess.PIPE,
                text=True,
            )
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = []
    for run in runs:
        base = next(r for r in runs if r["policy"] == run["policy"] and r["method"] == methods[0])
        same = [i for i in run["questions"] if i in base["questions"]]
        mine = [float(c) for i, c in zip(run["questions"], run["correct"]) if i in same]
        theirs = [float(c) for i, c in zip(base["questions"], base["correct"]) if i in same]
        rows.append(
            dict(
                method=run["method"],
                policy=run["policy"],
                n=len(run["correct"]),
                accuracy=stats.mean([float(c) for c in run["correct"]], bounds=(0, 1)),
                versus_first=None if run is base else stats.paired_difference(mine, theirs, bounds=(0, 1)),
                questions_per_s=run["questions_per_s"],
                peak_gb=(run["peak_bytes"] or 0) / 1e9,
            )
        )
    if a.out:  # this process leaves the device to the workers: the device is named from theirs
        table = [{k: v.as_dict() if isinstance(v, stats.Estimate) else v for k, v in r.items()} for r in rows]
        harness.write_json(
            a.out,
            dict(
                benchmark="many_questions",
                model=runs[0]["model"],
                document_tokens=runs[0]["document_tokens"],
                questions=a.questions,
                command=" ".join(sys.argv),
                rows=table,
                runs=runs,
            ),
            device=runs[0]["device"],
        )
    first = methods[0]
    print(
        f"\n{runs[0]['model']} on {runs[0]['device']}: a {runs[0]['document_tokens']}-token document, "
        f"{a.questions} questions"
    )
    print(
        f"{'policy':<28} {'method':<11} {'n':>4} {'accuracy':>20} {'- ' + first:>22} {'questions/s':>12} {'peak GB':>8}"
    )
    for r in rows:
        print(
            f"{r['policy']:<28} {r['method']:<11} {r['n']:4d} {r['accuracy'].format():>20} "
            f"{r['versus_first'].format() if r['versus_first'] else '-':>22} {r['questions_per_s']:12.2f} "
            f"{r['peak_gb']:8.2f}"
        )


if __name__ == "__main__":
    main()
