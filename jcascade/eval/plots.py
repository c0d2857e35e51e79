"""PNG plots of the evaluations (matplotlib's object API with the Agg renderer: no display, no pyplot state).

Every figure is sized to its text: constrained layout, titles wrapped to the figure's width. A point whose
95 % interval is missing (fewer than `stats.MIN_UNITS` units) is drawn hollow, without a bar, and its panel's
title says `NO_INTERVAL`. Every colour scale has a colour bar that names what the colour means.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

import numpy as np

from jcascade.eval import stats

NO_INTERVAL = f"n < {stats.MIN_UNITS}: no interval"


def _figure(panels: int = 1, width: float = 6.0, height: float = 4.0, layout: str = "constrained"):
    """A figure of `panels` axes side by side, each width x height inches; layout "compressed" for panels of
    fixed aspect (images)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * panels, height), layout=layout)
    return fig, fig.subplots(1, panels, squeeze=False)[0]


def _interval_errors(cells: list[Mapping]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values float [k], error bars float [2, k] (NaN where no interval), has interval bool [k]) of estimate
    dicts (a report's, in memory or read back from JSON with null bounds)."""
    estimates = [stats.Estimate.from_dict(c) for c in cells]
    values = np.array([e.value for e in estimates])
    return (
        values,
        np.abs(np.array([[e.low for e in estimates], [e.high for e in estimates]]) - values),
        np.array([e.has_interval for e in estimates], bool),
    )


def _points(ax, x, cells: list[Mapping], horizontal: bool = False, **kwargs) -> bool:
    """Estimates at x (y when horizontal) with their 95 % intervals as bars; points without one hollow and
    without a bar. Returns whether any point lacks its interval."""
    values, errors, has = _interval_errors(cells)
    xy, err = ((values, x), "xerr") if horizontal else ((x, values), "yerr")
    line = ax.errorbar(*xy, **{err: errors}, marker="o", capsize=3, **kwargs)[0]
    if not has.all():
        ax.plot(*(np.asarray(v)[~has] for v in xy), "o", color=line.get_color(), markerfacecolor="white", zorder=3)
    return not has.all()


def _panel_title(ax, text: str, missing: bool) -> None:
    """A panel's title, saying `NO_INTERVAL` when some of its points lack their interval."""
    ax.set_title(text + (f"\n{NO_INTERVAL} (hollow points)" if missing else ""), fontsize=9, wrap=True)


def _save(fig, path: str | pathlib.Path) -> pathlib.Path:
    """Writes `fig` at 120 dpi as a PNG of 256 colours (a palette image, a third of the bytes of matplotlib's
    RGBA and the same to the eye: lines, text and colour scales)."""
    import io

    from PIL import Image

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rendered = io.BytesIO()
    fig.savefig(rendered, format="png", dpi=120)
    Image.open(rendered).convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return path


def _length_ticks(lengths) -> list[str]:
    return [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths]


def _with_intervals(
    ax,
    table: Mapping[str, Mapping[str, Mapping]],
    counts: Mapping[str, int],
    ylabel: str,
    title: str,
    offset: float = 0.0,
) -> None:
    """One line per policy of estimate cells {label: {length: estimate dict}} (a report's), 95 % intervals as
    bars, the x ticks the lengths with the n behind each. offset: a small x shift per line, in octaves."""
    missing = False
    for i, (label, cells) in enumerate(table.items()):
        lengths = sorted(cells, key=int)
        x = np.array([int(n) for n in lengths]) * 2.0 ** (offset * (i - (len(table) - 1) / 2))
        missing |= _points(ax, x, [cells[n] for n in lengths], label=label)
    ax.set_xscale("log", base=2)
    ticks = sorted(counts, key=int)
    ax.set_xticks(
        [int(n) for n in ticks], [f"{t}\nn={counts[n]}" for t, n in zip(_length_ticks(map(int, ticks)), ticks)]
    )
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens); n = prompts per point")
    ax.set_ylabel(ylabel)
    _panel_title(ax, title, missing)


def _differences(ax, report: Mapping, xlabel: str, ylabel: str, units: str, all_at: int | None = None) -> None:
    """Each policy's paired difference to the baseline per length with its 95 % interval, and zero; the
    difference over "all" at x = all_at, if given. The x ticks name the lengths and the n behind them."""
    colors = {label: f"C{i}" for i, label in enumerate(report["policies"])}
    ticks, missing = {}, False
    for label, cells in report["differences"].items():
        lengths = [k for k in cells if k != "all" or all_at is not None]
        x = np.array([all_at if k == "all" else int(k) for k in lengths], float)
        missing |= _points(ax, x, [cells[k] for k in lengths], color=colors[label])
        ticks |= {
            int(v): f"{'all' if k == 'all' else _length_ticks([int(k)])[0]}\nn={cells[k]['n']}"
            for v, k in zip(x, lengths)
        }
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ticks), list(ticks.values()))
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    _panel_title(ax, f"paired difference to {report['baseline']} (same {units})", missing)


