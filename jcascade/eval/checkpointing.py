"""Resumable runs: a run's checkpoints (`jcascade.checkpoint`: committed atomically, a damaged one an error naming
its file), and resumes that continue exactly or refuse.

What a resume guarantees. A `Checkpointing` carries the run's identity, everything that determines its
results: for the command line every argument, the sha256 of the model's weight files and of its
tokenizer's definition, the devices and mesh, and the software versions (`runner.identity`); the work adds
the batch layout it computes with and the digest of its prompts (`resume(batch_size=..., prompts=...)`,
`prompts_sha256`: a version of jcascade that builds other prompts refuses the checkpoint). A checkpoint written
under another identity is refused, naming each difference with its saved and its current value. The progress
records the finished units themselves (e.g. passkey trials by (policy, length, bucket, sample)), not a count of
batches: on resume the work checks that they are exactly the first units of its own plan, in order
(`finished`), and skips them; at its end, `complete` checks that the results hold every planned unit once, in
plan order. Same identity means the same batches, so a resumed run's results equal an uninterrupted run's; anything
else raises. A run never reports fewer units than planned as complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import shutil
import time
from collections.abc import Callable, Sequence

import numpy as np

from jcascade.checkpoint import REMEDY, Progress, load_stream, save_stream, saved_progress

_ABSENT = object()  # an identity key one of two runs lacks


def _brief(value) -> str:
    """A saved or current identity value, shortened for an error message."""
    if value is _ABSENT:
        return "absent"
    text = json.dumps(value)
    return text if len(text) <= 48 else text[:45] + "..."


@dataclasses.dataclass
class Checkpointing:
    """Periodic checkpoints of one run: `save` every `every` tokens of progress into `directory`.

    run: the run's identity, everything that determines its results (JSON-serialisable; the module
    docstring says what the command line puts there); `resume` refuses a checkpoint of another identity.
    command: the command line that resumes the run (saved with every checkpoint, shown when a leftover
    checkpoint is found). `seconds()` counts the run's time across resumes.
    """

    directory: pathlib.Path
    every: int
    run: dict
    command: str = ""
    _since: int = dataclasses.field(default=0, init=False, repr=False)  # tokens since the last checkpoint
    _started: float = dataclasses.field(default_factory=time.perf_counter, init=False, repr=False)
    _earlier: float = dataclasses.field(default=0.0, init=False, repr=False)  # seconds of the resumed runs

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"checkpoint every must be a positive int (tokens), got {self.every!r}")
        self.run = json.loads(json.dumps(self.run))  # as it will read back

    def due(self, tokens: int) -> bool:
        """Counts `tokens` of progress; True when a checkpoint is due (then the count restarts)."""
        self._since += tokens
        if self._since < self.every:
            return False
        self._since = 0
        return True

    def seconds(self) -> float:
        """Seconds this run has taken so far, the runs it resumed included."""
        return self._earlier + time.perf_counter() - self._started

    def save(self, arrays, progress: dict) -> None:
        """Saves a checkpoint; of several processes (`jax.distributed`), process 0 alone (all resume from it)."""
        import jax

        if jax.process_index() != 0:
            return
        save_stream(
            self.directory, arrays, {"run": self.run, "command": self.command, "seconds": self.seconds(), **progress}
        )

    def resume(self, **layout):
        """(arrays, progress) of this run's last checkpoint, or None if there is none. layout: what else
        determines the results that only the work knows (e.g. batch_size=8), added to the run's identity
        (replacing keys of the same name). A checkpoint of another identity raises a ValueError naming each
        difference, saved then and now."""
        self.run = self.run | json.loads(json.dumps(layout))
        found = load_stream(self.directory)
        if found is None:
            return None
        arrays, progress = found
        theirs, seconds = progress["run"], progress["seconds"]
        if not isinstance(theirs, dict):
            raise ValueError(
                f"{progress.file}: damaged: its 'run' is a {type(theirs).__name__}, not an object; {REMEDY}"
            )
        pairs = {k: (theirs.get(k, _ABSENT), self.run.get(k, _ABSENT)) for k in sorted(self.run.keys() | theirs.keys())}
        differ = [f"{k} ({_brief(saved)}, {_brief(now)})" for k, (saved, now) in pairs.items() if saved != now]
        if differ:
            raise ValueError(
                f"the checkpoint in {self.directory} was written by another run, it differs in (saved, "
                f"now): {'; '.join(differ)}. Resume with what it was run with, or remove it"
            )
        for key in ("run", "command", "seconds"):
            progress.pop(key, None)
        self._earlier, self._started = seconds, time.perf_counter()
        return arrays, progress

    def clear(self) -> None:
        """Removes the checkpoints (the run finished)."""
        shutil.rmtree(self.directory, ignore_errors=True)


def prompts_sha256(prompts) -> str:
    """The sha256 of a sweep's prompts: an iterable of (token ids int [n], question start) in plan order."""
    digest = hashlib.sha256()
    for tokens, question_start in prompts:
        tokens = np.asarray(tokens, np.int64)
        digest.update(np.array([len(tokens), question_start], np.int64).tobytes() + tokens.tobytes())
    return digest.hexdigest()


def finished(progress: Progress, plan: Sequence[tuple], result: type, key: Callable) -> list:
    """The results a checkpoint holds (progress["results"], rebuilt as `result` dataclasses), checked to be the
    first units of `plan` (every unit of the run, in order, as key(result) names a result's): a ValueError
    naming the checkpoint's file otherwise."""
    try:
        results = [result(**r) for r in progress["results"]]
    except TypeError as e:
        raise ValueError(
            f"{progress.file}: damaged: its results are not {result.__name__} records ({e}); {REMEDY}"
        ) from None
    keys = [key(r) for r in results]
    if keys != list(plan[: len(keys)]):
        at = next(i for i, k in enumerate(keys) if i >= len(plan) or k != plan[i])
        raise ValueError(
            f"{progress.file}: its results are not the first units of this run: result {at} is "
            f"{keys[at]}, the run's unit {at} is {plan[at] if at < len(plan) else 'none'}; {REMEDY}"
        )
    return results


def complete(results: Sequence, plan: Sequence[tuple], key: Callable, what: str) -> None:
    """A RuntimeError unless `results` hold every unit of `plan` once, in plan order (key(result) names a
    result's unit): a run never reports fewer, or other, units than it planned as complete."""
    keys = [key(r) for r in results]
    if keys != list(plan):
        missing = [u for u in plan if u not in set(keys)]
        raise RuntimeError(
            f"{what}: {len(keys)} results ({len(set(keys))} distinct units) for the {len(plan)} "
            f"planned units, {len(missing)} of them missing (first: {missing[:1]}); not reported as "
            "a complete run"
        )


def open_run(directory: pathlib.Path, every: int | None, resume: bool, run: dict, command: str) -> Checkpointing | None:
    """A command line's checkpoints in `directory` (its --checkpoint-every `every` tokens, --resume `resume`),
    or None when it saves none. A checkpoint left there by an unfinished run is never ignored: without
    --resume the error names the command that resumes it (as saved with it). Raises ValueError."""
    if resume and every is None:
        raise ValueError("--resume continues a run made with --checkpoint-every N: pass that option again")
    saved = saved_progress(directory)
    if resume and saved is None:
        raise ValueError(f"--resume: no checkpoint in {directory}")
    if saved is not None and not resume:
        raise ValueError(
            f"{directory} holds the checkpoint of an earlier, unfinished run: continue it with "
            f"`{saved.get('command') or 'the same command and --resume'}`, or remove that folder"
        )
    return None if every is None else Checkpointing(directory, every, run, command)
