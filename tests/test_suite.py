"""The suite's own tools (tests/conftest.py): the default tier's sample of a parametrized product, and the count of
XLA compilations charged to the test that caused them, kept when a worker dies."""

import os
import subprocess
import sys
import types

import compile_count
import jax
import jax.numpy as jnp
from conftest import sampled


class Item:
    """What `sampled` reads of a collected test: its node id and, if parametrized, one id per parameter."""

    def __init__(self, test: str, *ids: str):
        self.nodeid = f"t.py::{test}" + (f"[{'-'.join(ids)}]" if ids else "")
        if ids:
            self.callspec = types.SimpleNamespace(_idlist=ids)


def test_the_default_tier_takes_every_value_of_every_parameter_of_a_product_and_every_other_test():
    product = [
        Item("p", b, t, f) for b in ("xla", "triton", "mosaic") for t in ("decode", "chunk") for f in ("int8", "float8")
    ]
    alone = [Item("q", str(i)) for i in range(4)] + [Item("r")]
    kept = sampled(product + alone)
    assert set(alone) <= kept
    chosen = [i for i in product if i in kept]
    for axis in range(3):
        assert {i.callspec._idlist[axis] for i in chosen} == {i.callspec._idlist[axis] for i in product}
    assert len(chosen) == 3  # the longest parameter's values, each with values of the others not yet taken
    assert sampled(product) == kept - set(alone)  # deterministic


def test_a_compile_is_charged_to_the_test_that_ran_it():
    mine = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
    compiled = compile_count.FIELDS.index("compiled")
    before = compile_count._stats.get(mine, [0.0] * len(compile_count.FIELDS))[compiled]

    @jax.jit
    def sine_of_a_counted_test(x):
        return jnp.sin(x) * 3.0

    x = jnp.arange(7.0)
    sine_of_a_counted_test(x).block_until_ready()
    sine_of_a_counted_test(x).block_until_ready()  # the same program: not compiled again
    assert compile_count._programs["jit(sine_of_a_counted_test)"][0] == 1
    assert compile_count._stats[mine][compiled] >= before + 1


def test_the_counts_of_a_process_that_dies_are_kept_up_to_its_last_module(tmp_path):
    """A pytest process writes its counts after each test module: one killed in its second module (as a worker
    dies by SIGSEGV) leaves the first module's compiles in the run's folder."""
    (tmp_path / "test_first.py").write_text(
        "import jax, jax.numpy as jnp\n\n\ndef test_compiles():\n"
        "    jax.jit(lambda x: x * 7.0)(jnp.ones(3)).block_until_ready()\n"
    )
    (tmp_path / "test_second.py").write_text("import os\n\n\ndef test_dies():\n    os._exit(3)\n")
    here = os.path.dirname(os.path.abspath(__file__))
    env = os.environ | {
        "JCASCADE_TEST_COMPILATIONS": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([here, os.path.join(here, "compile_site")]),
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "test_first.py",
            "test_second.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 3, run.stdout + run.stderr
    counts, _ = compile_count.read(str(tmp_path))
    assert counts["test_first.py::test_compiles"]["compiled"] >= 1, counts
