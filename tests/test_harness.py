"""The benchmarks' harness (benchmarks/harness.py): its statistics on calls of known cost, warm-up calls left
untimed, phases run in turn, the JSON every script writes (the run's commit, device and versions; strict numbers,
read back by the one reader of a script's JSON in code, `accuracy_kvpress.py --table`), a script's JSON keys, and
a process without JAX (kvpress's side) timing with it."""

import json
import pathlib
import subprocess
import sys
import time

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import accuracy_kvpress  # noqa: E402  (the benchmarks import each other from their folder, now on the path)
import bench_update  # noqa: E402
import harness  # noqa: E402


def fake_clock(monkeypatch) -> list[float]:
    """The harness's clock made a number that only the calls under test advance."""
    now = [0.0]
    monkeypatch.setattr(harness.time, "perf_counter", lambda: now[0])
    return now


def test_repeats_time_their_calls_alone_after_untimed_warm_up(monkeypatch):
    now = fake_clock(monkeypatch)
    costs = iter([100.0, 100.0] + [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0, 10.0, 10.0])  # 2 warm-up, 5 x 2 timed
    waited = []

    def call(x):
        now[0] += next(costs)
        return x

    timing = harness.time_it(
        call, "out", warmup=2, repeats=5, calls=2, sync=harness.Sync(wait=waited.append, peak_bytes=lambda: 7)
    )
    assert next(costs, None) is None  # every call made, none more
    assert waited == ["out"] * 7  # after each warm-up call, and once after each repeat's calls
    assert timing.seconds == (1.0, 2.0, 3.0, 4.0, 10.0)  # per call: a repeat's seconds over its 2 calls
    assert (timing.median, timing.min, timing.max, timing.spread, timing.peak_bytes) == (3.0, 1.0, 10.0, 2.0, 7)


def test_phases_run_in_turn_each_timed(monkeypatch):
    now = fake_clock(monkeypatch)
    order = []

    def phase(name, cost):
        def run():
            order.append(name)
            now[0] += cost

        return run

    first, second = harness.time_phases([phase("a", 1.0), phase("b", 5.0)], warmup=1, repeats=2)
    assert order == ["a", "b"] * 3
    assert (first.seconds, second.seconds) == ((1.0, 1.0), (5.0, 5.0))
    assert first.spread == 0 and first.peak_bytes is None  # the CPU reports no device memory


def test_a_sleep_of_known_length_times_at_least_that_long():
    timing = harness.time_it(time.sleep, 0.02, repeats=3)
    assert len(timing.seconds) == 3
    assert 0.02 <= timing.min <= timing.median <= timing.max < 2.0  # a sleep never ends early; 2 s: any machine
    out, seconds = harness.time_once(lambda: time.sleep(0.02) or "done")
    assert out == "done" and seconds >= 0.02


def test_the_json_holds_the_run_and_strict_numbers_read_back_by_the_table(tmp_path, capsys):
    """write_json puts the run's commit, device and versions before the result; a number that is not finite is
    null with its reason, as accuracy_kvpress.py's table (reading through eval_tables.load) expects."""
    estimate = dict(value=0.5, low=float("nan"), high=float("nan"), n=4, method="too few units (n=4 < 5)")
    row = dict(method="snapkv", kept=256, n=4, jcascade=estimate, kvpress=estimate, difference=estimate)
    row |= dict(identical_answers=0.25, jcascade_prompts_per_s=2.0, kvpress_prompts_per_s=1.0)
    path = tmp_path / "accuracy.json"
    harness.write_json(path, dict(benchmark="accuracy_kvpress", protocol="query-aware", rows=[row]))
    written = json.loads(path.read_text())
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=BENCHMARKS, capture_output=True, text=True).stdout.strip()
    assert written["commit"] == (commit or None) and isinstance(written["dirty"], bool | None)
    assert written["device"] == "cpu" and {"date", "jax", "jaxlib", "flax"} <= written.keys()
    assert list(written)[-3:] == ["benchmark", "protocol", "rows"]
    assert (
        written["rows"][0]["jcascade"]["low"] is None
        and "too few units" in written["rows"][0]["jcascade"]["low_reason"]
    )
    accuracy_kvpress.table([str(path)])
    assert "| query-aware | snapkv | 256 |" in capsys.readouterr().out


def test_a_scripts_json_keeps_its_keys(tmp_path, monkeypatch):
    """bench_update at a tiny shape: its rows' keys, beside the run's."""
    out = tmp_path / "update.json"
    tiny = "--chunk 8 --cache-size 16 --sinks 2 --cascades 2 --kv-heads 1 --head-dim 8 --iters 2 --warmup 1"
    monkeypatch.setattr(sys, "argv", ["bench_update.py", *tiny.split(), "--out", str(out)])
    bench_update.main()
    written = json.loads(out.read_text())
    assert {"commit", "device", "jax", "benchmark", "args", "rows"} <= written.keys()
    for row in written["rows"]:
        assert {"policy", "ms_per_call", "tokens_per_s", "compile_s", "kv_bytes"} <= row.keys()
        assert row["ms_per_call"] > 0 and row["compile_s"] > 0


def test_a_process_without_jax_times_with_the_harness():
    """kvpress's side runs in a virtual environment of torch without JAX: the harness imports JAX only to wait for
    JAX work or to name its device."""
    code = (
        f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import harness; "
        "no_device = harness.Sync(wait=lambda out: out, peak_bytes=lambda: None); "
        "out, seconds = harness.time_once(lambda: 3, sync=no_device); "
        "timing = harness.time_it(abs, -1, sync=no_device); "
        "assert out == 3 and seconds >= 0 and len(timing.seconds) == 5; "
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    subprocess.run([sys.executable, "-S", "-c", code], check=True)  # -S: no site-packages, so no JAX to find
