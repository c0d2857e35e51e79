"""--processes N: the command run as N `jax.distributed` processes on localhost (`jcascade.eval.processes`), each
batch's rows split over them, gives one device's results; a process that fails stops the others."""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from jcascade import cli
from jcascade.eval import processes

RULER = ["ruler", "--tasks", "niah_single_1,vt", "--policy", "cascade", "--budget", "0.25", "--min-length", "1K",
         "--max-length", "1K", "--samples", "4"]
PASSKEY = ["passkey", "--policy", "cascade:cache_size=32,sinks=4,stride=32", "--min-length", "128", "--max-length",
           "128", "--samples", "2", "--retention"]


def _one_device(argv, out):
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        cli.main([*argv, "--mesh", "data=1,model=1", "--out", str(out)])
    return json.loads(next(out.glob("*.json")).read_text())


def _processes(argv, out, n=2):
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # one CPU device a process unless XLA_FLAGS says more
    done = subprocess.run([sys.executable, "-m", "jcascade", *argv, "--processes", str(n), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    return done, (json.loads(next(out.glob("*.json")).read_text()) if done.returncode == 0 else None)


@pytest.mark.slow
def test_ruler_and_passkey_over_two_processes_give_one_devices_results(model_dir, tmp_path):
    ruler_done, ruler = _processes([*RULER, "--model", model_dir, "--checkpoint-every", "2048"], tmp_path / "ruler-2")
    assert ruler_done.returncode == 0, ruler_done.stderr[-3000:]
    expected = _one_device([*RULER, "--model", model_dir], tmp_path / "ruler-1")
    key = lambda r: (r["policy"], r["task"], r["index"], r["output"], r["score"])  # noqa: E731
    assert len(ruler["results"]) == 8 and list(map(key, ruler["results"])) == list(map(key, expected["results"]))
    assert ruler_done.stdout.count("wrote ") == 1  # process 0 alone writes and prints
    assert not (tmp_path / "ruler-2" / "checkpoint-ruler").exists()  # its checkpoints, removed at the end

    passkey_done, passkey = _processes([*PASSKEY, "--model", model_dir], tmp_path / "passkey-2")
    assert passkey_done.returncode == 0, passkey_done.stderr[-3000:]
    expected = _one_device([*PASSKEY, "--model", model_dir], tmp_path / "passkey-1")
    key = lambda r: (r["policy"], r["bucket"], r["sample"], r["answer"], r["retention"])  # noqa: E731
    assert len(passkey["results"]) == 10 and list(map(key, passkey["results"])) == list(map(key, expected["results"]))


def test_rows_that_do_not_split_over_the_processes_are_refused(model_dir, tmp_path):
    done, _ = _processes([*RULER, "--model", model_dir, "--batch-size", "3"], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "--batch-size 3 must be a multiple of the mesh's data axis or of --processes (2)" in done.stderr


def test_a_failing_process_stops_the_others_and_its_error_is_shown():
    fail_second = ("import os, sys, time\n"
                   "if os.environ['JCASCADE_PROCESS'] == '1/3':\n"
                   "    sys.exit('process 1 gives up')\n"
                   "time.sleep(120)")
    logged = []
    assert processes.launch(["-c", fail_second], 3, logged.append) == 1
    assert len(logged) == 1 and logged[0].startswith("process 1 of 3 failed (exit code 1)") \
        and "process 1 gives up" in logged[0]
    assert processes.launch(["-c", "pass"], 2) == 0
    with pytest.raises(ValueError, match="processes must be an int >= 2, got 1"):
        processes.launch(["-c", "pass"], 1)
