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


def _write_synced(path: pathlib.Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@dataclasses.dataclass
class Checkpointing:
    """Periodic checkpoints of one run: `save` every `every` tokens of progress into `directory`.

    run: the run's identity (its arguments, JSON-serialisable); `resume` refuses a checkpoint that
    another run wrote.
    """

    directory: pathlib.Path
    every: int
    run: dict
    _since: int = dataclasses.field(default=0, init=False, repr=False)  # tokens since the last checkpoint

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

    def save(self, arrays, progress: dict) -> None:
        save_stream(self.directory, arrays, {"run": self.run, **progress})

    def resume(self):
        """(arrays, progress) of this run's last checkpoint, or None if there is none."""
        found = load_stream(self.directory)
        if found is None:
            return None
        arrays, progress = found
        theirs = progress.pop("run")
        if theirs != self.run:
            differ = sorted(k for k in self.run.keys() | theirs.keys() if self.run.get(k) != theirs.get(k))
            raise ValueError(f"the checkpoint in {self.directory} was written by another run (it differs in "
                             f"{', '.join(differ)}): remove it, or resume with the same arguments")
        return arrays, progress

    def clear(self) -> None:
        """Removes the checkpoints (the run finished)."""
        shutil.rmtree(self.directory, ignore_errors=True)
