"""95 % intervals for the evaluations: the percentile bootstrap over independent units, with the rules that
keep it from overclaiming.

A unit is what can be treated as independent: a passkey trial (its 5 digits are correlated, so digits are
never resampled on their own), a RULER prompt (its score the fraction of its expected strings found), or a block
of consecutive tokens of a book (neighbouring tokens' log-likelihoods are correlated over distances far below a
block). Estimates are (weighted) means over units,
optionally passed through a transform (perplexity = exp(mean NLL)). Paired differences redraw the same units
for both sides, which is what makes a difference between two policies on the same prompts measurable.

The rules, each chosen so that an interval can only be wider than the plain bootstrap's, never narrower:

- **Too few units.** With fewer than `MIN_UNITS` units there is no interval (NaN bounds) and no verdict: a
  percentile bootstrap of 2-4 values is far too narrow (with 2 units it has 3 possible replicate means).
- **Strata.** Units may carry a stratum (a passkey context length and depth bucket, a RULER task and length, a
  book). Redrawing within strata keeps the design's balance and removes the variation between strata, but a
  stratum of n_h units contributes only (n_h - 1) / n_h of its variance, none at all with one unit, and a stratum whose
  units happen to agree (5 trials all right) contributes none either, though its true variance is not zero.
  So strata are honoured only when every stratum holds at least `MIN_STRATUM` units and every stratum's
  units vary (for a paired difference: their differences); otherwise all units are pooled into one stratum
  (pooling also counts the variation between strata, so it is the conservative choice).
- **Bounded values** (`bounds=(low, high)`, e.g. an accuracy in [0, 1]): the bootstrap cannot see variation
  that the sample happens not to show (10 trials all right give [1, 1]). The interval of a mean is widened
  to cover Wilson's score interval for the same mean and n, the interval of a binary outcome, whose variance
  p (1 - p) bounds that of any value in [0, 1] with mean p. A paired difference whose units all differ by
  the same amount is widened by the range times z^2 / (n + z^2): Wilson's upper bound on the share of units
  that could differ, when none of n did.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Hashable, Mapping, Sequence

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 10_000
MIN_UNITS = 5  # fewer units: no interval, no verdict
MIN_STRATUM = 5  # strata are honoured only when each holds at least this many units (else pooled)
_Z = 1.959963984540054  # the normal quantile of CONFIDENCE


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A point estimate with its 95 % interval [low, high] (NaN bounds with fewer than `MIN_UNITS` units),
    the number of units n behind it and how the interval was made (`method`)."""

    value: float
    low: float
    high: float
    n: int
    method: str = "bootstrap"

    def __post_init__(self):  # numpy numbers become Python ones (what JSON writes); None bounds (JSON's) are NaN
        for name in ("value", "low", "high"):
            x = getattr(self, name)
            x = float("nan") if x is None and name != "value" else x
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
                raise ValueError(f"Estimate.{name} must be a real number, got {x!r}")
            object.__setattr__(self, name, float(x))
        object.__setattr__(self, "n", integer("Estimate.n", self.n, least=0))
        if not isinstance(self.method, str):
            raise ValueError(f"Estimate.method must be a str, got {self.method!r}")

    @classmethod
    def from_dict(cls, d) -> Estimate:
        """The Estimate of `as_dict` or of a report's JSON (null bounds, "*_reason" keys beside them)."""
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    @property
    def has_interval(self) -> bool:
        return not (np.isnan(self.low) or np.isnan(self.high))

    @property
    def excludes_zero(self) -> bool:
        """True when the whole interval lies on one side of zero (missing intervals never do)."""
        return bool(self.has_interval and (self.low > 0 or self.high < 0))

    def bounds(self, digits: int = 2) -> str:
        """e.g. "[0.52, 0.75]", or "[no interval]" with too few units."""
        return f"[{self.low:.{digits}f}, {self.high:.{digits}f}]" if self.has_interval else "[no interval]"

    def format(self, digits: int = 2, n: bool = False) -> str:
        """e.g. "0.64 [0.52, 0.75]", with n=True "0.64 [0.52, 0.75] n=50"."""
        return f"{self.value:.{digits}f} {self.bounds(digits)}" + (f" n={self.n}" if n else "")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def integer(name: str, value, least: int | None = None) -> int:
    """value as a Python int (numpy integers accepted, bools not), at least `least`; else a ValueError naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if least is not None and value < least:
        raise ValueError(f"{name} must be >= {least}, got {value!r}")
    return int(value)


def _check_units(name: str, x, n: int | None = None) -> np.ndarray:
    try:
        x = np.asarray(x, np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a 1-D array of real numbers, got {x!r:.80}") from None
    if x.ndim != 1 or x.size == 0 or (n is not None and x.size != n):
        raise ValueError(
            f"{name} must be a non-empty 1-D array{'' if n is None else f' of {n} units'}, got shape {list(x.shape)}"
        )
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must be finite, got {x[~np.isfinite(x)][:3].tolist()}")
    return x


def stratum_codes(strata: Sequence | None, units: np.ndarray) -> np.ndarray:
    """int [n]: the stratum of each unit as the bootstrap uses it: the given strata when every one holds at
    least `MIN_STRATUM` units and every one's `units` values (float [n]) vary, else 0 for all (pooled)."""
    if strata is None:
        return np.zeros(units.size, np.int64)
    codes: dict = {}
    labels = np.array([codes.setdefault(s, len(codes)) for s in strata], np.int64)
    groups = [units[labels == g] for g in range(len(codes))]
    honoured = all(g.size >= MIN_STRATUM and np.ptp(g) > 0 for g in groups)
    return labels if honoured else np.zeros(units.size, np.int64)


