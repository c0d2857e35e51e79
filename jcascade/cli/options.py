"""The options the `jcascade` commands share: the argparse types of numbers; the options of every command (--model,
--out, --json, --mesh, --policy, --processes), of the evaluations and of the sweeps; the checks that need no model
(`check`), run before any model time; and errors that name their option (`option`, `message`)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pathlib
import re

import jax

from jcascade.eval import main_job, protocol
from jcascade.models import read_config, sharding
from jcascade.policies import parse_policy

LARGEST = 2**31 - 1  # counts and lengths: JAX's int32
SEEDS = 2**32  # seeds: a JAX key holds 32 bits


def integer(least: int = 1, most: int = LARGEST, k: bool = True):
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


count = integer()  # counts and lengths (tokens, prompts, devices); the benchmarks' options parse with it too
seed = integer(0, SEEDS - 1, k=False)


def real(low: float, high: float = math.inf, low_open: bool = False):
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


def argument(parse):
    """An argparse type from a parser raising ValueError (or OverflowError: "1e999" as an int)."""

    def convert(text: str):
        try:
            return parse(text)
        except (ValueError, OverflowError) as e:
            raise argparse.ArgumentTypeError(
                f"{text!r} is out of range ({e})" if isinstance(e, OverflowError) else str(e)
            ) from None

    return convert


policy = argument(parse_policy)  # NAME[:FIELD=VALUE,...]


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones (their help says what they mean)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def add_command(
    sub,
    name: str,
    help: str,
    run,
    *,
    batched: bool,
    out: str | None = "jcascade-out",
    policies: bool = True,
    results: str | None = None,
    check=None,
) -> argparse.ArgumentParser:
    """The parser of command `name` with the options every command has: --model, --out, --json, --mesh; --policy,
    unless the command defines its own (`policies`); --processes, for a command that runs batches of rows
    (`batched`). `run(args)` runs it, `check(args)` checks its own options before any model time; it writes its
    results as `results`.json (default: the command's name)."""
    p = sub.add_parser(name, help=help, description=help, formatter_class=_Help)
    p.set_defaults(run=run, check=check, results=results or name, parser=p, processes=1)
    p.add_argument("--model", help="model directory or .gguf file (default: SmolLM2-135M-Instruct from PyPI)")
    p.add_argument("--out", default=out, help="directory for the JSON (and PNG) results")
    p.add_argument("--json", action="store_true", help="print the summary as JSON to stdout (tables to stderr)")
    p.add_argument(
        "--mesh",
        type=argument(sharding.parse_mesh),
        metavar="data=D,model=M",
        help="devices: rows over D, weights and KV heads over M "
        f"(default: {'rows over all' if batched else 'one device'})",
    )
    if policies:
        pair = "Sink and Cascade of {sinks} sinks + {cache_size} tokens, {cascades} cascades, stride {stride}"
        p.add_argument(
            "--policy",
            action="append",
            type=policy,
            metavar="SPEC",
            help=f"NAME[:FIELD=VALUE,...], repeatable (default: {pair.format(**main_job.PAIR)})",
        )
    if batched:
        p.add_argument(
            "--processes",
            type=count,
            default=1,
            metavar="N",
            help="run as N processes of one device each (GPU i for process i), each batch's rows split over them "
            "(jcascade.eval.processes); not with --mesh",
        )
    return p


def add_protocol(p) -> None:
    p.add_argument(
        "--protocol",
        choices=protocol.PROTOCOLS,
        default=protocol.QUERY_AWARE,
        help="query-aware: the policy compresses each prompt with its question; query-agnostic: the context alone, "
        "before the question (kvpress's default), which is then read over the frozen compressed context",
    )


def add_evaluation(p) -> None:
    """The options of a command that compares policies: --baseline, --checkpoint-every, --resume."""
    p.add_argument(
        "--baseline",
        metavar="LABEL",
        help="the policy the others are compared with on the same prompts, by its printed label (default: the first)",
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
        help="continue the run saved by --checkpoint-every (same arguments); the results equal an uninterrupted run's",
    )


def add_sweep(p, shortest: int | None, longest: int | None, samples: int | None, per: str) -> None:
    """Context lengths, samples and seed of a sweep, and the evaluation options."""
    for flag, default, help in (
        ("--min-length", shortest, "shortest context (tokens; 1K = 1024)"),
        ("--max-length", longest, "longest context; lengths double"),
        ("--samples", samples, f"prompts per {per} and length"),
    ):
        p.add_argument(flag, type=count, default=default, help=help)
    p.add_argument("--seed", type=seed, default=0, help="seed of the prompts")
    add_evaluation(p)


@contextlib.contextmanager
def option(name: str):
    """Errors (ValueError, TypeError, OSError) raised inside become ValueErrors naming the option `name`."""
    try:
        yield
    except (ValueError, TypeError, OSError) as e:
        text = message(e)
        raise ValueError(text if text.startswith(name) else f"{name}: {text}") from e


_OUT_OF_MEMORY = re.compile(r"(?:RESOURCE_EXHAUSTED|Out of memory)\D*?(\d+) bytes", re.IGNORECASE)


def message(error: Exception) -> str:
    """The error's message; with its type's name for other than ValueError and OSError (whose messages say); an
    allocation that failed says how much it asked for and what to lower."""
    asked = _OUT_OF_MEMORY.search(str(error)) if isinstance(error, jax.errors.JaxRuntimeError | MemoryError) else None
    if asked:
        return (
            f"out of memory: the run asked for {int(asked.group(1)) / 2**30:.1f} GiB at once; lower --batch-size "
            "or --max-length (or the policies' stride), or run on a device with more memory"
        )
    return str(error) if isinstance(error, ValueError | OSError) else f"{type(error).__name__}: {error}"


def given(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, list[str]]:
    """{option: how `argv` sets it, once per time ("--opt value", "--opt=value")} for `parser`'s long options, as
    argparse reads them (a unique prefix stands for its option), by each option's last name."""
    actions = {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}
    found: dict[str, list[str]] = {}
    for i, arg in enumerate(argv):
        word = arg.split("=", 1)[0]
        if not word.startswith("--"):
            continue
        matches = {actions[word]} if word in actions else {a for o, a in actions.items() if o.startswith(word)}
        if len(matches) == 1:
            action = matches.pop()
            value = i + 1 < len(argv) and "=" not in arg and action.nargs != 0
            found.setdefault(action.option_strings[-1], []).append(f"{arg} {argv[i + 1]}" if value else arg)
    return found


def check_once(args) -> None:
    """An option that takes one value given twice, or the storage format named by both --kv-dtype and a --policy
    spec: a ValueError naming both (argparse would keep one of them without a word)."""
    settings = given(args.parser, args.argv)
    once = {a.option_strings[-1] for a in args.parser._actions if not isinstance(a, argparse._AppendAction)}
    for name, entries in settings.items():
        if name in once and len(entries) > 1:
            raise ValueError(f"{name}: given {len(entries)} times ({', '.join(entries)}); give it once")
    if "--kv-dtype" in settings:
        specs = [p for group in getattr(args, "policy", None) or [] for p in group if not isinstance(p, str)]
        for spec in specs:
            if spec.kv_dtype != "model":
                raise ValueError(
                    f"--kv-dtype: the storage format is given twice, by {settings['--kv-dtype'][0]} and by "
                    f"--policy {type(spec).__name__.lower()}:...,kv_dtype={spec.kv_dtype}; name it "
                    "once (--kv-dtype formats the named policies, a spec its own policy)"
                )


def check_lengths(args) -> None:
    if args.min_length is not None and args.max_length is not None and args.max_length < args.min_length:
        raise ValueError(
            f"--max-length: the longest context ({args.max_length}) must be >= the shortest "
            f"(--min-length {args.min_length})"
        )


def check_out(out: pathlib.Path, file: str) -> None:
    """Raises a ValueError naming --out unless `out` is a writable directory or can be made one, where `file` (the
    results) is not a directory."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a directory")
    existing = next(p for p in [out, *out.absolute().parents] if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--out: cannot create {out}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out: cannot write in {existing}" + ("" if existing == out else f" to create {out}"))
    if (out / file).is_dir():
        raise ValueError(f"--out: {out / file} is a directory, so the results cannot be written there")


def check(args) -> None:
    """The checks that need no model, before any work: the paths of --model, --words-file, --book (a file path;
    a packaged book's name is checked when it loads) and --out, options that must agree, and the command's own
    checks (`add_command`'s `check`)."""
    check_once(args)
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
        check_lengths(args)
    if args.processes > 1 and args.mesh is not None:
        raise ValueError(
            f"--mesh: with --processes {args.processes} the rows go over the processes, one device each; "
            "leave --mesh out"
        )
    if args.processes > 1 and (args.batch_size or 0) % args.processes:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of --processes ({args.processes})")
    if args.check is not None:
        args.check(args)
    if args.out is not None:
        check_out(pathlib.Path(args.out), args.results + ".json")


def check_protocol(args, specs: list) -> None:
    """Under --protocol query-agnostic, refuses a Recycled policy among `specs` and, by its config, a --model
    with sliding or linear layers (`protocol.check`)."""
    if args.protocol == protocol.QUERY_AGNOSTIC:
        with option("--model"):
            config = None if args.model is None else read_config(args.model)
        with option("--protocol"):
            protocol.check(args.protocol, specs, config)
