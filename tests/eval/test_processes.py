"""--processes N: the command run as N `jax.distributed` processes on localhost (`jcascade.eval.processes`), each
batch's rows split over them, gives one device's results; a process that fails stops the others."""

import contextlib
import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tiny

from jcascade import cli
from jcascade.cli import running
from jcascade.eval import processes
from jcascade.eval.checkpointing import Checkpointing

# RULER: 4 batches of 2 rows (one a process), gathered every second batch (a checkpoint each 4K tokens); passkey:
# batches of 4, 4 and 2 prompts, the last padded to 4 (process 1 computes its padding rows alone), with retention
RULER = [
    "ruler",
    "--tasks",
    "niah_single_1,vt",
    "--policy",
    "cascade",
    "--budget",
    "0.25",
    "--min-length",
    "1K",
    "--max-length",
    "1K",
    "--samples",
    "4",
    "--batch-size",
    "2",
]
PASSKEY = [
    "passkey",
    "--policy",
    "cascade:cache_size=32,sinks=4,stride=32",
    "--min-length",
    "128",
    "--max-length",
    "128",
    "--samples",
    "2",
    "--retention",
    "--batch-size",
    "4",
]


def _one_device(argv, out):
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        cli.main([*argv, "--mesh", "data=1,model=1", "--out", str(out)])
    return json.loads(next(out.glob("*.json")).read_text())


def _processes(argv, out, n=2):
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # one CPU device a process unless XLA_FLAGS says more
    done = subprocess.run(
        [sys.executable, "-m", "jcascade", *argv, "--processes", str(n), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done, (json.loads(next(out.glob("*.json")).read_text()) if done.returncode == 0 else None)


@pytest.mark.slow
def test_ruler_and_passkey_over_two_processes_give_one_devices_results(model_dir, tmp_path):
    ruler_done, ruler = _processes([*RULER, "--model", model_dir, "--checkpoint-every", "4096"], tmp_path / "ruler-2")
    assert ruler_done.returncode == 0, ruler_done.stderr[-3000:]
    expected = _one_device([*RULER, "--model", model_dir], tmp_path / "ruler-1")
    key = lambda r: (r["policy"], r["task"], r["index"], r["output"], r["score"])
    assert len(ruler["results"]) == 8 and list(map(key, ruler["results"])) == list(map(key, expected["results"]))
    assert len({r["output"] for r in expected["results"]}) > 4  # rows that differ: their order is checked
    assert not (tmp_path / "ruler-2" / "checkpoint-ruler").exists()  # its checkpoints, removed at the end

    passkey_done, passkey = _processes([*PASSKEY, "--model", model_dir], tmp_path / "passkey-2")
    assert passkey_done.returncode == 0, passkey_done.stderr[-3000:]
    expected = _one_device([*PASSKEY, "--model", model_dir], tmp_path / "passkey-1")
    key = lambda r: (r["policy"], r["bucket"], r["sample"], r["answer"], r["retention"])
    assert len(passkey["results"]) == 10 and list(map(key, passkey["results"])) == list(map(key, expected["results"]))


def test_each_process_takes_its_part_of_the_rows_in_order(monkeypatch):
    import jax

    model = tiny.model(97)  # on one device: split over processes when there are several
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    parts = []
    for i in range(3):
        monkeypatch.setattr(jax, "process_index", lambda i=i: i)
        parts.append(processes.mine(np.arange(12), model).tolist())
    assert parts == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(ValueError, match="a batch of 7 rows does not split over 3 processes"):
        processes.mine(list(range(7)), model)
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    assert processes.mine(list(range(7)), model) == list(range(7))


def test_only_process_0_writes_results_and_checkpoints(monkeypatch, tmp_path):
    import jax

    args = cli.parse(["ruler", "--out", str(tmp_path / "out")])
    checkpointing = Checkpointing(tmp_path / "checkpoint", 1, {})
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    running.finish(args, {"results": []}, "table", [])
    checkpointing.save(None, {"results": []})
    assert not (tmp_path / "out" / "ruler.json").exists() and not (tmp_path / "checkpoint").exists()
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    running.finish(args, {"results": []}, "table", [])
    checkpointing.save(None, {"results": []})
    assert (tmp_path / "out" / "ruler.json").exists() and (tmp_path / "checkpoint").exists()


def test_a_failing_process_stops_the_others_and_its_error_is_shown():
    fail_second = (
        "import os, sys, time\n"
        "if os.environ['JCASCADE_PROCESS'] == '1/3':\n"
        "    sys.exit('process 1 gives up')\n"
        "time.sleep(120)"
    )
    logged, start = [], time.perf_counter()
    assert processes.launch(["-c", fail_second], 3, logged.append) == 1
    assert time.perf_counter() - start < 60  # the two others, sleeping for 120 s, were stopped
    assert (
        len(logged) == 1
        and logged[0].startswith("process 1 of 3 failed (exit code 1)")
        and "process 1 gives up" in logged[0]
    )
    assert processes.launch(["-c", "pass"], 2) == 0
    with pytest.raises(ValueError, match="processes must be an int >= 2, got 1"):
        processes.launch(["-c", "pass"], 1)
