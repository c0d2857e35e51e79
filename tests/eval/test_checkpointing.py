"""Resumable runs: checkpoints commit atomically, a resumed stream equals an uninterrupted one, and a
`jcascade perplexity` run killed with SIGKILL then resumed writes the same results."""

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
import tiny

import jcascade as jc
from jcascade import cli
from jcascade.eval import checkpointing, passkey, perplexity, runner

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
    state = dataclasses.replace(
        state,
        k=jc.Stored(state.k.data + jnp.bfloat16(1.5)),
        score=state.score + 0.25,
        pos=state.pos.at[..., 0].set(7),
        seen=state.seen + 1,
    )
    assert checkpointing.load_stream(tmp_path / "none") is None
    # the keys and values as their arrays (a cache in the model's dtype: no scales)
    array = lambda state, name: getattr(state, name).data if name in ("k", "v") else getattr(state, name)
    arrays = {name: array(state, name) for name in ("k", "v", "score", "pos", "seen")}
    checkpointing.save_stream(tmp_path / "c", {"cache": arrays, "logps": np.arange(5, dtype=np.float32)}, {"at": 3})
    arrays, progress = checkpointing.load_stream(tmp_path / "c")
    cache = arrays["cache"] | {name: jc.Stored(arrays["cache"][name]) for name in ("k", "v")}
    restored = jc.CacheState(**cache, kernels=state.kernels)
    for name in ("k", "v", "score", "pos", "seen"):
        got, want = np.asarray(array(restored, name)), np.asarray(array(state, name))
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert np.array_equal(arrays["logps"], np.arange(5)) and progress == {"at": 3}
    checkpointing.save_stream(tmp_path / "p", None, {"only": "progress"})
    assert checkpointing.load_stream(tmp_path / "p") == (None, {"only": "progress"})


def test_a_checkpoint_cut_short_never_loads(tmp_path, monkeypatch):
    checkpointing.save_stream(tmp_path, {"x": np.ones(3)}, {"n": 1})

    def killed(*args):
        raise KeyboardInterrupt("killed before the commit")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", killed)
        with pytest.raises(KeyboardInterrupt):
            checkpointing.save_stream(tmp_path, {"x": np.zeros(3)}, {"n": 2})
    (tmp_path / "generation-00000009").mkdir()  # a folder left half-written by a killed process
    arrays, progress = checkpointing.load_stream(tmp_path)
    assert progress == {"n": 1} and np.array_equal(arrays["x"], np.ones(3))
    checkpointing.save_stream(tmp_path, {"x": np.full(3, 5.0)}, {"n": 3})
    assert checkpointing.load_stream(tmp_path)[1] == {"n": 3}
    assert len(list(tmp_path.glob("generation-*"))) == 1  # the old and the unfinished ones are gone


def test_another_runs_checkpoint_is_refused_naming_each_difference_saved_and_now(tmp_path):
    first = checkpointing.Checkpointing(tmp_path, 10, {"seed": 1, "policy": "a", "model_sha256": "0" * 64})
    first.resume(batch_size=8)  # the work adds its batch layout to the run's identity
    first.save(None, {})
    with pytest.raises(
        ValueError,
        match=r"written by another run, it differs in \(saved, now\): batch_size \(8, 16\); "
        r"model_sha256 \(\"0{44}\.\.\., \"1{44}\.\.\.\); seed \(1, 2\); tokenizer_sha256 \(absent, "
        r"\"2{44}\.\.\.\)\. Resume with what it was run with, or remove it",
    ):
        checkpointing.Checkpointing(
            tmp_path, 10, {"seed": 2, "policy": "a", "model_sha256": "1" * 64, "tokenizer_sha256": "2" * 64}
        ).resume(batch_size=16)
    same = checkpointing.Checkpointing(tmp_path, 10, {"seed": 1, "policy": "a", "model_sha256": "0" * 64})
    assert same.resume(batch_size=8) == (None, {})
    with pytest.raises(ValueError, match="checkpoint every must be a positive int"):
        checkpointing.Checkpointing(tmp_path, 0, {})


