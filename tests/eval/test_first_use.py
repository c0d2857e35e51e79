"""First use: batch sizes that fit the run, the warnings before a run (a cache that holds the whole context, a
book shorter than a block) as one clean line each on the command line, and generate's status line."""

import io
import re
import time
import types

import jax
import numpy as np
import pytest

import jcascade as jc
from jcascade import cli
from jcascade.cli import running
from jcascade.eval import runner


@pytest.mark.parametrize(
    "prompts,data,most,want",
    [
        (2, 1, 8, 2),
        (8, 1, 8, 8),
        (10, 1, 8, 5),
        (20, 1, 8, 7),
        (3, 2, 8, 4),
        (20, 2, 8, 10),
        (40, 2, 8, 14),
        (100, 1, 32, 25),
    ],
)
def test_the_default_batch_is_what_the_run_needs(prompts, data, most, want):
    """The fewest batches of at most `most` x D rows for a (policy, length)'s prompts, as equal as possible, rounded
    up to a multiple of the mesh's data axis D: a ruler run of 2 prompts is not padded to 8 rows."""
    mesh = None if data == 1 else types.SimpleNamespace(shape={"data": data, "model": 1})
    assert running.batch_size(types.SimpleNamespace(batch_size=None), prompts, mesh, most) == want
    assert running.batch_size(types.SimpleNamespace(batch_size=6), prompts, mesh, most) == 6


@pytest.mark.parametrize(
    "policy,slots",
    [
        (jc.Sink(window=60, sinks=4), 64),
        (jc.Cascade(cache_size=64, sinks=4), 68),
        (jc.H2O(heavy=8, recent=8), 16),
        (jc.SnapKV(budget=48), 48),
        (jc.AdaKV(scorer=jc.PyramidKV(budget=40)), 40),
        (jc.KVzip(budget=30), 30),
    ],
    ids=lambda p: type(p).__name__ if isinstance(p, jc.policies.Policy) else str(p),
)
def test_keeps_whole_is_the_cache_holding_every_token(policy, slots):
    assert runner.keeps_whole(policy, slots) and not runner.keeps_whole(policy, slots + 1)


def test_a_cascade_holds_every_token_until_its_slots_are_full():
    """The rule keeps_whole relies on for ring policies: Cascade's rings take every token until all are full
    (a ring past the first accepts every 2**i-th token only once full), then evict."""
    import tiny

    model, policy = tiny.model(64), jc.Cascade(cache_size=32, sinks=4, num_cascades=4, stride=8)
    tokens = np.random.default_rng(0).integers(0, 64, (1, 37))
    for n in (36, 37):
        state = model.init_cache(policy, 1)
        state, _, _ = jc.prefill(model, policy, state, tokens[:, :n], np.array([n]))
        held = np.unique(np.asarray(jc.cached_positions(jax.tree.map(lambda x: x[0], state.cache))))
        assert (set(held) - {-1} == set(range(n))) == (n <= 36) == runner.keeps_whole(policy, n)


def test_whole_context_warns_for_the_policies_that_compare_as_full():
    policies = {
        "Full": jc.Full(),
        "Sink 60": jc.Sink(window=60, sinks=4),
        "Cascade 32x4": jc.Cascade(cache_size=32, sinks=4),
    }
    with pytest.warns(UserWarning, match=r"^at 64 tokens the cache of Sink 60 holds the whole context") as caught:
        runner.warn_whole_context({64: policies, 128: policies})
    assert len(caught) == 1


def test_the_command_line_prints_warnings_as_one_line(model_dir, tmp_path, capsys):
    """A passkey run whose Sink cache holds the 128-token context, and a book shorter than one block: each warning
    is one line `warning: ...` on stderr, no source line of a Python warning."""
    cli.main(
        [
            "passkey",
            "--model",
            model_dir,
            "--policy",
            "sink:window=200,sinks=4,stride=64",
            "--policy",
            "cascade:cache_size=32,sinks=4,stride=64",
            "--min-length",
            "128",
            "--max-length",
            "128",
            "--buckets",
            "1",
            "--samples",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err
    line = (
        "warning: at 128 tokens the cache of Sink 200 holds the whole context: nothing is evicted, so it compares "
        "as Full; use longer contexts or smaller caches\n"
    )
    assert line in err and "Cascade 32x4 holds" not in err and "warnings.warn" not in err and "Warning:" not in err
    (tmp_path / "book.txt").write_text(" ".join(["The grass is green. The sky is blue."] * 30))
    cli.main(
        [
            "perplexity",
            "--model",
            model_dir,
            "--policy",
            "sink:window=32,sinks=4,stride=64",
            "--book",
            str(tmp_path / "book.txt"),
            "--max-tokens",
            "200",
            "--out",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err
    assert re.search(
        r"[\r\n]warning: the 1 book\(s\) to stream hold 200 tokens: 1 block\(s\) of 4096 tokens, "
        r"fewer than the 5 an interval needs[^\r\n]*\n",
        err,
    ), err  # its own line (a bar cleared first)
    assert "warnings.warn" not in err and "Warning:" not in err


def test_the_status_line_shows_the_stage_past_its_delay():
    out = io.StringIO()
    with runner.status("job", "running", delay=0.0, file=out):
        jax.jit(lambda x: x * 3 + 1)(np.ones(7, np.float32)).block_until_ready()  # a program compiled here
        time.sleep(1.2)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("job: compiling, ") and lines[-1].startswith("job: running, ") and len(lines) == 2
    quick = io.StringIO()
    with runner.status("job", "running", delay=5.0, file=quick):
        pass
    assert quick.getvalue() == ""
