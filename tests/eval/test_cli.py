"""The `jcascade` command line end to end on a tiny random model saved to a temporary directory (offline)."""

import json

import jax
import pytest

import jcascade as jc
from jcascade import cli

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
    assert {"full", "sink", "cascade", "slidingwindow", "h2o"} <= set(cli.policy_classes())
    assert cli.parse_policy("cascade:cache_size=64,gamma=0.99,head_reduction=mean") == \
        jc.Cascade(cache_size=64, gamma=0.99, head_reduction="mean")
    assert cli.parse_policy("Sliding_Window: window=8, positions=original") == \
        jc.SlidingWindow(window=8, positions="original")
    assert cli.parse_policy("full") == jc.Full()
    assert cli.parse_policy("h2o:heavy=4,recent=4,stride=16") == jc.H2O(heavy=4, recent=4, stride=16)
    for spec, match in [("nope", "unknown policy 'nope'; known: .*cascade"),
                        ("cascade:size=4", "FIELD one of cache_size, sinks"),
                        ("cascade:cache_size", "expected FIELD=VALUE"),
                        ("cascade:sinks=4", "Cascade needs cache_size=..."),
                        ("cascade:cache_size=big", "Cascade.cache_size must be an int, got 'big'"),
                        ("cascade:cache_size=64,positions=rope", "Cascade.positions must be one of"),
                        ("cascade:cache_size=63", "must be divisible")]:
        with pytest.raises(ValueError, match=match):
            cli.parse_policy(spec)


def test_generate(model_dir, tmp_path, capsys):
    cli.main(["generate", "--model", model_dir, "--prompt", "The grass is", "--max-new-tokens", "4",
              "--policy", SINK, "--out", str(tmp_path)])
    result = json.loads((tmp_path / "generate.json").read_text())
    assert result["prompt"] == "The grass is" and len(result["output_ids"]) == 4
    assert result["output"] in capsys.readouterr().out


def test_passkey_and_compare(model_dir, tmp_path, capsys):
    cli.main(["passkey", "--model", model_dir, "--policy", SINK, "--policy", CASCADE, "--min-length", "128",
              "--max-length", "256", "--retention", "--out", str(tmp_path / "passkey")])
    printed = capsys.readouterr().out
    assert "context" in printed and SINK in printed and "by key depth" in printed and "key tokens the question sees" in printed
    assert f"{CASCADE} - {SINK}, same prompts, by context length: 128: " in printed
    result = json.loads((tmp_path / "passkey" / "passkey.json").read_text())
    assert len(result["results"]) == 2 * 2 * 5 and set(result["accuracy"]) == {SINK, CASCADE}
    assert result["baseline"] == SINK and set(result["differences"][CASCADE]) == {"128", "256", "all"}
    cell = result["accuracy"][CASCADE]["128"]
    assert cell["low"] <= cell["value"] <= cell["high"]
    assert set(result["retention"][SINK]) == {"128", "256"} and len(result["retention_by_layer"][SINK]["128"]) == 2
    assert all(len(r["retention"]) == 2 and len(r["retention"][0]) == 2 for r in result["results"])
    assert png(tmp_path / "passkey" / "passkey_accuracy.png") and png(tmp_path / "passkey" / "passkey_depth.png")
    cli.main(["compare", "--model", model_dir, "--cache-size", "32", "--sinks", "4", "--stride", "32",
              "--min-length", "128", "--max-length", "128", "--samples", "1", "--out", str(tmp_path / "compare")])
    printed = capsys.readouterr().out
    assert "Sink vs Cascade" in printed and "key tokens the question sees" in printed
    assert printed.strip().splitlines()[-1].startswith("  over all lengths: Cascade - Sink = ")  # the verdict ends it
    compare = json.loads((tmp_path / "compare" / "passkey.json").read_text())
    assert set(compare["accuracy"]) == {"Sink", "Cascade"} and compare["retention"] is not None
    same_length = [r["key"] for r in result["results"] if r["context_length"] == 128 and r["policy"] == SINK]
    assert [r["key"] for r in compare["results"] if r["policy"] == "Sink"] == same_length  # same seed, same prompts
    assert png(tmp_path / "compare" / "passkey_accuracy.png")


