"""Shared test set-up: jax on the CPU, the hypothesis profile, the tiny model directory, and tests that need
several devices (`@pytest.mark.devices(n)`).

The device count of a jax process is fixed when jax starts, and most tests want the one CPU device (the
command line, for one, splits its batches over every device it sees). A test marked `devices(n)` therefore
runs in a child pytest process started with n emulated CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=n`) whenever this process has fewer. One child runs all of
a run's tests that need n devices: it starts as soon as they are collected (under xdist, by the first worker
to get there; the others share it) and runs beside the other tests, which come first; each of those tests
then reports here, under its own name, what the child reported for it (setup, call and teardown: outcome,
failure, captured output, duration), waiting for it if need be. `pytest path::test[param]` runs one of them
alone the same way; a process that already has n devices runs them in place.
"""

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU backend compiles with LLVM at -O0: the tests are compile-bound (a tiny model's generate compiles in
# ~5 s and runs in ms), and -O0 cuts compile time by about 40 % at the same results (no fast-math either way).
# Set before jax starts; subprocesses (the device child, the multi-process and fetch tests) inherit it.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
# One persistent compilation cache for the whole run, every compile written to it: the xdist workers, the device child
# and the subprocesses (CLI, README) compile some of the same programs, and a worker drops jax's in-memory caches when
# its programs' memory maps grow large (below). Measured over a full run that dropped them after every module: 5,992
# entries written, 1,954 read back instead of compiled (jax's estimate of the time saved: 76 s); with only the programs
# of 1 s or more written (448), 25 were read back and the count of programs compiled grew by about 1,900 (the small
# programs each module compiled again). A fresh folder per run (created by the first process, inherited by the rest
# through the environment) keeps runs independent; the run's summary says what was written, read and saved.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jcascade-test-jit-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Every process of the run counts its XLA compilations (compile_site/compile_count.py) into one folder of the run;
# the subprocesses the tests start load the counter through compile_site/sitecustomize.py on PYTHONPATH.
_COMPILE_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_site")
if "JCASCADE_TEST_COMPILATIONS" not in os.environ:
    os.environ["JCASCADE_TEST_COMPILATIONS"] = tempfile.mkdtemp(prefix="jcascade-test-compilations-")
    atexit.register(shutil.rmtree, os.environ["JCASCADE_TEST_COMPILATIONS"], ignore_errors=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_COMPILE_SITE, os.environ.get("PYTHONPATH")]))
sys.path.insert(0, _COMPILE_SITE)
import compile_count  # noqa: E402  (it must listen before jax is first imported)

compile_count.install()

import pytest  # noqa: E402  (after the counter: pytest plugins import jax)
from hypothesis import HealthCheck, settings  # noqa: E402  (after the counter, as pytest)

