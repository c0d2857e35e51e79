"""The bootstrap intervals of jcascade.eval.stats on cases with known answers."""

import numpy as np
import pytest

from jcascade.eval import stats


def test_a_constant_without_bounds_is_a_point_and_with_bounds_is_wilsons_interval():
    """Unbounded values that never vary give a point; an accuracy that never varies (10 of 10 right) is not
    known exactly: it gets Wilson's score interval, [0.72, 1.00] for 10 of 10."""
    e = stats.mean(np.full(30, 0.4))
    assert (e.value, e.low, e.high, e.n) == pytest.approx((0.4, 0.4, 0.4, 30))
    assert e.excludes_zero and not stats.mean(np.zeros(30)).excludes_zero
    all_right = stats.mean(np.ones(10), bounds=(0, 1))
    assert all_right.value == 1.0 and all_right.low == pytest.approx(0.7225, abs=1e-3) and all_right.high == 1.0
    assert "Wilson" in all_right.method


def test_ten_fair_coin_flips_give_about_plus_minus_0_3():
    flips = np.array([1, 0, 0, 1, 1, 0, 1, 0, 0, 1], float)
    e = stats.mean(flips, bounds=(0, 1))
    assert e.value == 0.5 and e.n == 10
    assert e.low == pytest.approx(0.2, abs=0.05) and e.high == pytest.approx(0.8, abs=0.05)


def test_one_unit_per_stratum_pools_the_strata():
    """Strata of one unit cannot be resampled within themselves (every replicate would be the sample):
    they are pooled, and the interval is the unstratified one."""
    x = np.array([1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1], float)
    e = stats.mean(x, strata=list(range(x.size)), bounds=(0, 1))
    pooled = stats.mean(x, bounds=(0, 1))
    assert (e.low, e.high) == (pooled.low, pooled.high) and e.high - e.low > 0.4
    assert "pooled" in e.method
    d = stats.paired_difference(x, 1 - x, strata=list(range(x.size)), bounds=(0, 1))
    assert d.high - d.low > 0.5


def test_constant_strata_are_pooled():
    """Two strata, each constant: resampled within themselves every replicate is the sample (a point);
    the units vary, so the strata are pooled and the interval is wide."""
    x = np.r_[np.zeros(5), np.ones(5)]
    labels = [(0, "a")] * 5 + [(1, "b")] * 5  # any hashable labels
    e = stats.mean(x, strata=labels)
    assert e.low < 0.35 and e.high > 0.65 and "pooled" in e.method
    # one stratum varying is not enough: the constant one would count as known exactly (5 of 5 right)
    some = stats.mean(np.r_[np.ones(5), [0, 1, 0, 1, 1.0]], strata=labels)
    assert "pooled" in some.method
    # a paired difference stratifies by the per-unit differences: sides that vary but agree pool
    a = np.r_[[0, 1, 0, 1, 1.0], [1, 0, 1, 0, 0.0]]
    assert "pooled" in stats.paired_difference(a, a, strata=labels).method


def test_strata_that_vary_and_hold_enough_units_are_honoured():
    """Two strata of 20 units far apart: redrawn within themselves, the interval drops the variation between
    them and is narrower than the pooled one, and still has width."""
    rng = np.random.default_rng(0)
    x = np.r_[rng.random(20) * 0.2, 0.8 + rng.random(20) * 0.2]
    e = stats.mean(x, strata=[0] * 20 + [1] * 20)
    pooled = stats.mean(x)
    assert e.method == "stratified bootstrap" and 0 < e.high - e.low < 0.5 * (pooled.high - pooled.low)
    small = stats.mean(x[16:24], strata=[0] * 4 + [1] * 4)  # strata of 4 < MIN_STRATUM units: pooled
    assert "pooled" in small.method


def test_a_proportion_matches_the_normal_interval():
    """Many independent Bernoulli units: the percentile interval approaches p +- 1.96 sqrt(p (1 - p) / n)."""
    x = np.zeros(2000)
    x[:600] = 1.0
    e = stats.mean(x)
    half = 1.96 * np.sqrt(0.3 * 0.7 / x.size)
    assert e.value == pytest.approx(0.3)
    assert e.low == pytest.approx(0.3 - half, abs=0.004) and e.high == pytest.approx(0.3 + half, abs=0.004)


def test_weights_make_a_ratio_estimate():
    """Blocks of unequal length: the estimate is the token-weighted mean, not the mean of block means."""
    e = stats.mean([1.0, 3.0] * 3, weights=[3.0, 1.0] * 3)
    assert e.value == pytest.approx(1.5)
    assert 1.0 <= e.low <= e.high <= 3.0


