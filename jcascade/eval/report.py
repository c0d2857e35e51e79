"""Reports: evaluation results turned into the JSON payloads and printed tables of the `jcascade` command,
callable from a notebook. A report is a JSON-serialisable dict; `*_text` prints it, `summary` drops the
per-trial records (what `--json` prints), `jcascade.eval.plots` draws it.

    from jcascade.eval import passkey, report
    policies = report.labelled([jc.Sink(window=384), jc.Cascade(cache_size=384, num_cascades=2)])
    results = passkey.sweep(model, tokenizer, policies, [768], samples=24)
    rep = report.passkey(results, policies, run={"model": "SmolLM2-135M"})
    print(report.passkey_text(rep))          # the tables `jcascade passkey` prints
    rep["verdicts"]                          # {"Cascade 384x2": "better"}: vs the baseline, the first policy

Every estimate is {"value", "low", "high", "n", "method"} (`stats.Estimate.as_dict`): n is the number of
units behind it (prompts, or token blocks for perplexity), method how its 95 % interval was made.

JSON (`json_text`, what the command writes and prints) is strict: never NaN or Infinity. A number that is
not finite is written as null, and in an object a key "<key>_reason" beside it says why: for the bounds of
an estimate without interval, "no interval: " and its method (e.g. "low": null, "low_reason": "no interval:
too few units (n=4 < 5)"), otherwise the value it stands for ("not finite: nan", "not finite: inf"); in a
list the null stands alone. numpy numbers and arrays are written as JSON numbers and lists.
`stats.Estimate.from_dict` reads an estimate back.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jcascade.eval import passkey as passkey_eval
from jcascade.eval import perplexity as perplexity_eval
from jcascade.eval import stats
from jcascade.policies import spec


def with_format(label: str, policy) -> str:
    """`label` naming the policy's KV storage format when it is not the model's dtype ("Cascade 384x2 int8")."""
    return label if policy.kv_dtype == "model" else f"{label} {policy.kv_dtype}"


def labelled(policies: Sequence) -> dict[str, object]:
    """{short label: policy} (`Policy.label` with its storage format, e.g. "Cascade 384x2", "Cascade 384x2 int8");
    labels that collide get " #2", " #3"."""
    out: dict[str, object] = {}
    for policy in policies:
        base = with_format(policy.label, policy)
        label, k = base, 1
        while label in out:
            k += 1
            label = f"{base} #{k}"
        out[label] = policy
    return out


def policy_specs(policies, context_lengths: Sequence[int] = ()) -> dict:
    """The JSON form of a sweep's `policies` ({label: policy}, or a function of the context length returning it,
    as `passkey.sweep` and `ruler.sweep` take): {label: spec}, or {label: {str(length): spec}} for a function,
    at each of `context_lengths`. Specs are `jcascade.policies.spec`'s (parse_policy reads each back, so a run
    can be replayed from its JSON); a value that is already a str (a spec read from a report) is kept."""
    write = lambda policy: policy if isinstance(policy, str) else spec(policy)
    if not callable(policies):
        return {label: write(policy) for label, policy in policies.items()}
    if not context_lengths:
        raise ValueError("policy_specs: policies given as a function of the context length need the context lengths")
    at = {n: policies(n) for n in context_lengths}
    return {label: {str(n): write(at[n][label]) for n in context_lengths} for label in at[context_lengths[0]]}


def _check_results(results, kind: type, made_by: str, empty_ok: bool = False) -> list:
    """`results` as a list: a sequence of `kind` (what `made_by` returns), non-empty unless `empty_ok`, else a
    TypeError or ValueError naming the argument."""
    if isinstance(results, str | bytes | Mapping) or not isinstance(results, Sequence):
        raise TypeError(
            f"results must be a sequence of {kind.__name__} (as {made_by} returns), got {type(results).__name__}"
        )
    if not results and not empty_ok:
        raise ValueError(f"results is empty: a report needs at least one {kind.__name__} (as {made_by} returns)")
    strangers = [r for r in results if not isinstance(r, kind)]
    if strangers:
        raise TypeError(
            f"results must hold {kind.__name__}s (as {made_by} returns), got a "
            f"{type(strangers[0]).__name__}: {strangers[0]!r:.80}"
        )
    return list(results)


def _lengths(results: Sequence) -> list[int]:
    return sorted({r.context_length for r in results})


def _estimates(table: Mapping) -> dict:
    """{label: {key: Estimate}} -> {label: {str(key): dict}}."""
    return {label: {str(k): e.as_dict() for k, e in cells.items()} for label, cells in table.items()}


def _estimate(d: Mapping) -> stats.Estimate:
    return stats.Estimate.from_dict(d)


def _jsonable(value, reason: str = ""):
    """value with the module doc's JSON convention applied: (the value, the reason when it became null)."""
    if isinstance(value, np.ndarray | np.generic):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None, reason or f"not finite: {value}"
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            k = k.item() if isinstance(k, np.generic) else k
            estimate = k in ("low", "high") and isinstance(value.get("method"), str)
            out[k], why = _jsonable(v, f"no interval: {value['method']}" if estimate else "")
            if why:
                out[f"{k}_reason"] = why
        return out, ""
    if isinstance(value, list | tuple):
        return [_jsonable(v)[0] for v in value], ""
    return value, ""


