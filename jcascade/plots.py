"""PNG plots of the evaluations (matplotlib's object API with the Agg renderer: no display, no pyplot state)."""

from __future__ import annotations

import pathlib
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


def passkey_accuracy(table: Mapping[str, Mapping[int, Mapping[int, float]]], path, title: str = "") -> pathlib.Path:
    """Mean per-digit accuracy over depth buckets vs context length, one line per policy (Figure 8 style).
    table: {policy: {context_length: {bucket: accuracy}}} (`jcascade.passkey.accuracy_table`)."""
    fig, (ax,) = _figure()
    for label, by_length in table.items():
        lengths = sorted(by_length)
        ax.plot(lengths, [np.mean(list(by_length[n].values())) for n in lengths], marker="o", label=label)
    ax.axhline(0.1, color="gray", linestyle=":", label="random digits")
    ax.set_xscale("log", base=2)
    ticks = sorted({n for by_length in table.values() for n in by_length})
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("per-digit accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title or "Passkey retrieval")
    ax.legend()
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
    """Perplexity of each position bucket vs position, one line per policy (Figure 7 style); dotted
    vertical lines mark the bounded caches' capacities (label -> capacity, None for unbounded).
    summary: `jcascade.perplexity.summary`."""
    fig, (ax,) = _figure(width=7.0)
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
    return _save(fig, path)


def attention_maps(images: Mapping[str, np.ndarray], length: int, path, title: str = "") -> pathlib.Path:
    """One panel per policy of `jcascade.attention_map.render` images (query rows, key columns): held keys
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
