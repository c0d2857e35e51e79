"""The `jcascade` command line: `jcascade compare | generate | passkey | perplexity | ruler | attention-map`
(`jcascade COMMAND --help`), a thin layer over `jcascade.eval`. --model takes a model directory or .gguf file
(default: SmolLM2-135M-Instruct from PyPI); results go to --out as JSON and PNG; --json prints the summary to
stdout (strict JSON: a number that is not finite is null, with a "<key>_reason" beside it). Paths and options
are checked before any model time; an error names its option. Policies are NAME[:FIELD=VALUE,...], a policy
class in lower case and its dataclass fields, e.g.
  --policy cascade:cache_size=1024,sinks=64,stride=512 --policy sink:window=1024,sinks=64,stride=512
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import math
import os
import pathlib
import re
import shlex
import sys
import warnings

import jax
from tqdm import tqdm

from jcascade.eval import (
    attention_map,
    main_job,
    passkey,
    perplexity,
    plots,
    processes,
    protocol,
    report,
    ruler,
    runner,
    texts,
)
from jcascade.models import read_config, sharding
from jcascade.policies import parse_policy, policy_classes

_log = functools.partial(print, file=sys.stderr)


def _load(args, batched: bool):
    """(model, tokenizer, name, mesh) of --model on the --mesh of a command that runs batches of rows or one
    sequence (`runner.load`); of --processes, on this process's device (rows go over the processes)."""
    mesh = None if jax.process_count() > 1 else sharding.device_mesh(args.mesh, batched=batched, name="--mesh")
    data = 1 if mesh is None else mesh.shape["data"]
    if getattr(args, "batch_size", None) is not None and args.batch_size % data:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the mesh's data axis ({data})")
    with _option("--model"):
        return *runner.load(args.model, mesh, _log), mesh


@contextlib.contextmanager
def _option(name: str):
    """Errors (ValueError, TypeError, OSError) raised inside become ValueErrors naming the option `name`."""
    try:
        yield
    except (ValueError, TypeError, OSError) as e:
        message = _message(e)
        raise ValueError(message if message.startswith(name) else f"{name}: {message}") from e


_OUT_OF_MEMORY = re.compile(r"(?:RESOURCE_EXHAUSTED|Out of memory)\D*?(\d+) bytes", re.IGNORECASE)


def _message(error: Exception) -> str:
    """The error's message; with its type's name for other than ValueError and OSError (whose messages say); an
    allocation that failed says how much it asked for and what to lower."""
    asked = _OUT_OF_MEMORY.search(str(error)) if isinstance(error, jax.errors.JaxRuntimeError | MemoryError) else None
    if asked:
        return (
            f"out of memory: the run asked for {int(asked.group(1)) / 2**30:.1f} GiB at once; lower --batch-size "
            "or --max-length (or the policies' stride), or run on a device with more memory"
        )
    return str(error) if isinstance(error, ValueError | OSError) else f"{type(error).__name__}: {error}"


def _evaluate(args, name: str, total: int, identity: dict, work, tokenizer, mesh, unit: str = "tok"):
    """`runner.run` (progress in `unit`s) with the checkpoints of --checkpoint-every / --resume in
    --out/checkpoint-<name>. The run's identity: every argument (the policies by spec, the model by its content),
    `identity`, and with checkpoints the model's and tokenizer's hashes and the devices (`runner.identity`)."""
    skip = (
        "run",
        "parser",
        "argv",
        "resume",
        "checkpoint_every",
        "out",
        "json",
        "policy",
        "model",
        "mesh",
        "processes",
    )
    run = {k: v for k, v in vars(args).items() if k not in skip} | identity
    if args.checkpoint_every is not None:  # the hashes read the model's files: only for a run that checkpoints
        run |= runner.identity(args.model, tokenizer, mesh, _log)
    command = shlex.join(["jcascade", *args.argv] + ([] if args.resume else ["--resume"]))
    return runner.run(
        name,
        total,
        work,
        pathlib.Path(args.out) / f"checkpoint-{name}",
        args.checkpoint_every,
        args.resume,
        run,
        command,
        unit,
    )


