"""A long stream's checkpoints on disk, committed atomically: `jc.save_stream` and `jc.load_stream`.

A checkpoint is a pytree of arrays (a cache, the log-likelihoods so far; saved with orbax) plus JSON
progress. `save_stream` writes it into a new generation folder of the checkpoint directory and only
then points the directory's LATEST file at it (`os.replace`, atomic), so a process killed at any moment
leaves either the previous checkpoint or the new one, never a half-written one that loads. `load_stream`
reads the generation LATEST names; older generations and unfinished ones are removed by the next save. A
checkpoint that cannot be read (LATEST naming no generation, a progress.json that is missing, truncated,
not a JSON object or lacks a key the reader needs, arrays orbax cannot restore) raises a ValueError naming
the file and the problem. A run resumed from its checkpoints, and another run's refused:
`jcascade.eval.checkpointing`.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil

LATEST = "LATEST"
REMEDY = "remove that folder to start the run over"  # what every error about a checkpoint's folder advises
_GENERATION = re.compile(r"generation-\d{8}")


class Progress(dict):
    """A checkpoint's JSON progress (a dict); a key it lacks raises a ValueError naming its file."""

    def __init__(self, values: dict, file: pathlib.Path):
        super().__init__(values)
        self.file = file

    def __missing__(self, key):
        raise ValueError(
            f"{self.file}: damaged: it has no {key!r} (it holds {', '.join(map(repr, self)) or 'nothing'}); {REMEDY}"
        )


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
        raise ValueError(
            f"{latest}: damaged: it names {shown}, which is not a generation folder of {directory} "
            f"(found: {found}); {REMEDY}"
        )
    return directory / name


def _progress(target: pathlib.Path) -> Progress:
    """The progress.json of generation folder `target`; ValueError naming it if it is missing or damaged."""
    file = target / "progress.json"
    try:
        progress = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{file}: missing from the checkpoint; {REMEDY}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: damaged: not UTF-8 text (byte {e.start}); {REMEDY}") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{file}: damaged or truncated: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); {REMEDY}"
        ) from None
    if not isinstance(progress, dict):
        raise ValueError(f"{file}: damaged: a JSON {type(progress).__name__}, not an object; {REMEDY}")
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
        raise ValueError(f"{target / 'arrays'}: damaged: orbax cannot restore its arrays ({cause}); {REMEDY}") from e


def saved_progress(directory: str | pathlib.Path) -> Progress | None:
    """The JSON progress of the last committed checkpoint in `directory` (arrays not read), or None."""
    target = _latest(pathlib.Path(directory).absolute())
    return None if target is None else _progress(target)


def _write_synced(path: pathlib.Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
