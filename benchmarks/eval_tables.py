"""Markdown tables for the results book (docs/results/) from the JSON in benchmarks/results/: each page's table
names the command below that prints it.

    python benchmarks/eval_tables.py benchmarks/results/eval-qwen                 # passkey and perplexity
    python benchmarks/eval_tables.py ruler benchmarks/results/ruler-qwen benchmarks/results/ruler-qwen-16k
    python benchmarks/eval_tables.py protocols benchmarks/results/ruler-qwen-protocols/*
    python benchmarks/eval_tables.py formats benchmarks/results/kv-accuracy/*
    python benchmarks/eval_tables.py decode|prefill|state|memory FILE.json ...   # bench_model.py
    python benchmarks/eval_tables.py before-after B-*.json A-*.json               # bench_model.py, a change
    python benchmarks/eval_tables.py kernels FILE.json ...                        # bench_kernels.py
    python benchmarks/eval_tables.py flashinfer|shared|recycled FILE.json ...     # and so on: COMMANDS below

The estimates are recomputed from the per-trial (passkey) and per-block (perplexity) records in the JSON
with today's `jcascade.eval.stats`, so tables of older runs follow its rules too. Passkey: per-digit
accuracy with its 95 % interval per context length and policy (n prompts per cell), Full beside them where
it ran, the paired difference of each Cascade to Sink, and the key tokens the question sees. Perplexity:
overall perplexity with its interval and the paired difference to Sink over whole books. RULER: the runs'
per-prompt records merged (each prompt scored once per policy), then the average over tasks per length and
policy, the paired differences to Full and, at the same budget, of Cascade to Sink and of AdaKV, Expected
Attention and KVzip to SnapKV, and each task's score per length. Protocols: RULER runs of both protocols (each
run's JSON names its own) merged per protocol, every policy's average under each, the paired difference
query-agnostic - query-aware on the same prompts, and each policy's difference to Full within its protocol.
Formats: each policy in the model's dtype, int8 and float8 (labels ending in the format), paired format - model.
KVzip rows of runs whose policy ranked per KV head (every run before `kvzip` meant the paper's whole-model
allocation) are labelled "KVzip-head", as the command line names that policy now.

The timing tables print each run's GPU and date; a speed-up divides by the first row of the same shape and size
(batch, tokens) on the same GPU among the files given, so the order of the files names the baseline.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import pathlib
import statistics
import sys

from jcascade.eval import passkey, perplexity, report, ruler, stats


def record(run: pathlib.Path, name: str) -> pathlib.Path | None:
    """A run's `name`.json, else its gzip-compressed `name`.json.gz (per-prompt records are kept compressed), else
    None."""
    return next((p for p in (run / f"{name}.json", run / f"{name}.json.gz") if p.exists()), None)


def load(run: pathlib.Path, name: str) -> dict:
    """The contents of `record(run, name)`."""
    path = record(run, name) or run / f"{name}.json"  # missing: the error names the plain file
    return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())


def head_allocated(spec: str | dict) -> bool:
    """Whether a KVzip policy's spec (a text, or {context length: text}) ranks its tokens per KV head."""
    return all("global" not in text for text in (spec.values() if isinstance(spec, dict) else [spec]))


def ruler_records(run: pathlib.Path) -> tuple[dict, list[ruler.RulerResult]]:
    """A RULER run's report and its per-prompt results; KVzip ranked per KV head is labelled "KVzip-head ..."."""
    rep = load(run, "ruler")
    renamed = {
        label: "KVzip-head" + label[len("KVzip") :]
        for label, spec in rep["policies"].items()
        if label.split()[0] == "KVzip" and head_allocated(spec)
    }
    return rep, [ruler.RulerResult(**(r | {"policy": renamed.get(r["policy"], r["policy"])})) for r in rep["results"]]


def short(label: str) -> str:
    """'cascade:cache_size=2048,...,num_cascades=8,...' -> 'Cascade x8'; 'sink:...' -> 'Sink'; the short labels
    of newer runs ('Cascade 2048x8') as they are."""
    if ":" not in label:
        return label
    name = label.split(":")[0].capitalize()
    fields = dict(item.split("=") for item in label.partition(":")[2].split(",") if item)
    return f"{name} x{fields.get('num_cascades', 4)}" if name == "Cascade" else name


def cell(e) -> str:
    return "-" if e is None else e.format()


def trials(run: pathlib.Path) -> list[passkey.PasskeyResult]:
    """The per-trial records of a passkey run, policies under their short labels."""
    records = load(run, "passkey")["results"]
    return [passkey.PasskeyResult(**(r | {"policy": short(r["policy"])})) for r in records]