# The suite's two tiers (`JCASCADE_TESTS`): the default tier runs every test, but of a test's parametrized product
# (family x policy, backend x format x ...) only a few instances in which every value of every parameter appears
# (`sampled`), and fewer hypothesis examples; the full tier (`JCASCADE_TESTS=full`, what .ci/run runs) runs every
# instance and more examples.
TIERS = ("default", "full")
TIER = os.environ.get("JCASCADE_TESTS", "default")
for tier, examples in zip(TIERS, (8, 25)):  # each example of the cache properties compiles its own programs
    settings.register_profile(
        tier,
        deadline=None,
        max_examples=examples,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", TIER if TIER in TIERS else "default"))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny random model + tokenizer saved as a model directory (the CLI's --model)."""
    import tiny

    return str(tiny.save(tmp_path_factory.mktemp("tiny-model")))


def _memory_maps() -> int:
    """The memory maps this process holds (0 where /proc/self/maps does not exist)."""
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(scope="module", autouse=True)
def _counts_written():
    """Writes this process's compilation counts after each test module, so that a worker that dies keeps what it
    counted up to its last module in the run's summary (a default-tier run lost two workers' counts, which were
    written only at exit)."""
    yield
    compile_count.write()


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
    """Each program XLA compiles for the CPU holds memory maps until jax drops it (about three, more for a large
    one), and a process may hold at most vm.max_map_count of them (65,530 by default): an xdist worker that kept
    every program of the suite crossed it and died by SIGSEGV inside an XLA compile (two workers in one default-tier
    run, at about 25,000 maps each when replaced), and one that ran test_families' 113 instances in one module
    aborted inside one (twice, 2026-11-29). After each test, jax's in-memory caches are dropped only once the process
    holds more than a quarter that many maps, so that later tests and modules reuse the programs earlier ones
    compiled."""
    yield
    if _memory_maps() > _map_limit() // 4:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()  # the programs' maps go with the executables


# ---- tests that need several devices -------------------------------------------------------------------

REPORTS = "JCASCADE_TEST_REPORTS"  # set for a child run: the file it writes its reports to, one JSON line each
CHILD_TIMEOUT = 3600  # seconds a child run may take in all
_CHILDREN = pytest.StashKey[dict]()


def devices_needed(item) -> int:
    mark = item.get_closest_marker("devices")
    return mark.args[0] if mark else 0


def _missing_devices(n: int) -> bool:
    import jax

    return jax.device_count() < n


def pytest_addoption(parser):
    parser.addoption(
        "--compilations",
        type=int,
        default=None,
        metavar="N",
        help="after the run's XLA compilation count, show the N test files that compile most and the N "
        "jitted functions compiled most often (0 for all)",
    )


def pytest_collectstart(collector):
    if isinstance(collector, pytest.Module):
        compile_count.collecting = f"{collector.nodeid} (collection)"


def sampled(items: list) -> set:
    """The default tier's instances: every test that is not a product of several parameters, and of each product
    a few instances that together take every value of every parameter (greedily: each next instance the one with
    the most values not yet taken, the first in collection order among equals; deterministic)."""
    kept, products = set(), {}
    for item in items:
        # one id per parametrize() call or parametrized fixture (pytest's CallSpec._idlist; pytest is pinned)
        ids = getattr(getattr(item, "callspec", None), "_idlist", ())
        if len(ids) > 1:
            products.setdefault(item.nodeid.split("[")[0], []).append(item)
        else:
            kept.add(item)
    for instances in products.values():
        values = {item: set(enumerate(item.callspec._idlist)) for item in instances}
        untaken = set().union(*values.values())
        while untaken:
            best = max(instances, key=lambda item: len(values[item] & untaken))
            kept.add(best)
            untaken -= values[best]
    return kept


def pytest_collection_finish(session):
    compile_count.collecting = None
    _start_children(session)


def pytest_configure(config):
    if TIER not in TIERS:
        raise pytest.UsageError(f"JCASCADE_TESTS={TIER!r}: expected one of {', '.join(TIERS)} (unset: default)")
    path = os.environ.pop(REPORTS, None)
    if path:  # a child run: write every report for the parent
        config.pluginmanager.register(_ReportWriter(config, path), "jcascade-report-writer")


# The test files that take longest (pytest --durations on 2 cores), longest first: with `--dist loadfile
# --no-loadscope-reorder` the xdist workers take them first and the short files fill the end, so that both
# workers finish together (xdist's default order, by number of tests, left a long file for the end).
LONGEST_FILES = (
    "tests/models/test_families.py",
    "tests/test_generation.py",
    "tests/test_context.py",
    "tests/test_shared.py",
    "tests/models/test_packaged.py",
    "tests/test_readme.py",
    "tests/eval/test_cli.py",
    "tests/eval/test_evaluation.py",
    "tests/pallas_kernels/test_pallas_kernels.py",
)


def pytest_collection_modifyitems(config, items):
    """The longest files first (LONGEST_FILES); the tests that need more devices last, so that their child runs
    while the others do."""

    def rank(item):
        path = item.nodeid.split("::")[0]
        return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: a file's tests keep their order
    if TIER == "default":
        kept = sampled(items)
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = [i for i in items if i in kept]
    items[:] = [i for i in items if not devices_needed(i)] + [i for i in items if devices_needed(i)]


def _start_children(session):
    if session.config.option.collectonly:
        return
    children = session.config.stash.setdefault(_CHILDREN, {})
    for n in sorted({devices_needed(i) for i in session.items} - {0}):
        if _missing_devices(n):
            children[n] = _Child(session, n)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    child = item.config.stash.get(_CHILDREN, {}).get(devices_needed(item))
    if child is None:
        return None  # an ordinary test, or this process has the devices
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in child.reports(item):
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    # nothing was set up here for this test; finish what the previous test left that the next one does not share
    item.session._setupstate.teardown_exact(nextitem)
    return True


def pytest_sessionfinish(session, exitstatus):
    compile_count.write()
    stopped = exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) or session.shouldstop
    for child in session.config.stash.get(_CHILDREN, {}).values():
        child.finish(kill=bool(stopped))