def _legend_below(fig, ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4), fontsize=8)


def _heat_map(ax, grid: np.ndarray, fontsize: int = 8):
    """grid float [rows, columns] in [0, 1] as coloured cells with their values written in (NaN cells blank);
    returns the image, for its colour bar."""
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
        if not np.isnan(value):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=fontsize)
    return image


def passkey(report: Mapping, path, title: str = "") -> pathlib.Path:
    """A passkey report (`jcascade.eval.report.passkey`) as one figure: per-digit accuracy vs context length
    per policy with 95 % intervals (Figure 8 style); the paired difference of each policy to the baseline
    per length (the verdict's quantity); the key tokens the question sees, when recorded. n on the axis."""
    return _save(_passkey(report, title), path)


def _passkey(report: Mapping, title: str):
    panels = (
        ["accuracy"]
        + (["differences"] if report["differences"] else [])
        + (["retention"] if report.get("retention") else [])
    )
    fig, axes = _figure(len(panels), width=4.6, height=4.2)
    counts = report["prompts"]
    axes[0].axhline(0.1, color="gray", linestyle=":", label="random digits")
    _with_intervals(axes[0], report["accuracy"], counts, "per-digit accuracy (95 % interval)", "accuracy", offset=0.04)
    axes[0].set_ylim(-0.02, 1.02)
    if "differences" in panels:
        ax = axes[panels.index("differences")]
        _differences(ax, report, "context length (tokens)", "accuracy difference (95 % interval)", "prompts")
    if "retention" in panels:
        ax = axes[panels.index("retention")]
        _with_intervals(
            ax,
            report["retention"],
            counts,
            "share of key tokens seen (95 % interval)",
            "retention (mean over layers and KV heads)",
            offset=0.04,
        )
        ax.set_ylim(-0.02, 1.02)
    _legend_below(fig, axes[0])
    fig.suptitle(title or "Passkey retrieval", wrap=True)
    return fig


def passkey_depth(report: Mapping, path, title: str = "") -> pathlib.Path:
    """Accuracy per depth bucket (rows) x context length (columns), one panel per policy, each cell the mean
    of its prompts (n per cell in the title)."""
    return _save(_passkey_depth(report, title), path)


