"""`jcascade perplexity`: streaming perplexity over public-domain books (§4.2 of the Cascading KV Cache paper,
arXiv 2406.17808)."""

from __future__ import annotations

import hashlib

from jcascade.cli import options, running
from jcascade.eval import perplexity, plots, report


def add(sub) -> None:
    p = options.add_command(
        sub,
        "perplexity",
        "streaming perplexity over public-domain books (§4.2 of the Cascading KV Cache paper, arXiv 2406.17808)",
        run,
        batched=False,
    )
    p.add_argument(
        "--book",
        action="append",
        metavar="NAME|FILE",
        help="a packaged book (e.g. paradise_lost), 'all', or a text file; repeatable (default: paradise_lost)",
    )
    p.add_argument(
        "--max-tokens", type=options.count, help="stream at most this many tokens of each book (default: all)"
    )
    p.add_argument("--bucket", type=options.count, default=256, help="positions per point of the curve")
    p.add_argument(
        "--block", type=options.count, default=perplexity.BLOCK, help="tokens per block, the unit of the bootstrap"
    )
    options.add_evaluation(p)


def run(args) -> None:
    policies = running.policies(args, streaming=True)
    model, tokenizer, name, mesh = running.load(args, batched=False)
    with options.option("--book"):
        books = perplexity.books(tokenizer, args.book or ["paradise_lost"], args.max_tokens, running.log)
    longest = max([c for c in map(perplexity.cache_capacity, policies.values()) if c is not None], default=1)
    (results, skipped), seconds, checkpointing = running.evaluate(
        args,
        len(policies) * sum(len(t) for t in books.values() if len(t) > longest),
        {
            "policies": report.policy_specs(policies),
            "books": {b: [len(t), hashlib.sha256(t.tobytes()).hexdigest()] for b, t in books.items()},
        },
        lambda progress, checkpointing: perplexity.perplexity(
            model, books, policies, bucket=args.bucket, block=args.block, progress=progress, checkpointing=checkpointing
        ),
        tokenizer,
        mesh,
    )
    rep = report.perplexity(
        results,
        policies,
        skipped=skipped,
        baseline=args.baseline,
        run={
            "model": name,
            "max_tokens": args.max_tokens,
            "bucket": args.bucket,
            "block": args.block,
            "seconds": seconds,
        },
    )
    running.finish(
        args,
        rep,
        f"\nStreaming perplexity, {name}, {len(books) - len(skipped)} books, {seconds:.0f} s\n"
        + report.perplexity_text(rep),
        [lambda out: plots.perplexity(rep, out / "perplexity.png", f"Streaming perplexity ({name})")],
        checkpointing,
    )
