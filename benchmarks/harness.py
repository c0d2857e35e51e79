"""The benchmarks' one harness: timing (warm-up, device sync, repeats, median and spread, peak device memory), a
stopwatch for marks inside one long run, and the JSON every script writes (with the commit, device and versions).

    timing = harness.time_it(f, x, repeats=10)     # one untimed call of f(x), then 10 timed
    timing.median, timing.spread, timing.peak_bytes
    out, seconds = harness.time_once(f, x)        # one call, its compilation included
    harness.write_json(path, dict(benchmark="update", rows=rows))

Work is timed until its outputs are computed, as `sync` waits for them: JAX (the default) or TORCH. The harness
imports JAX only where it waits for JAX work, names JAX's device or writes JSON (through jcascade), so that a
process of torch alone (kvpress's side, FlashInfer's) times with it too.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import pathlib
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
VERSIONS = ("jax", "jaxlib", "flax", "torch")  # recorded where installed


@dataclasses.dataclass(frozen=True)
class Sync:
    """A library's device work: `wait(outputs)` returns them once computed; `peak_bytes()` is the most device
    memory this process has held so far (a high-water mark, never reset between calls), None where the backend
    does not report it."""

    wait: Callable[[Any], Any]
    peak_bytes: Callable[[], int | None]


def _jax_wait(outputs):
    import jax

    return jax.block_until_ready(outputs)


def _jax_peak_bytes() -> int | None:
    """The largest peak_bytes_in_use of this process's devices."""
    import jax

    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    return max((p for p in peaks if p is not None), default=None)


def _torch_wait(outputs):
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return outputs


def _torch_peak_bytes() -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


JAX = Sync(_jax_wait, _jax_peak_bytes)
TORCH = Sync(_torch_wait, _torch_peak_bytes)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Timed repeats of one call: seconds[i] is repeat i's wall time per call; peak_bytes the device memory
    high-water mark after them (`Sync.peak_bytes`)."""

    seconds: tuple[float, ...]
    peak_bytes: int | None

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def min(self) -> float:
        return min(self.seconds)

    @property
    def max(self) -> float:
        return max(self.seconds)

    @property
    def spread(self) -> float:
        """The interquartile range of the repeats' seconds (0 for one repeat)."""
        if len(self.seconds) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.seconds, n=4, method="inclusive")
        return q3 - q1


class Stopwatch:
    """Wall-clock seconds since it was made: marks inside one long run (a prefill's elapsed time at 32K, 128K
    and 1M tokens, a sweep's batches as they end)."""

    def __init__(self):
        self.start = time.perf_counter()

    def elapsed(self, outputs=None, sync: Sync = JAX) -> float:
        """Seconds since the start, read once `outputs` are computed."""
        sync.wait(outputs)
        return time.perf_counter() - self.start


def time_once(fn: Callable, *args, sync: Sync = JAX) -> tuple[Any, float]:
    """(fn(*args), its seconds): one call, timed until its outputs are computed (a first call's seconds hold its
    compilation; `lambda: jitted.lower(...).compile()` times the compilation alone)."""
    watch = Stopwatch()
    out = fn(*args)
    return out, watch.elapsed(out, sync)


def time_phases(
    phases: Sequence[Callable[[], Any]], *, warmup: int = 1, repeats: int = 5, calls: int = 1, sync: Sync = JAX
) -> list[Timing]:
    """A Timing per phase of a procedure whose phases run in turn, each from the state the one before left (a block
    of decode steps, then the step that refreshes the cache): `warmup` untimed rounds of one call of each phase
    (compilation happens there), then `repeats` timed rounds, in which each phase is called `calls` times and
    timed until its last call's outputs are computed; its seconds over `calls` are the repeat's (calls > 1: the
    calls queue on the device back to back, the host's dispatch of each hidden behind the one before)."""
    for _ in range(warmup):
        for phase in phases:
            sync.wait(phase())
    seconds = [[] for _ in phases]
    for _ in range(repeats):
        for phase, times in zip(phases, seconds):
            watch = Stopwatch()
            for _ in range(calls):
                out = phase()
            times.append(watch.elapsed(out, sync) / calls)
    peak = sync.peak_bytes()
    return [Timing(tuple(times), peak) for times in seconds]


def time_it(fn: Callable, *args, warmup: int = 1, repeats: int = 5, calls: int = 1, sync: Sync = JAX) -> Timing:
    """Seconds per call of fn(*args): `warmup` untimed calls, then `repeats` timed repeats of `calls` calls
    (`time_phases` of one phase). A function that carries state from call to call (a donated cache) closes over
    it."""
    return time_phases([lambda: fn(*args)], warmup=warmup, repeats=repeats, calls=calls, sync=sync)[0]


def _git(*args: str) -> str | None:
    """git's output in this checkout, None outside one (or without git)."""
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def run_info(device: str | None = None) -> dict:
    """What a result was measured with: date; commit (this checkout's HEAD, None outside a git checkout) and dirty
    (tracked files differ from it); device (JAX's first device's kind, or `device`: the name a process that leaves
    the device to its workers has from them); the versions of jax, jaxlib, flax and torch installed."""
    commit = _git("rev-parse", "HEAD")
    changed = None if commit is None else _git("--no-optional-locks", "status", "--porcelain", "--untracked-files=no")
    if device is None:
        import jax

        device = jax.devices()[0].device_kind
    dirty = None if changed is None else bool(changed)
    info = dict(date=time.strftime("%Y-%m-%d"), commit=commit, dirty=dirty, device=device)
    for name in VERSIONS:
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return info


def write_json(path: str | pathlib.Path, result: dict, device: str | None = None) -> None:
    """Writes `run_info(device)` and then `result` to `path` (its folder made) as strict JSON
    (`jcascade.eval.report.json_text`: a number that is not finite is written as null, with a "<key>_reason")."""
    from jcascade.eval.report import json_text

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json_text(run_info(device) | result))
