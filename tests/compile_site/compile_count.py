"""Counts the XLA compilations of a test run, per test, in every process of the run.

Each process that imports jax (the pytest process, its xdist workers, the child run with emulated devices, and the
subprocesses the tests start: the command line, the README's blocks, multi-process runs) listens to jax's monitoring
events and writes what it saw to a file of its own in the folder named by `$JCASCADE_TEST_COMPILATIONS` (a test process
after each test module and when its session ends, any process when it exits). A compile is charged to the test that
`$PYTEST_CURRENT_TEST` names when it happens (pytest sets it during a test's setup, call and teardown; subprocesses
inherit it), or to the file being collected, else to "(outside a test)".

What is counted, per test:
- `compiled`: programs XLA compiled (jax's backend compile event, less the programs loaded from the persistent
  compilation cache), and `compile_s` their seconds;
- `loaded`: programs loaded from the persistent cache instead, and `saved_s` the compile seconds that saved
  (jax's own estimate: the original compile time less the read);
- `trace_s` and `lower_s`: seconds spent tracing to jaxprs and lowering to MLIR, which no cache saves.
"""

import atexit
import json
import os
import threading

FOLDER = "JCASCADE_TEST_COMPILATIONS"
FIELDS = ("compiled", "compile_s", "loaded", "saved_s", "trace_s", "lower_s")
OUTSIDE = "(outside a test)"

_stats: dict[str, list[float]] = {}
_programs: dict[str, list[float]] = {}  # jitted function name -> [compiled, compile_s]
_hit = threading.local()  # a cache hit is announced inside the compile whose duration follows it
_installed = False
collecting = None  # the test file being collected, set by the conftest


def _owner() -> str:
    current = os.environ.get("PYTEST_CURRENT_TEST")
    if current:
        return current.rsplit(" (", 1)[0]  # "path::name[param] (call)" -> "path::name[param]"
    return collecting or OUTSIDE


def _add(field: str, value: float) -> None:
    _stats.setdefault(_owner(), [0.0] * len(FIELDS))[FIELDS.index(field)] += value


def _on_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _hit.value = True


def _on_duration(event: str, seconds: float, fun_name: str = "?", **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        if getattr(_hit, "value", False):
            _hit.value = False
            _add("loaded", 1)
        else:
            _add("compiled", 1)
            _add("compile_s", seconds)
            program = _programs.setdefault(fun_name, [0, 0.0])
            program[0] += 1
            program[1] += seconds
    elif event == "/jax/compilation_cache/compile_time_saved_sec":
        _add("saved_s", max(seconds, 0.0))
    elif event == "/jax/core/compile/jaxpr_trace_duration":
        _add("trace_s", seconds)
    elif event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        _add("lower_s", seconds)


def install() -> None:
    """Listens to jax's events in this process (once) and writes them out at exit; `write` may come sooner."""
    global _installed
    if _installed or not os.environ.get(FOLDER):
        return
    _installed = True
    from jax._src import monitoring

    monitoring.register_event_listener(_on_event)
    monitoring.register_event_duration_secs_listener(_on_duration)
    atexit.register(write)


def write() -> None:
    """Writes this process's counts so far to its own file of the run's folder (replacing an earlier write)."""
    folder = os.environ.get(FOLDER)
    if not folder or not _stats or not os.path.isdir(folder):
        return
    path = os.path.join(folder, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(
            {"tests": {owner: dict(zip(FIELDS, values)) for owner, values in _stats.items()}, "programs": _programs}, f
        )
    os.replace(path + ".tmp", path)


def added_up(counts, key=lambda owner: owner) -> dict[str, dict[str, float]]:
    """(owner, {field: value}) pairs added up per `key(owner)` (every field present, 0 where none was counted)."""
    total: dict[str, dict[str, float]] = {}
    for owner, values in counts:
        mine = total.setdefault(key(owner), dict.fromkeys(FIELDS, 0.0))
        for field, value in values.items():
            mine[field] += value
    return total


def read(folder: str) -> tuple[dict[str, dict[str, float]], dict[str, list[float]]]:
    """Every process's counts in `folder`, added up per test (or collection, or outside), and the programs
    compiled per jitted function name ([count, seconds])."""
    counts, programs = [], {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                data = json.load(f)
            counts += data["tests"].items()
            for program, (count, seconds) in data["programs"].items():
                mine = programs.setdefault(program, [0, 0.0])
                mine[0] += count
                mine[1] += seconds
    return added_up(counts), programs
