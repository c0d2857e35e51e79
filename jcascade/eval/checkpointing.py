"""Resumable long runs: checkpoints of a stream's state, committed atomically.

A checkpoint is a pytree of arrays (a cache, the log-likelihoods so far; saved with orbax) plus JSON
progress. `save_stream` writes it into a new generation folder of the checkpoint directory and only then
points the directory's LATEST file at it (`os.replace`, atomic), so a process killed at any moment leaves
either the previous checkpoint or the new one, never a half-written one that loads. `load_stream` reads
the generation LATEST names; older generations and unfinished ones are removed by the next save.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import time

LATEST = "LATEST"


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


def load_stream(directory: str | pathlib.Path):
    """The last committed checkpoint in `directory` as (arrays, progress), or None if there is none. arrays
    comes back as nested dicts of arrays (a dataclass such as `CacheState` saved as a dict of its fields:
    rebuild it with `CacheState(**arrays[...])`), or None when the checkpoint saved none."""
    import orbax.checkpoint as ocp

    directory = pathlib.Path(directory).absolute()
    if not (directory / LATEST).is_file():
        return None
    target = directory / (directory / LATEST).read_text().strip()
    progress = json.loads((target / "progress.json").read_text())
    if not (target / "arrays").exists():
        return None, progress
    return ocp.StandardCheckpointer().restore(target / "arrays"), progress


def saved_progress(directory: str | pathlib.Path) -> dict | None:
    """The JSON progress of the last committed checkpoint in `directory` (arrays not read), or None."""
    directory = pathlib.Path(directory).absolute()
    if not (directory / LATEST).is_file():
        return None
    return json.loads((directory / (directory / LATEST).read_text().strip() / "progress.json").read_text())


def _write_synced(path: pathlib.Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@dataclasses.dataclass
class Checkpointing:
    """Periodic checkpoints of one run: `save` every `every` tokens of progress into `directory`.

    run: the run's identity (its arguments, JSON-serialisable); `resume` refuses a checkpoint that
    another run wrote. command: the command line that resumes the run (saved with every checkpoint, shown
    when a leftover checkpoint is found). `seconds()` counts the run's time across resumes.
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

    def resume(self):
        """(arrays, progress) of this run's last checkpoint, or None if there is none."""
        found = load_stream(self.directory)
        if found is None:
            return None
        arrays, progress = found
        theirs = progress.pop("run")
        progress.pop("command", None)
        if theirs != self.run:
            differ = sorted(k for k in self.run.keys() | theirs.keys() if self.run.get(k) != theirs.get(k))
            raise ValueError(f"the checkpoint in {self.directory} was written by another run (it differs in "
                             f"{', '.join(differ)}): remove it, or resume with the same arguments")
        self._earlier = progress.pop("seconds", 0.0)
        self._started = time.perf_counter()
        return arrays, progress

    def clear(self) -> None:
        """Removes the checkpoints (the run finished)."""
        shutil.rmtree(self.directory, ignore_errors=True)


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