def _row_parts(mesh) -> int:
    """The parts a batch's rows split into: the processes of --processes, or the mesh's data axis (1 without)."""
    if jax.process_count() > 1:
        return jax.process_count()
    return 1 if mesh is None else mesh.shape["data"]


def _batch_size(args, prompts: int, mesh, most: int) -> int:
    """--batch-size, or what a run of `prompts` prompts per (policy, length) needs: the fewest batches of at most
    `most` x D rows, as equal as possible (`passkey.equal_batches`), rounded up to a multiple of D, the parts the
    rows split into (`_row_parts`)."""
    data = _row_parts(mesh)
    return args.batch_size or -(-passkey.equal_batches(prompts, most * data) // data) * data


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _finish(args, name: str, result: dict, text: str, figures, checkpointing=None) -> None:
    """Writes the results (`runner.write`), prints the tables (stdout, or stderr with --json) and, with
    --json, the summary (`report.summary`) to stdout. Of several processes (--processes), process 0 alone, once
    every process is done with the run (and its checkpoint, which the writing removes)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("results")
    if jax.process_index() != 0:
        return
    with _option("--out"):
        files = runner.write(args.out, name, result, figures, checkpointing)
    print(text + "\n\nwrote " + ", ".join(files), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(report.json_text(report.summary(result) | {"files": files}))


LARGEST = 2**31 - 1  # counts and lengths: JAX's int32
SEEDS = 2**32  # seeds: a JAX key holds 32 bits


def _integer(least: int = 1, most: int = LARGEST, k: bool = True):
    """An argparse type: an int in [least, most]; with `k`, "4K" / "4k" for 4096."""

    def parse(text: str) -> int:
        try:
            value = int(text[:-1]) * 1024 if k and text[-1:].lower() == "k" else int(text)
        except ValueError:
            example = " such as 4096 or 4K" if k else ""
            raise argparse.ArgumentTypeError(f"must be an int{example}, got {text!r}") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(
                f"must be {'positive' if least == 1 else f'>= {least}'} and at most {most}, got {text!r}"
            )
        return value

    parse.__doc__ = (
        f"An argparse type: an int from {least} to {most}{', 4K / 4k for 4096' if k else ''}; "
        "anything else is an ArgumentTypeError naming the value."
    )
    return parse


count = _integer()  # counts and lengths (tokens, prompts, devices); public: the benchmarks' options parse with it


def _real(low: float, high: float = math.inf, low_open: bool = False):
    """An argparse type: a finite float in [low, high] ((low, high] with `low_open`)."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high == math.inf else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number in {interval}, got {text!r}") from None
        if not (math.isfinite(value) and low <= value <= high and not (low_open and value == low)):
            raise argparse.ArgumentTypeError(f"must be a finite number in {interval}, got {text!r}")
        return value

    return parse


def _argument(parse):
    """An argparse type from a parser raising ValueError (or OverflowError: "1e999" as an int)."""

    def convert(text: str):
        try:
            return parse(text)
        except (ValueError, OverflowError) as e:
            raise argparse.ArgumentTypeError(
                f"{text!r} is out of range ({e})" if isinstance(e, OverflowError) else str(e)
            ) from None

    return convert


def _policies(args) -> dict:
    policies = report.labelled(args.policy or main_job.policies(**main_job.PAIR))
    for policy in policies.values() if args.command in ("perplexity", "attention-map") else ():
        with _option("--policy"):
            perplexity.check_streaming(policy)
    if args.command != "attention-map":
        with _option("--baseline"):
            report.baseline_label(policies, args.baseline)  # checked before the model loads
    return policies


def cmd_generate(args) -> None:
    model, tokenizer, name, _ = _load(args, batched=False)
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
    _log(f"[{result['prompt_tokens']} prompt tokens, {result['seconds']:.1f} s, {name}, {args.policy}]")
    if args.out is not None:
        with _option("--out"):
            runner.write(args.out, "generate", result)


