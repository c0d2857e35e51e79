"""The figures (`jcascade.eval.plots`): titles inside the figure, "n < 5: no interval" where an interval is
missing, labelled colour bars. Reports come from the real report builders fed synthetic results (no model
runs); each figure is drawn with Agg and inspected."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.text import Text
from PIL import Image

import jcascade as jc
from jcascade.eval import passkey, perplexity, plots, report, ruler

POLICIES = {"Sink 1024": jc.Sink(window=1020, sinks=4), "Cascade 1024x4": jc.Cascade(cache_size=1020, num_cascades=4)}


def passkey_report(samples: int, lengths=(1024, 2048, 4096), buckets: int = 4) -> dict:
    """n = buckets x samples prompts per policy and length, with retention."""
    rng = np.random.default_rng(0)
    results = [
        passkey.PasskeyResult(
            label,
            n,
            b,
            s,
            "12345",
            (b + 0.5) / buckets,
            n,
            "12345",
            float(rng.random()),
            8,
            rng.random((2, 1)).tolist(),
        )
        for label in POLICIES
        for n in lengths
        for b in range(buckets)
        for s in range(samples)
    ]
    return report.passkey(results, POLICIES)


def perplexity_report(blocks: int, block: int = 64) -> dict:
    """One book of `blocks` blocks per policy."""
    rng = np.random.default_rng(0)
    tokens = blocks * block + 1
    results = [
        perplexity.BookPerplexity(
            "paradise_lost",
            label,
            tokens,
            3.0,
            (3 + rng.random(blocks)).tolist(),
            block,
            (3 + rng.random(blocks)).tolist(),
            block,
        )
        for label in POLICIES
    ]
    return report.perplexity(results, POLICIES)


def ruler_report(samples: int, lengths=(1024, 2048), tasks=("niah_single_1", "vt", "cwe")) -> dict:
    """n = tasks x samples prompts per policy and length."""
    rng = np.random.default_rng(0)
    results = [
        ruler.RulerResult(label, task, n, i, n, "", float(rng.random() > 0.5))
        for label in POLICIES
        for task in tasks
        for n in lengths
        for i in range(samples)
    ]
    return report.ruler(results, {label: repr(p) for label, p in POLICIES.items()})


def attention_images(pixels: int = 32) -> dict[str, np.ndarray]:
    """render-like images: log10 scores below the diagonal, +inf (visible without a score) near it."""
    rng = np.random.default_rng(0)
    rows, cols = np.indices((pixels, pixels))
    image = np.where(cols <= rows, rng.normal(-2, 1, (pixels, pixels)), np.nan)
    image[(rows - cols >= 0) & (rows - cols < 3)] = np.inf
    return {label: image for label in POLICIES}


LONG = (
    "Sink vs Cascade: 64 sinks + 384 tokens each (Cascade: 2 cascades), prefill stride 192 "
    "(/home/someone/models/SmolLM2-135M-Instruct, query-aware) "
) * 2

FIGURES = {  # name: draw(title, few) -> Figure; few: fewer than 5 units behind some estimates
    "passkey": lambda title, few: plots._passkey(passkey_report(samples=1 if few else 2), title),
    "passkey_depth": lambda title, few: plots._passkey_depth(passkey_report(samples=1, lengths=(768,)), title),
    "perplexity": lambda title, few: plots._perplexity(perplexity_report(blocks=3 if few else 40), title),
    "ruler": lambda title, few: plots._ruler(ruler_report(samples=1 if few else 2), title),
    "attention_maps": lambda title, few: plots._attention_maps(attention_images(), 512, title),
}


def drawn(fig):
    """fig drawn with Agg (layout and wrapping done); returns its renderer."""
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    return renderer


def texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(Text)]


@pytest.mark.parametrize("title", [LONG, "SmolLM2-135M, query-aware"])
@pytest.mark.parametrize("name", FIGURES)
def test_titles_and_all_text_inside_the_figure(name, title):
    fig = FIGURES[name](title, False)
    renderer = drawn(fig)
    titles = [
        t
        for t in fig.findobj(Text)
        if t.get_text() and (t.get_text() == fig.get_suptitle() or any(t is ax.title for ax in fig.axes))
    ]
    assert any(title.strip()[:20] in t.get_text() for t in titles)
    box = fig.bbox
    for t in titles:
        extent = t.get_window_extent(renderer)
        assert box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1, (t.get_text()[:40], extent, box)
        assert box.y0 - 1 <= extent.y0 and extent.y1 <= box.y1 + 1, (t.get_text()[:40], extent, box)
    tight = fig.get_tightbbox(renderer)  # inches: every artist, labels and legends included
    assert 0 <= tight.x0 and 0 <= tight.y0 and tight.x1 <= fig.bbox_inches.x1 and tight.y1 <= fig.bbox_inches.y1, (
        tight,
        fig.bbox_inches,
    )


@pytest.mark.parametrize("name", ["passkey", "perplexity", "ruler"])
@pytest.mark.parametrize("few", [True, False])
def test_a_missing_interval_is_said(name, few):
    fig = FIGURES[name]("", few)
    drawn(fig)
    assert plots.NO_INTERVAL == "n < 5: no interval"
    assert any(plots.NO_INTERVAL in t for t in texts(fig)) == few
    bars = [
        segment
        for ax in fig.axes
        for c in ax.collections
        if isinstance(c, LineCollection)
        for segment in c.get_segments()
        if len(segment) == 2 and np.all(np.isfinite(segment))
    ]
    assert not any(np.allclose(*segment) for segment in bars)  # a missing interval is no bar, not a zero-width one


def test_a_report_read_back_from_json_is_drawn_with_its_note(tmp_path):
    rep = json.loads(report.json_text(passkey_report(samples=1)))
    path = plots.passkey(rep, tmp_path / "passkey.png")
    assert Image.open(path).mode == "P"  # 256 colours: a third of the bytes of RGBA (benchmarks/results stays lean)
    fig = plots._passkey(rep, "")
    drawn(fig)
    assert any(plots.NO_INTERVAL in t for t in texts(fig))


@pytest.mark.parametrize("name", ["passkey_depth", "ruler", "attention_maps"])
def test_colour_bars_say_what_the_colour_means(name):
    fig = FIGURES[name]("", False)
    drawn(fig)
    labels = [im.colorbar.ax.get_ylabel() for ax in fig.axes for im in ax.get_images() if im.colorbar is not None]
    assert labels and all(label.strip() for label in labels), labels