def passkey_table(run: pathlib.Path, full: pathlib.Path | None) -> str:
    results = trials(run)
    full_cells = next(iter(passkey.estimates(trials(full)).values())) if full and full.exists() else None
    accuracy, held = passkey.estimates(results), passkey.retention_estimates(results)
    labels = list(accuracy)
    base = next((k for k in labels if k.startswith("Sink")), labels[0])  # the differences' baseline
    diffs = passkey.paired_differences(results, base)
    head = labels + (["Full"] if full_cells else [])
    lines = [
        "| context | n | "
        + " | ".join(head)
        + " | "
        + " | ".join(f"{k} - {base}" for k in diffs)
        + " | held: "
        + " / ".join(labels)
        + " |",
        "|---" * (3 + len(head) + len(diffs)) + "|",
    ]
    for n in sorted(accuracy[labels[0]]):
        row = [cell(accuracy[k].get(n)) for k in labels] + ([cell(full_cells.get(n))] if full_cells else [])
        row += [cell(diffs[k].get(n)) for k in diffs]
        lines.append(
            f"| {n:,} | {accuracy[labels[0]][n].n} | "
            + " | ".join(row)
            + " | "
            + " / ".join(f"{held[k][n].value:.2f}" for k in labels)
            + " |"
        )
    pooled = diffs[next(iter(diffs))]["all"].n
    lines.append(
        f"| all lengths | {pooled} | "
        + " | ".join([""] * len(head))
        + " | "
        + " | ".join(cell(diffs[k]["all"]) for k in diffs)
        + " | |"
    )
    return "\n".join(lines)


def passkey_tables(runs: list[pathlib.Path]) -> str:
    """The passkey table of each run folder that holds every policy it compares (Full among them)."""
    return "\n\n".join(passkey_table(run, None) for run in runs)


def perplexity_table(runs: list[pathlib.Path]) -> str:
    lines = ["| cache | tokens | blocks | Sink | Cascade x4 | Cascade x8 | x4 - Sink | x8 - Sink |", "|---" * 8 + "|"]
    fields = {f.name for f in dataclasses.fields(perplexity.BookPerplexity)}
    for run in runs:
        books = load(run, "perplexity")["books"]
        results = [
            perplexity.BookPerplexity(**({k: v for k, v in b.items() if k in fields} | {"policy": short(b["policy"])}))
            for b in books
        ]
        summary = perplexity.summary(results)
        labels = list(summary)
        diffs = perplexity.paired_differences(results, labels[0])
        interval = {k: summary[k]["interval"] for k in labels}
        ppl = [f"{summary[k]['perplexity']:.2f} [{interval[k]['low']:.2f}, {interval[k]['high']:.2f}]" for k in labels]
        lines.append(
            f"| {run.name.split('-')[-1]} | {summary[labels[0]]['tokens']:,} | {interval[labels[0]]['n']} | "
            + " | ".join(ppl + [cell(diffs[k]["all"]) for k in labels[1:]])
            + " |"
        )
    return "\n".join(lines)


RULER_PAIRS = {
    "Cascade": "Sink",
    "AdaKV-SnapKV": "SnapKV",
    "ExpectedAttention": "SnapKV",
    "KVzip": "SnapKV",
    "KVzip-head": "SnapKV",
}  # also compared at a budget