def json_text(value, indent: int | None = 1) -> str:
    """Strict JSON of a report (or any result): the module doc's convention for numbers that are not finite;
    anything else that JSON cannot hold raises (ValueError, TypeError) rather than being written."""
    return json.dumps(_jsonable(value)[0], indent=indent, allow_nan=False)


def baseline_label(policies: Mapping, baseline: str | None) -> str:
    """`baseline` checked against the policy labels, or the first label when it is None."""
    if baseline is None:
        return next(iter(policies))
    if baseline not in policies:
        raise ValueError(f"baseline {baseline!r} must be one of the policy labels {list(policies)}")
    return baseline


def passkey(
    results: Sequence[passkey_eval.PasskeyResult], policies, *, baseline: str | None = None, run: Mapping | None = None
) -> dict:
    """The report of a passkey sweep (`passkey.sweep`; policies as swept, written by `policy_specs`): accuracy per
    policy and context length, per depth bucket, paired differences to `baseline` (default: the first
    policy) per length and over all, a verdict per policy, retention when recorded, every trial. run: what
    else the payload should hold (model, filler, seconds, ...)."""
    results = _check_results(results, passkey_eval.PasskeyResult, "passkey.sweep")
    policies = policy_specs(policies, _lengths(results))
    baseline = baseline_label(policies, baseline)
    retained = any(r.retention is not None for r in results)
    differences = passkey_eval.paired_differences(results, baseline) if len(policies) > 1 else {}
    by_bucket = passkey_eval.accuracy_table(results)
    return {
        **dict(run or {}),
        "policies": policies,
        "baseline": baseline,
        "prompts": {
            str(n): sum(1 for r in results if r.policy == baseline and r.context_length == n) for n in _lengths(results)
        },
        "accuracy": _estimates(passkey_eval.estimates(results)),
        "accuracy_by_bucket": {
            label: {str(n): {str(b): a for b, a in t.items()} for n, t in v.items()} for label, v in by_bucket.items()
        },
        "differences": _estimates(differences),
        "verdicts": {label: stats.verdict_word(d["all"], "better") for label, d in differences.items()},
        "retention": _estimates(passkey_eval.retention_estimates(results)) if retained else None,
        "retention_by_layer": (
            {
                label: {str(n): layers for n, layers in v.items()}
                for label, v in passkey_eval.retention_by_layer(results).items()
            }
            if retained
            else None
        ),
        "results": [dataclasses.asdict(r) for r in results],
    }


def _grid(table: Mapping, counts: Mapping[str, int], labels: Sequence[str]) -> list[str]:
    """Rows: context lengths with their n; columns: policies' "value [low, high]"."""
    cells = {
        (label, n): _estimate(table[label][n]).format() if n in table.get(label, {}) else "-"
        for label in labels
        for n in counts
    }
    width = max(len(text) for text in [*labels, *cells.values()]) + 2
    rows = ["context".rjust(7) + "n".rjust(6) + "".join(label.rjust(width) for label in labels)]
    return rows + [
        f"{int(n):7d}{count:6d}" + "".join(cells[label, n].rjust(width) for label in labels)
        for n, count in counts.items()
    ]


