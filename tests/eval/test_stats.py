"""The bootstrap intervals of jcascade.eval.stats on cases with known answers."""

import numpy as np
import pytest

from jcascade.eval import stats


def test_a_constant_has_a_zero_width_interval():
    e = stats.mean(np.full(30, 0.4))
    assert (e.value, e.low, e.high) == pytest.approx((0.4, 0.4, 0.4))
    assert e.excludes_zero and not stats.mean(np.zeros(30)).excludes_zero


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
    e = stats.mean([1.0, 3.0], weights=[3.0, 1.0])
    assert e.value == pytest.approx(1.5)
    assert 1.0 <= e.low <= e.high <= 3.0


def test_strata_are_resampled_within_themselves():
    """Two strata, each constant: a stratified replicate always holds 5 of each, so the interval is a point;
    resampling across strata would give a wide one."""
    x = np.r_[np.zeros(5), np.ones(5)]
    labels = [(0, "a")] * 5 + [(1, "b")] * 5  # any hashable labels
    stratified = stats.mean(x, strata=labels)
    assert (stratified.low, stratified.high) == pytest.approx((0.5, 0.5))
    pooled = stats.mean(x)
    assert pooled.low < 0.35 and pooled.high > 0.65


def test_paired_differences_cancel_what_the_sides_share():
    rng = np.random.default_rng(0)
    a = rng.random(50)
    same = stats.paired_difference(a, a)
    assert (same.value, same.low, same.high) == (0.0, 0.0, 0.0) and not same.excludes_zero
    shifted = stats.paired_difference(a + 0.1, a)  # a wide spread per unit, an exact shift per pair
    assert (shifted.low, shifted.high) == pytest.approx((0.1, 0.1)) and shifted.excludes_zero
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


def test_one_unit_has_no_interval_and_the_verdict_says_so():
    e = stats.mean([0.7])
    assert e.value == 0.7 and np.isnan(e.low) and not e.excludes_zero
    assert "too few units" in stats.verdict(e, "A", "B", "better")


def test_verdicts():
    better = stats.Estimate(0.12, 0.05, 0.19)
    assert stats.verdict(better, "Cascade", "Sink", "better").endswith("Cascade is better (the 95 % interval excludes zero).")
    assert "Sink is better" in stats.verdict(better, "Cascade", "Sink", "worse")  # e.g. a perplexity difference
    assert "not distinguishable from zero" in stats.verdict(stats.Estimate(0.02, -0.01, 0.05), "A", "B", "better")
    assert better.format() == "0.12 [0.05, 0.19]"


def test_bad_input_is_rejected():
    for call, match in [(lambda: stats.mean([]), "non-empty 1-D"),
                        (lambda: stats.mean([1.0, np.nan]), "finite"),
                        (lambda: stats.paired_difference([1.0, 2.0], [1.0]), "of 2 units"),
                        (lambda: stats.mean([1.0, 2.0], weights=[1.0, 0.0]), "positive"),
                        (lambda: stats.mean([1.0, 2.0], strata=[0]), "one label per unit"),
                        (lambda: stats.blocks([1.0], 0), "block must be a positive int"),
                        (lambda: stats.verdict(stats.Estimate(0, 0, 0), "A", "B", "higher"), "higher_is")]:
        with pytest.raises(ValueError, match=match):
            call()
