"""Resumable runs: checkpoints commit atomically, a resumed stream equals an uninterrupted one, and a
`jcascade perplexity` run killed with SIGKILL then resumed writes the same results."""

import json
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

import jcascade as jc
import tiny
from jcascade import cli
from jcascade.eval import passkey, perplexity, checkpointing

SINK = "sink:window=32,sinks=4,stride=32"
CASCADE = "cascade:cache_size=32,sinks=4,stride=32"


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    path = tmp_path_factory.mktemp("books") / "grass.txt"
    words = np.random.default_rng(0).choice(["grass", "green", "sky", "blue", "sun", "is", "the", "."], 3000)
    path.write_text(" ".join(words))
    return str(path)


def test_a_checkpoint_round_trips_exactly(tmp_path):
    state = jc.init_cache(jc.Full(), 1, 2, 4, jnp.bfloat16, max_tokens=8)
    state = jc.CacheState(k=state.k + jnp.bfloat16(1.5), v=state.v, score=state.score + 0.25,
                          pos=state.pos.at[..., 0].set(7), seen=state.seen + 1)
    assert checkpointing.load_stream(tmp_path / "none") is None
    checkpointing.save_stream(tmp_path / "c", {"cache": vars(state), "logps": np.arange(5, dtype=np.float32)}, {"at": 3})
    arrays, progress = checkpointing.load_stream(tmp_path / "c")
    restored = jc.CacheState(**arrays["cache"])
    for name in ("k", "v", "score", "pos", "seen"):
        got, want = np.asarray(getattr(restored, name)), np.asarray(getattr(state, name))
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert np.array_equal(arrays["logps"], np.arange(5)) and progress == {"at": 3}
    checkpointing.save_stream(tmp_path / "p", None, {"only": "progress"})
    assert checkpointing.load_stream(tmp_path / "p") == (None, {"only": "progress"})


def test_a_checkpoint_cut_short_never_loads(tmp_path, monkeypatch):
    checkpointing.save_stream(tmp_path, {"x": np.ones(3)}, {"n": 1})

    def killed(*args):
        raise KeyboardInterrupt("killed before the commit")

    with monkeypatch.context() as m:
        m.setattr(checkpointing.os, "replace", killed)
        with pytest.raises(KeyboardInterrupt):
            checkpointing.save_stream(tmp_path, {"x": np.zeros(3)}, {"n": 2})
    (tmp_path / "generation-00000009").mkdir()  # a folder left half-written by a killed process
    arrays, progress = checkpointing.load_stream(tmp_path)
    assert progress == {"n": 1} and np.array_equal(arrays["x"], np.ones(3))
    checkpointing.save_stream(tmp_path, {"x": np.full(3, 5.0)}, {"n": 3})
    assert checkpointing.load_stream(tmp_path)[1] == {"n": 3}
    assert len(list(tmp_path.glob("generation-*"))) == 1  # the old and the unfinished ones are gone


def test_another_runs_checkpoint_is_refused(tmp_path):
    checkpointing.Checkpointing(tmp_path, 10, {"seed": 1, "policy": "a"}).save(None, {})
    with pytest.raises(ValueError, match="written by another run .*differs in seed"):
        checkpointing.Checkpointing(tmp_path, 10, {"seed": 2, "policy": "a"}).resume()
    with pytest.raises(ValueError, match="checkpoint every must be a positive int"):
        checkpointing.Checkpointing(tmp_path, 0, {})


def test_a_stream_resumed_from_any_chunk_equals_the_whole_stream():
    model = tiny.model(97, seed=3)
    tokens = np.random.default_rng(1).integers(0, 97, 300)
    policy = jc.Cascade(cache_size=32, sinks=4, num_cascades=2, stride=32)
    points = []
    whole = perplexity.stream(model, policy, tokens, after_chunk=lambda p: points.append(
        (p[0], p[1].copy(), p[2])))
    assert [p[2] for p in points] == list(range(32, 300, 32))  # every chunk but the last
    for point in (points[0], points[4], points[-1]):
        assert np.array_equal(perplexity.stream(model, policy, tokens, start=point), whole)
    with pytest.raises(ValueError, match="start does not belong to this stream"):
        perplexity.stream(model, policy, tokens[:200], start=points[0])


