"""95 % intervals for the evaluations: the percentile bootstrap over independent units.

A unit is what can be treated as independent: a passkey trial (its 5 digits are correlated, so digits
are never resampled on their own) or a block of consecutive tokens of a book (neighbouring tokens'
log-likelihoods are correlated over distances far below a block). Estimates are (weighted) means over
units, optionally passed through a transform (perplexity = exp(mean NLL)). Resampling is stratified:
units are redrawn within their stratum (a passkey depth bucket and context length, a book), so every
replicate keeps the design's balance. Paired differences redraw the same units for both sides, which
is what makes a difference between two policies on the same prompts or tokens measurable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 10_000


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A point estimate with its bootstrap interval [low, high] (NaN bounds with fewer than 2 units)."""

    value: float
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        """True when the whole interval lies on one side of zero (NaN intervals never do)."""
        return bool(self.low > 0 or self.high < 0)

    def bounds(self, digits: int = 2) -> str:
        """e.g. "[0.52, 0.75]"."""
        return f"[{self.low:.{digits}f}, {self.high:.{digits}f}]"

    def format(self, digits: int = 2) -> str:
        """e.g. "0.64 [0.52, 0.75]"."""
        return f"{self.value:.{digits}f} {self.bounds(digits)}"

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def _check_units(name: str, x, n: int | None = None) -> np.ndarray:
    x = np.asarray(x, np.float64)
    if x.ndim != 1 or x.size == 0 or (n is not None and x.size != n):
        raise ValueError(f"{name} must be a non-empty 1-D array{'' if n is None else f' of {n} units'}, "
                         f"got shape {list(x.shape)}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must be finite, got {x[~np.isfinite(x)][:3].tolist()}")
    return x


def resample_indices(n: int, strata: Sequence | None, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """int [resamples, n]: bootstrap draws of unit indices, each unit redrawn within its stratum."""
    codes = {}
    labels = np.zeros(n, np.int64) if strata is None else np.array([codes.setdefault(s, len(codes)) for s in strata])
    groups = [np.flatnonzero(labels == g) for g in range(labels.max() + 1)]
    return np.concatenate([g[rng.integers(0, g.size, (resamples, g.size))] for g in groups], axis=1)


def _means(values: np.ndarray, weights: np.ndarray, idx: np.ndarray | slice) -> np.ndarray:
    return (values[idx] * weights[idx]).sum(axis=-1) / weights[idx].sum(axis=-1)


def _interval(value: float, replicates: np.ndarray, n: int, confidence: float) -> Estimate:
    if n < 2:
        return Estimate(value, float("nan"), float("nan"))
    low, high = np.quantile(replicates, [(1 - confidence) / 2, (1 + confidence) / 2])
    return Estimate(value, float(low), float(high))


def paired_estimates(columns: Sequence, *, weights=None, strata: Sequence | None = None,
                     transform: Callable[[np.ndarray], np.ndarray] = np.asarray,
                     contrast: Callable[..., np.ndarray] | None = None, confidence: float = CONFIDENCE,
                     resamples: int = RESAMPLES, seed: int = 0) -> Estimate:
    """The bootstrap interval of contrast(transform(mean of column 0), transform(mean of column 1), ...).

    columns: per-unit values of each side, float [n] each, all over the same n units (same prompts,
    same token blocks); weights float [n] (e.g. tokens per block; default 1); strata: a label per unit.
    Every replicate redraws one set of units for all columns. contrast defaults to the single column.
    """
    columns = [_check_units(f"columns[{i}]", c) for i, c in enumerate(columns)]
    n = columns[0].size
    columns = [_check_units(f"columns[{i}]", c, n) for i, c in enumerate(columns)]
    weights = np.ones(n) if weights is None else _check_units("weights", weights, n)
    if np.any(weights <= 0):
        raise ValueError("weights must be positive")
    if strata is not None and len(strata) != n:
        raise ValueError(f"strata must give one label per unit ({n}), got {len(strata)}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    contrast = contrast or (lambda x: x)
    idx = resample_indices(n, strata, resamples, np.random.default_rng(seed))
    value = contrast(*(transform(_means(c, weights, slice(None))) for c in columns))
    replicates = contrast(*(transform(_means(c, weights, idx)) for c in columns))
    return _interval(float(value), replicates, n, confidence)


def mean(values, *, weights=None, strata=None, transform=np.asarray, seed: int = 0) -> Estimate:
    """transform(weighted mean of per-unit values) with its 95 % interval."""
    return paired_estimates([values], weights=weights, strata=strata, transform=transform, seed=seed)


def paired_difference(a, b, *, weights=None, strata=None, transform=np.asarray, seed: int = 0) -> Estimate:
    """transform(mean a) - transform(mean b) over the same units, with its 95 % interval."""
    return paired_estimates([a, b], weights=weights, strata=strata, transform=transform,
                            contrast=lambda x, y: x - y, seed=seed)


def blocks(values, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Splits a stream of per-token values [S] into consecutive blocks of `block` tokens (the last one may
    be shorter). Returns (mean per block, tokens per block), each float [ceil(S / block)]."""
    values = _check_units("values", values)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    starts = np.arange(0, values.size, block)
    counts = np.diff(np.append(starts, values.size)).astype(np.float64)
    return np.add.reduceat(values, starts) / counts, counts


def verdict(difference: Estimate, first: str, second: str, higher_is: str, digits: int = 2) -> str:
    """A sentence on a paired difference first - second, e.g. 'Cascade - Sink = 0.12 [0.05, 0.19]: Cascade is
    better (the 95 % interval excludes zero).' higher_is: "better" or "worse" for the first side."""
    if higher_is not in ("better", "worse"):
        raise ValueError(f"higher_is must be 'better' or 'worse', got {higher_is!r}")
    head = f"{first} - {second} = {difference.format(digits)}"
    if np.isnan(difference.low):
        return f"{head}: too few units for an interval."
    if not difference.excludes_zero:
        return f"{head}: not distinguishable from zero at 95 %: no measured difference between {first} and {second}."
    winner = first if (difference.value > 0) == (higher_is == "better") else second
    return f"{head}: {winner} is better (the 95 % interval excludes zero)."
