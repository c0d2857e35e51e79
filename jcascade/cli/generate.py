"""`jcascade generate`: continues a prompt under a cache policy."""

from __future__ import annotations

from jcascade.cli import options, running
from jcascade.eval import report, runner


def add(sub) -> None:
    p = options.add_command(
        sub,
        "generate",
        "continue a prompt under a cache policy",
        run,
        batched=False,
        out=None,
        policies=False,
        check=check,
    )
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument(
        "--policy",
        type=options.policy,
        default="cascade:cache_size=1024,sinks=64,stride=512",
        metavar="SPEC",
        help="NAME[:FIELD=VALUE,...]",
    )
    p.add_argument("--max-new-tokens", type=options.count, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=options.real(0.0), default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=options.real(0.0, 1.0, low_open=True), default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=options.seed, default=0, help="sampling seed")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")


def check(args) -> None:
    if not args.prompt:
        raise ValueError("--prompt: must not be empty")


def run(args) -> None:
    model, tokenizer, name, _ = running.load(args, batched=False)
    result = {"model": name} | runner.generate(
        model,
        tokenizer,
        args.prompt,
        args.policy,
        raw=args.raw,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
    )
    print(report.json_text(result) if args.json else result["output"])
    running.log(f"[{result['prompt_tokens']} prompt tokens, {result['seconds']:.1f} s, {name}, {args.policy}]")
    if args.out is not None:
        with options.option("--out"):
            runner.write(args.out, args.results, result)
