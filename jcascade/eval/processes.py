"""Rows over processes of one device each, on one host (`jcascade ruler | passkey | compare --processes N`):
`launch` starts N copies of a command, each of which calls `join` first to become process i of a
`jax.distributed` group on localhost, with device i alone (GPU i; on the CPU, each process's own CPU devices).

Each process holds the whole model on its device and computes its share of every batch's rows (`mine`, in
order: process i the i-th of N equal parts), with no collective inside the computation: each decodes until its
own rows are done. The sweeps keep their batches' rows and gather them into every process only where they need
every row (`gather_batches`, one collective for all batches since the last: at a checkpoint and at the end), so
each process runs its batches at its own pace, not waiting at every batch for the process whose rows decode the
longest. RULER's prompts are built once, a share in each process, and exchanged (`built_once`). A row's result
does not depend on the other rows of its call, so the results are one device's
(tests/eval/test_processes.py on the CPU; identical RULER outputs on four GPUs, docs/results/multi-gpu.md). Process 0
keeps the terminal and writes the results and checkpoints; the others print nothing unless they fail.

Why: one process driving four GPUs loses a tenth to a third of data parallelism's throughput, likely to the host
issuing each decode step's thousand small kernels to every device (docs/multi-device.md); N processes issue theirs
side by side. Why rows and not one mesh over the processes: on a mesh the decode loop stops on a reduction over
every process at every step, where split rows need one collective per checkpoint.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np

ENV = "JCASCADE_PROCESS"  # "i/N" in the environment of launched process i of N


def launched() -> bool:
    """Whether this process was started by `launch`."""
    return ENV in os.environ


def join() -> None:
    """In a process started by `launch`, before jax touches any device: joins the `jax.distributed` group on
    localhost as process i of N with device i only (`local_device_ids`; CPU collectives over gloo). Raises a
    RuntimeError where the process was not launched."""
    import jax

    if not launched():
        raise RuntimeError(f"join() is for processes started by launch() ({ENV} is not set)")
    process, processes = map(int, os.environ[ENV].split("/"))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], processes, process, local_device_ids=[process])


def splits(model) -> bool:
    """Whether `model`'s batches are split over processes: several processes (`jax.distributed`) and a model on
    one device in each (no mesh; a model on a mesh over all processes' devices computes every row as one)."""
    import jax

    return jax.process_count() > 1 and getattr(model, "mesh", None) is None


def mine(rows, model):
    """This process's part of `rows` (a sequence or array, rows first) where `model` splits over processes
    (`splits`): the i-th of N equal parts; else all of them. Raises ValueError if N does not divide the rows."""
    import jax

    if not splits(model):
        return rows
    n, i = jax.process_count(), jax.process_index()
    if len(rows) % n:
        raise ValueError(f"a batch of {len(rows)} rows does not split over {n} processes: use a multiple of {n}")
    part = len(rows) // n
    return rows[i * part : (i + 1) * part]


def gather_batches(parts: list, model) -> list:
    """The full rows of each batch where `model` splits over processes (`splits`): `parts` holds this process's
    rows of each batch (`mine`): numpy arrays, or tuples of them and None, of one shape for every batch and
    process. Returns each batch's rows of every process, in process order, gathered in one collective as bytes
    (so every dtype arrives exactly: float64 too, which jax would narrow). Else `parts`."""
    if not splits(model) or not parts:
        return parts
    import jax
    from jax.experimental import multihost_utils

    stacked = jax.tree.map(lambda *batches: np.stack(batches), *parts)  # leaves [batches, rows / N, ...]
    as_bytes = jax.tree.map(lambda x: x.reshape(*x.shape[:2], -1).view(np.uint8), stacked)
    everyone = multihost_utils.process_allgather(as_bytes, tiled=False)  # leaves [N, batches, rows / N, bytes]
    return [
        jax.tree.map(
            lambda rows, x: np.asarray(rows[:, b]).reshape(-1, rows.shape[3]).view(x.dtype).reshape(-1, *x.shape[2:]),
            everyone,
            stacked,
        )
        for b in range(len(parts))
    ]


def built_once(build: Callable[[object], object], units: Sequence, model) -> list:
    """[build(u) for u in units]; where `model` splits over processes (`splits`), each process builds every N-th
    unit (process i: units i, i + N, ...) and the built items are exchanged (pickled, one collective), so each
    is built once, not once a process. The items must pickle, and what build(u) returns must not depend on what
    it built before. Raises ValueError where a process's items take 2 GiB or more pickled."""
    if not splits(model):
        return [build(u) for u in units]
    import jax
    from jax.experimental import multihost_utils

    n, i = jax.process_count(), jax.process_index()
    mine = np.frombuffer(pickle.dumps([build(u) for u in units[i::n]]), np.uint8)
    if len(mine) >= 2**31:
        raise ValueError(
            f"built_once: {len(units[i::n])} items take {len(mine)} bytes pickled, over the 2 GiB "
            "one exchange takes; build fewer at once"
        )
    sizes = multihost_utils.process_allgather(np.array(len(mine), np.int32))  # [N]
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: len(mine)] = mine
    shares = [
        pickle.loads(row[:size].tobytes()) for row, size in zip(multihost_utils.process_allgather(padded), sizes)
    ]  # [N, most]
    return [shares[j % n][j // n] for j in range(len(units))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(command: list[str], processes: int, log=print) -> int:
    """Runs `python command...` as `processes` processes (each calls `join`) and waits for them; returns 0, or
    the exit code of the first that failed (128 + N for one killed by signal N; the others are then stopped and
    its error output is logged; process 0's goes to this terminal). Process 0 inherits stdout and stderr, the
    others print nothing. SIGTERM and SIGHUP stop them all too."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 2:
        raise ValueError(f"processes must be an int >= 2, got {processes!r}")
    address = f"localhost:{_free_port()}"
    errors = {i: tempfile.TemporaryFile() for i in range(1, processes)}  # process 0 writes to the terminal
    stop = lambda signum, _: sys.exit(128 + signum)  # so that `finally` stops the processes
    handlers = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    started = [
        subprocess.Popen(
            [sys.executable, *command],
            env=os.environ | {ENV: f"{i}/{processes}", "JAX_COORDINATOR_ADDRESS": address},
            stdout=None if i == 0 else subprocess.DEVNULL,
            stderr=errors.get(i),
        )
        for i in range(processes)
    ]
    try:
        while True:
            codes = [p.poll() for p in started]
            failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is not None:
                code = codes[failed] if codes[failed] > 0 else 128 - codes[failed]
                if failed:
                    errors[failed].seek(0)
                    log(
                        f"process {failed} of {processes} failed (exit code {code}):\n"
                        + errors[failed].read().decode(errors="backslashreplace")[-4000:]
                    )
                return code
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.1)
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in errors.values():
            f.close()
        for s, handler in handlers.items():
            signal.signal(s, handler)
