"""`jcascade passkey`: passkey retrieval over context lengths x key depths x policies; its options and sweep are
also `jcascade compare`'s."""

from __future__ import annotations

from jcascade.cli import options, running
from jcascade.eval import passkey, plots, protocol, report, runner, texts


def add_options(p, machine: bool = False) -> None:
    """The passkey options; with `machine`, None defaults (the main job's per machine: `main_job.defaults`)."""
    options.add_sweep(p, *((None, None, None) if machine else (1024, 2048, 10)), "depth bucket")
    p.add_argument(
        "--filler",
        choices=("repeat", "words"),
        default=None if machine else "repeat",
        help="repeated sentences or random dictionary words",
    )
    p.add_argument("--buckets", type=options.count, default=5, help="depth buckets")
    p.add_argument("--words-file", help="word list for --filler words (default: Debian's wamerican)")
    p.add_argument(
        "--batch-size",
        type=options.count,
        help="prompts per generate call, a multiple of the mesh's data axis D (default: buckets x samples in equal "
        "batches of at most 32 x D)",
    )


def add(sub) -> None:
    p = options.add_command(
        sub, "passkey", "passkey retrieval over context lengths x key depths x policies", run, batched=True, check=check
    )
    add_options(p)
    p.add_argument(
        "--retention",
        action="store_true",
        help="also record how many of the key's tokens each layer and KV head holds when the question is fed "
        "(--protocol query-aware only)",
    )
    options.add_protocol(p)


def check(args) -> None:
    """--protocol query-agnostic refuses --retention, a Recycled --policy and a --model with sliding or linear
    layers."""
    if args.protocol == protocol.QUERY_AGNOSTIC and args.retention:
        raise ValueError(
            "--retention: recorded under --protocol query-aware only (it reads the cache where the "
            "question's chunk starts, inside one prompt)"
        )
    options.check_protocol(args, args.policy or [])


def run(args) -> None:
    sweep(args, running.policies(args, streaming=False), "Passkey retrieval", args.retention)


def sweep(args, policies: dict, title: str, retention: bool) -> None:
    """The passkey sweep of `policies` under the options, its report headed `title`; with `retention`, how much
    of the key each layer and KV head holds."""
    options.check_lengths(args)
    lengths = passkey.context_lengths(args.min_length, args.max_length)
    if args.words_file is not None and args.filler != "words":
        raise ValueError(f"--words-file: used only with --filler words, not --filler {args.filler}")
    with options.option("--words-file"):
        words = texts.word_list(args.words_file, log=running.log) if args.filler == "words" else None
    model, tokenizer, name, mesh = running.load(args, batched=True)
    per_length = args.buckets * args.samples
    batch = running.batch_size(args, per_length, mesh, 32)
    runner.warn_whole_context({n: policies for n in lengths})
    running.log(
        f"{title}\nmodel {name}; filler {args.filler}; context lengths {lengths}; {args.buckets} depth buckets x "
        f"{args.samples} samples = {per_length} prompts per length; policies:\n"
        + "\n".join(f"  {k}: {v}" for k, v in report.policy_specs(policies).items())
    )
    words_hash = words and running.sha256("\n".join(words))
    results, seconds, checkpointing = running.evaluate(
        args,
        len(policies) * per_length * sum(lengths),
        {"policies": report.policy_specs(policies), "words": words_hash, "batch_size": batch},
        lambda progress, checkpointing: passkey.sweep(
            model,
            tokenizer,
            policies,
            lengths,
            samples=args.samples,
            filler=args.filler,
            words=words,
            seed=args.seed,
            num_buckets=args.buckets,
            retention=retention,
            progress=progress,
            checkpointing=checkpointing,
            protocol=args.protocol,
            batch_size=batch,
        ),
        tokenizer,
        mesh,
    )
    rep = report.passkey(
        results,
        policies,
        baseline=args.baseline,
        run={
            "title": title,
            "model": name,
            "protocol": args.protocol,
            "filler": args.filler,
            "seed": args.seed,
            "context_lengths": lengths,
            "buckets": args.buckets,
            "samples": args.samples,
            "seconds": seconds,
        },
    )
    heading = f"\n{title}\n{name}, {args.protocol}, {args.filler} filler, {seconds:.0f} s\n"
    running.finish(
        args,
        rep,
        heading + report.passkey_text(rep),
        [
            lambda out: plots.passkey(rep, out / "passkey_accuracy.png", f"{title} ({name}, {args.protocol})"),
            lambda out: plots.passkey_depth(rep, out / "passkey_depth.png", f"{name}, {args.protocol}"),
        ],
        checkpointing,
    )