def test_main_job_defaults_follow_the_machine(monkeypatch, tmp_path):
    import jax

    assert cli.main_job_defaults() == cli.MAIN_JOB["cpu"] | {"model": None}  # the tests run on the CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("JCASCADE_CACHE", str(tmp_path))
    assert cli.main_job_defaults() == cli.MAIN_JOB["gpu"] | {"model": None}
    qwen = tmp_path / jc.models.QWEN25_CODER_05B_INSTRUCT.name
    qwen.mkdir()
    (qwen / jc.models.loading.CONVERTED_CONFIG).write_text("{}")
    assert cli.main_job_defaults() == cli.MAIN_JOB["gpu-qwen"] | {"model": str(qwen)}


def test_perplexity_and_attention_map(model_dir, book, tmp_path, capsys):
    cli.main(["perplexity", "--model", model_dir, "--policy", SINK, "--policy", CASCADE, "--book", book,
              "--max-tokens", "200", "--bucket", "50", "--block", "50", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "grass" in printed and "95 % interval" in printed and f"perplexity {CASCADE} - {SINK} = " in printed
    assert all(" [" in line for line in printed.splitlines() if line.startswith(("grass", "all")))
    result = json.loads((tmp_path / "perplexity.json").read_text())
    assert result["baseline"] == SINK and set(result["differences"]) == {CASCADE}
    assert result["summary"][SINK]["interval"]["low"] <= result["summary"][SINK]["perplexity"]
    assert result["summary"][SINK]["tokens"] == 200 and len(result["summary"][CASCADE]["curve"]) == 4
    assert result["capacities"] == {SINK: 36, CASCADE: 36}
    assert png(tmp_path / "perplexity.png")
    cli.main(["attention-map", "--model", model_dir, "--policy", SINK, "--policy", CASCADE, "--book", book,
              "--tokens", "160", "--pixels", "64", "--out", str(tmp_path)])
    maps = json.loads((tmp_path / "attention_map.json").read_text())["maps"]
    assert maps[SINK]["oldest_non_sink"] == 128 - 32 and maps[CASCADE]["oldest_non_sink"] < 128 - 32
    assert png(tmp_path / "attention_map.png")


@pytest.mark.parametrize("argv,message", [
    (["passkey", "--policy", "nope"], "unknown policy 'nope'"),
    (["passkey", "--policy", "cascade:cache_size=32,sinks=4", "--min-length", "16"], "--min-length 16 is too short"),
    (["passkey", "--min-length", "4K", "--max-length", "1K"], "--max-length (1024) must be >= --min-length (4096)"),
    (["perplexity", "--policy", "snapkv:budget=64"], "streaming policy"),
    (["generate", "--prompt", "hi", "--policy", "cascade:cache_size=-1"], "cache_size must be >= 1"),
    (["passkey", "--samples", "0"], "expected a positive int"),
    (["passkey", "--mesh", "data=0"], "with positive ints, got 'data=0'"),
    (["passkey", "--mesh", "rows=2"], "with positive ints, got 'rows=2'"),
    (["passkey", "--mesh", "data=2,data=4"], "each axis at most once"),
    (["passkey", "--mesh", "data=64,model=64"], f"--mesh data=64,model=64 needs 4096 devices, {jax.device_count()} are"),
    (["generate", "--prompt", "hi", "--mesh", "data=2"], "this command runs one sequence, so the data axis must be 1"),
])
def test_bad_arguments_are_rejected_clearly(model_dir, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--model", model_dir])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err


def test_a_missing_model_is_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["passkey", "--model", str(tmp_path / "nowhere"), "--out", str(tmp_path)])
    assert "no such model directory or .gguf file" in capsys.readouterr().err


def test_equal_batches():
    assert [cli.equal_batches(n) for n in (1, 25, 32, 33, 80, 100)] == [1, 25, 32, 17, 27, 25]