def run_passkey(args, policies: dict, title: str, retention: bool) -> None:
    _check_lengths(args)
    lengths = passkey.context_lengths(args.min_length, args.max_length)
    if args.words_file is not None and args.filler != "words":
        raise ValueError(f"--words-file: used only with --filler words, not --filler {args.filler}")
    with _option("--words-file"):
        words = texts.word_list(args.words_file, log=_log) if args.filler == "words" else None
    model, tokenizer, name, mesh = _load(args, batched=True)
    per_length = args.buckets * args.samples
    batch = _batch_size(args, per_length, mesh, 32)
    runner.warn_whole_context({n: policies for n in lengths})
    _log(
        f"{title}\nmodel {name}; filler {args.filler}; context lengths {lengths}; {args.buckets} depth buckets x "
        f"{args.samples} samples = {per_length} prompts per length; policies:\n"
        + "\n".join(f"  {k}: {v}" for k, v in report.policy_specs(policies).items())
    )
    results, seconds, checkpointing = _evaluate(
        args,
        "passkey",
        len(policies) * per_length * sum(lengths),
        {"policies": report.policy_specs(policies), "words": words and _sha256("\n".join(words)), "batch_size": batch},
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
    _finish(
        args,
        "passkey",
        rep,
        f"\n{title}\n{name}, {args.protocol}, {args.filler} filler, {seconds:.0f} s\n" + report.passkey_text(rep),
        [
            lambda out: plots.passkey(rep, out / "passkey_accuracy.png", f"{title} ({name}, {args.protocol})"),
            lambda out: plots.passkey_depth(rep, out / "passkey_depth.png", f"{name}, {args.protocol}"),
        ],
        checkpointing,
    )


def cmd_compare(args) -> None:
    vars(args).update({k: v for k, v in main_job.defaults().items() if getattr(args, k) is None})
    policies = report.labelled(main_job.policies(args.cache_size, args.sinks, args.cascades, args.stride))
    run_passkey(
        args,
        policies,
        f"Sink vs Cascade: {args.sinks} sinks + {args.cache_size} tokens each "
        f"(Cascade: {args.cascades} cascades), prefill stride {args.stride}",
        retention=True,
    )


def cmd_perplexity(args) -> None:
    policies = _policies(args)
    model, tokenizer, name, mesh = _load(args, batched=False)
    with _option("--book"):
        books = perplexity.books(tokenizer, args.book or ["paradise_lost"], args.max_tokens, _log)
    longest = max([c for c in map(perplexity.cache_capacity, policies.values()) if c is not None], default=1)
    (results, skipped), seconds, checkpointing = _evaluate(
        args,
        "perplexity",
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
    _finish(
        args,
        "perplexity",
        rep,
        f"\nStreaming perplexity, {name}, {len(books) - len(skipped)} books, {seconds:.0f} "
        "s\n" + report.perplexity_text(rep),
        [lambda out: plots.perplexity(rep, out / "perplexity.png", f"Streaming perplexity ({name})")],
        checkpointing,
    )


def cmd_ruler(args) -> None:
    lengths, tasks = passkey.context_lengths(args.min_length, args.max_length), args.tasks
    model, tokenizer, name, mesh = _load(args, batched=True)  # KVzip's policies need the tokenizer
    with _option("--policy"):
        at = ruler.policy_grid(
            [p for group in args.policy or [ruler.DEFAULT_POLICIES] for p in group],
            args.budget,
            tokenizer,
            args.kv_dtype,
        )
    with _option("--budget"):  # a budget's slots grow with n
        specs = report.policy_specs(at, lengths)
    with _option("--baseline"):
        report.baseline_label(specs, args.baseline)
    batch = _batch_size(args, len(tasks) * args.samples, mesh, 8)
    runner.warn_whole_context({n: at(n) for n in lengths})
    with _option("--book"):
        prose = texts.load_book(args.book, _log) if any(ruler.TASKS[t].needs_prose for t in tasks) else None
    results, seconds, checkpointing = _evaluate(
        args,
        "ruler",
        len(specs) * len(tasks) * args.samples * len(lengths),
        {"policies": specs, "prose": prose and _sha256(prose), "batch_size": batch},
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
    _finish(
        args,
        "ruler",
        rep,
        f"\nRULER, {name}, {args.protocol}, {seconds:.0f} s\n" + report.ruler_text(rep),
        [lambda out: plots.ruler(rep, out / "ruler.png", f"RULER ({name}, {args.protocol})")],
        checkpointing,
    )


def cmd_attention_map(args) -> None:
    policies = _policies(args)
    model, tokenizer, name, _ = _load(args, batched=False)
    with _option("--book"):
        tokens = perplexity.book_tokens(tokenizer, texts.load_book(args.book, _log), args.tokens)
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
    heading, images = (
        f"{name}, layer {layer}, KV head {args.kv_head}",
        {k: attention_map.render(m, args.pixels) for k, m in maps.items()},
    )
    rep = report.attention_map(
        maps,
        policies,
        run={"model": name, "book": str(args.book), "tokens": len(tokens), "layer": layer, "kv_head": args.kv_head},
    )
    _finish(
        args,
        "attention_map",
        rep,
        f"\nAttention maps, {heading}, first {len(tokens)} tokens of "
        f"{pathlib.Path(args.book).stem}\n" + report.attention_map_text(rep),
        [lambda out: plots.attention_maps(images, len(tokens), out / "attention_map.png", heading)],
    )


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones (their help says what they mean)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jcascade",
        description=__doc__,
        epilog="policies: " + ", ".join(policy_classes()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    policy, pair = (
        _argument(parse_policy),
        "Sink and Cascade of {sinks} sinks + {cache_size} tokens, {cascades} cascades, stride {stride}".format(
            **main_job.PAIR
        ),
    )

    def command(name: str, help: str, run, batched: bool, out: str | None = "jcascade-out", policies: bool = True):
        p = sub.add_parser(name, help=help, description=help, formatter_class=_Help)
        p.set_defaults(run=run, parser=p, processes=1)  # --processes: the batched commands
        p.add_argument("--model", help="model directory or .gguf file (default: SmolLM2-135M-Instruct from PyPI)")
        p.add_argument("--out", default=out, help="directory for the JSON (and PNG) results")
        p.add_argument("--json", action="store_true", help="print the summary as JSON to stdout (tables to stderr)")
        p.add_argument(
            "--mesh",
            type=_argument(sharding.parse_mesh),
            metavar="data=D,model=M",
            help="devices: rows "
            f"over D, weights and KV heads over M (default: {'rows over all' if batched else 'one device'})",
        )
        if policies:
            p.add_argument(
                "--policy",
                action="append",
                type=policy,
                metavar="SPEC",
                help=f"NAME[:FIELD=VALUE,...], repeatable (default: {pair})",
            )
        if batched:
            p.add_argument(
                "--processes",
                type=count,
                default=1,
                metavar="N",
                help="run as N processes of one device "
                "each (GPU i for process i), each batch's rows split over them (jcascade.eval.processes); "
                "not with --mesh",
            )
        return p

    def protocol_option(p):
        p.add_argument(
            "--protocol",
            choices=protocol.PROTOCOLS,
            default=protocol.QUERY_AWARE,
            help="query-aware: "
            "the policy compresses each prompt with its question; query-agnostic: the context alone, "
            "before the question (kvpress's default), which is then read over the frozen compressed context",
        )

    def evaluation(p):
        p.add_argument(
            "--baseline",
            metavar="LABEL",
            help="the policy the others are compared with on the same "
            "prompts, by its printed label (default: the first)",
        )
        p.add_argument(
            "--checkpoint-every",
            type=count,
            metavar="TOKENS",
            help="save progress to --out/checkpoint-<command> every this many tokens",
        )
        p.add_argument(
            "--resume",
            action="store_true",
            help="continue the run saved by --checkpoint-every (same "
            "arguments); the results equal an uninterrupted run's",
        )

    p = command("generate", "continue a prompt under a cache policy", cmd_generate, False, None, policies=False)
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument(
        "--policy",
        type=policy,
        default="cascade:cache_size=1024,sinks=64,stride=512",
        metavar="SPEC",
        help="NAME[:FIELD=VALUE,...]",
    )
    p.add_argument("--max-new-tokens", type=count, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=_real(0.0), default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=_real(0.0, 1.0, low_open=True), default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=_integer(0, SEEDS - 1, k=False), default=0, help="sampling seed")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")

    def sweep(p, shortest, longest, samples, per: str):
        """Context lengths, samples and seed of a sweep, and the evaluation options."""
        for flag, default, help in (
            ("--min-length", shortest, "shortest context (tokens; 1K = 1024)"),
            ("--max-length", longest, "longest context; lengths double"),
            ("--samples", samples, f"prompts per {per} and length"),
        ):
            p.add_argument(flag, type=count, default=default, help=help)
        p.add_argument("--seed", type=_integer(0, SEEDS - 1, k=False), default=0, help="seed of the prompts")
        evaluation(p)

    def passkey_options(p, machine: bool = False):
        """The passkey options; with `machine`, None defaults (the main job's per machine: `main_job.defaults`)."""
        sweep(p, *((None, None, None) if machine else (1024, 2048, 10)), "depth bucket")
        p.add_argument(
            "--filler",
            choices=("repeat", "words"),
            default=None if machine else "repeat",
            help="repeated sentences or random dictionary words",
        )
        p.add_argument("--buckets", type=count, default=5, help="depth buckets")
        p.add_argument("--words-file", help="word list for --filler words (default: Debian's wamerican)")
        p.add_argument(
            "--batch-size",
            type=count,
            help="prompts per generate call, a multiple of the mesh's "
            "data axis D (default: buckets x samples in equal batches of at most 32 x D)",
        )

    p = command(
        "compare",
        "the main job: passkey retrieval under Sink vs Cascade caches of the same size. Unset "
        "options take this machine's defaults, " + main_job.describe(),
        cmd_compare,
        True,
        policies=False,
    )
    passkey_options(p, machine=True)
    p.set_defaults(protocol=protocol.QUERY_AWARE)  # it records retention, read inside one prompt
    p.add_argument("--cache-size", type=count, help="non-sink tokens of each cache")
    p.add_argument("--sinks", type=_integer(0), help="sink tokens of each cache")
    p.add_argument("--cascades", type=count, help="Cascade's sub-caches")
    p.add_argument("--stride", type=count, help="prefill chunk (tokens)")

    p = command(
        "passkey",
        "passkey retrieval over context lengths x key depths x policies",
        lambda args: run_passkey(args, _policies(args), "Passkey retrieval", args.retention),
        True,
    )
    passkey_options(p)
    p.add_argument(
        "--retention",
        action="store_true",
        help="also record how many of the key's tokens each layer "
        "and KV head holds when the question is fed (--protocol query-aware only)",
    )
    protocol_option(p)

    p = command(
        "perplexity",
        "streaming perplexity over public-domain books (§4.2 of the Cascading KV Cache paper, arXiv 2406.17808)",
        cmd_perplexity,
        False,
    )
    p.add_argument(
        "--book",
        action="append",
        metavar="NAME|FILE",
        help="a packaged book (e.g. paradise_lost), 'all', or a text file; repeatable (default: paradise_lost)",
    )
    p.add_argument("--max-tokens", type=count, help="stream at most this many tokens of each book (default: all)")
    p.add_argument("--bucket", type=count, default=256, help="positions per point of the curve")
    p.add_argument("--block", type=count, default=perplexity.BLOCK, help="tokens per block, the unit of the bootstrap")
    evaluation(p)

    p = command("ruler", "RULER's synthetic tasks under every policy at a KV budget", cmd_ruler, True, policies=False)
    p.add_argument(
        "--tasks",
        type=_argument(ruler.task_list),
        default="all",
        help="comma-separated, or all: " + ", ".join(ruler.TASKS),
    )
    p.add_argument(
        "--policy",
        action="append",
        type=_argument(ruler.policy_list),
        metavar="NAMES|SPEC",
        help="comma-separated policy names, each at every --budget and length, among "
        + ", ".join(ruler.POLICIES)
        + "; or NAME:FIELD=VALUE,... used as given; repeatable (default: "
        + ",".join(ruler.DEFAULT_POLICIES)
        + ")",
    )
    p.add_argument(
        "--budget",
        type=_argument(ruler.budget_list),
        default="0.25,0.5",
        help="KV slots kept, sinks "
        "and windows included: fractions of the context (<1) or token counts, comma-separated",
    )
    p.add_argument(
        "--kv-dtype",
        type=_argument(ruler.kv_dtype_list),
        default="model",
        help="KV storage formats "
        "of the named policies, comma-separated, each at every budget: model (the model's dtype), int8, "
        "float8_e4m3fn (a spec sets its own kv_dtype field)",
    )
    p.add_argument(
        "--batch-size",
        type=count,
        help="prompts per generate call, a multiple of the mesh's data "
        "axis D (default: tasks x samples in equal batches of at most 8 x D)",
    )
    p.add_argument("--book", default="paradise_lost", help="the prose haystack (RULER's essays are not offline)")
    protocol_option(p)
    sweep(p, 4096, 8192, 50, "task")

    p = command(
        "attention-map",
        "which positions each query sees while a book streams through a cache",
        cmd_attention_map,
        False,
    )
    p.add_argument("--book", default="paradise_lost", metavar="NAME|FILE", help="a packaged book or a text file")
    p.add_argument("--tokens", type=count, default=4096, help="stream the first N tokens")
    p.add_argument("--layer", type=_integer(0, k=False), help="layer to show (default: the middle one)")
    p.add_argument("--kv-head", type=_integer(0, k=False), default=0, help="KV head to show")
    p.add_argument("--pixels", type=count, default=512, help="image side")
    return parser


_NEGATIVE = re.compile(r"-(\d|\.\d|inf|nan)", re.IGNORECASE)  # -1K, -.5, -inf, -nan


def _negative_values(argv: list[str]) -> list[str]:
    """ "--opt -1K" -> "--opt=-1K": a negative value reaches the option's check, not "expected one argument"."""
    out: list[str] = []
    for arg in argv:
        joined = out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE.match(arg)
        out[-1:] = [f"{out[-1]}={arg}"] if joined else [*out[-1:], arg]
    return out


def _given(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, list[str]]:
    """{option: how `argv` sets it, once per time ("--opt value", "--opt=value")} for `parser`'s long options, as
    argparse reads them (a unique prefix stands for its option), by each option's last name."""
    actions = {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}
    given: dict[str, list[str]] = {}
    for i, arg in enumerate(argv):
        word = arg.split("=", 1)[0]
        if not word.startswith("--"):
            continue
        matches = {actions[word]} if word in actions else {a for o, a in actions.items() if o.startswith(word)}
        if len(matches) == 1:
            action = matches.pop()
            value = i + 1 < len(argv) and "=" not in arg and action.nargs != 0
            given.setdefault(action.option_strings[-1], []).append(f"{arg} {argv[i + 1]}" if value else arg)
    return given


def _check_once(args) -> None:
    """An option that takes one value given twice, or the storage format named by both --kv-dtype and a --policy
    spec: a ValueError naming both (argparse would keep one of them without a word)."""
    given = _given(args.parser, args.argv)
    once = {a.option_strings[-1] for a in args.parser._actions if not isinstance(a, argparse._AppendAction)}
    for option, entries in given.items():
        if option in once and len(entries) > 1:
            raise ValueError(f"{option}: given {len(entries)} times ({', '.join(entries)}); give it once")
    if "--kv-dtype" in given:
        specs = [p for group in getattr(args, "policy", None) or [] for p in group if not isinstance(p, str)]
        for policy in specs:
            if policy.kv_dtype != "model":
                raise ValueError(
                    f"--kv-dtype: the storage format is given twice, by {given['--kv-dtype'][0]} and by "
                    f"--policy {type(policy).__name__.lower()}:...,kv_dtype={policy.kv_dtype}; name it "
                    "once (--kv-dtype formats the named policies, a spec its own policy)"
                )


RESULTS = {"compare": "passkey", "attention-map": "attention_map"}  # a command's results file, <name>.json


def _check_lengths(args) -> None:
    if args.min_length is not None and args.max_length is not None and args.max_length < args.min_length:
        raise ValueError(
            f"--max-length: the longest context ({args.max_length}) must be >= the shortest "
            f"(--min-length {args.min_length})"
        )


def _check_out(out: pathlib.Path, files: list[str]) -> None:
    """Raises a ValueError naming --out unless `out` is a writable directory or can be made one, where none of
    `files` is a directory."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a directory")
    existing = next(p for p in [out, *out.absolute().parents] if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--out: cannot create {out}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out: cannot write in {existing}" + ("" if existing == out else f" to create {out}"))
    for name in files:
        if (out / name).is_dir():
            raise ValueError(f"--out: {out / name} is a directory, so the results cannot be written there")


def _check(args) -> None:
    """The checks that need no model, before any work: the paths of --model, --words-file, --book (a file
    path; a packaged book's name is checked when it loads) and --out, and options that must agree (--protocol
    query-agnostic refuses --retention, a Recycled --policy and, by its config, a --model with sliding or linear
    layers)."""
    _check_once(args)
    if args.model is not None and not pathlib.Path(args.model).exists():
        raise ValueError(f"--model: no such model directory or .gguf file: {args.model}")
    if getattr(args, "words_file", None) is not None and not pathlib.Path(args.words_file).is_file():
        raise ValueError(f"--words-file: no such file: {args.words_file}")
    books = getattr(args, "book", None)
    for book in [books] if isinstance(books, str) else books or []:
        if not pathlib.Path(book).is_file() and (pathlib.Path(book).suffix or os.sep in book):
            raise ValueError(
                f"--book: no such file: {book} (a packaged book is named without suffix, e.g. paradise_lost)"
            )
    if hasattr(args, "min_length"):
        _check_lengths(args)
    if args.processes > 1 and args.mesh is not None:
        raise ValueError(
            f"--mesh: with --processes {args.processes} the rows go over the processes, one device each; "
            "leave --mesh out"
        )
    if args.processes > 1 and (args.batch_size or 0) % args.processes:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of --processes ({args.processes})")
    if args.command == "generate" and not args.prompt:
        raise ValueError("--prompt: must not be empty")
    if getattr(args, "protocol", None) == protocol.QUERY_AGNOSTIC:
        if getattr(args, "retention", False):
            raise ValueError(
                "--retention: recorded under --protocol query-aware only (it reads the cache where the "
                "question's chunk starts, inside one prompt)"
            )
        with _option("--model"):
            config = None if args.model is None else read_config(args.model)
        with _option("--protocol"):
            given = (
                [p for group in args.policy or [] for p in group if not isinstance(p, str)]  # specs among names
                if args.command == "ruler"
                else args.policy or []
                if args.command == "passkey"
                else []
            )
            protocol.check(args.protocol, given, config)
    if args.out is not None:
        _check_out(pathlib.Path(args.out), [RESULTS.get(args.command, args.command) + ".json"])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments of a `jcascade` command line (default: sys.argv), checked as far as they can be without a
    model; bad ones exit with the command's usage and an error naming the option (SystemExit 2)."""
    argv = _negative_values(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        _check(args)
    except ValueError as e:
        args.parser.error(str(e))
    return args


def main(argv: list[str] | None = None) -> None:
    """Runs a command line; every expected error (bad input, paths, memory) exits with the command's usage and
    the message (SystemExit 2), never a traceback. Warnings print as one line each, `warning: <message>` (above
    a progress bar)."""
    args = parse(argv)
    if args.processes > 1 and not processes.launched():
        if args.model is None:  # fetched here, on the CPU, once for all the processes
            jax.config.update("jax_platforms", "cpu")
            runner.model_path(None, _log)
        code = processes.launch(["-m", "jcascade", *args.argv], args.processes, _log)
        if code:
            raise SystemExit(code)
        return
    try:
        if args.processes > 1:  # launched: one of the processes
            processes.join()
        with warnings.catch_warnings():
            warnings.showwarning = lambda message, *_, **__: tqdm.write(
                f"warning: {message}", sys.stderr
            )  # above a bar
            args.run(args)
    except (ValueError, TypeError, OSError, OverflowError, MemoryError, jax.errors.JaxRuntimeError) as e:
        args.parser.error(_message(e))