def resample_indices(labels: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """int [resamples, n]: bootstrap draws of unit indices, each unit redrawn within its stratum `labels`."""
    groups = [np.flatnonzero(labels == g) for g in range(labels.max() + 1)]
    return np.concatenate([g[rng.integers(0, g.size, (resamples, g.size))] for g in groups], axis=1)


def _means(values: np.ndarray, weights: np.ndarray, idx: np.ndarray | slice) -> np.ndarray:
    return (values[idx] * weights[idx]).sum(axis=-1) / weights[idx].sum(axis=-1)


def _bootstrap(
    columns: dict[str, object], weights, strata, bounds, transform: Callable, contrast: Callable, seed: int
) -> tuple[float, np.ndarray | None, np.ndarray, str, tuple[float, float] | None]:
    """(contrast of the transformed means of the columns {name: values [n]}, its bootstrap replicates or None
    with too few units, the weights, the method, the checked bounds)."""
    n = _check_units(*next(iter(columns.items()))).size
    columns = {name: _check_units(name, c, n) for name, c in columns.items()}
    if not callable(transform):
        raise ValueError(f"transform must be callable, got {transform!r}")
    weights = np.ones(n) if weights is None else _check_units("weights", weights, n)
    if np.any(weights <= 0):
        raise ValueError("weights must be positive")
    strata = _check_strata(strata, n)
    bounds = _check_bounds(bounds, columns, transform)
    seed = integer("seed", seed, least=0)
    value = float(contrast(*(transform(_means(c, weights, slice(None))) for c in columns.values())))
    if n < MIN_UNITS:
        return value, None, weights, f"too few units (n={n} < {MIN_UNITS})", bounds
    labels = stratum_codes(strata, np.subtract(*columns.values()) if len(columns) == 2 else columns["values"])
    idx = resample_indices(labels, RESAMPLES, np.random.default_rng(seed))
    replicates = contrast(*(transform(_means(c, weights, idx)) for c in columns.values()))
    method = "stratified bootstrap" if labels.max() > 0 else "bootstrap"
    return (
        value,
        replicates,
        weights,
        method + (" (strata pooled)" if strata is not None and labels.max() == 0 else ""),
        bounds,
    )


def _percentiles(replicates: np.ndarray) -> tuple[float, float]:
    low, high = np.quantile(replicates, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
    return float(low), float(high)


def _check_strata(strata, n: int) -> list | None:
    """strata as a list of n hashable labels (or None)."""
    if strata is None:
        return None
    if isinstance(strata, (str, bytes)) or not isinstance(strata, Sequence | np.ndarray):
        raise ValueError(f"strata must be a sequence of one label per unit, got {type(strata).__name__}")
    strata = list(strata)
    if len(strata) != n:
        raise ValueError(f"strata must give one label per unit ({n}), got {len(strata)}")
    unhashable = [s for s in strata if not isinstance(s, Hashable)]
    if unhashable:
        raise ValueError(f"strata labels must be hashable (e.g. a tuple, not a list), got {unhashable[0]!r}")
    return strata


def _check_bounds(bounds, columns: dict[str, np.ndarray], transform: Callable) -> tuple[float, float] | None:
    """bounds (low, high) as finite floats with low < high that every value of every column lies in."""
    if bounds is None:
        return None
    if transform is not np.asarray:
        raise ValueError("bounds apply to untransformed means only")
    try:
        low, high = (float(b) for b in bounds)
    except (TypeError, ValueError):
        raise ValueError(f"bounds must be (low, high) with low < high, got {bounds!r}") from None
    if not (np.isfinite(low) and np.isfinite(high) and low < high):
        raise ValueError(f"bounds must be (low, high), finite, with low < high, got {bounds!r}")
    for name, c in columns.items():
        outside = c[(c < low) | (c > high)]
        if outside.size:
            raise ValueError(f"{name} must lie in bounds [{low:g}, {high:g}], got {outside[:3].tolist()}")
    return low, high


def effective_units(weights: np.ndarray) -> float:
    """Kish's effective number of units of a weighted mean: (sum w)^2 / sum w^2 (n when weights are equal)."""
    return float(weights.sum() ** 2 / (weights**2).sum())


def wilson(p: float, n: float) -> tuple[float, float]:
    """Wilson's score interval for a proportion p in [0, 1] observed over n > 0 units (numpy numbers too)."""
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, numbers.Real) or not 0 <= p <= 1:
        raise ValueError(f"p must be a proportion in [0, 1], got {p!r}")
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Real) or not 0 < n < np.inf:
        raise ValueError(f"n must be a positive finite number of units, got {n!r}")
    centre = (p + _Z**2 / (2 * n)) / (1 + _Z**2 / n)
    half = _Z / (1 + _Z**2 / n) * np.sqrt(p * (1 - p) / n + _Z**2 / (4 * n**2))
    return float(centre - half), float(centre + half)