def test_paired_differences_cancel_what_the_sides_share():
    rng = np.random.default_rng(0)
    a = rng.random(50)
    same = stats.paired_difference(a, a)
    assert (same.value, same.low, same.high) == (0.0, 0.0, 0.0) and not same.excludes_zero
    shifted = stats.paired_difference(a + 0.1, a)  # a wide spread per unit, an exact shift per pair
    assert (shifted.low, shifted.high) == pytest.approx((0.1, 0.1)) and shifted.excludes_zero
    wins = stats.paired_difference(np.ones(10), np.zeros(10), bounds=(0, 1))  # 10 of 10 pairs differ by 1
    assert wins.value == 1.0 and wins.low == pytest.approx(1 - 3.8415 / 13.8415, abs=1e-3) and wins.high == 1.0
    unpaired_half_width = 1.96 * np.sqrt(2 * a.var() / a.size)
    assert unpaired_half_width > 0.1  # unpaired, the same shift could not be told from zero


def test_a_transform_applies_to_the_mean_of_each_replicate():
    """Perplexity = exp(mean NLL): the percentile interval of exp(.) is exp of the NLL interval."""
    rng = np.random.default_rng(1)
    nll, counts = rng.normal(3.0, 0.5, 40), rng.integers(100, 4097, 40).astype(float)
    on_nll = stats.mean(nll, weights=counts, seed=3)
    on_ppl = stats.mean(nll, weights=counts, transform=np.exp, seed=3)
    assert on_ppl.value == pytest.approx(np.exp(np.average(nll, weights=counts)))
    assert (on_ppl.low, on_ppl.high) == pytest.approx((np.exp(on_nll.low), np.exp(on_nll.high)), rel=1e-3)
    diff = stats.paired_difference(nll + np.log(2.0), nll, weights=counts, transform=np.exp)
    assert diff.value == pytest.approx(np.exp(np.average(nll, weights=counts)))  # 2 ppl - ppl = ppl


def test_blocks_split_a_stream():
    means, counts = stats.blocks(np.arange(10.0), 4)
    np.testing.assert_allclose(means, [1.5, 5.5, 8.5])
    np.testing.assert_allclose(counts, [4, 4, 2])


def test_too_few_units_have_no_interval_and_no_verdict():
    for x in ([0.7], [0.2, 0.9], [0.1, 0.5, 0.9, 0.3]):
        e = stats.mean(x, bounds=(0, 1))
        assert np.isnan(e.low) and not e.excludes_zero and e.n == len(x)
        assert "too few units" in stats.verdict(e, "A", "B", "better")
        assert stats.verdict_word(e, "better") == "too few units"
    d = stats.paired_difference(np.ones(4), np.zeros(4), bounds=(0, 1))
    assert np.isnan(d.low) and stats.verdict_word(d, "better") == "too few units"


def test_perplexity_blocks_one_per_book_and_few_blocks():
    """One block per book (strata of one unit) pools the books; the interval is as wide as the pooled one and
    never a point while the blocks differ."""
    rng = np.random.default_rng(2)
    nll, counts = rng.normal(3.0, 0.3, 8), np.full(8, 4096.0)
    one_per_book = stats.mean(nll, weights=counts, strata=[f"book{i}" for i in range(8)], transform=np.exp)
    pooled = stats.mean(nll, weights=counts, transform=np.exp)
    assert (one_per_book.low, one_per_book.high) == (pooled.low, pooled.high)
    assert one_per_book.low < np.exp(nll.mean()) < one_per_book.high
    d = stats.paired_difference(
        nll + rng.normal(0.05, 0.2, 8), nll, weights=counts, strata=[f"book{i}" for i in range(8)], transform=np.exp
    )
    assert d.high - d.low > 0.1
    assert np.isnan(stats.mean(nll[:3], weights=counts[:3], transform=np.exp).low)  # 3 blocks: no interval


def test_verdicts():
    better = stats.Estimate(0.12, 0.05, 0.19, 120)
    assert stats.verdict(better, "Cascade", "Sink", "better") == (
        "Cascade - Sink = 0.12 [0.05, 0.19] (n=120): Cascade is better (the 95 % interval excludes zero)."
    )
    assert "Sink is better" in stats.verdict(better, "Cascade", "Sink", "worse")  # e.g. a perplexity difference
    assert stats.verdict_word(better, "worse") == "worse"
    assert "not distinguishable from zero" in stats.verdict(stats.Estimate(0.02, -0.01, 0.05, 50), "A", "B", "better")
    assert better.format() == "0.12 [0.05, 0.19]" and better.format(n=True) == "0.12 [0.05, 0.19] n=120"