def ruler_tables(runs: list[pathlib.Path]) -> str:
    results = {}
    for run in runs:
        for r in ruler_records(run)[1]:
            results[(r.policy, r.task, r.context_length, r.index)] = r
    results = list(results.values())
    labels = list(dict.fromkeys(r.policy for r in results))
    merged = report.ruler(results, dict.fromkeys(labels, ""), baseline="Full")
    lengths = sorted(int(n) for n in merged["prompts"])
    average, differences = merged["average"], merged["differences"]

    def est(table, label, n):  # a report's estimate as a table cell, "-" where that policy did not run
        found = table.get(label, {}).get(str(n))
        return cell(found and stats.Estimate(**found))

    lines = [
        "**Average over the tasks** (n prompts per policy and length)",
        "",
        "| context | n | " + " | ".join(labels) + " |",
        "|---" * (2 + len(labels)) + "|",
    ]
    lines += [
        f"| {n:,} | {merged['prompts'][str(n)]} | " + " | ".join(est(average, k, n) for k in labels) + " |"
        for n in lengths
    ]
    pairs = [(k, "Full") for k in labels if k != "Full"]
    pairs += [
        (k, k.replace(mine, base, 1))
        for mine, base in RULER_PAIRS.items()
        for k in labels
        if k.startswith(mine + " ") and k.replace(mine, base, 1) in labels
    ]
    lines += [
        "",
        "**Paired differences** on the same prompts, per length and over the lengths each pair ran",
        "",
        "| difference | " + " | ".join(f"{n // 1024}K" for n in lengths) + " | all |",
        "|---" * (2 + len(lengths)) + "|",
    ]
    for mine, base in pairs:
        table = (
            differences
            if base == "Full"
            else report.ruler([r for r in results if r.policy in (mine, base)], {base: "", mine: ""}, baseline=base)[
                "differences"
            ]
        )
        lines.append(f"| {mine} - {base} | " + " | ".join(est(table, mine, n) for n in [*lengths, "all"]) + " |")
    tasks = list(ruler.TASKS)
    lines += [
        "",
        "**Each task** (score per length, n = 50 prompts each; - not run)",
        "",
        "| task | " + " | ".join(labels) + " |",
        "|---" * (1 + len(labels)) + "|",
    ]
    for task in tasks:
        scores = [merged["scores"][k].get(task, {}) for k in labels]
        row = [" / ".join(f"{s[str(n)]['value']:.2f}" if str(n) in s else "-" for n in lengths) for s in scores]
        lines.append(f"| {task} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def ruler_results(runs: list[pathlib.Path]) -> dict[str, dict[tuple, ruler.RulerResult]]:
    """{protocol: {(policy, task, length, index): result}}: the runs' per-prompt records merged per protocol."""
    merged: dict[str, dict[tuple, ruler.RulerResult]] = {}
    for run in runs:
        report_, results = ruler_records(run)
        for r in results:
            merged.setdefault(report_.get("protocol", "query-aware"), {})[
                (r.policy, r.task, r.context_length, r.index)
            ] = r
    return merged


def protocol_table(runs: list[pathlib.Path]) -> str:
    by_protocol = ruler_results(runs)
    aware, agnostic = by_protocol.get("query-aware", {}), by_protocol.get("query-agnostic", {})
    labels = list(dict.fromkeys(key[0] for key in [*aware, *agnostic]))
    names = list(dict.fromkeys(label.split()[0] for label in labels))
    labels.sort(
        key=lambda label: (float(label.split()[-1].rstrip("%")) if "%" in label else 0.0, names.index(label.split()[0]))
    )  # Full, then by budget

    def scores(results, label):  # {(task, length, index): score} of one policy
        return {key[1:]: r.score for key, r in results.items() if key[0] == label}

    def difference(a: dict, b: dict):  # a - b on the prompts both hold, None where they share none
        same = sorted(a.keys() & b.keys())
        return same and stats.paired_difference(
            [a[k] for k in same], [b[k] for k in same], strata=[k[0] for k in same], bounds=(0, 1)
        )

    def mean(a: dict):
        return a and stats.mean(list(a.values()), strata=[k[0] for k in a], bounds=(0, 1))

    lines = [
        "| policy | n | query-aware | query-agnostic | agnostic - aware | aware - Full | agnostic - Full |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in labels:
        mine, theirs = scores(aware, label), scores(agnostic, label)
        cells = [mean(mine), mean(theirs), difference(theirs, mine)]
        cells += (
            [None, None]
            if label == "Full"
            else [difference(mine, scores(aware, "Full")), difference(theirs, scores(agnostic, "Full"))]
        )
        lines.append(
            f"| {label} | {max(len(mine), len(theirs))} | " + " | ".join(cell(c or None) for c in cells) + " |"
        )
    return "\n".join(lines)


FORMATS = ("int8", "float8_e4m3fn")


def base_label(label: str) -> tuple[str, str]:
    """'Cascade 25% int8' -> ('Cascade 25%', 'int8'); a label without a format -> (label, 'model')."""
    head, _, last = label.rpartition(" ")
    return (head, last) if last in FORMATS else (label, "model")


def formats_table(runs: list[pathlib.Path]) -> str:
    """Each policy in the model's dtype beside its int8 and float8 storage, and the paired differences format -
    model on the same prompts (RULER per protocol, passkey) or blocks (perplexity), from whichever of ruler.json,
    passkey.json and perplexity.json each run folder holds."""
    lines = [
        "| metric | policy | n | model dtype | int8 | float8_e4m3fn | int8 - model | float8 - model |",
        "|---" * 8 + "|",
    ]

    def add(metric, labels, n, value, difference):
        for base in dict.fromkeys(base_label(k)[0] for k in labels):
            mine = {base_label(k)[1]: k for k in labels if base_label(k)[0] == base}
            if "model" not in mine:
                continue
            cells = [value(mine.get(f)) for f in ("model", *FORMATS)]
            cells += [difference(mine[f], mine["model"]) if f in mine else None for f in FORMATS]
            lines.append(
                f"| {metric} | {base} | {n(mine['model'])} | "
                + " | ".join(c if isinstance(c, str) else cell(c) for c in cells)
                + " |"
            )

    for run in runs:
        if record(run, "ruler"):
            rep, results = ruler_records(run)
            by = {
                k: {(r.task, r.context_length, r.index): r.score for r in results if r.policy == k}
                for k in dict.fromkeys(r.policy for r in results)
            }
            mean = lambda k: k and stats.mean(list(by[k].values()), strata=[t[0] for t in by[k]], bounds=(0, 1))

            def paired(k, base):
                same = sorted(by[k].keys() & by[base].keys())
                return stats.paired_difference(
                    [by[k][t] for t in same], [by[base][t] for t in same], strata=[t[0] for t in same], bounds=(0, 1)
                )

            add(f"RULER {rep.get('protocol', 'query-aware')}", list(by), lambda k: len(by[k]), mean, paired)
        if record(run, "passkey"):
            results = [passkey.PasskeyResult(**r) for r in load(run, "passkey")["results"]]
            labels = list(dict.fromkeys(r.policy for r in results))
            pooled = lambda k: k and stats.mean([r.accuracy for r in results if r.policy == k], bounds=(0, 1))
            add(
                "passkey",
                labels,
                lambda k: sum(r.policy == k for r in results),
                pooled,
                lambda k, base: passkey.paired_differences([r for r in results if r.policy in (k, base)], base)[k][
                    "all"
                ],
            )
        if record(run, "perplexity"):
            fields = {f.name for f in dataclasses.fields(perplexity.BookPerplexity)}
            results = [
                perplexity.BookPerplexity(**{k: v for k, v in b.items() if k in fields})
                for b in load(run, "perplexity")["books"]
            ]
            summary = perplexity.summary(results)

            def ppl(k):
                if k is None:
                    return None
                i = summary[k]["interval"]
                return f"{summary[k]['perplexity']:.3f} [{i['low']:.3f}, {i['high']:.3f}]"

            def relative(k, base):
                d = perplexity.paired_differences([r for r in results if r.policy in (k, base)], base)[k]["all"]
                return f"{cell(d)} ({d.value / summary[base]['perplexity']:+.2%})"

            add("perplexity", list(summary), lambda k: f"{summary[k]['tokens']:,} tokens", ppl, relative)
    return "\n".join(lines)


# The timing runs' JSON (bench_model.py, bench_kernels.py, bench_flashinfer.py, ...): one table per kind.

RESULTS = pathlib.Path(__file__).parent / "results"


def read(path: str | pathlib.Path) -> dict:
    """One JSON file, plain or gzip-compressed."""
    path = pathlib.Path(path)
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def name(path: str | pathlib.Path) -> str:
    """A results file as the book names it: its path under benchmarks/results/, without .json or .json.gz."""
    path = pathlib.Path(path).resolve()
    shown = path.relative_to(RESULTS.resolve()) if path.is_relative_to(RESULTS.resolve()) else path
    return f"`{shown.as_posix().removesuffix('.gz').removesuffix('.json')}`"


def gpu(run: dict) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100'; 'cpu' -> 'CPU'."""
    device = run.get("device", "?")
    return next((w for w in device.split() if w[:1] in "HABL" and w[1:2].isdigit()), device.upper())


def kv_format(run: dict) -> str:
    """The KV storage of a bench_model run: bf16 (the model's dtype), int8 or float8_e4m3fn."""
    found = run.get("policy", "").partition("kv_dtype=")[2].split(",")[0]
    return "bf16" if found in ("", "model") else found


def tp(run: dict) -> str:
    """The 'model' axis of a run's mesh, and its processes where more than one."""
    size, processes = (run.get("mesh") or {}).get("model", 1), run.get("processes") or 1
    return f"{size}" + (f" ({processes} processes)" if processes > 1 else "")


def speedups(rows: list[tuple[tuple, float | None]]) -> list[str] | None:
    """Each (key, value) row's speed-up over the first row of its key: first value / value ("-" where either is
    missing, e.g. a batch that did not fit); None where no key has two rows (nothing to compare)."""
    first: dict = {}
    for key, value in rows:
        first.setdefault(key, value)
    if len(first) == len(rows):
        return None
    return [f"{first[key] / value:.2f}x" if value and first[key] else "-" for key, value in rows]


def markdown(head: list[str], rows: list[list[str]], extra: tuple[str, list[str]] | None = None) -> str:
    """A markdown table; `extra`, (its heading, its cells), is a last column where given."""
    if extra:
        head, rows = head + [extra[0]], [row + [cell_] for row, cell_ in zip(rows, extra[1])]
    return "\n".join(
        ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"] + ["| " + " | ".join(r) + " |" for r in rows]
    )


def decode_table(paths: list[pathlib.Path]) -> str:
    """bench_model.py's decode steps: ms a step per batch, the fraction of the step's memory roofline (bytes over
    the bandwidth the run measured, shown in TB/s) and, where files share a GPU and shape, the speed-up over the
    first of them."""
    found = [(path, run, r) for path in paths for run in [read(path)] for r in run.get("decode", [])]
    rows = []
    for path, run, r in found:
        row = [name(path), gpu(run), run["date"], run.get("shape") or "8b", tp(run), kv_format(run), str(r["batch"])]
        if r.get("ms_per_step") is None:
            rows.append(row + [r.get("error", "not run"), "", ""])
            continue
        bandwidth = run["bandwidth"]["rate"] / 1e12 if "bandwidth" in run else run.get("copy_gb_s", 0) / 1e3
        rows.append(
            row
            + [
                f"{r['ms_per_step']:.2f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['fraction_of_roofline']:.2f} ({bandwidth:.2f})",
            ]
        )
    ups = speedups([((gpu(run), run.get("shape"), r["batch"]), r.get("ms_per_step")) for _, run, r in found])
    head = ["JSON", "GPU", "date", "shape", "TP", "KV", "batch", "ms a step", "tokens/s", "of roofline (TB/s)"]
    return markdown(head, rows, ups and ("speed-up", ups))


def prefill_table(paths: list[pathlib.Path]) -> str:
    """bench_model.py's strided prefill: seconds, tokens/s and MFU per prompt length and, where files share a GPU
    and shape, the speed-up over the first of them."""
    found = [
        (path, run, r) for path in paths for run in [read(path)] for r in (run.get("prefill") or {}).get("rows", [])
    ]
    rows = [
        [name(path), gpu(run), run["date"], run.get("shape") or "8b", tp(run), f"{r['tokens']:,}"]
        + [f"{r['seconds']:.2f}", f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.2f}"]
        for path, run, r in found
    ]
    ups = speedups([((gpu(run), run.get("shape"), r["tokens"]), r["seconds"]) for _, run, r in found])
    head = ["JSON", "GPU", "date", "shape", "TP", "tokens", "seconds", "tokens/s", "MFU"]
    return markdown(head, rows, ups and ("speed-up", ups))


def before_after_table(paths: list[pathlib.Path]) -> str:
    """bench_model.py before and after a change: files named B-*.json (before) and A-*.json (after), the two sides'
    runs alternating on one GPU. Per shape and measure (a decode step per batch, a prefill per length): each side's
    runs and the ratio after / before of their medians."""
    sides, runs = {"B": {}, "A": {}}, []
    for path in paths:
        if path.name[:2] not in ("B-", "A-"):
            raise SystemExit(f"{path}: name the files B-*.json (before the change) and A-*.json (after it)")
        run = read(path)
        runs.append(run)
        shape, side = run.get("shape") or "8b", sides[path.name[0]]
        for r in run.get("decode", []):
            side.setdefault((shape, f"decode, batch {r['batch']}", "ms"), []).append(r["ms_per_step"])
        for r in (run.get("prefill") or {}).get("rows", []):
            side.setdefault((shape, f"prefill, {r['tokens']:,} tokens", "s"), []).append(r["seconds"])
    rows = []
    for key, before in sides["B"].items():
        after = sides["A"].get(key)
        if after:
            runs_of = lambda xs: ", ".join(f"{x:.2f}" for x in xs) + f" {key[2]}"
            ratio = statistics.median(after) / statistics.median(before)
            rows.append([key[0], key[1], runs_of(before), runs_of(after), f"{ratio:.3f}"])
    where = ", ".join(sorted({f"{gpu(run)}, {run['date']}" for run in runs}))
    return f"{where}\n\n" + markdown(["shape", "measure", "before", "after", "after / before"], rows)


def state_table(paths: list[pathlib.Path]) -> str:
    """The state a row holds (from the shapes: K/V in the run's format, scores, recurrent states), by layer type."""
    lines = ["| shape | KV | state | GB per row | of which, by layer type |", "|---" * 5 + "|"]
    for path in paths:
        run = read(path)
        for state, kinds in run["state_bytes_per_row"].items():
            parts = ", ".join(f"{kind} {n / 1e9:.3f}" for kind, n in kinds.items())
            total = sum(kinds.values()) / 1e9
            lines.append(f"| {run.get('shape') or '8b'} | {kv_format(run)} | {state} | {total:.2f} | {parts} |")
    return "\n".join(lines)


def memory_table(paths: list[pathlib.Path]) -> str:
    """Bytes a token takes in each run's KV format (K, V, their scales, and the score and position of its slot), from
    the state of its Cascade cache (`state_bytes_per_row`) over that cache's slots; what a sequence then holds."""
    lines = [
        "| shape | KV | bytes per token | tokens per GB | 32K context: Full / a quarter kept "
        "| 128K: Full / a quarter |",
        "|---" * 6 + "|",
    ]
    for path in paths:
        run = read(path)
        fields = dict(item.split("=") for item in run["policy"].partition(":")[2].split(","))
        state = next(v for k, v in run["state_bytes_per_row"].items() if k.startswith("Cascade"))
        per_token = sum(state.values()) / (int(fields["cache_size"]) + int(fields["sinks"]))
        gb = [n * per_token / 1e9 for n in (32768, 8192, 131072, 32768)]
        lines.append(
            f"| {run.get('shape') or '8b'} | {kv_format(run)} | {per_token:,.0f} | {1e9 / per_token:,.0f} | "
            f"{gb[0]:.3g} / {gb[1]:.3g} GB | {gb[2]:.3g} / {gb[3]:.3g} GB |"
        )
    return "\n".join(lines)


IMPLEMENTATIONS = {"mosaic_gpu": "Mosaic GPU", "triton": "Triton"}


def kernels_tables(paths: list[pathlib.Path]) -> str:
    """bench_kernels.py: (a) chunk attention against cuDNN, (b) one layer over 1M tokens against cuDNN's causal
    attention (the paper's Figure 6b) and its stride sweep (6c), (c) one token pushed at a time (6a), (d) decode
    attention over a full cache, per KV format and variant, with the fraction of the memory bandwidth."""
    runs = [(path, read(path)) for path in paths]
    out = []
    chunk = [(p, r) for p, r in runs if "a_chunk" in r and "mosaic_gpu" in r["a_chunk"]["best"]]
    if chunk:
        lines = [
            "| JSON | GPU | date | cuDNN, no scores: ms | "
            + " | ".join(f"{v}: forward ms (x cuDNN) | {v}: with scores" for v in IMPLEMENTATIONS.values())
            + " |",
            "|---" * 8 + "|",
        ]
        for path, run in chunk:
            a = run["a_chunk"]
            cells = [
                f"{a['best'][k]['ms_without_scores']:.2f} ({a['best'][k]['ratio_without_scores']:.2f}x) | "
                f"{a['best'][k]['ms_with_scores']:.2f} ({a['best'][k]['ratio_with_scores']:.2f}x)"
                for k in IMPLEMENTATIONS
            ]
            lines.append(
                f"| {name(path)} | {gpu(run)} | {run['date']} | {a['baseline_ms']:.2f} | " + " | ".join(cells) + " |"
            )
        out.append("\n".join(lines))
    prefill = [(p, r) for p, r in runs if "b_prefill_1m" in r]
    if prefill:
        lines = [
            "| JSON | GPU | date | cuDNN causal: s | Mosaic GPU: s (speed-up) | Triton: s (speed-up) | "
            "stride 1024 / 4096 / 16384: s |",
            "|---" * 7 + "|",
        ]
        for path, run in prefill:
            b = run["b_prefill_1m"]
            ours = [f"{b['ours_s'][k]:.2f} ({b['speedup'][k]:.1f}x)" for k in IMPLEMENTATIONS]
            sweep = {s["stride"]: s["seconds"] for s in b["stride_sweep"]} | {4096: b["ours_s"]["mosaic_gpu"]}
            lines.append(
                f"| {name(path)} | {gpu(run)} | {run['date']} | {b['full_attention_at_tokens_s']:.2f} | "
                + " | ".join(ours)
                + " | "
                + " / ".join(f"{sweep[k]:.2f}" for k in sorted(sweep))
                + " |"
            )
        out.append("\n".join(lines))
    for path, run in runs:
        if "c_push" in run:
            lines = [
                f"{name(path)}, {gpu(run)}, {run['date']}:",
                "",
                "| batch | cascades | implementation | fill: us a token | steady: us a token |",
                "|---" * 5 + "|",
            ]
            lines += [
                f"| {c['batch']} | {c['cascades'] or '-'} | {c['implementation']} | "
                + " | ".join(f"{c[k]:.2f}" if c.get(k) else "" for k in ("fill_us_per_token", "steady_us_per_token"))
                + " |"
                for c in run["c_push"]
            ]
            out.append("\n".join(lines))
    decode = [(p, r) for p, r in runs if r.get("d_decode") and "variant" in r["d_decode"][0]]
    if decode:
        variants = list(dict.fromkeys(d["variant"] for _, r in decode for d in r["d_decode"]))
        lines = [
            "| JSON | GPU | date | batch | KV | " + " | ".join(f"{v}: us (of bandwidth)" for v in variants) + " |",
            "|---" * (5 + len(variants)) + "|",
        ]
        for path, run in decode:
            cells: dict = {}
            for d in run["d_decode"]:
                cells.setdefault((d["batch"], d["kv_dtype"]), {})[d["variant"]] = (
                    f"{d['us_per_step']:.1f} ({d['fraction_of_bandwidth']:.2f})"
                )
            lines += [
                f"| {name(path)} | {gpu(run)} | {run['date']} | {batch} | {'bf16' if kv == 'model' else kv} | "
                + " | ".join(found.get(v, "") for v in variants)
                + " |"
                for (batch, kv), found in cells.items()
            ]
        out.append("\n".join(lines))
    return "\n\n".join(out)


BEST, OURS = "FlashInfer decode, best of CUDA-core / tensor-core", "jcascade decode, bf16 (RoPE in the kernel)"
FLASHINFER_ROWS = {  # a row of the table: the methods of bench_flashinfer.py it takes the fastest of
    BEST: ("flashinfer decode", "flashinfer decode (tc)"),
    "FlashInfer decode, RoPE in the kernel": ("flashinfer decode, rope",),
    "FlashInfer decode, fp8 (a scale per tensor)": ("flashinfer decode fp8",),
    OURS: ("jcascade decode",),
    "jcascade decode, int8": ("jcascade decode int8",),
    "jcascade decode, float8_e4m3fn": ("jcascade decode fp8",),
    "jcascade decode, bf16, keys stored rotated": ("jcascade decode, stored rotated",),
    "jcascade decode, int8, keys stored rotated": ("jcascade decode int8, stored rotated",),
    "jcascade decode, float8_e4m3fn, keys stored rotated": ("jcascade decode fp8, stored rotated",),
    "FlashInfer cascade (FA2), prefix read once": ("flashinfer cascade (fa2)",),
    "jcascade shared prefix": ("jcascade shared",),
}
FLASHINFER_RATIOS = {  # rows that do the same work: jcascade's time over FlashInfer's
    "jcascade bf16 / FlashInfer best": (OURS, BEST),
    "jcascade int8 / FlashInfer fp8": ("jcascade decode, int8", "FlashInfer decode, fp8 (a scale per tensor)"),
    "jcascade shared / FlashInfer cascade": ("jcascade shared prefix", "FlashInfer cascade (FA2), prefix read once"),
    "jcascade int8 / bf16, both keys stored rotated": (
        "jcascade decode, int8, keys stored rotated",
        "jcascade decode, bf16, keys stored rotated",
    ),
    "jcascade int8, keys stored rotated / FlashInfer best": ("jcascade decode, int8, keys stored rotated", BEST),
}


def flashinfer_table(paths: list[pathlib.Path]) -> str:
    """bench_flashinfer.py: one decode step of one 8B attention layer over a 32K-token prefix plus 16 tokens of
    each row's own, device ms per method and batch, both libraries on one machine; then jcascade's time over
    FlashInfer's for the pairs that do the same work."""
    out = []
    for path in paths:
        run = read(path)
        ms = {(r["method"], r["batch"]): r["device_ms"] for r in run["rows"] if r.get("device_ms")}
        batches = sorted({b for _, b in ms})
        rows = {
            label: [min((ms[m, b] for m in methods if (m, b) in ms), default=None) for b in batches]
            for label, methods in FLASHINFER_ROWS.items()
        }
        rows = {label: times for label, times in rows.items() if any(times)}
        lines = [
            f"| {name(path)}, {gpu(run)}, {run['date']}: device ms | " + " | ".join(f"B = {b}" for b in batches) + " |",
            "|---" * (1 + len(batches)) + "|",
        ]
        lines += [f"| {label} | " + " | ".join(f"{t:.3f}" for t in times) + " |" for label, times in rows.items()]
        lines += [
            f"| {label} | " + " | ".join(f"{a / b:.2f}x" for a, b in zip(rows[mine], rows[theirs])) + " |"
            for label, (mine, theirs) in FLASHINFER_RATIOS.items()
            if mine in rows and theirs in rows
        ]
        kv = {r["batch"]: r["kv_bytes"] for r in run["rows"] if r["method"] == "jcascade decode" and r.get("kv_bytes")}
        if kv and BEST in rows and OURS in rows:  # the replicated cache's K and V bytes over the device time
            lines.append(
                "| K and V read, TB/s: FlashInfer best / jcascade bf16 | "
                + " | ".join(
                    f"{kv[b] / t / 1e9:.2f} / {kv[b] / o / 1e9:.2f}" for b, t, o in zip(batches, rows[BEST], rows[OURS])
                )
                + " |"
            )
        out.append("\n".join(lines))
    return "\n\n".join(out)


def shared_table(paths: list[pathlib.Path]) -> str:
    """bench_shared.py: one decode step of one 8B layer over a 32K-token prefix stored once (`jc.attend_shared`)
    against a Full cache holding the prefix for every row, ms of wall clock a call and the speed-up."""
    out = []
    for path in paths:
        run = read(path)
        by = {}
        for r in run["rows"]:
            by.setdefault(r.get("kv_dtype", "model"), {})[r["batch"]] = r
        batches = sorted({r["batch"] for r in run["rows"]})
        lines = [
            f"| {name(path)}, {gpu(run)}, {run['date']}: ms (speed-up) | "
            + " | ".join(f"B = {b}" for b in batches)
            + " | largest difference from the replicated cache |",
            "|---" * (2 + len(batches)) + "|",
        ]
        for kv, rows in by.items():
            cells = [f"{rows[b]['shared_ms']:.3f} ({rows[b]['speedup']:.1f}x)" if b in rows else "" for b in batches]
            worst = max(r["max_abs_difference"] for r in rows.values())
            lines.append(
                f"| prefix stored once, {'bf16' if kv == 'model' else kv} | " + " | ".join(cells) + f" | {worst:.1e} |"
            )
        first = next(iter(by.values()))
        lines.append(
            "| replicated bf16 cache | " + " | ".join(f"{first[b]['replicated_ms']:.3f}" for b in batches) + " | |"
        )
        out.append("\n".join(lines))
    return "\n\n".join(out)


def recycled_table(paths: list[pathlib.Path]) -> str:
    """bench_recycled.py: decode after a 32K-token prompt, ms a step of the recycled steps, of the step that
    re-selects, their mean over a refresh period, and each policy's speed-up over Full at the same batch."""
    out = []
    for path in paths:
        run = read(path)
        full = {r["batch"]: r for r in run["rows"] if r["policy"] == "Full"}
        lines = [
            f"{name(path)}, {gpu(run)}, {run['date']}:",
            "",
            "| batch | policy | steps 1-49: ms | vs Full | step 50: ms | mean over the 50: ms | vs Full |",
            "|---" * 7 + "|",
        ]
        lines += [
            f"| {r['batch']} | {r['policy']} | {r['ms_per_step']:.2f} | "
            f"{base['ms_per_step'] / r['ms_per_step']:.2f}x | "
            f"{r['last_step_ms']:.2f} | {r['mean_ms_per_step']:.2f} | "
            f"{base['mean_ms_per_step'] / r['mean_ms_per_step']:.2f}x |"
            for r in run["rows"]
            for base in [full[r["batch"]]]
        ]
        out.append("\n".join(lines))
    return "\n\n".join(out)


def data_parallel_table(paths: list[pathlib.Path]) -> str:
    """bench_data_parallel.py: RULER prompts/s on one GPU and over a mesh or several processes in the same call,
    the speed-up, the outputs equal to one GPU's, and the paired score difference where the run scored it."""
    lines = [
        "| JSON | GPU | date | run | prompts | prompts/s | speed-up | identical outputs | score - one GPU |",
        "|---" * 9 + "|",
    ]
    for path in paths:
        run = read(path)
        for label, r in run["runs"].items():
            difference = r.get("score_minus_one_device")
            lines.append(
                f"| {name(path)} | {gpu(run)} | {run['date']} | {label} | {r['prompts']} | {r['prompts_per_s']:.2f} | "
                f"{r['speedup']:.2f}x | {r['identical_outputs']} of {r['prompts']} | "
                f"{cell(difference and stats.Estimate.from_dict(difference))} |"
            )
    return "\n".join(lines)


def questions_table(paths: list[pathlib.Path]) -> str:
    """bench_many_questions.py: accuracy, the paired difference to the shared context, questions/s, peak memory."""
    lines = ["| JSON | GPU | date | policy | method | n | accuracy | - shared (paired) | questions/s | peak GB |"]
    lines.append("|---" * 10 + "|")
    for path in paths:
        run = read(path)
        lines += [
            f"| {name(path)} | {gpu(run)} | {run['date']} | {r['policy']} | {r['method']} | {r['n']} | "
            f"{cell(stats.Estimate.from_dict(r['accuracy']))} | "
            f"{cell(r['versus_first'] and stats.Estimate.from_dict(r['versus_first']))} | "
            f"{r['questions_per_s']:.2f} | {r['peak_gb']:.2f} |"
            for r in run["rows"]
        ]
    return "\n".join(lines)


def main_job_table(paths: list[pathlib.Path]) -> str:
    """`jcascade compare` runs (passkey, Sink against Cascade): each policy's accuracy and the paired difference,
    recomputed from the per-trial records with today's statistics."""
    lines = ["| JSON | context | cache | cascades | trials per policy | Sink | Cascade | Cascade - Sink |"]
    lines.append("|---" * 8 + "|")
    for path in paths:
        run = read(path)
        results = [passkey.PasskeyResult(**r) for r in run["results"]]
        accuracy, difference = passkey.estimates(results), passkey.paired_differences(results, "Sink")["Cascade"]
        length = run["context_lengths"][0]
        fields = dict(f.split("=") for f in run["policies"]["Cascade"].partition("(")[2].rstrip(")").split(", "))
        lines.append(
            f"| {name(path)} | {length:,} | {fields['sinks']} + {int(fields['cache_size']):,} | "
            f"{fields['num_cascades']} | "
            f"{accuracy['Sink'][length].n} | {cell(accuracy['Sink'][length])} | {cell(accuracy['Cascade'][length])} | "
            f"{cell(difference['all'])} |"
        )
    return "\n".join(lines)


KVPRESS_METHODS = {"kvzip": "kvzip-head"}  # the kvpress scripts' "kvzip" is jc.KVzip's per-KV-head allocation


def kvpress_table(paths: list[pathlib.Path]) -> str:
    """accuracy_kvpress.py: jcascade and kvpress on the same prompts, each side's accuracy, the paired difference,
    the identical answers and each side's prompts/s (runs of both protocols; query-aware first)."""
    rows = []
    for path in paths:
        run = read(path)
        protocol = run.get("protocol", "query-aware")
        rows += [(protocol, run, r) for r in run["rows"]]
    rows.sort(key=lambda row: row[0] != "query-aware")  # stable: each protocol's rows in the files' order
    seen = set()
    lines = [
        "| protocol | method | kept | jcascade | kvpress | jcascade - kvpress | identical answers | "
        "prompts/s jcascade / kvpress |",
        "|---" * 8 + "|",
    ]
    for protocol, run, r in rows:
        kept = r.get("kept", run.get("kept")) if r["method"] != "full" else None
        if (protocol, r["method"], kept) in seen:  # a method two runs share (Full beside each): its first run
            continue
        seen.add((protocol, r["method"], kept))
        n = r.get("n", r["jcascade"]["n"])
        speed = r.get("jcascade_prompts_per_s"), r.get("kvpress_prompts_per_s")
        speed_cell = f"{speed[0]:.1f} / {speed[1]:.2f} ({speed[0] / speed[1]:.1f}x)" if all(speed) else "-"
        estimates = [cell(stats.Estimate.from_dict(r[k])) for k in ("jcascade", "kvpress", "difference")]
        lines.append(
            f"| {protocol} | {KVPRESS_METHODS.get(r['method'], r['method'])} | {kept or '-'} | "
            + " | ".join(estimates)
            + " | "
            f"{r['identical_answers'] * n:.0f} / {n} | {speed_cell} |"
        )
    return "\n".join(lines)


def parity_table(paths: list[pathlib.Path]) -> str:
    """parity_kvpress.py: per method, the mean overlap of jcascade's kept set with kvpress's and the identical sets."""
    lines = ["| method | mean overlap of the kept sets | identical sets |", "|---" * 3 + "|"]
    for path in paths:
        lines += [
            f"| {KVPRESS_METHODS.get(r['method'], r['method'])} | {r['overlap']:.3f} | "
            f"{round(r['identical'] * r['sets'])} / {r['sets']} |"
            for r in read(path)["rows"]
        ]
    return "\n".join(lines)


def main(root: str) -> None:
    root = pathlib.Path(root)
    for run in sorted(root.glob("passkey-*")):
        filler = run.name.split("-")[-1]
        print(f"\n**{run.name}**\n\n" + passkey_table(run, root / f"full-{filler}"))
    runs = sorted(root.glob("perplexity-*"), key=lambda p: int(p.name.split("-")[-1]))
    if runs:
        print("\n**perplexity**\n\n" + perplexity_table(runs))


COMMANDS = {
    "passkey": passkey_tables,
    "ruler": ruler_tables,
    "protocols": protocol_table,
    "formats": formats_table,
    "decode": decode_table,
    "prefill": prefill_table,
    "before-after": before_after_table,
    "state": state_table,
    "memory": memory_table,
    "kernels": kernels_tables,
    "flashinfer": flashinfer_table,
    "shared": shared_table,
    "recycled": recycled_table,
    "data-parallel": data_parallel_table,
    "questions": questions_table,
    "main-job": main_job_table,
    "kvpress": kvpress_table,
    "parity": parity_table,
}  # the first argument names the table; else it is an evaluation folder of passkey and perplexity runs


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in COMMANDS and len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        sys.exit(f"usage: eval_tables.py FOLDER | {{{'|'.join(COMMANDS)}}} FILE_OR_FOLDER ...\n{__doc__}")
    if sys.argv[1] in COMMANDS:
        print(COMMANDS[sys.argv[1]]([pathlib.Path(path) for path in sys.argv[2:]]))
    else:
        main(sys.argv[1])