def mean(
    values,
    *,
    weights=None,
    strata=None,
    bounds: tuple[float, float] | None = None,
    transform: Callable[[np.ndarray], np.ndarray] = np.asarray,
    seed: int = 0,
) -> Estimate:
    """transform(weighted mean of per-unit values float [n]) with its 95 % interval (see the module doc).

    weights float [n] (e.g. tokens per block; default 1); strata: a hashable label per unit; bounds: the
    range every value lies in, when it has one (accuracies: (0, 1)); not with a transform."""
    value, replicates, w, method, bounds = _bootstrap(
        {"values": values}, weights, strata, bounds, transform, lambda x: x, seed
    )
    n = w.size
    if replicates is None:
        return Estimate(value, float("nan"), float("nan"), n, method)
    low, high = _percentiles(replicates)
    if bounds is not None:
        lo, hi = bounds
        p = min(max((value - lo) / (hi - lo), 0.0), 1.0)
        w_low, w_high = wilson(p, effective_units(w))
        low, high = min(low, lo + (hi - lo) * w_low), max(high, lo + (hi - lo) * w_high)
        method += " widened to Wilson's score interval"
    return Estimate(value, low, high, n, method)


def paired_difference(
    a,
    b,
    *,
    weights=None,
    strata=None,
    bounds: tuple[float, float] | None = None,
    transform: Callable[[np.ndarray], np.ndarray] = np.asarray,
    seed: int = 0,
) -> Estimate:
    """transform(mean a) - transform(mean b) over the same n units (float [n] each), with its 95 % interval;
    every replicate redraws one set of units for both sides. bounds: the range of each side's values."""
    value, replicates, w, method, bounds = _bootstrap(
        {"a": a, "b": b}, weights, strata, bounds, transform, lambda x, y: x - y, seed
    )
    n = w.size
    if replicates is None:
        return Estimate(value, float("nan"), float("nan"), n, method)
    low, high = _percentiles(replicates)
    if bounds is not None and high - low <= 1e-12 * max(1.0, abs(value)):
        lo, hi = bounds
        spread = (hi - lo) * _Z**2 / (effective_units(w) + _Z**2)
        low, high = max(value - spread, lo - hi), min(value + spread, hi - lo)
        method += " widened (every unit differed by the same amount)"
    return Estimate(value, low, high, n, method)