def test_the_run_identity_holds_the_model_content_the_tokenizer_and_the_devices(model_dir, tmp_path):
    """The model by the bytes of the files it loads from (a copy elsewhere is the same model; one changed byte
    of a weight file, same name and size, is another), the tokenizer by its definition, the devices."""
    import shutil

    copy = pathlib.Path(shutil.copytree(model_dir, tmp_path / "elsewhere" / pathlib.Path(model_dir).name))
    files = runner.model_files(copy)
    assert files[0].name == "jcascade-config.json" and all(f.is_relative_to(copy / "weights") for f in files[1:])
    assert len(files) > 3 and runner.model_sha256(copy) == runner.model_sha256(pathlib.Path(model_dir))
    weight = max(files, key=lambda f: f.stat().st_size)
    data = bytearray(weight.read_bytes())
    data[len(data) // 2] ^= 1
    weight.write_bytes(bytes(data))
    assert runner.model_sha256(copy) != runner.model_sha256(pathlib.Path(model_dir))
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(8))
    assert runner.model_files(tmp_path / "m.gguf") == [tmp_path / "m.gguf"]

    loaded, again = jc.load_tokenizer(model_dir), jc.load_tokenizer(copy)
    assert runner.tokenizer_sha256(loaded) == runner.tokenizer_sha256(again)
    again.chat_template = None
    assert runner.tokenizer_sha256(loaded) != runner.tokenizer_sha256(again)
    assert runner.tokenizer_sha256(tiny.tokenizer()) == runner.tokenizer_sha256(tiny.tokenizer())
    other = tiny.tokenizer()
    other.add_tokens(["<extra>"])
    assert runner.tokenizer_sha256(other) != runner.tokenizer_sha256(tiny.tokenizer())

    assert runner.devices(None) == "1 cpu"
    assert set(runner.identity(model_dir, loaded, None, log=None)) == {
        "model_sha256",
        "tokenizer_sha256",
        "devices",
        "software",
    }


def _progress_file(directory):
    return next(directory.glob("generation-*")) / "progress.json"


def _rewrite_progress(directory, change):
    file = _progress_file(directory)
    file.write_text(change(file.read_text()))


def _damage_arrays(directory):
    for chunk in (next(directory.glob("generation-*")) / "arrays").rglob("d/*"):
        chunk.write_bytes(chunk.read_bytes()[:10])


