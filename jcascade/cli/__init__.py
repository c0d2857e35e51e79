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
import re
import sys
import warnings

import jax
from tqdm import tqdm

from jcascade.cli import attention_map, compare, generate, options, passkey, perplexity, ruler, running
from jcascade.eval import processes, runner
from jcascade.policies import policy_classes

COMMANDS = (generate, compare, passkey, perplexity, ruler, attention_map)  # each adds its parser (`add`)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jcascade",
        description=__doc__,
        epilog="policies: " + ", ".join(policy_classes()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add(sub)
    return parser


_NEGATIVE = re.compile(r"-(\d|\.\d|inf|nan)", re.IGNORECASE)  # -1K, -.5, -inf, -nan


def _negative_values(argv: list[str]) -> list[str]:
    """ "--opt -1K" -> "--opt=-1K": a negative value reaches the option's check, not "expected one argument"."""
    out: list[str] = []
    for arg in argv:
        joined = out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE.match(arg)
        out[-1:] = [f"{out[-1]}={arg}"] if joined else [*out[-1:], arg]
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments of a `jcascade` command line (default: sys.argv), checked as far as they can be without a
    model (`options.check`); bad ones exit with the command's usage and an error naming the option
    (SystemExit 2)."""
    argv = _negative_values(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        options.check(args)
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
            runner.model_path(None, running.log)
        code = processes.launch(["-m", "jcascade", *args.argv], args.processes, running.log)
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
        args.parser.error(options.message(e))
