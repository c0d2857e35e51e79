"""`jcascade attention-map`: which positions each query sees while a book streams through a cache."""

from __future__ import annotations

import pathlib

from jcascade.cli import options, running
from jcascade.eval import attention_map, perplexity, plots, report, runner, texts


def add(sub) -> None:
    p = options.add_command(
        sub,
        "attention-map",
        "which positions each query sees while a book streams through a cache",
        run,
        batched=False,
        results="attention_map",
    )
    p.add_argument("--book", default="paradise_lost", metavar="NAME|FILE", help="a packaged book or a text file")
    p.add_argument("--tokens", type=options.count, default=4096, help="stream the first N tokens")
    p.add_argument("--layer", type=options.integer(0, k=False), help="layer to show (default: the middle one)")
    p.add_argument("--kv-head", type=options.integer(0, k=False), default=0, help="KV head to show")
    p.add_argument("--pixels", type=options.count, default=512, help="image side")


def run(args) -> None:
    policies = running.policies(args, streaming=True)
    model, tokenizer, name, _ = running.load(args, batched=False)
    with options.option("--book"):
        tokens = perplexity.book_tokens(tokenizer, texts.load_book(args.book, running.log), args.tokens)
    layer = model.config.num_layers // 2 if args.layer is None else args.layer
    for option, value, bound in (
        ("--layer", layer, model.config.num_layers),
        ("--kv-head", args.kv_head, model.config.num_kv_heads),
    ):
        if value >= bound:
            raise ValueError(f"{option}: must be < {bound} (the model's {option[2:].replace('-', ' ')}s), got {value}")
    maps, _, _ = runner.run(
        "attention map",
        len(policies) * len(tokens),
        lambda progress, _: {
            k: attention_map.record(model, p, tokens, layer, args.kv_head, progress=progress)
            for k, p in policies.items()
        },
    )
    heading = f"{name}, layer {layer}, KV head {args.kv_head}"
    images = {k: attention_map.render(m, args.pixels) for k, m in maps.items()}
    rep = report.attention_map(
        maps,
        policies,
        run={"model": name, "book": str(args.book), "tokens": len(tokens), "layer": layer, "kv_head": args.kv_head},
    )
    running.finish(
        args,
        rep,
        f"\nAttention maps, {heading}, first {len(tokens)} tokens of {pathlib.Path(args.book).stem}\n"
        + report.attention_map_text(rep),
        [lambda out: plots.attention_maps(images, len(tokens), out / "attention_map.png", heading)],
    )