def test_bad_input_is_rejected():
    for call, match in [
        (lambda: stats.mean([]), "non-empty 1-D"),
        (lambda: stats.mean([1.0, np.nan]), "finite"),
        (lambda: stats.paired_difference([1.0, 2.0], [1.0]), "of 2 units"),
        (lambda: stats.mean([1.0, 2.0], weights=[1.0, 0.0]), "positive"),
        (lambda: stats.mean([1.0, 2.0], strata=[0]), "one label per unit"),
        (lambda: stats.blocks([1.0], 0), "block must be >= 1"),
        (lambda: stats.blocks([1.0], 2.0), "block must be an int"),
        (lambda: stats.blocks([1.0], True), "block must be an int"),
        (lambda: stats.mean(np.ones(6), bounds=(1, 0)), "bounds must be"),
        (lambda: stats.verdict(stats.Estimate(0, 0, 0, 9), "A", "B", "higher"), "higher_is"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


def test_bounds_and_arguments_are_checked_whatever_the_sample_size():
    """Values outside the declared bounds, bounds that are not finite or ordered, bounds with a transform,
    strata of the wrong length or with unhashable labels, seeds that are not non-negative ints: ValueErrors
    naming the argument, with 3 units (no interval) as with 30 and for both sides of a paired difference."""
    for n in (3, 30):
        ones, half = np.ones(n), np.full(n, 0.5)
        for call, match in [
            (lambda: stats.mean(ones * 1.5, bounds=(0, 1)), r"values must lie in bounds \[0, 1\], got \[1.5"),
            (lambda: stats.mean(-ones, bounds=(0, 1)), "values must lie in bounds"),
            (lambda: stats.paired_difference(half, ones * 2, bounds=(0, 1)), r"b must lie in bounds \[0, 1\]"),
            (lambda: stats.paired_difference(half, half, bounds=(0, 1), transform=np.exp), "untransformed"),
            (lambda: stats.mean(half, bounds=(0, np.inf)), "finite"),
            (lambda: stats.mean(half, bounds=(np.nan, 1)), "bounds must be"),
            (lambda: stats.mean(half, bounds=(0, 1, 2)), "bounds must be"),
            (lambda: stats.mean(half, bounds=1), "bounds must be"),
            (lambda: stats.mean(half, bounds=(0, 1), transform=np.exp), "untransformed"),
            (lambda: stats.mean(half, transform="exp"), "transform must be callable"),
            (lambda: stats.mean(half, strata=[0] * (n + 1)), f"one label per unit \\({n}\\)"),
            (lambda: stats.mean(half, strata="ab" * n), "sequence of one label per unit"),
            (lambda: stats.mean(half, strata=[[0]] * n), "hashable"),
            (lambda: stats.paired_difference(half, ones[:-1]), f"of {n} units"),
            (lambda: stats.mean(half, seed=-1), "seed must be >= 0"),
            (lambda: stats.mean(half, seed=1.0), "seed must be an int"),
            (lambda: stats.mean([]), "non-empty"),
            (lambda: stats.mean(["a"] * n), "real numbers"),
        ]:
            with pytest.raises(ValueError, match=match):
                call()
    for call, match in [
        (lambda: stats.wilson(1.5, 10), "p must be a proportion"),
        (lambda: stats.wilson(0.5, 0), "n must be a positive"),
        (lambda: stats.Estimate(0.5, 0.1, 0.9, -1), "Estimate.n must be >= 0"),
        (lambda: stats.Estimate(0.5, 0.1, 0.9, 2.5), "Estimate.n must be an int"),
        (lambda: stats.Estimate("0.5", 0.1, 0.9, 2), "Estimate.value must be a real number"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


def test_numpy_numbers_are_accepted_where_python_ones_are():
    """numpy ints for seeds, blocks, n and Wilson's n, numpy floats for bounds and estimates: the same results
    as Python numbers, and estimates that hold Python numbers (what JSON writes)."""
    rng = np.random.default_rng(0)
    x = rng.random(12)
    assert stats.mean(x, seed=np.int64(3), bounds=(np.float32(0), np.int64(1))) == stats.mean(x, seed=3, bounds=(0, 1))
    assert stats.paired_difference(x, x[::-1], seed=np.uint32(2)) == stats.paired_difference(x, x[::-1], seed=2)
    np.testing.assert_array_equal(stats.blocks(x, np.int64(5))[1], stats.blocks(x, 5)[1])
    assert stats.wilson(np.float64(0.5), np.int64(10)) == stats.wilson(0.5, 10)
    e = stats.Estimate(np.float64(0.5), np.float32(0.25), np.float64(0.75), np.int64(12))
    assert e == stats.Estimate(0.5, 0.25, 0.75, 12) and type(e.n) is int and type(e.low) is float
    none = stats.Estimate.from_dict({"value": 0.5, "low": None, "low_reason": "no interval", "high": None, "n": 3})
    assert not none.has_interval and none.format() == "0.50 [no interval]"