def _passkey_depth(report: Mapping, title: str):
    table = report["accuracy_by_bucket"]
    lengths = sorted(report["prompts"], key=int)
    buckets = len(next(iter(table[next(iter(table))].values())))
    per_cell = {report["prompts"][n] // buckets for n in lengths}
    fig, axes = _figure(len(table), width=max(3.2, 1.4 + 0.9 * len(lengths)), height=3.6)
    for ax, (label, by_length) in zip(axes, table.items()):
        grid = np.array([[by_length[n].get(str(b), np.nan) for n in lengths] for b in range(buckets)])
        image = _heat_map(ax, grid)
        ax.set_xticks(range(len(lengths)), _length_ticks(int(n) for n in lengths))
        ax.set_yticks(range(buckets), [f"{100 * b // buckets}-{100 * (b + 1) // buckets}%" for b in range(buckets)])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("key depth")
        ax.set_title(label, fontsize=9, wrap=True)
    fig.colorbar(image, ax=list(axes), label="per-digit accuracy (mean of the cell)")
    fig.suptitle(
        (title + ": " if title else "") + f"accuracy by key depth, n={'/'.join(map(str, sorted(per_cell)))} "
        "prompts per cell",
        fontsize=10,
        wrap=True,
    )
    return fig


def perplexity(report: Mapping, path, title: str = "") -> pathlib.Path:
    """A perplexity report (`jcascade.eval.report.perplexity`) as one figure: perplexity of each position
    bucket vs position per policy (Figure 7 style; dotted lines at the bounded caches' capacities); each
    policy's overall perplexity with its 95 % interval and n blocks; the paired difference to the baseline
    over the first N tokens."""
    return _save(_perplexity(report, title), path)


def _perplexity(report: Mapping, title: str):
    summary = report["summary"]
    panels = 3 if report["differences"] else 2
    fig, axes = _figure(panels, width=4.6, height=4.2)
    ax, overall = axes[0], axes[1]
    for label, s in summary.items():
        curve = np.exp(np.asarray(s["curve"]))
        ax.plot((np.arange(curve.size) + 0.5) * s["bucket"], curve, label=label)
    for capacity in sorted({c for c in report["capacities"].values() if c}):
        ax.axvline(capacity, color="gray", linestyle=":")
    ax.set_yscale("log")
    ax.set_xlabel("position in the book (tokens); dotted: cache sizes")
    ax.set_ylabel("perplexity of the position bucket")
    ax.set_title("by position", fontsize=9, wrap=True)
    labels = list(summary)
    missing = False
    for i, label in enumerate(labels):
        missing |= _points(overall, [i], [summary[label]["interval"]], horizontal=True, color=f"C{i}")
    overall.set_yticks(range(len(labels)), [f"{k}\nn={summary[k]['interval']['n']}" for k in labels], fontsize=8)
    overall.invert_yaxis()
    overall.set_xlabel("perplexity over all books (95 % interval)")
    _panel_title(overall, "overall; n = blocks", missing)
    if report["differences"]:
        longest = max(b["tokens"] for b in report["books"])
        _differences(
            axes[2],
            report,
            "first N tokens of each book; all: whole books",
            "perplexity difference (95 % interval)",
            "blocks",
            all_at=longest,
        )
    _legend_below(fig, ax)
    fig.suptitle(title or "Streaming perplexity", wrap=True)
    return fig


def ruler(report: Mapping, path, title: str = "") -> pathlib.Path:
    """A RULER report (`jcascade.eval.report.ruler`) as one figure: the average over tasks vs context length
    per policy with 95 % intervals (n on the axis), the paired difference to the baseline per length, and a
    task x policy heat map of the score (mean over lengths)."""
    return _save(_ruler(report, title), path)


def _ruler(report: Mapping, title: str):
    fig, axes = _figure(3, width=4.8, height=4.4)
    _with_intervals(
        axes[0],
        report["average"],
        report["prompts"],
        "average score over tasks (95 % interval)",
        "average over tasks",
        offset=0.04,
    )
    axes[0].set_ylim(-0.02, 1.02)
    if report["differences"]:
        _differences(axes[1], report, "context length (tokens)", "score difference (95 % interval)", "prompts")
    labels = list(report["policies"])
    tasks = list(dict.fromkeys(t for v in report["scores"].values() for t in v))
    grid = np.array(
        [[np.mean([e["value"] for e in report["scores"][label][task].values()]) for label in labels] for task in tasks]
    )
    fig.colorbar(_heat_map(axes[2], grid, fontsize=7), ax=axes[2], label="score (RULER string match, 0-1)")
    axes[2].set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    axes[2].set_yticks(range(len(tasks)), tasks, fontsize=8)
    axes[2].set_title("score by task (mean over lengths)", fontsize=9, wrap=True)
    _legend_below(fig, axes[0])
    fig.suptitle(title or "RULER", wrap=True)
    return fig


def attention_maps(images: Mapping[str, np.ndarray], length: int, path, title: str = "") -> pathlib.Path:
    """One panel per policy of `jcascade.eval.attention_map.render` images (query rows, key columns): held keys
    coloured by log10 EMA score, keys visible without a score in one colour, white where nothing is."""
    return _save(_attention_maps(images, length, title), path)


def _attention_maps(images: Mapping[str, np.ndarray], length: int, title: str):
    from matplotlib.colors import ListedColormap

    finite = np.concatenate([im[np.isfinite(im)] for im in images.values()])
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    fig, axes = _figure(len(images), width=5.0, height=4.6, layout="compressed")
    for ax, (label, image) in zip(axes, images.items()):
        common = dict(extent=(0, length, length, 0), interpolation="nearest")
        ax.imshow(np.where(np.isposinf(image), 1.0, np.nan), cmap=ListedColormap(["#f4a582"]), vmin=0, vmax=1, **common)
        shown = ax.imshow(
            np.where(np.isfinite(image), image, np.nan), cmap="viridis", vmin=low, vmax=max(high, low + 1e-6), **common
        )
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        ax.set_title(label, fontsize=9, wrap=True)
    if finite.size:
        fig.colorbar(shown, ax=list(axes), label="log10 EMA score of a held key")
    fig.suptitle(
        title + ("\n" if title else "") + "salmon: visible keys without a score (the query's own chunk, "
        "or a policy that keeps none)",
        fontsize=9,
        wrap=True,
    )
    return fig
