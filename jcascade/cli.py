"""The `jcascade` command line."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="jcascade", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="stream random data through a Sink and a Cascade cache")
    demo.add_argument("--tokens", type=int, default=4096, help="stream length")
    demo.add_argument("--cache-size", type=int, default=128, help="non-sink slots of each cache")
    demo.add_argument("--sinks", type=int, default=4)
    demo.add_argument("--stride", type=int, default=256, help="tokens per chunk")
    demo.add_argument("--heavy-every", type=int, default=97, help="period of the heavily attended tokens")
    args = parser.parse_args(argv)
    if args.command == "demo":
        for name in ("tokens", "cache_size", "stride", "heavy_every"):
            if getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        if args.sinks < 0:
            parser.error(f"--sinks must be >= 0, got {args.sinks}")
        from jcascade import demo as demo_module

        demo_module.main(args.tokens, args.cache_size, args.sinks, args.stride, args.heavy_every)
