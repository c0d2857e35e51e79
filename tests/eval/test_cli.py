"""The `jcascade` command line end to end on a tiny random model saved to a temporary directory (offline)."""

import contextlib
import io
import json
import math
import re

import jax
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jcascade as jc
from jcascade import cli
from jcascade.cli import options
from jcascade.eval import main_job, passkey, report, ruler, runner, stats
from jcascade.policies import parse_policy, policy_classes, spec

SINK = "sink:window=32,sinks=4,stride=32"
CASCADE = "cascade:cache_size=32,sinks=4,stride=32"


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    path = tmp_path_factory.mktemp("books") / "grass.txt"
    path.write_text(" ".join(["The grass is green. The sky is blue. The sun is yellow."] * 40))
    return str(path)


def png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_parse_policy_is_generic_over_the_policy_fields():
    assert {"full", "sink", "cascade", "slidingwindow", "h2o"} <= set(policy_classes())
    assert parse_policy("cascade:cache_size=64,gamma=0.99,head_reduction=mean") == jc.Cascade(
        cache_size=64, gamma=0.99, head_reduction="mean"
    )
    assert parse_policy("Sliding_Window: window=8, positions=original") == jc.SlidingWindow(
        window=8, positions="original"
    )
    assert parse_policy("full") == jc.Full()
    assert parse_policy("h2o:heavy=4,recent=4,stride=16") == jc.H2O(heavy=4, recent=4, stride=16)
    for text, match in [
        ("nope", "unknown policy 'nope'; known: .*cascade"),
        ("cascade:size=4", "FIELD one of cache_size, sinks"),
        ("cascade:cache_size", "expected FIELD=VALUE"),
        ("cascade:sinks=4", "Cascade needs cache_size=..."),
        ("cascade:cache_size=big", "Cascade.cache_size must be an int, got 'big'"),
        ("cascade:cache_size=64,positions=rope", "Cascade.positions must be one of"),
        ("cascade:cache_size=63", "must be divisible"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_policy(text)


def test_generate(model_dir, tmp_path, capsys):
    cli.main(
        [
            "generate",
            "--model",
            model_dir,
            "--prompt",
            "The grass is",
            "--max-new-tokens",
            "4",
            "--policy",
            SINK,
            "--out",
            str(tmp_path),
        ]
    )
    result = json.loads((tmp_path / "generate.json").read_text())
    assert result["prompt"] == "The grass is" and len(result["output_ids"]) == 4
    assert result["output"] in capsys.readouterr().out
    cli.main(["generate", "--model", model_dir, "--prompt", "The grass is", "--max-new-tokens", "4", "--json"])
    assert json.loads(capsys.readouterr().out)["output_ids"] == result["output_ids"]


def test_passkey_and_compare(model_dir, tmp_path, capsys):
    cli.main(
        [
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
            "1",
            "--retention",
            "--out",
            str(tmp_path / "passkey"),
        ]
    )
    captured = capsys.readouterr()
    printed = captured.out
    assert "context     n" in printed and "Sink 32" in printed and "by key depth" in printed
    assert "key tokens the question sees" in printed
    assert "accuracy Cascade 32x4 - Sink 32, paired, by length: 128 context: " in printed and " n=5" in printed
    assert "passkey: 100%" in captured.err  # the progress bar ends full
    result = json.loads((tmp_path / "passkey" / "passkey.json").read_text())
    assert len(result["results"]) == 2 * 2 * 5 and set(result["accuracy"]) == {"Sink 32", "Cascade 32x4"}
    assert {k: parse_policy(v) for k, v in result["policies"].items()} == {  # specs: the run replays from its JSON
        "Sink 32": parse_policy(SINK),
        "Cascade 32x4": parse_policy(CASCADE),
    }
    assert result["protocol"] == "query-aware"  # the default
    assert result["baseline"] == "Sink 32" and set(result["differences"]["Cascade 32x4"]) == {"128", "256", "all"}
    assert result["prompts"] == {"128": 5, "256": 5} and result["verdicts"]["Cascade 32x4"] in stats.VERDICTS
    cell = result["accuracy"]["Cascade 32x4"]["128"]
    assert cell["low"] <= cell["value"] <= cell["high"] and cell["n"] == 5 and cell["high"] > cell["low"]
    assert set(result["retention"]["Sink 32"]) == {"128", "256"}
    assert len(result["retention_by_layer"]["Sink 32"]["128"]) == 2
    assert all(len(r["retention"]) == 2 and len(r["retention"][0]) == 2 for r in result["results"])
    assert png(tmp_path / "passkey" / "passkey_accuracy.png") and png(tmp_path / "passkey" / "passkey_depth.png")
    cli.main(
        [
            "compare",
            "--model",
            model_dir,
            "--cache-size",
            "32",
            "--sinks",
            "4",
            "--stride",
            "32",
            "--min-length",
            "128",
            "--max-length",
            "128",
            "--samples",
            "1",
            "--out",
            str(tmp_path / "compare"),
            "--json",
        ]
    )
    captured = capsys.readouterr()
    summary = json.loads(captured.out)  # --json: stdout is the summary alone, the tables go to stderr
    assert "Sink vs Cascade" in captured.err and "key tokens the question sees" in captured.err
    [(cascade, difference)] = summary["differences"].items()  # Cascade 32x2: the CPU's 2 cascades
    assert cascade == f"Cascade 32x{main_job.SETTINGS['cpu']['cascades']}"
    assert summary["verdicts"] == {cascade: stats.verdict_word(stats.Estimate.from_dict(difference["all"]), "better")}
    assert "results" not in summary and summary["files"][0].endswith("passkey.json")
    assert summary["accuracy"]["Sink 32"]["128"]["n"] == 5 and summary["retention"] is not None
    compare = json.loads((tmp_path / "compare" / "passkey.json").read_text())
    same_length = [r["key"] for r in result["results"] if r["context_length"] == 128 and r["policy"] == "Sink 32"]
    assert [r["key"] for r in compare["results"] if r["policy"] == "Sink 32"] == same_length  # same prompts


def test_main_job_defaults_follow_the_machine(monkeypatch, tmp_path):
    import jax

    assert main_job.defaults() == main_job.SETTINGS["cpu"] | {"model": None}  # the tests run on the CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("JCASCADE_CACHE", str(tmp_path))
    assert main_job.defaults() == main_job.SETTINGS["gpu"] | {"model": None}
    qwen = tmp_path / jc.models.QWEN25_CODER_05B_INSTRUCT.name
    qwen.mkdir()
    (qwen / "tokenizer_config.json").write_text("{}")
    (qwen / jc.models.loading.CONVERTED_CONFIG).write_text("{}")  # converted before the layout was recorded
    assert main_job.defaults() == main_job.SETTINGS["gpu"] | {"model": None}
    (qwen / jc.models.loading.CONVERTED_CONFIG).write_text(json.dumps({"layout": jc.models.loading.CONVERTED_LAYOUT}))
    assert main_job.defaults() == main_job.SETTINGS["gpu-qwen"] | {"model": str(qwen)}


def test_perplexity_and_attention_map(model_dir, book, tmp_path, capsys):
    cli.main(
        [
            "perplexity",
            "--model",
            model_dir,
            "--policy",
            SINK,
            "--policy",
            CASCADE,
            "--book",
            book,
            "--max-tokens",
            "200",
            "--bucket",
            "50",
            "--block",
            "50",
            "--out",
            str(tmp_path),
        ]
    )
    printed = capsys.readouterr().out
    assert "grass" in printed and "95 % interval" in printed and "perplexity: Cascade 32x4 - Sink 32 = " in printed
    assert all(" [" in line and " n=4" in line for line in printed.splitlines() if line.startswith(("grass", "all")))
    result = json.loads((tmp_path / "perplexity.json").read_text())
    assert result["baseline"] == "Sink 32" and set(result["differences"]) == {"Cascade 32x4"}
    assert result["summary"]["Sink 32"]["interval"]["n"] == 4  # 4 blocks of 50 tokens: too few for an interval
    assert result["verdicts"] == {"Cascade 32x4": "too few units"}
    assert result["summary"]["Sink 32"]["tokens"] == 200 and len(result["summary"]["Cascade 32x4"]["curve"]) == 4
    assert result["capacities"] == {"Sink 32": 36, "Cascade 32x4": 36}
    assert png(tmp_path / "perplexity.png")
    cli.main(
        [
            "attention-map",
            "--model",
            model_dir,
            "--policy",
            SINK,
            "--policy",
            CASCADE,
            "--book",
            book,
            "--tokens",
            "160",
            "--pixels",
            "64",
            "--out",
            str(tmp_path),
        ]
    )
    maps = json.loads((tmp_path / "attention_map.json").read_text())["maps"]
    assert maps["Sink 32"]["oldest_non_sink"] == 128 - 32 and maps["Cascade 32x4"]["oldest_non_sink"] < 128 - 32
    assert png(tmp_path / "attention_map.png")


def test_ruler(model_dir, tmp_path, capsys):
    cli.main(
        [
            "ruler",
            "--model",
            model_dir,
            "--tasks",
            "niah_single_1,vt",
            "--policy",
            "full,cascade",
            "--budget",
            "0.25",
            "--min-length",
            "1K",
            "--max-length",
            "1K",
            "--samples",
            "5",
            "--batch-size",
            "5",
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    printed = capsys.readouterr()
    summary = json.loads(printed.out)
    assert "/20.0 [" in printed.err and "prompt/s]" in printed.err  # progress counts the 20 prompts
    assert summary["baseline"] == "Full" and set(summary["verdicts"]) == {"Cascade 25%"}
    assert summary["average"]["Full"]["1024"]["n"] == 10 and set(summary["scores"]["Full"]) == {"niah_single_1", "vt"}
    result = json.loads((tmp_path / "ruler.json").read_text())
    assert len(result["results"]) == 2 * 2 * 5 and png(tmp_path / "ruler.png")
    assert result["protocol"] == summary["protocol"] == "query-aware"  # the default
    grid = ruler.policy_grid(["full", "cascade"], [0.25])(1024)  # specs: the run replays from its JSON
    assert {k: parse_policy(v["1024"]) for k, v in result["policies"].items()} == grid
    assert result["policies"]["Cascade 25%"]["1024"].startswith("cascade:cache_size=192,sinks=64,num_cascades=4")


def test_ruler_and_passkey_query_agnostic(model_dir, tmp_path, monkeypatch, capsys):
    """--protocol reaches every generate call of the sweep and is named in the printed heading and the JSON (the
    sweeps' tests check what it does)."""
    called = []

    def recorded(generate):
        def call(*args, **kwargs):
            called.append(args[4])  # the protocol
            return generate(*args, **kwargs)

        return call

    monkeypatch.setattr(ruler, "generate", recorded(ruler.generate))
    monkeypatch.setattr(passkey, "generate", recorded(passkey.generate))
    cli.main(
        [
            "ruler",
            "--model",
            model_dir,
            "--protocol",
            "query-agnostic",
            "--tasks",
            "niah_single_1",
            "--policy",
            "full",
            "--policy",
            SINK,
            "--min-length",
            "512",
            "--max-length",
            "512",
            "--samples",
            "2",
            "--batch-size",
            "2",
            "--out",
            str(tmp_path),
        ]
    )  # a spec with fields is used as given
    cli.main(
        [
            "passkey",
            "--model",
            model_dir,
            "--protocol",
            "query-agnostic",
            "--policy",
            "full:stride=64",
            "--min-length",
            "128",
            "--max-length",
            "128",
            "--samples",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    printed = capsys.readouterr().out
    assert printed.count(", query-agnostic, ") == 2 and called == ["query-agnostic"] * 3, (printed, called)
    for name, count in (("ruler", 4), ("passkey", 5)):
        result = json.loads((tmp_path / f"{name}.json").read_text())
        assert result["protocol"] == "query-agnostic" and len(result["results"]) == count
    assert json.loads((tmp_path / "ruler.json").read_text())["policies"]["Sink 32"] == {"512": spec(parse_policy(SINK))}


def test_query_agnostic_refusals_come_before_any_model_time(model_dir, tmp_path, monkeypatch, capsys):
    import tiny
    from jcascade.models.config import FAMILY_FEATURES, Rotary

    gemma = tmp_path / "gemma"
    jc.save_converted(
        tiny.model(
            64,
            architecture="gemma3",
            **FAMILY_FEATURES["gemma3"],
            num_layers=2,
            sliding_window=24,
            layer_types=("sliding", "global"),
            rotary=Rotary(theta=10000.0, local_theta=10000.0),
        ),
        gemma,
    )
    monkeypatch.setattr(runner, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    for argv, message in [
        (
            ["ruler", "--model", str(gemma)],
            "--protocol: protocol query-agnostic is not supported yet for models with sliding or linear layers",
        ),
        (["passkey", "--model", model_dir, "--retention"], "--retention: recorded under --protocol query-aware only"),
        (
            ["passkey", "--model", model_dir, "--policy", "recycled:top_k=16,refresh_every=4"],
            "--protocol: protocol query-agnostic does not support Recycled",
        ),
        (
            ["ruler", "--model", model_dir, "--policy", "full", "--policy", "recycled:top_k=16,refresh_every=4"],
            "--protocol: protocol query-agnostic does not support Recycled",
        ),
    ]:
        with pytest.raises(SystemExit):
            cli.main([*argv, "--protocol", "query-agnostic", "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert f"jcascade {argv[0]}: error: {message}" in err, err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["passkey", "--policy", "nope"], "unknown policy 'nope'"),
        (["ruler", "--protocol", "agnostic"], "argument --protocol: invalid choice: 'agnostic'"),
        (
            ["passkey", "--policy", "cascade:cache_size=32,sinks=4", "--min-length", "16"],
            "context_length=16 is too short: the passkey prompt without filler takes",
        ),
        (
            ["passkey", "--min-length", "4K", "--max-length", "1K"],
            "--max-length: the longest context (1024) must be >= the shortest (--min-length 4096)",
        ),
        (["compare", "--min-length", "64K"], "--max-length: the longest context (768) must be >= the shortest"),
        (["perplexity", "--policy", "snapkv:budget=64"], "streaming policy"),
        (["generate", "--prompt", "hi", "--policy", "cascade:cache_size=-1"], "cache_size must be >= 1"),
        (["passkey", "--samples", "0"], "argument --samples: must be positive and at most 2147483647, got '0'"),
        (["passkey", "--samples", "-3"], "argument --samples: must be positive and at most 2147483647, got '-3'"),
        (
            ["passkey", "--min-length", "-1K"],
            "argument --min-length: must be positive and at most 2147483647, got '-1K'",
        ),
        (["passkey", "--samples", "3000000K"], "argument --samples: must be positive and at most 2147483647"),
        (["passkey", "--samples", "two"], "argument --samples: must be an int such as 4096 or 4K, got 'two'"),
        (["passkey", "--seed", "-1"], "argument --seed: must be >= 0 and at most 4294967295, got '-1'"),
        (["passkey", "--seed", "1.5"], "argument --seed: must be an int, got '1.5'"),
        (["passkey", "--words-file", __file__], "--words-file: used only with --filler words, not --filler repeat"),
        (["passkey", "--baseline", "Sink 99"], "--baseline: baseline 'Sink 99' must be one of the policy labels"),
        (
            ["generate", "--prompt", "hi", "--temperature", "nan"],
            "argument --temperature: must be a finite number in [0,",
        ),
        (
            ["generate", "--prompt", "hi", "--temperature", "-0.5"],
            "argument --temperature: must be a finite number in [0,",
        ),
        (
            ["generate", "--prompt", "hi", "--temperature", "inf"],
            "argument --temperature: must be a finite number in [0,",
        ),
        (
            ["generate", "--prompt", "hi", "--top-p", "2"],
            "argument --top-p: must be a finite number in (0, 1], got '2'",
        ),
        (
            ["generate", "--prompt", "hi", "--top-p", "0"],
            "argument --top-p: must be a finite number in (0, 1], got '0'",
        ),
        (["generate", "--prompt", ""], "--prompt: must not be empty"),
        (["ruler", "--budget", "inf"], "argument --budget: 'inf' is out of range"),
        (["attention-map", "--layer", "2", "--tokens", "64"], "--layer: must be < 2 (the model's layers), got 2"),
        (["attention-map", "--kv-head", "-1"], "argument --kv-head: must be >= 0"),
        (["ruler", "--tasks", "qa_1"], "argument --tasks: tasks must be comma-separated names among niah_single_1"),
        (["ruler", "--budget", "0.01", "--policy", "sink"], "--budget: budget 0.01 keeps 40 slots at 4096 tokens"),
        (["passkey", "--mesh", "data=0"], "with positive ints, got 'data=0'"),
        (["passkey", "--mesh", "rows=2"], "with positive ints, got 'rows=2'"),
        (["passkey", "--mesh", "data=2,data=4"], "each axis at most once"),
        (
            ["passkey", "--mesh", "data=64,model=64"],
            f"--mesh data=64,model=64 needs 4096 devices, {jax.device_count()} are",
        ),
        (
            ["generate", "--prompt", "hi", "--mesh", "data=2"],
            "this command runs one sequence, so the data axis must be 1",
        ),
        (
            ["ruler", "--processes", "2", "--mesh", "data=2"],
            "--mesh: with --processes 2 the rows go over the processes",
        ),
        (["ruler", "--processes", "2", "--batch-size", "3"], "--batch-size 3 must be a multiple of --processes (2)"),
        (["passkey", "--processes", "0"], "argument --processes: must be positive"),
    ],
)
def test_bad_arguments_are_rejected_clearly(model_dir, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--model", model_dir])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err
    assert f"usage: jcascade {argv[0]} [-h]" in err and "{generate," not in err, err  # the subcommand's usage
    assert f"jcascade {argv[0]}: error: " in err and "Traceback" not in err, err


def test_help_shows_the_effective_defaults(capsys):
    for command, expected in [
        ("passkey", ["(default: 10)", "(default: 1024)", "(default: 2048)"]),
        ("compare", ["cpu: --cache-size 384", "gpu: --cache-size 768"]),
    ]:
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert all(e in text for e in expected), text


def test_equal_batches():
    assert [passkey.equal_batches(n) for n in (1, 25, 32, 33, 80, 100)] == [1, 25, 32, 17, 27, 25]


def _strict(text: str):
    """json.loads refusing NaN and Infinity (which Python's json reads by default)."""

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_is_strict_when_a_cell_has_too_few_prompts_for_an_interval(model_dir, tmp_path, capsys):
    """2 prompts per cell (< stats.MIN_UNITS): no interval. stdout and the file are strict JSON; the bounds are
    null with the reason beside them, and the report reads back as the same estimates."""
    cli.main(
        [
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
            "128",
            "--buckets",
            "2",
            "--samples",
            "1",
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    summary = _strict(capsys.readouterr().out)
    written = _strict((tmp_path / "passkey.json").read_text())
    for payload in (summary, written):
        cell = payload["accuracy"]["Sink 32"]["128"]
        assert cell["n"] == 2 and cell["low"] is None and cell["high"] is None
        assert cell["low_reason"] == "no interval: too few units (n=2 < 5)" == cell["high_reason"]
        assert stats.Estimate.from_dict(cell).format() == f"{cell['value']:.2f} [no interval]"
        assert payload["verdicts"] == {"Cascade 32x4": "too few units"}
    (tmp_path / "again" / "passkey_accuracy.png").mkdir(parents=True)  # a figure cannot be written: the JSON is kept
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
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
                "128",
                "--buckets",
                "2",
                "--samples",
                "1",
                "--out",
                str(tmp_path / "again"),
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "jcascade passkey: error: --out: [Errno 21] Is a directory: " in err, err
    assert f"(the results are written to {tmp_path / 'again' / 'passkey.json'}, the figures are not)" in err, err
    assert _strict((tmp_path / "again" / "passkey.json").read_text())["results"] == written["results"]


def test_json_text_convention():
    """Not-finite numbers become null with "<key>_reason" beside them (in lists: null alone), numpy numbers
    become JSON numbers, and what JSON cannot hold raises instead of being written."""
    nan, inf = float("nan"), float("inf")
    value = {
        "e": stats.Estimate(0.5, nan, nan, 3, "too few units (n=3 < 5)").as_dict(),
        "ppl": inf,
        "curve": np.array([1.0, nan, -inf]),
        "n": np.int64(7),
        "ok": np.bool_(True),
        np.int32(4): (np.float32(0.5),),
    }
    assert _strict(report.json_text(value)) == {
        "e": {
            "value": 0.5,
            "low": None,
            "low_reason": "no interval: too few units (n=3 < 5)",
            "high": None,
            "high_reason": "no interval: too few units (n=3 < 5)",
            "n": 3,
            "method": "too few units (n=3 < 5)",
        },
        "ppl": None,
        "ppl_reason": "not finite: inf",
        "curve": [1.0, None, None],
        "n": 7,
        "ok": True,
        "4": [0.5],
    }
    with pytest.raises(TypeError):
        report.json_text({"policy": jc.Full()})


def test_results_that_cannot_be_written_to_out_are_kept(tmp_path):
    """runner.write: a --out that cannot be made a directory (a file stands in the way) keeps the results in
    a temporary file named by the error."""
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    with pytest.raises(OSError, match="the results are saved in ") as error:
        runner.write(blocker / "out", "passkey", {"accuracy": float("nan"), "n": np.int64(3)})
    saved = str(error.value).rsplit("saved in ", 1)[1]
    assert _strict(open(saved).read()) == {"accuracy": None, "accuracy_reason": "not finite: nan", "n": 3}
    assert blocker.read_text() == "mine"


@pytest.mark.parametrize(
    "make,option,message",
    [
        (lambda tmp: ["--out", str(tmp / "file")], "--out", "exists and is not a directory"),
        (lambda tmp: ["--out", str(tmp / "file" / "below")], "--out", "is not a directory"),
        (lambda tmp: ["--out", str(tmp)], "--out", "passkey.json is a directory"),
        (lambda tmp: ["--model", str(tmp / "nowhere")], "--model", "no such model directory or .gguf file"),
        (lambda tmp: ["--filler", "words", "--words-file", str(tmp / "words.txt")], "--words-file", "no such file"),
    ],
)
def test_paths_are_refused_before_any_model_time(make, option, message, tmp_path, monkeypatch, capsys):
    """A bad output or input path is refused at once, naming its option: the model is never loaded and the
    file in the way is left as it was."""
    (tmp_path / "file").write_text("mine")
    (tmp_path / "passkey.json").mkdir()
    monkeypatch.setattr(runner, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["passkey", *make(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"jcascade passkey: error: {option}: " in err and message in err, err
    assert (tmp_path / "file").read_text() == "mine"
    with pytest.raises(SystemExit):
        cli.main(["perplexity", "--book", str(tmp_path / "missing.txt")])
    assert "jcascade perplexity: error: --book: no such file" in capsys.readouterr().err


def _int(least: int, most: int = options.LARGEST):
    return lambda v: type(v) is int and least <= v <= most


def _float(low: float, high: float, low_open: bool = False):
    return lambda v: type(v) is float and math.isfinite(v) and low <= v <= high and not (low_open and v == low)


_COUNT, _SEED = _int(1), _int(0, options.SEEDS - 1)
NUMBERS = [
    ("generate", "--max-new-tokens", _COUNT),
    ("generate", "--temperature", _float(0, math.inf)),
    ("generate", "--top-p", _float(0, 1, low_open=True)),
    ("generate", "--seed", _SEED),
    *[
        ("passkey", o, _COUNT)
        for o in ("--min-length", "--max-length", "--samples", "--buckets", "--batch-size", "--checkpoint-every")
    ],
    ("passkey", "--seed", _SEED),
    ("compare", "--sinks", _int(0)),
    *[("compare", o, _COUNT) for o in ("--cache-size", "--cascades", "--stride")],
    *[("perplexity", o, _COUNT) for o in ("--max-tokens", "--bucket", "--block")],
    ("ruler", "--budget", lambda v: all(type(b) is float and 0 < b < math.inf for b in v)),
    ("ruler", "--samples", _COUNT),
    ("attention-map", "--layer", _int(0)),
    ("attention-map", "--kv-head", _int(0)),
    *[("attention-map", o, _COUNT) for o in ("--tokens", "--pixels")],
]
_VALUES = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.integers(-(2**25), 2**25).map(lambda i: f"{i}K"),
    st.floats().map(str),
    st.text(max_size=6),
    st.sampled_from(
        [
            "0",
            "-0",
            "1e999",
            "-inf",
            "NaN",
            "0x10",
            " 7 ",
            "1_000",
            "4k",
            "K",
            "-.5",
            "--json",
            "0.25,0.5",
            "2048,nan",
            "",
        ]
    ),
)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["ruler", "--kv-dtype", "int8", "--policy", "sink", "--policy", "snapkv:budget=256,kv_dtype=float8_e4m3fn"],
            r"--kv-dtype: the storage format is given twice, by --kv-dtype int8 and by --policy "
            r"snapkv:\.\.\.,kv_dtype=float8_e4m3fn",
        ),
        (["ruler", "--budget", "0.5", "--budget=0.25"], r"--budget: given 2 times \(--budget 0.5, --budget=0.25\)"),
        (["passkey", "--json", "--js"], r"--json: given 2 times \(--json, --js\)"),
        (["perplexity", "--block", "64", "--bucket", "32", "--block", "64"], r"--block: given 2 times"),
    ],
    ids=["kv_dtype by flag and spec", "a flag twice", "a prefix", "the same value twice"],
)
def test_a_setting_given_twice_is_refused_naming_both(argv, message, capsys):
    """argparse keeps the last of an option given twice; the command line refuses it before any model time, as it
    refuses a storage format named by --kv-dtype and by a --policy spec (which of them formats that policy?)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.parse(argv)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err.splitlines()[-1])
    cli.parse(["ruler", "--kv-dtype", "int8", "--policy", "sink", "--policy", "snapkv:budget=256"])  # once each: fine


def test_an_out_of_memory_error_names_the_memory_asked_for_and_what_to_lower(model_dir, tmp_path, monkeypatch, capsys):
    """XLA's allocation failure reaches the user as one line (the command's usage error, no traceback) with the
    GiB asked for and the options that lower it."""

    def out_of_memory(*_, **__):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 29856398512 bytes.")

    monkeypatch.setattr(ruler, "sweep", out_of_memory)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "ruler",
                "--model",
                model_dir,
                "--tasks",
                "vt",
                "--min-length",
                "512",
                "--max-length",
                "512",
                "--samples",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == (
        "jcascade ruler: error: out of memory: the run asked for 27.8 GiB at once; lower "
        "--batch-size or --max-length (or the policies' stride), or run on a device with "
        "more memory"
    )


@settings(max_examples=200)  # parsing only: a few ms an example
@given(case=st.sampled_from(NUMBERS), value=_VALUES)
@example(case=NUMBERS[1], value="inf")
@example(case=NUMBERS[2], value="nan")
@example(case=next(c for c in NUMBERS if c[1] == "--budget"), value="1e999")
@example(case=NUMBERS[0], value="99999999999999999999K")
def test_numbers_are_accepted_in_range_or_refused_naming_their_option(case, value):
    """Any value of a number option parses to an int or finite float in the option's range, or exits with the
    command's usage error (SystemExit 2) naming the option on stderr; never a traceback. Parse only: no model."""
    command, option, accepted = case
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = cli.parse([command, option, value, *(["--prompt", "hi"] if command == "generate" else [])])
        except SystemExit as exit_info:
            last = err.getvalue().rstrip().splitlines()[-1]
            assert exit_info.code == 2 and last.startswith(f"jcascade {command}: error: ") and option in last, last
            return
    assert accepted(getattr(args, option[2:].replace("-", "_"))), (option, value)