class _ReportWriter:
    def __init__(self, config, path):
        self.config, self.file = config, open(path, "a")

    def pytest_runtest_logreport(self, report):
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        self.file.write(json.dumps(data) + "\n")
        self.file.flush()

    def pytest_unconfigure(self):
        self.file.close()


class _Child:
    """The child pytest process with `n` emulated CPU devices running the session's tests that need them, in a
    folder that every xdist worker of the run shares: the worker that creates it starts the child and writes
    its `pid` there, and a thread of that worker writes `exit` (its exit code) when it ends."""

    def __init__(self, session, n: int):
        config = self.config = session.config
        base = config._tmp_path_factory.getbasetemp()
        self.folder = (base.parent if hasattr(config, "workerinput") else base) / f"devices{n}-child"
        self.reports_path, self.output, self.exit = (
            self.folder / name for name in ("reports.jsonl", "output.txt", "exit")
        )
        self.process, self.received, self.offset = None, {}, 0
        self.deadline = time.monotonic() + CHILD_TIMEOUT
        try:
            self.folder.mkdir()
        except FileExistsError:
            return  # another worker started it
        self.reports_path.touch()
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags, **{REPORTS: str(self.reports_path)})
        ini = ["-c", str(config.inipath)] if config.inipath is not None else []
        nodeids = [i.nodeid for i in session.items if devices_needed(i) == n]
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *ini,
            f"--rootdir={config.rootpath}",
            f"--basetemp={self.folder / 'tmp'}",
            *nodeids,
        ]
        with open(self.output, "w") as out:
            self.process = subprocess.Popen(command, cwd=config.rootpath, env=env, stdout=out, stderr=subprocess.STDOUT)
        self._write("pid", self.process.pid)

        def wait():
            self._write("exit", self.process.wait())

        threading.Thread(target=wait, daemon=True).start()

    def _write(self, name: str, value: int) -> None:
        (self.folder / f"{name}.tmp").write_text(str(value))
        os.replace(self.folder / f"{name}.tmp", self.folder / name)

    def _read(self) -> None:
        if not self.reports_path.exists():
            return
        with open(self.reports_path, "rb") as f:
            f.seek(self.offset)
            text = f.read()
        complete = text[: text.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            data = json.loads(line)
            self.received.setdefault(data["nodeid"], []).append(data)

    def _done(self, nodeid: str) -> bool:
        got = self.received.get(nodeid, [])
        return bool(got) and got[-1]["when"] == "teardown"

    def _ended(self) -> bool:
        """Whether the child has ended: its starter wrote `exit`, or (the starter gone) no such process remains."""
        if self.exit.exists():
            return True
        if self.process is not None or not (self.folder / "pid").exists():
            return False
        try:
            os.kill(int((self.folder / "pid").read_text()), 0)
        except ProcessLookupError:
            return True
        return False

    def reports(self, item) -> list:
        nodeid = item.nodeid
        while True:
            ended = self._ended()  # before reading: every report is written by then
            self._read()
            if self._done(nodeid):
                return self._deserialize(self.received[nodeid], item)
            if ended or time.monotonic() > self.deadline:
                return [*self._deserialize(self.received.get(nodeid, []), item), self._lost(item, ended)]
            time.sleep(0.05)

    def _deserialize(self, data: list, item) -> list:
        reports = [self.config.hook.pytest_report_from_serializable(config=self.config, data=d) for d in data]
        for report in reports:  # JSON made lists of the tuples
            report.nodeid, report.location = item.nodeid, item.location
            report.sections = [tuple(section) for section in report.sections]
            if isinstance(report.longrepr, list):  # a skip: (path, line, reason)
                report.longrepr = tuple(report.longrepr)
        return reports

    def _lost(self, item, ended: bool):
        code = self.exit.read_text() if self.exit.exists() else "?"
        why = f"exited with code {code}" if ended else f"ran past {CHILD_TIMEOUT} s"
        tail = self.output.read_text(errors="replace")[-6000:] if self.output.exists() else ""
        return pytest.TestReport(
            item.nodeid,
            item.location,
            {k: 1 for k in item.keywords},
            "failed",
            f"the child pytest process with {devices_needed(item)} devices {why} before "
            f"reporting this test; the end of its output ({self.output}):\n{tail}",
            "call",
        )

    def finish(self, kill: bool) -> None:
        """At the end of the session of the worker that started the child: let it finish for the other workers
        (unless the run was stopped), then make sure it is gone."""
        if self.process is None:
            return
        if not kill:
            try:
                self.process.wait(timeout=max(0.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# ---- the run's compilation count -------------------------------------------------------------------------


def pytest_terminal_summary(terminalreporter, config):
    """The run's XLA compilations, summed over every process (the machine-independent cost of the suite), and
    with `--compilations N` the N test files that compile most and the N jitted functions compiled most often."""
    if (
        hasattr(config, "workerinput")
        or config.pluginmanager.has_plugin("jcascade-report-writer")
        or config.option.collectonly
    ):
        return  # a worker or the devices child: the process that started the run reports
    compile_count.write()
    per_test, programs = compile_count.read(os.environ["JCASCADE_TEST_COMPILATIONS"])
    total = compile_count.added_up(per_test.items(), key=lambda owner: "run").get("run") or dict.fromkeys(
        compile_count.FIELDS, 0.0
    )
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
    written = len([n for n in os.listdir(cache) if n.endswith("-cache")]) if os.path.isdir(cache) else 0
    write = terminalreporter.write_line
    terminalreporter.section("XLA compilations")
    write(
        f"{total['compiled']:,.0f} programs compiled in {total['compile_s']:,.0f} s; "
        f"{total['loaded']:,.0f} loaded from the run's compilation cache instead ({written:,} entries written), "
        f"saving {total['saved_s']:,.0f} s; tracing {total['trace_s']:,.0f} s, lowering {total['lower_s']:,.0f} s"
    )
    top = config.getoption("compilations")
    if top is None:
        return
    per_file = compile_count.added_up(per_test.items(), key=lambda owner: owner.split("::")[0].split(" (")[0])
    rows = sorted(per_file.items(), key=lambda kv: -(kv[1]["compile_s"] + kv[1]["trace_s"] + kv[1]["lower_s"]))
    write(f"{'compiled':>9} {'compile s':>10} {'loaded':>7} {'saved s':>8} {'trace s':>8} {'lower s':>8}  file")
    for name, v in rows[: top or None]:
        write(
            f"{v['compiled']:9.0f} {v['compile_s']:10.1f} {v['loaded']:7.0f} {v['saved_s']:8.1f} "
            f"{v['trace_s']:8.1f} {v['lower_s']:8.1f}  {name}"
        )
    write(f"{'compiled':>9} {'compile s':>10}  jitted function")
    for name, (count, seconds) in sorted(programs.items(), key=lambda kv: -kv[1][0])[: top or None]:
        write(f"{count:9.0f} {seconds:10.1f}  {name}")
