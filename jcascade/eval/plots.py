"""PNG plots of the evaluations (matplotlib's object API with the Agg renderer: no display, no pyplot state)."""

from __future__ import annotations

import pathlib
import textwrap
from collections.abc import Mapping

import numpy as np


def _figure(panels: int = 1, width: float = 6.0, height: float = 4.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * panels, height), layout="constrained")
    return fig, fig.subplots(1, panels, squeeze=False)[0]


def _save(fig, path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _with_intervals(ax, table: Mapping[str, Mapping[int, object]], ylabel: str) -> None:
    """One line per policy of Estimate cells {policy: {context_length: Estimate}}, 95 % intervals as bars."""
    for label, by_length in table.items():
        lengths = sorted(by_length)
        cells = [by_length[n] for n in lengths]
        values = np.array([c.value for c in cells])
        spread = np.abs(np.array([[c.low for c in cells], [c.high for c in cells]]) - values)
        ax.errorbar(lengths, values, yerr=np.nan_to_num(spread), marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ticks = sorted({n for by_length in table.values() for n in by_length})
    ax.set_xticks(ticks, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in ticks])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.02, 1.02)


def passkey_accuracy(accuracy: Mapping[str, Mapping[int, object]], path, title: str = "",
                     retention: Mapping[str, Mapping[int, object]] | None = None) -> pathlib.Path:
    """Mean per-digit accuracy vs context length with 95 % intervals, one line per policy (Figure 8 style);
    with `retention`, a second panel shows the fraction of key tokens the question sees.
    accuracy, retention: {policy: {context_length: Estimate}} (`jcascade.eval.passkey.estimates`)."""
    fig, axes = _figure(2 if retention else 1)
    _with_intervals(axes[0], accuracy, "per-digit accuracy (95 % interval)")
    axes[0].axhline(0.1, color="gray", linestyle=":", label="random digits")
    axes[0].set_title(title or "Passkey retrieval")
    axes[0].legend(fontsize=8)
    if retention:
        _with_intervals(axes[1], retention, "key tokens held when the question is fed")
        axes[1].set_title("Retention (mean over layers and KV heads)")
        axes[1].legend(fontsize=8)
    return _save(fig, path)


def passkey_heatmaps(table: Mapping[str, Mapping[int, Mapping[int, float]]], path, num_buckets: int = 5) -> pathlib.Path:
    """Accuracy per depth bucket (rows) x context length (columns), one panel per policy."""
    fig, axes = _figure(len(table), width=1.2 + 0.9 * max(len(t) for t in table.values()), height=3.6)
    for ax, (label, by_length) in zip(axes, table.items()):
        lengths = sorted(by_length)
        grid = np.array([[by_length[n].get(b, np.nan) for n in lengths] for b in range(num_buckets)])
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for (b, j), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(j, b, f"{value:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(num_buckets), [f"{100 * b // num_buckets}-{100 * (b + 1) // num_buckets}%"
                                           for b in range(num_buckets)])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("key depth")
        ax.set_title(label, fontsize=9)
    fig.colorbar(image, ax=list(axes), label="per-digit accuracy")
    return _save(fig, path)


def perplexity_curves(summary: Mapping[str, Mapping], path, capacities: Mapping[str, int | None] | None = None,
                      title: str = "") -> pathlib.Path:
    """Left: perplexity of each position bucket vs position, one line per policy (Figure 7 style); dotted
    vertical lines mark the bounded caches' capacities (label -> capacity, None for unbounded). Right: each
    policy's overall perplexity with its 95 % interval. summary: `jcascade.eval.perplexity.summary`."""
    fig, (ax, overall) = _figure(2, width=5.5)
    for label, s in summary.items():
        curve = np.exp(np.asarray(s["curve"]))
        ax.plot((np.arange(curve.size) + 0.5) * s["bucket"], curve, label=f"{label} (overall {s['perplexity']:.2f})")
    for capacity in sorted({c for c in (capacities or {}).values() if c}):
        ax.axvline(capacity, color="gray", linestyle=":", label=f"cache of {capacity} tokens")
    ax.set_yscale("log")
    ax.set_xlabel("position in the book (tokens)")
    ax.set_ylabel("perplexity of the position bucket")
    ax.set_title(title or "Streaming perplexity")
    ax.legend(fontsize=8)
    labels = list(summary)
    values = np.array([summary[k]["perplexity"] for k in labels])
    bounds = np.array([[summary[k]["interval"]["low"], summary[k]["interval"]["high"]] for k in labels]).T
    overall.errorbar(values, range(len(labels)), xerr=np.nan_to_num(np.abs(bounds - values)), fmt="o", capsize=4)
    overall.set_yticks(range(len(labels)), [textwrap.fill(label.replace(",", ", "), 24) for label in labels], fontsize=7)
    overall.invert_yaxis()
    overall.set_xlabel("perplexity over all books (95 % interval)")
    overall.set_title("Overall")
    return _save(fig, path)


def attention_maps(images: Mapping[str, np.ndarray], length: int, path, title: str = "") -> pathlib.Path:
    """One panel per policy of `jcascade.eval.attention_map.render` images (query rows, key columns): held keys
    coloured by log10 EMA score, keys visible without a score in one colour, white where nothing is."""
    from matplotlib.colors import ListedColormap

    finite = np.concatenate([im[np.isfinite(im)] for im in images.values()])
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    fig, axes = _figure(len(images), width=5.0, height=4.6)
    for ax, (label, image) in zip(axes, images.items()):
        common = dict(extent=(0, length, length, 0), interpolation="nearest")
        ax.imshow(np.where(np.isposinf(image), 1.0, np.nan), cmap=ListedColormap(["#f4a582"]), vmin=0, vmax=1,
                  **common)
        shown = ax.imshow(np.where(np.isfinite(image), image, np.nan), cmap="viridis", vmin=low,
                          vmax=max(high, low + 1e-6), **common)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        ax.set_title(label, fontsize=9)
    if finite.size:
        fig.colorbar(shown, ax=list(axes), label="log10 EMA score of a held key")
    fig.suptitle(title + ("\n" if title else "") + "salmon: visible keys without a score (the query's own chunk, "
                 "or a policy that keeps none)", fontsize=9)
    return _save(fig, path)
