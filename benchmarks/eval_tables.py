"""Markdown tables for benchmarks/RESULTS.md from the JSON that `benchmarks/run_evaluation.sh` and `jcascade ruler`
write.

    python benchmarks/eval_tables.py benchmarks/results/eval-qwen
    python benchmarks/eval_tables.py ruler benchmarks/results/ruler-qwen benchmarks/results/ruler-qwen-16k-32k
    python benchmarks/eval_tables.py protocols benchmarks/results/ruler-qwen-protocols/*
    python benchmarks/eval_tables.py formats benchmarks/results/kv-accuracy/*

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
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import pathlib
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
    diffs = passkey.paired_differences(results, labels[0])
    head = labels + (["Full"] if full_cells else [])
    lines = [
        "| context | n | "
        + " | ".join(head)
        + " | "
        + " | ".join(f"{k} - {labels[0]}" for k in diffs)
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
        for r in load(run, "ruler")["results"]:
            results[(r["policy"], r["task"], r["context_length"], r["index"])] = ruler.RulerResult(**r)
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
        report_ = load(run, "ruler")
        for r in report_["results"]:
            key = (r["policy"], r["task"], r["context_length"], r["index"])
            merged.setdefault(report_.get("protocol", "query-aware"), {})[key] = ruler.RulerResult(**r)
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
            rep = load(run, "ruler")
            results = [ruler.RulerResult(**r) for r in rep["results"]]
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


def main(root: str) -> None:
    root = pathlib.Path(root)
    for run in sorted(root.glob("passkey-*")):
        filler = run.name.split("-")[-1]
        print(f"\n**{run.name}**\n\n" + passkey_table(run, root / f"full-{filler}"))
    runs = sorted(root.glob("perplexity-*"), key=lambda p: int(p.name.split("-")[-1]))
    if runs:
        print("\n**perplexity**\n\n" + perplexity_table(runs))


if __name__ == "__main__":
    if sys.argv[1] == "ruler":
        print(ruler_tables([pathlib.Path(p) for p in sys.argv[2:]]))
    elif sys.argv[1] == "protocols":
        print(protocol_table([pathlib.Path(p) for p in sys.argv[2:]]))
    elif sys.argv[1] == "formats":
        print(formats_table([pathlib.Path(p) for p in sys.argv[2:]]))
    else:
        main(sys.argv[1])