def results_of(out) -> dict:
    found = json.loads((out / "perplexity.json").read_text())
    del found["seconds"]
    return found


@pytest.mark.slow
def test_perplexity_killed_and_resumed_equals_an_uninterrupted_run(model_dir, book, tmp_path, capsys):
    args = ["perplexity", "--model", model_dir, "--book", book, "--policy", SINK, "--policy", CASCADE,
            "--checkpoint-every", "64"]
    cli.main(args[:-2] + ["--out", str(tmp_path / "whole")])

    out = tmp_path / "killed"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.Popen([sys.executable, "-m", "jcascade", *args, "--out", str(out)], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    checkpoint = out / "checkpoint-perplexity"
    deadline = time.monotonic() + 120
    while not len(list(checkpoint.glob("generation-*"))) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # a few more checkpoints, then the kill lands anywhere
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert run.returncode == -signal.SIGKILL, run.stderr.read().decode()[-2000:]
    assert not (out / "perplexity.json").exists()
    saved = checkpointing.load_stream(checkpoint)[1]
    assert saved["position"] > 0  # it was killed mid-run

    for again in (args, args[:-2]):  # a checkpoint is there: never start over silently, with or without
        with pytest.raises(SystemExit):  # --checkpoint-every; name the command that resumes it
            cli.main(again + ["--out", str(out)])
        err = " ".join(capsys.readouterr().err.split())
        assert f"holds the checkpoint of an earlier, unfinished run: continue it with `jcascade {args[0]}" in err
        assert f"--out {out} --resume`" in err
    cli.main(args + ["--out", str(out), "--resume"])
    assert results_of(out) == results_of(tmp_path / "whole")
    assert not checkpoint.exists()  # removed once the run finished


def test_passkey_interrupted_and_resumed_equals_an_uninterrupted_run(model_dir, tmp_path, monkeypatch):
    args = ["passkey", "--model", model_dir, "--policy", SINK, "--policy", CASCADE, "--min-length", "128",
            "--max-length", "256", "--samples", "2", "--batch-size", "3", "--checkpoint-every", "300"]
    cli.main(args + ["--out", str(tmp_path / "whole")])
    answer, calls = passkey.answer, []

    def dies_at_the_fifth_batch(*a, **k):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt("killed")
        return answer(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(passkey, "answer", dies_at_the_fifth_batch)
        with pytest.raises(KeyboardInterrupt):
            cli.main(args + ["--out", str(tmp_path / "cut")])
    # batches of 3, 3, 3 and 1 prompts of 128 tokens: the fourth is short of the 300 tokens between checkpoints
    saved = checkpointing.load_stream(tmp_path / "cut" / "checkpoint-passkey")[1]
    assert saved["batches"] == 3 and saved["command"].endswith(f"--out {tmp_path / 'cut'} --resume")
    saved_seconds = saved["seconds"]
    assert saved_seconds > 0

    def counted(*a, **k):
        calls.append(1)
        return answer(*a, **k)

    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(passkey, "answer", counted)
        cli.main(args + ["--out", str(tmp_path / "cut"), "--resume"])
    assert len(calls) == 2 * 2 * 4 - 3  # policies x lengths x batches, less the saved ones
    whole, cut = (json.loads((tmp_path / d / "passkey.json").read_text()) for d in ("whole", "cut"))
    assert cut["seconds"] > saved_seconds  # the time of the run it resumed counts
    del whole["seconds"], cut["seconds"]
    assert cut == whole


@pytest.mark.parametrize("extra,message", [
    (["--resume"], "--resume continues a run made with --checkpoint-every N"),
    (["--resume", "--checkpoint-every", "1K"], "--resume: no checkpoint in"),
])
def test_resume_arguments_are_checked(model_dir, book, tmp_path, extra, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["perplexity", "--model", model_dir, "--book", book, "--policy", SINK, "--out", str(tmp_path),
                  *extra])
    assert message in capsys.readouterr().err