@pytest.mark.parametrize(
    "damage,where,problem",
    [
        (
            lambda d: (d / "LATEST").write_text("generation-00000007"),
            "LATEST",
            "damaged: it names 'generation-00000007', which is not a generation folder of .* "
            "\\(found: generation-00000000\\)",
        ),
        (lambda d: (d / "LATEST").write_text(""), "LATEST", "damaged: it names '', which is not a generation folder"),
        (lambda d: (d / "LATEST").write_bytes(b"\xff\xfe"), "LATEST", "damaged: it names bytes that are not text"),
        (lambda d: _progress_file(d).unlink(), "progress.json", "missing from the checkpoint"),
        (
            lambda d: _progress_file(d).write_bytes(b'{"run": "\xff"}'),
            "progress.json",
            "damaged: not UTF-8 text \\(byte 9\\)",
        ),
        (
            lambda d: _rewrite_progress(d, lambda text: text[: len(text) // 2]),
            "progress.json",
            "damaged or truncated: not valid JSON \\(.* at line 1, column",
        ),
        (lambda d: _rewrite_progress(d, lambda text: "[1, 2]"), "progress.json", "damaged: a JSON list, not an object"),
        (
            lambda d: _rewrite_progress(d, lambda text: text.replace('"run"', '"ran"')),
            "progress.json",
            "damaged: it has no 'run' \\(it holds 'ran', 'command', 'seconds', 'results'\\)",
        ),
        (
            lambda d: _rewrite_progress(d, lambda text: text.replace('"results"', '"result"')),
            "progress.json",
            "damaged: it has no 'results'",
        ),
        (
            lambda d: _rewrite_progress(d, lambda text: text.replace('"sample"', '"example"')),
            "progress.json",
            "damaged: its results are not PasskeyResult records \\(.*unexpected keyword argument 'example'",
        ),
        (_damage_arrays, "arrays", "damaged: orbax cannot restore its arrays"),
    ],
    ids=[
        "latest-names-none",
        "latest-empty",
        "latest-not-text",
        "progress-missing",
        "progress-not-text",
        "progress-truncated",
        "progress-not-object",
        "no-run",
        "no-results",
        "result-fields",
        "arrays",
    ],
)
def test_a_damaged_checkpoint_names_the_file_and_the_problem(tmp_path, damage, where, problem):
    result = passkey.PasskeyResult("Sink", 128, 0, 0, "12345", 0.5, 120, "12345", 1.0, 2, None)
    key = lambda r: (r.policy, r.context_length, r.bucket, r.sample)
    checkpointing.Checkpointing(tmp_path, 1, {"seed": 0}).save(
        {"x": np.arange(4.0)}, {"results": [dataclasses.asdict(result)]}
    )

    def restore():
        arrays, progress = checkpointing.Checkpointing(tmp_path, 1, {"seed": 0}).resume()
        return arrays, checkpointing.finished(progress, [key(result)], passkey.PasskeyResult, key)

    arrays, results = restore()
    assert np.array_equal(arrays["x"], np.arange(4.0)) and results == [result]
    damage(tmp_path)
    with pytest.raises(
        ValueError,
        match=f"{tmp_path}/(generation-00000000/)?{where}: {problem}.*; remove that folder to start the run over",
    ):
        restore()


def test_a_damaged_checkpoint_is_a_one_line_error_of_the_command(model_dir, tmp_path, capsys):
    checkpoint = tmp_path / "checkpoint-passkey"
    checkpointing.save_stream(checkpoint, None, {"run": {}, "command": "jcascade passkey --resume", "seconds": 1.0})
    _rewrite_progress(checkpoint, lambda text: text[:-9])
    for resume in ([], ["--resume"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(
                [
                    "passkey",
                    "--model",
                    model_dir,
                    "--policy",
                    SINK,
                    "--checkpoint-every",
                    "1K",
                    "--out",
                    str(tmp_path),
                    *resume,
                ]
            )
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err, err
        assert f"error: {_progress_file(checkpoint)}: damaged or truncated: not valid JSON" in err, err


def test_a_checkpoint_of_other_units_is_refused(tmp_path):
    """A checkpoint whose results are not the first units of the sweep (here: another context length, with an
    identity that does not say so) is refused before any model time is spent."""
    tokenizer = tiny.tokenizer()
    theirs = passkey.PasskeyResult("Sink", 256, 0, 0, "12345", 0.5, 250, "12345", 1.0, 2, None)
    planned = passkey.plan(passkey.PromptBuilder(tokenizer), [128, 256], samples=1, seed=0)
    saved = {
        "run": 1,
        "batch_size": 5,
        "protocol": "query-aware",  # the identity the sweep adds to {"run": 1}
        "prompts": checkpointing.prompts_sha256((p.tokens, p.question_start) for n in planned for p in planned[n]),
    }
    checkpointing.Checkpointing(tmp_path, 1, saved).save(None, {"results": [dataclasses.asdict(theirs)]})
    policy = jc.Sink(window=32, sinks=4, stride=32)
    with pytest.raises(
        ValueError,
        match=r"progress.json: its results are not the first units of this run: result "
        r"0 is \('Sink', 256, 0, 0\), the run's unit 0 is \('Sink', 128, 0, 0\)",
    ):
        passkey.sweep(
            None,
            tokenizer,
            {"Sink": policy},
            [128, 256],
            checkpointing=checkpointing.Checkpointing(tmp_path, 1, {"run": 1}),
        )


def test_a_sweep_never_reports_fewer_units_than_planned(model_dir, monkeypatch):
    """The passkey sweep's results must hold every (policy, length, bucket, sample) once, in order: a prompt
    generator that drops a prompt makes it raise instead of returning a short run."""
    key = lambda r: r
    checkpointing.complete([("a", 1), ("a", 2)], [("a", 1), ("a", 2)], key, "run")
    for results, message in [
        (
            [("a", 1)],
            r"run: 1 results \(1 distinct units\) for the 2 planned units, 1 of them "
            r"missing \(first: \[\('a', 2\)\]\); not reported as a complete run",
        ),
        ([("a", 1), ("a", 1)], r"2 results \(1 distinct units\) for the 2 planned units, 1 of"),
        ([("a", 2), ("a", 1)], r"2 results \(2 distinct units\) for the 2 planned units, 0 of"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            checkpointing.complete(results, [("a", 1), ("a", 2)], key, "run")

    model, tokenizer = jc.load_pretrained(model_dir), jc.load_tokenizer(model_dir)
    policies = {"Sink 32": jc.Sink(window=32, sinks=4, stride=32)}
    sweep = lambda: passkey.sweep(model, tokenizer, policies, [128], samples=1, batch_size=5)
    assert [(r.bucket, r.sample) for r in sweep()] == [(b, 0) for b in range(5)]
    prompts = passkey.prompts
    monkeypatch.setattr(passkey, "prompts", lambda *a, **k: prompts(*a, **k)[:-1])
    with pytest.raises(
        RuntimeError,
        match=r"passkey sweep: 4 results \(4 distinct units\) for the 5 planned units, "
        r"1 of them missing \(first: \[\('Sink 32', 128, 4, 0\)\]\)",
    ):
        sweep()


def test_a_stream_resumed_from_any_chunk_equals_the_whole_stream():
    model = tiny.model(97, seed=3)
    tokens = np.random.default_rng(1).integers(0, 97, 300)
    policy = jc.Cascade(cache_size=32, sinks=4, num_cascades=2, stride=32)
    points = []
    whole = perplexity.stream(model, policy, tokens, after_chunk=lambda p: points.append((p[0], p[1].copy(), p[2])))
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
    args = [
        "perplexity",
        "--model",
        model_dir,
        "--book",
        book,
        "--policy",
        SINK,
        "--policy",
        CASCADE,
        "--checkpoint-every",
        "64",
    ]
    cli.main(args[:-2] + ["--out", str(tmp_path / "whole")])

    out = tmp_path / "killed"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.Popen(
        [sys.executable, "-m", "jcascade", *args, "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
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


def interrupted(monkeypatch, argv: list[str], batch: int, module=passkey, batch_function: str = "answer") -> None:
    """Runs the command line `argv`, killed (KeyboardInterrupt) as its `batch`-th batch starts (a batch: a call of
    `module.batch_function`, passkey's `answer` by default)."""
    computes, calls = getattr(module, batch_function), []

    def dies(*a, **k):
        calls.append(1)
        if len(calls) == batch:
            raise KeyboardInterrupt("killed")
        return computes(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(module, batch_function, dies)
        with pytest.raises(KeyboardInterrupt):
            cli.main(argv)


def refusal(argv: list[str], capsys) -> str:
    """The error of a command line that must stop, white space collapsed."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = " ".join(capsys.readouterr().err.split())
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    return err


def test_passkey_interrupted_and_resumed_equals_an_uninterrupted_run(model_dir, tmp_path, monkeypatch, capsys):
    args = [
        "passkey",
        "--model",
        model_dir,
        "--policy",
        SINK,
        "--policy",
        CASCADE,
        "--min-length",
        "128",
        "--max-length",
        "256",
        "--samples",
        "2",
        "--batch-size",
        "3",
        "--checkpoint-every",
        "300",
    ]
    cli.main(args + ["--out", str(tmp_path / "whole")])
    interrupted(monkeypatch, args + ["--out", str(tmp_path / "cut")], batch=5)
    # batches of 3, 3, 3 and 1 prompts of 128 tokens: the fourth is short of the 300 tokens between checkpoints
    saved = checkpointing.load_stream(tmp_path / "cut" / "checkpoint-passkey")[1]
    assert len(saved["results"]) == 9 and saved["command"].endswith(f"--out {tmp_path / 'cut'} --resume")
    saved_seconds = saved["seconds"]
    assert saved_seconds > 0

    other = tmp_path / "other" / pathlib.Path(model_dir).name  # another model in a folder of the same name
    tokenizer = jc.load_tokenizer(model_dir)
    jc.save_converted(tiny.model(len(tokenizer), seed=1), other)
    tokenizer.save_pretrained(other)
    err = refusal([args[0], "--model", str(other), *args[3:], "--out", str(tmp_path / "cut"), "--resume"], capsys)
    assert 'was written by another run, it differs in (saved, now): model_sha256 ("' in err and "tokenizer" not in err

    answer, calls = passkey.answer, []

    def counted(*a, **k):
        calls.append(1)
        return answer(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(passkey, "answer", counted)
        cli.main(args + ["--out", str(tmp_path / "cut"), "--resume"])
    assert len(calls) == 2 * 2 * 4 - 3  # policies x lengths x batches, less the saved ones
    whole, cut = (json.loads((tmp_path / d / "passkey.json").read_text()) for d in ("whole", "cut"))
    assert cut["seconds"] > saved_seconds  # the time of the run it resumed counts
    del whole["seconds"], cut["seconds"]
    assert cut == whole


def test_a_resume_with_another_word_list_or_haystack_is_refused(model_dir, tmp_path, monkeypatch, capsys):
    """The identity holds the content of --words-file (passkey) and of the prose --book (RULER), not their names."""
    from jcascade.eval import ruler

    def checkpointed_then_killed(*args, checkpointing, batch_size, **kwargs):
        checkpointing.resume(batch_size=batch_size)
        checkpointing.save(None, {"results": []})
        raise KeyboardInterrupt("killed after its first checkpoint")

    words, book = tmp_path / "words.txt", tmp_path / "book.txt"
    words.write_text("\n".join(a + b + "sky" for a in "abcdefghijk" for b in "abcdefghijk"))
    book.write_text("The grass is green. The sky is blue. " * 200)
    for module, file, key, argv in [
        (
            passkey,
            words,
            "words",
            [
                "passkey",
                "--policy",
                SINK,
                "--filler",
                "words",
                "--words-file",
                str(words),
                "--min-length",
                "128",
                "--max-length",
                "128",
            ],
        ),
        (
            ruler,
            book,
            "prose",
            [
                "ruler",
                "--tasks",
                "niah_single_2",
                "--policy",
                "full",
                "--budget",
                "0.5",
                "--min-length",
                "1K",
                "--max-length",
                "1K",
                "--samples",
                "1",
                "--book",
                str(book),
            ],
        ),
    ]:
        argv += ["--model", model_dir, "--checkpoint-every", "1", "--out", str(tmp_path)]
        with monkeypatch.context() as m:
            m.setattr(module, "sweep", checkpointed_then_killed)
            with pytest.raises(KeyboardInterrupt):
                cli.main(argv)
        file.write_text(file.read_text().replace("sky", "sea"))
        err = refusal(argv + ["--resume"], capsys)
        differences = err.split("it differs in (saved, now): ", 1)[1]
        assert differences.startswith(f'{key} ("') or f'; {key} ("' in differences, err


def test_a_resume_whose_prompts_are_built_otherwise_is_refused(model_dir, tmp_path, monkeypatch, capsys):
    """The identity holds the digest of the sweep's prompts: a RULER run checkpointed by one version of the
    generator (here: another noise sentence in vt's haystack) is refused by another, not continued with other
    prompts."""
    from jcascade.eval import ruler

    argv = [
        "ruler",
        "--model",
        model_dir,
        "--tasks",
        "vt",
        "--policy",
        "full",
        "--budget",
        "0.5",
        "--min-length",
        "1K",
        "--max-length",
        "1K",
        "--samples",
        "2",
        "--batch-size",
        "1",
        "--checkpoint-every",
        "1",
        "--out",
        str(tmp_path),
    ]
    interrupted(monkeypatch, argv, batch=2, module=ruler, batch_function="generate")
    monkeypatch.setattr(ruler, "NOISE", ruler.NOISE.replace("green", "grey"))
    err = refusal(argv + ["--resume"], capsys)
    assert 'it differs in (saved, now): prompts ("' in err, err


@pytest.mark.devices(2)
def test_a_run_interrupted_on_one_or_two_devices_resumes_exactly_on_as_many_or_refuses(
    model_dir, tmp_path, monkeypatch, capsys
):
    """The default batch follows the devices (65 prompts: batches of 22, 22 and 21 on one device, 34 and 31 on
    two). A run interrupted on one device and resumed on two, or the reverse, is refused, naming the devices
    and batch sizes; interrupted and resumed on two, it equals an uninterrupted run on two."""
    args = [
        "passkey",
        "--model",
        model_dir,
        "--policy",
        SINK,
        "--min-length",
        "128",
        "--max-length",
        "128",
        "--samples",
        "13",
        "--checkpoint-every",
        "1",
    ]
    one, two = ["--mesh", "data=1"], []
    cli.main(args + two + ["--out", str(tmp_path / "whole")])
    for mesh, cut, done in ((two, "cut-on-two", 34), (one, "cut-on-one", 22)):
        interrupted(monkeypatch, args + mesh + ["--out", str(tmp_path / cut)], batch=2)
        assert len(checkpointing.load_stream(tmp_path / cut / "checkpoint-passkey")[1]["results"]) == done
    on_two, on_one = '"2 cpu (mesh data=2, model=1)"', '"1 cpu"'
    for mesh, cut, differ in (
        (one, "cut-on-two", f"batch_size (34, 22); devices ({on_two}, {on_one})."),
        (two, "cut-on-one", f"batch_size (22, 34); devices ({on_one}, {on_two})."),
    ):
        err = refusal(args + mesh + ["--out", str(tmp_path / cut), "--resume"], capsys)
        assert f"was written by another run, it differs in (saved, now): {differ} Resume with" in err, err
    cli.main(args + two + ["--out", str(tmp_path / "cut-on-two"), "--resume"])
    whole, cut = (json.loads((tmp_path / d / "passkey.json").read_text()) for d in ("whole", "cut-on-two"))
    del whole["seconds"], cut["seconds"]
    assert cut == whole and len(cut["results"]) == 65


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--resume"], "--resume continues a run made with --checkpoint-every N"),
        (["--resume", "--checkpoint-every", "1K"], "--resume: no checkpoint in"),
    ],
)
def test_resume_arguments_are_checked(model_dir, book, tmp_path, extra, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["perplexity", "--model", model_dir, "--book", book, "--policy", SINK, "--out", str(tmp_path), *extra])
    assert message in capsys.readouterr().err
