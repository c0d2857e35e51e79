"""Resumable long runs: checkpoints committed atomically, and resumes that continue exactly or refuse.

Storage. A checkpoint is a pytree of arrays (a cache, the log-likelihoods so far; saved with orbax) plus
JSON progress. `save_stream` writes it into a new generation folder of the checkpoint directory and only
then points the directory's LATEST file at it (`os.replace`, atomic), so a process killed at any moment
leaves either the previous checkpoint or the new one, never a half-written one that loads. `load_stream`
reads the generation LATEST names; older generations and unfinished ones are removed by the next save. A
checkpoint that cannot be read (LATEST naming no generation, a progress.json that is missing, truncated,
not a JSON object or lacks a key the reader needs, arrays orbax cannot restore) raises a ValueError naming
the file and the problem.

What a resume guarantees. A `Checkpointing` carries the run's identity, everything that determines its
results: for the command line every argument, the sha256 of the model's weight files and of its
tokenizer's definition, the devices and mesh, and the software versions (`runner.identity`); the work adds
the batch layout it computes with (`resume(batch_size=...)`). A checkpoint written under another identity
is refused, naming each difference with its saved and its current value. The progress records the finished
units themselves (e.g. passkey trials by (policy, length, bucket, sample)), not a count of batches: on
resume the work checks that they are exactly the first units of its own plan, in order (`finished`), and
skips them; at its end, `complete` checks that the results hold every planned unit once, in plan order.
Same identity means the same batches, so a resumed run's results equal an uninterrupted run's; anything
else raises. A run never reports fewer units than planned as complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import time
from collections.abc import Callable, Sequence

LATEST = "LATEST"
_GENERATION = re.compile(r"generation-\d{8}")
_REMEDY = "remove that folder to start the run over"
_ABSENT = object()  # an identity key one of two runs lacks


class Progress(dict):
    """A checkpoint's JSON progress (a dict); a key it lacks raises a ValueError naming its file."""

    def __init__(self, values: dict, file: pathlib.Path):
        super().__init__(values)
        self.file = file

    def __missing__(self, key):
        raise ValueError(f"{self.file}: damaged: it has no {key!r} (it holds {', '.join(map(repr, self)) or 'nothing'})"
                         f"; {_REMEDY}")


def _generations(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in directory.glob("generation-*") if p.is_dir())


def save_stream(directory: str | pathlib.Path, arrays, progress: dict) -> pathlib.Path:
    """Writes a checkpoint of `arrays` (a pytree of arrays, or None) and `progress` (JSON-serialisable) into
    `directory` (created if needed) and commits it atomically. Returns the generation folder written."""
    import orbax.checkpoint as ocp

    directory = pathlib.Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    done = _generations(directory)
    number = int(done[-1].name.split("-")[1]) + 1 if done else 0
    target = directory / f"generation-{number:08d}"
    target.mkdir()
    if arrays is not None:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(target / "arrays", arrays)
        checkpointer.wait_until_finished()
    _write_synced(target / "progress.json", json.dumps(progress))
    _write_synced(directory / f".{LATEST}.tmp", target.name)
    os.replace(directory / f".{LATEST}.tmp", directory / LATEST)
    for old in done:
        shutil.rmtree(old, ignore_errors=True)
    return target


def _latest(directory: pathlib.Path) -> pathlib.Path | None:
    """The generation folder LATEST names in `directory`, or None without LATEST; ValueError if it names none."""
    latest = directory / LATEST
    if not latest.is_file():
        return None
    try:
        name = latest.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        name = None
    if name is None or not _GENERATION.fullmatch(name) or not (directory / name).is_dir():
        found = ", ".join(p.name for p in _generations(directory)) or "none"
        shown = "bytes that are not text" if name is None else repr(name)
        raise ValueError(f"{latest}: damaged: it names {shown}, which is not a generation folder of {directory} "
                         f"(found: {found}); {_REMEDY}")
    return directory / name


def _progress(target: pathlib.Path) -> Progress:
    """The progress.json of generation folder `target`; ValueError naming it if it is missing or damaged."""
    file = target / "progress.json"
    try:
        progress = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{file}: missing from the checkpoint; {_REMEDY}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: damaged: not UTF-8 text (byte {e.start}); {_REMEDY}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: damaged or truncated: not valid JSON ({e.msg} at line {e.lineno}, column "
                         f"{e.colno}); {_REMEDY}") from None
    if not isinstance(progress, dict):
        raise ValueError(f"{file}: damaged: a JSON {type(progress).__name__}, not an object; {_REMEDY}")
    return Progress(progress, file)


