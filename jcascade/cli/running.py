"""What the `jcascade` commands share when they run: the model on --mesh (or one device of --processes), the
policies, the batch size, the run under --checkpoint-every / --resume, and the results written to --out and
printed."""

from __future__ import annotations

import functools
import hashlib
import pathlib
import shlex
import sys

import jax

from jcascade.cli.options import option
from jcascade.eval import main_job, passkey, perplexity, report, runner
from jcascade.models import sharding

log = functools.partial(print, file=sys.stderr)


def load(args, batched: bool):
    """(model, tokenizer, name, mesh) of --model on the --mesh of a command that runs batches of rows or one
    sequence (`runner.load`); of --processes, on this process's device (rows go over the processes)."""
    mesh = None if jax.process_count() > 1 else sharding.device_mesh(args.mesh, batched=batched, name="--mesh")
    data = 1 if mesh is None else mesh.shape["data"]
    if getattr(args, "batch_size", None) is not None and args.batch_size % data:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the mesh's data axis ({data})")
    with option("--model"):
        return *runner.load(args.model, mesh, log), mesh


def policies(args, streaming: bool) -> dict:
    """The --policy specs by label (default: the main job's pair), before the model loads: with `streaming`, each
    must stream (`perplexity.check_streaming`); --baseline, of a command that has it, must be one of them."""
    labelled = report.labelled(args.policy or main_job.policies(**main_job.PAIR))
    for policy in labelled.values() if streaming else ():
        with option("--policy"):
            perplexity.check_streaming(policy)
    if hasattr(args, "baseline"):
        with option("--baseline"):
            report.baseline_label(labelled, args.baseline)
    return labelled


def _row_parts(mesh) -> int:
    """The parts a batch's rows split into: the processes of --processes, or the mesh's data axis (1 without)."""
    if jax.process_count() > 1:
        return jax.process_count()
    return 1 if mesh is None else mesh.shape["data"]


def batch_size(args, prompts: int, mesh, most: int) -> int:
    """--batch-size, or what a run of `prompts` prompts per (policy, length) needs: the fewest batches of at most
    `most` x D rows, as equal as possible (`passkey.equal_batches`), rounded up to a multiple of D, the parts the
    rows split into (`_row_parts`)."""
    data = _row_parts(mesh)
    return args.batch_size or -(-passkey.equal_batches(prompts, most * data) // data) * data


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def evaluate(args, total: int, identity: dict, work, tokenizer, mesh, unit: str = "tok"):
    """`runner.run` of the command's results (progress in `unit`s) with the checkpoints of --checkpoint-every /
    --resume in --out/checkpoint-<results>. The run's identity: every argument (the policies by spec, the model
    by its content), `identity`, and with checkpoints the model's and tokenizer's hashes and the devices
    (`runner.identity`)."""
    skip = "run check results parser argv resume checkpoint_every out json policy model mesh processes".split()
    run = {k: v for k, v in vars(args).items() if k not in skip} | identity
    if args.checkpoint_every is not None:  # the hashes read the model's files: only for a run that checkpoints
        run |= runner.identity(args.model, tokenizer, mesh, log)
    command = shlex.join(["jcascade", *args.argv] + ([] if args.resume else ["--resume"]))
    checkpoint = pathlib.Path(args.out) / f"checkpoint-{args.results}"
    return runner.run(args.results, total, work, checkpoint, args.checkpoint_every, args.resume, run, command, unit)


def finish(args, result: dict, text: str, figures, checkpointing=None) -> None:
    """Writes the results (`runner.write`), prints the tables (stdout, or stderr with --json) and, with --json, the
    summary (`report.summary`) to stdout. Of several processes (--processes), process 0 alone, once every process
    is done with the run (and its checkpoint, which the writing removes)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("results")
    if jax.process_index() != 0:
        return
    with option("--out"):
        files = runner.write(args.out, args.results, result, figures, checkpointing)
    print(text + "\n\nwrote " + ", ".join(files), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(report.json_text(report.summary(result) | {"files": files}))
