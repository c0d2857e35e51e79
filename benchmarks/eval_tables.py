"""Markdown tables for benchmarks/RESULTS.md from the JSON that `benchmarks/run_evaluation.sh` writes.

    python benchmarks/eval_tables.py benchmarks/results/eval-qwen

Passkey: per-digit accuracy with its 95 % interval per context length and policy, Full beside them where
it ran, the paired difference of each Cascade to Sink, and the key tokens the question sees. Perplexity:
overall perplexity with its interval and the paired difference to Sink.
"""

from __future__ import annotations

import json
import pathlib
import sys

from jcascade.eval.stats import Estimate


def short(label: str) -> str:
    """'cascade:cache_size=2048,...,num_cascades=8,...' -> 'Cascade x8'; 'sink:...' -> 'Sink'."""
    name = label.split(":")[0].capitalize()
    fields = dict(item.split("=") for item in label.partition(":")[2].split(",") if item)
    return f"{name} x{fields.get('num_cascades', 4)}" if name == "Cascade" else name


def cell(d: dict | None) -> str:
    return "-" if d is None else Estimate(**d).format()


def passkey_table(run: pathlib.Path, full: pathlib.Path | None) -> str:
    data = json.loads((run / "passkey.json").read_text())
    full_data = json.loads((full / "passkey.json").read_text()) if full and full.exists() else None
    labels = list(data["policies"])
    head = [short(k) for k in labels] + (["Full"] if full_data else [])
    diffs = data["differences"]
    lines = ["| context | " + " | ".join(head) + " | " + " | ".join(f"{short(k)} - Sink" for k in diffs)
             + " | held: " + " / ".join(short(k) for k in labels) + " |",
             "|---" * (2 + len(head) + len(diffs)) + "|"]
    for n in map(str, data["context_lengths"]):
        row = [cell(data["accuracy"][k].get(n)) for k in labels]
        if full_data:
            row.append(cell(next(iter(full_data["accuracy"].values())).get(n)))
        row += [cell(diffs[k].get(n)) for k in diffs]
        held = " / ".join(f"{data['retention'][k][n]['value']:.2f}" for k in labels)
        lines.append(f"| {int(n):,} | " + " | ".join(row) + f" | {held} |")
    lines.append("| all lengths | " + " | ".join([""] * len(head)) + " | "
                 + " | ".join(cell(diffs[k]["all"]) for k in diffs) + " | |")
    return "\n".join(lines)


def perplexity_table(runs: list[pathlib.Path]) -> str:
    lines = ["| cache | tokens | Sink | Cascade x4 | Cascade x8 | x4 - Sink | x8 - Sink |", "|---" * 7 + "|"]
    for run in runs:
        data = json.loads((run / "perplexity.json").read_text())
        summary, labels = data["summary"], list(data["policies"])
        ppl = [f"{summary[k]['perplexity']:.2f} {Estimate(**summary[k]['interval']).bounds()}" for k in labels]
        diffs = [cell(data["differences"][k]) for k in labels[1:]]
        size = run.name.split("-")[-1]
        lines.append(f"| {size} | {next(iter(summary.values()))['tokens']:,} | " + " | ".join(ppl + diffs) + " |")
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
    main(sys.argv[1])