def load_stream(directory: str | pathlib.Path):
    """The last committed checkpoint in `directory` as (arrays, progress), or None if there is none. arrays
    comes back as nested dicts of arrays (a dataclass such as `CacheState` saved as a dict of its fields:
    rebuild it with `CacheState(**arrays[...], kernels=...)`), or None when the checkpoint saved none. progress is a
    `Progress` (a dict). A damaged checkpoint raises a ValueError naming the file and the problem."""
    import orbax.checkpoint as ocp

    target = _latest(pathlib.Path(directory).absolute())
    if target is None:
        return None
    progress = _progress(target)
    if not (target / "arrays").exists():
        return None, progress
    try:
        return ocp.StandardCheckpointer().restore(target / "arrays"), progress
    except Exception as e:  # orbax wraps tensorstore's error (e.g. a missing or truncated chunk file)
        cause = str(e.__cause__ or e).split("\n")[0]
        raise ValueError(f"{target / 'arrays'}: damaged: orbax cannot restore its arrays ({cause}); {_REMEDY}") from e


def saved_progress(directory: str | pathlib.Path) -> Progress | None:
    """The JSON progress of the last committed checkpoint in `directory` (arrays not read), or None."""
    target = _latest(pathlib.Path(directory).absolute())
    return None if target is None else _progress(target)


def _write_synced(path: pathlib.Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


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
        save_stream(self.directory, arrays, {"run": self.run, "command": self.command, "seconds": self.seconds(),
                                             **progress})

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
            raise ValueError(f"{progress.file}: damaged: its 'run' is a {type(theirs).__name__}, not an object; "
                             f"{_REMEDY}")
        pairs = {k: (theirs.get(k, _ABSENT), self.run.get(k, _ABSENT)) for k in sorted(self.run.keys() | theirs.keys())}
        differ = [f"{k} ({_brief(saved)}, {_brief(now)})" for k, (saved, now) in pairs.items() if saved != now]
        if differ:
            raise ValueError(f"the checkpoint in {self.directory} was written by another run, it differs in (saved, "
                             f"now): {'; '.join(differ)}. Resume with what it was run with, or remove it")
        for key in ("run", "command", "seconds"):
            progress.pop(key, None)
        self._earlier, self._started = seconds, time.perf_counter()
        return arrays, progress

    def clear(self) -> None:
        """Removes the checkpoints (the run finished)."""
        shutil.rmtree(self.directory, ignore_errors=True)


def finished(progress: Progress, plan: Sequence[tuple], result: type, key: Callable) -> list:
    """The results a checkpoint holds (progress["results"], rebuilt as `result` dataclasses), checked to be the
    first units of `plan` (every unit of the run, in order, as key(result) names a result's): a ValueError
    naming the checkpoint's file otherwise."""
    try:
        results = [result(**r) for r in progress["results"]]
    except TypeError as e:
        raise ValueError(f"{progress.file}: damaged: its results are not {result.__name__} records ({e}); "
                         f"{_REMEDY}") from None
    keys = [key(r) for r in results]
    if keys != list(plan[: len(keys)]):
        at = next(i for i, k in enumerate(keys) if i >= len(plan) or k != plan[i])
        raise ValueError(f"{progress.file}: its results are not the first units of this run: result {at} is "
                         f"{keys[at]}, the run's unit {at} is {plan[at] if at < len(plan) else 'none'}; {_REMEDY}")
    return results


def complete(results: Sequence, plan: Sequence[tuple], key: Callable, what: str) -> None:
    """A RuntimeError unless `results` hold every unit of `plan` once, in plan order (key(result) names a
    result's unit): a run never reports fewer, or other, units than it planned as complete."""
    keys = [key(r) for r in results]
    if keys != list(plan):
        missing = [u for u in plan if u not in set(keys)]
        raise RuntimeError(f"{what}: {len(keys)} results ({len(set(keys))} distinct units) for the {len(plan)} "
                           f"planned units, {len(missing)} of them missing (first: {missing[:1]}); not reported as "
                           "a complete run")


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
        raise ValueError(f"{directory} holds the checkpoint of an earlier, unfinished run: continue it with "
                         f"`{saved.get('command') or 'the same command and --resume'}`, or remove that folder")
    return None if every is None else Checkpointing(directory, every, run, command)