def passkey_text(report: Mapping) -> str:
    """The printed tables of a passkey report: accuracy with 95 % intervals and n per context length, by key
    depth, retention (if recorded), then the paired differences and verdicts."""
    labels, counts = list(report["policies"]), report["prompts"]
    lines = [
        "per-digit accuracy (random digits: 0.10) [95 % interval], n prompts per policy and length:",
        *_grid(report["accuracy"], counts, labels),
    ]
    buckets = len(next(iter(next(iter(report["accuracy_by_bucket"].values())).values())))
    per_cell = "/".join(sorted({str(n // buckets) for n in counts.values()}))
    lines += [
        "",
        f"by key depth (n={per_cell} per cell):".ljust(30)
        + " ".join(f"{100 * b // buckets}-{100 * (b + 1) // buckets}%".rjust(7) for b in range(buckets)),
    ]
    for label, by_length in report["accuracy_by_bucket"].items():
        for n, cells in by_length.items():
            lines.append(
                f"{label[:21]:>21} {int(n):7d}  "
                + " ".join(f"{cells.get(str(b), np.nan):7.2f}" for b in range(buckets))
            )
    if report.get("retention"):
        lines += [
            "",
            "key tokens the question sees (mean over layers and KV heads; 1 = all held):",
            *_grid(report["retention"], counts, labels),
        ]
    lines += ["", *difference_lines(report, "accuracy")]
    return "\n".join(lines)


def difference_lines(report: Mapping, measure: str) -> list[str]:
    """Per policy: its paired difference to the baseline per length, then the overall verdict sentence."""
    higher_is = "worse" if measure == "perplexity" else "better"
    unit = "tokens" if measure == "perplexity" else "context"  # RULER and passkey: by context length
    lines = []
    for label, cells in report["differences"].items():
        parts = ", ".join(f"{k} {unit}: {_estimate(e).format(n=True)}" for k, e in cells.items() if k != "all")
        if parts:
            lines.append(f"{measure} {label} - {report['baseline']}, paired, by length: {parts}")
        lines.append(f"{measure}: {stats.verdict(_estimate(cells['all']), label, report['baseline'], higher_is)}")
    return lines


def perplexity(
    results: Sequence[perplexity_eval.BookPerplexity],
    policies: Mapping[str, object],
    *,
    skipped: Sequence[str] = (),
    baseline: str | None = None,
    run: Mapping | None = None,
) -> dict:
    """The report of `perplexity.perplexity`: per policy over all books (with the position curve), per book,
    paired differences to `baseline` (default: the first policy) over the first N tokens and whole
    streams, and a verdict per policy (lower perplexity is better)."""
    results = _check_results(results, perplexity_eval.BookPerplexity, "perplexity.perplexity", empty_ok=bool(skipped))
    baseline = baseline_label(policies, baseline)
    differences = perplexity_eval.paired_differences(list(results), baseline) if len(policies) > 1 else {}
    return {
        **dict(run or {}),
        "policies": policy_specs(policies),
        "capacities": {label: perplexity_eval.cache_capacity(p) for label, p in policies.items()},
        "baseline": baseline,
        "skipped": list(skipped),
        "summary": perplexity_eval.summary(list(results)),
        "differences": _estimates(differences),
        "verdicts": {label: stats.verdict_word(d["all"], "worse") for label, d in differences.items()},
        "books": [
            dataclasses.asdict(r) | {"perplexity": r.perplexity, "interval": r.interval().as_dict()} for r in results
        ],
    }


def perplexity_text(report: Mapping) -> str:
    """The printed tables of a perplexity report: per book and over all books, with 95 % intervals and the
    number of blocks behind them, then the paired differences and verdicts."""
    labels, summary = list(report["policies"]), report["summary"]
    cells = {(b["book"], b["policy"]): _estimate(b["interval"]).format(n=True) for b in report["books"]}
    books = list(dict.fromkeys(b["book"] for b in report["books"]))
    rows = [
        (book[:27], next(b["tokens"] for b in report["books"] if b["book"] == book), [cells[book, k] for k in labels])
        for book in books
    ]
    rows.append(
        ("all", summary[labels[0]]["tokens"], [_estimate(summary[k]["interval"]).format(n=True) for k in labels])
    )
    width = max(len(text) for text in [*labels, *(c for row in rows for c in row[2])]) + 2
    lines = ["book".ljust(28) + "tokens".rjust(9) + "".join(label.rjust(width) for label in labels)]
    lines += [name.ljust(28) + f"{tokens:9d}" + "".join(c.rjust(width) for c in row) for name, tokens, row in rows]
    lines += [
        f"(perplexity [95 % interval] n=blocks of {report['books'][0]['block']} tokens: a bootstrap over blocks)",
        "",
    ]
    if report["skipped"]:
        lines += [f"skipped (not longer than the largest cache): {', '.join(report['skipped'])}", ""]
    return "\n".join(lines + difference_lines(report, "perplexity"))


def ruler(results: Sequence, policies, *, baseline: str | None = None, run: Mapping | None = None) -> dict:
    """The report of a RULER sweep (`ruler.sweep`; policies as swept, written by `policy_specs`): RULER's
    score (string_match_all, in [0, 1]) per policy, task and length, the average over tasks per length (a
    bootstrap over samples, stratified by task), paired differences to `baseline` (default: the first policy) on
    the same prompts per length and over all lengths, and a verdict per policy."""
    from jcascade.eval.ruler import RulerResult

    results = _check_results(results, RulerResult, "ruler.sweep")
    lengths = _lengths(results)
    policies = policy_specs(policies, lengths)
    baseline = baseline_label(policies, baseline)
    cells: dict[tuple, list] = {}
    for r in results:
        cells.setdefault((r.policy, r.task, r.context_length), []).append(r)
    scores: dict = {}
    for (label, task, n), mine in cells.items():
        scores.setdefault(label, {}).setdefault(task, {})[n] = stats.mean([r.score for r in mine], bounds=(0, 1))
    average, differences = {}, {}
    by_prompt = {
        label: {(r.task, r.context_length, r.index): r.score for r in results if r.policy == label}
        for label in policies
    }
    for label, mine in by_prompt.items():
        if label != baseline:
            stats.shared_units(mine, by_prompt[baseline], label, baseline, "prompt")
        for n in [*lengths, "all"]:
            keys = sorted(k for k in mine if n == "all" or k[1] == n)
            strata = [k[:2] if n == "all" else k[0] for k in keys]
            if n != "all" and keys:  # (merged runs: a policy may lack some lengths)
                average.setdefault(label, {})[n] = stats.mean([mine[k] for k in keys], strata=strata, bounds=(0, 1))
            shared = [k for k in keys if k in by_prompt[baseline]]
            if label != baseline and shared:
                differences.setdefault(label, {})[n] = stats.paired_difference(
                    [mine[k] for k in shared],
                    [by_prompt[baseline][k] for k in shared],
                    bounds=(0, 1),
                    strata=[k[:2] if n == "all" else k[0] for k in shared],
                )
    return {
        **dict(run or {}),
        "policies": policies,
        "baseline": baseline,
        "prompts": {str(n): sum(1 for r in results if r.policy == baseline and r.context_length == n) for n in lengths},
        "scores": {
            label: {task: {str(n): e.as_dict() for n, e in t.items()} for task, t in v.items()}
            for label, v in scores.items()
        },
        "average": _estimates(average),
        "differences": _estimates(differences),
        "verdicts": {label: stats.verdict_word(d["all"], "better") for label, d in differences.items()},
        "results": [dataclasses.asdict(r) for r in results],
    }


def ruler_text(report: Mapping) -> str:
    """The printed tables of a RULER report: the average over tasks per length and policy (95 % interval, n
    prompts), each task's score per policy (pooled over lengths), then the paired differences and verdicts."""
    labels = list(report["policies"])
    lines = [
        "RULER average over tasks (string_match_all, 0-1) [95 % interval], n prompts per policy and length:",
        *_grid(report["average"], report["prompts"], labels),
        "",
    ]
    tasks = list(dict.fromkeys(t for v in report["scores"].values() for t in v))
    width = max(len(label) for label in labels) + 2
    n = "/".join(sorted({str(e["n"]) for v in report["scores"].values() for t in v.values() for e in t.values()}))
    lines += [f"by task, mean over lengths (n={n} per length):", " " * 20 + "".join(k.rjust(width) for k in labels)]
    for task in tasks:
        means = [np.mean([e["value"] for e in report["scores"][label][task].values()]) for label in labels]
        lines.append(f"{task:>20}" + "".join(f"{m:.2f}".rjust(width) for m in means))
    return "\n".join(lines + ["", *difference_lines(report, "RULER")])


def attention_map(maps: Mapping, policies: Mapping[str, object], *, run: Mapping | None = None) -> dict:
    """The report of `attention_map.record` per policy (label -> AttentionMap): what each cache holds."""
    from jcascade.eval import attention_map as amap

    return {
        **dict(run or {}),
        "policies": policy_specs(policies),
        "maps": {label: amap.summary(m, getattr(policies[label], "sinks", 0)) for label, m in maps.items()},
    }


def attention_map_text(report: Mapping) -> str:
    return "\n".join(
        f"  {label}: before the last chunk (position {s['last_chunk_start']}) the cache holds "
        f"{s['held']} tokens, the oldest past the sinks at position {s['oldest_non_sink']}"
        for label, s in report["maps"].items()
    )


def summary(report: Mapping) -> dict:
    """The report without per-trial records, per-book curves and per-layer retention: what `--json` prints."""
    drop = {"results", "retention_by_layer", "accuracy_by_bucket"}
    out = {k: v for k, v in report.items() if k not in drop}
    if "summary" in out:
        out["summary"] = {k: {f: v for f, v in s.items() if f != "curve"} for k, s in out["summary"].items()}
        out["books"] = [{f: v for f, v in b.items() if f not in ("curve", "block_nll")} for b in out["books"]]
    return out
