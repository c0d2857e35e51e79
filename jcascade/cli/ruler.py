"""`jcascade ruler`: RULER's synthetic tasks (`jcascade.eval.ruler`) under every policy at a KV budget."""

from __future__ import annotations

from jcascade.cli import options, running
from jcascade.eval import passkey, plots, report, ruler, runner, texts


def add(sub) -> None:
    p = options.add_command(
        sub,
        "ruler",
        "RULER's synthetic tasks under every policy at a KV budget",
        run,
        batched=True,
        policies=False,
        check=check,
    )
    p.add_argument(
        "--tasks",
        type=options.argument(ruler.task_list),
        default="all",
        help="comma-separated, or all: " + ", ".join(ruler.TASKS),
    )
    p.add_argument(
        "--policy",
        action="append",
        type=options.argument(ruler.policy_list),
        metavar="NAMES|SPEC",
        help="comma-separated policy names, each at every --budget and length, among "
        + ", ".join(ruler.POLICIES)
        + "; or NAME:FIELD=VALUE,... used as given; repeatable (default: "
        + ",".join(ruler.DEFAULT_POLICIES)
        + ")",
    )
    p.add_argument(
        "--budget",
        type=options.argument(ruler.budget_list),
        default="0.25,0.5",
        help="KV slots kept, sinks and windows included: fractions of the context (<1) or token counts, "
        "comma-separated",
    )
    p.add_argument(
        "--kv-dtype",
        type=options.argument(ruler.kv_dtype_list),
        default="model",
        help="KV storage formats of the named policies, comma-separated, each at every budget: model (the model's "
        "dtype), int8, float8_e4m3fn (a spec sets its own kv_dtype field)",
    )
    p.add_argument(
        "--batch-size",
        type=options.count,
        help="prompts per generate call, a multiple of the mesh's data axis D (default: tasks x samples in equal "
        "batches of at most 8 x D)",
    )
    p.add_argument("--book", default="paradise_lost", help="the prose haystack (RULER's essays are not offline)")
    options.add_protocol(p)
    options.add_sweep(p, 4096, 8192, 50, "task")


def check(args) -> None:
    """--protocol query-agnostic refuses a Recycled --policy spec and a --model with sliding or linear layers."""
    options.check_protocol(args, [p for group in args.policy or [] for p in group if not isinstance(p, str)])


def run(args) -> None:
    lengths, tasks = passkey.context_lengths(args.min_length, args.max_length), args.tasks
    model, tokenizer, name, mesh = running.load(args, batched=True)  # KVzip's policies need the tokenizer
    with options.option("--policy"):
        at = ruler.policy_grid(
            [p for group in args.policy or [ruler.DEFAULT_POLICIES] for p in group],
            args.budget,
            tokenizer,
            args.kv_dtype,
        )
    with options.option("--budget"):  # a budget's slots grow with n
        specs = report.policy_specs(at, lengths)
    with options.option("--baseline"):
        report.baseline_label(specs, args.baseline)
    batch = running.batch_size(args, len(tasks) * args.samples, mesh, 8)
    runner.warn_whole_context({n: at(n) for n in lengths})
    with options.option("--book"):
        prose = texts.load_book(args.book, running.log) if any(ruler.TASKS[t].needs_prose for t in tasks) else None
    results, seconds, checkpointing = running.evaluate(
        args,
        len(specs) * len(tasks) * args.samples * len(lengths),
        {"policies": specs, "prose": prose and running.sha256(prose), "batch_size": batch},
        lambda progress, checkpointing: ruler.sweep(
            model,
            tokenizer,
            at,
            lengths,
            tasks=tasks,
            prose=prose,
            samples=args.samples,
            seed=args.seed,
            batch_size=batch,
            progress=progress,
            checkpointing=checkpointing,
            protocol=args.protocol,
        ),
        tokenizer,
        mesh,
        unit="prompt",
    )
    rep = report.ruler(
        results,
        at,
        baseline=args.baseline,
        run={
            "model": name,
            "protocol": args.protocol,
            "tasks": tasks,
            "budgets": args.budget,
            "kv_dtypes": args.kv_dtype,
            "samples": args.samples,
            "seconds": seconds,
        },
    )
    running.finish(
        args,
        rep,
        f"\nRULER, {name}, {args.protocol}, {seconds:.0f} s\n" + report.ruler_text(rep),
        [lambda out: plots.ruler(rep, out / "ruler.png", f"RULER ({name}, {args.protocol})")],
        checkpointing,
    )
