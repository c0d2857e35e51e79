"""`jcascade compare`, the main job: passkey retrieval under Sink vs Cascade caches of the same size, with this
machine's settings (`main_job`) for the options left unset."""

from __future__ import annotations

from jcascade.cli import options, passkey
from jcascade.eval import main_job, protocol, report


def add(sub) -> None:
    p = options.add_command(
        sub,
        "compare",
        "the main job: passkey retrieval under Sink vs Cascade caches of the same size. Unset options take this "
        "machine's defaults, " + main_job.describe(),
        run,
        batched=True,
        policies=False,
        results="passkey",
    )
    passkey.add_options(p, machine=True)
    p.set_defaults(protocol=protocol.QUERY_AWARE)  # it records retention, read inside one prompt
    p.add_argument("--cache-size", type=options.count, help="non-sink tokens of each cache")
    p.add_argument("--sinks", type=options.integer(0), help="sink tokens of each cache")
    p.add_argument("--cascades", type=options.count, help="Cascade's sub-caches")
    p.add_argument("--stride", type=options.count, help="prefill chunk (tokens)")


def run(args) -> None:
    vars(args).update({k: v for k, v in main_job.defaults().items() if getattr(args, k) is None})
    policies = report.labelled(main_job.policies(args.cache_size, args.sinks, args.cascades, args.stride))
    passkey.sweep(
        args,
        policies,
        f"Sink vs Cascade: {args.sinks} sinks + {args.cache_size} tokens each "
        f"(Cascade: {args.cascades} cascades), prefill stride {args.stride}",
        retention=True,
    )