def blocks(values, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Splits a stream of per-token values [S] into consecutive blocks of `block` tokens (the last one may
    be shorter). Returns (mean per block, tokens per block), each float [ceil(S / block)]."""
    values = _check_units("values", values)
    block = integer("block", block, least=1)
    starts = np.arange(0, values.size, block)
    counts = np.diff(np.append(starts, values.size)).astype(np.float64)
    return np.add.reduceat(values, starts) / counts, counts


def by_policy(results, unit, value, baseline: str) -> tuple[dict, dict]:
    """({policy: {unit(r): value(r)}} over results r with a `.policy` label, the baseline's own dict); raises
    ValueError when no result is the baseline's. The units pair the sides of a paired difference."""
    table: dict[str, dict] = {}
    for r in results:
        table.setdefault(r.policy, {})[unit(r)] = value(r)
    if baseline not in table:
        raise ValueError(f"baseline {baseline!r} is not among the policies {list(table)}")
    return table, table[baseline]


def shared_units(mine: Mapping, base: Mapping, policy: str, baseline: str, unit: str) -> list:
    """The units (keys, in `mine`'s order) that a policy's results and the baseline's share, the units of their
    paired differences; a ValueError naming both policies when they share none (runs merged from other prompts)."""
    shared = [k for k in mine if k in base]
    if not shared:
        raise ValueError(
            f"policy {policy!r} shares no {unit} with the baseline {baseline!r}: a paired difference "
            f"compares the same {unit}s (run both on them, or choose another baseline)"
        )
    return shared


VERDICTS = ("better", "worse", "no measured difference", "too few units")


def verdict_word(difference: Estimate, higher_is: str) -> str:
    """One of VERDICTS for the first side of a paired difference first - second. higher_is: "better" or
    "worse" for the first side (accuracy: "better"; perplexity: "worse")."""
    if higher_is not in ("better", "worse"):
        raise ValueError(f"higher_is must be 'better' or 'worse', got {higher_is!r}")
    if not difference.has_interval:
        return "too few units"
    if not difference.excludes_zero:
        return "no measured difference"
    return "better" if (difference.value > 0) == (higher_is == "better") else "worse"


def verdict(difference: Estimate, first: str, second: str, higher_is: str, digits: int = 2) -> str:
    """A sentence on a paired difference first - second, e.g. 'Cascade - Sink = 0.12 [0.05, 0.19] (n=120
    prompts): Cascade is better (the 95 % interval excludes zero).'"""
    word = verdict_word(difference, higher_is)
    head = f"{first} - {second} = {difference.format(digits)} (n={difference.n})"
    if word == "too few units":
        return f"{head}: too few units for an interval (at least {MIN_UNITS}); no verdict."
    if word == "no measured difference":
        return f"{head}: not distinguishable from zero at 95 %: no measured difference between {first} and {second}."
    winner = first if word == "better" else second
    return f"{head}: {winner} is better (the 95 % interval excludes zero)."
