"""RoPE (jcascade/rope.py): the rotate-half formula, relative positions, and Llama 3's frequency scaling."""

import jax.numpy as jnp
import numpy as np
import pytest
from oracle import np_rope

import jcascade as jc


def test_rope_matches_rotate_half_formula_and_is_relative():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 2, 16)).astype(np.float32)
    pos = rng.integers(0, 5000, size=(3, 5, 2))
    rope = jc.RoPE(10000.0)
    np.testing.assert_allclose(
        rope(jnp.asarray(x), jnp.asarray(pos)), np_rope(x.astype(np.float64), pos, 10000.0), atol=2e-4
    )
    np.testing.assert_array_equal(rope(jnp.asarray(x), jnp.zeros((3, 5, 2), jnp.int32)), x)
    q, k = jnp.asarray(x[0, 0, 0]), jnp.asarray(x[0, 0, 1])
    dot = lambda m, n: float(rope(q, jnp.int32(m)) @ rope(k, jnp.int32(n)))
    assert dot(7, 3) == pytest.approx(dot(107, 103), rel=1e-4)


def test_llama3_scaling_keeps_high_and_divides_low_frequencies():
    plain = jc.RoPE(500000.0).inv_freq(128)
    scaled = jc.RoPE(500000.0, jc.Llama3Scaling(factor=8.0)).inv_freq(128)
    wavelen = 2 * np.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 8, rtol=1e-6)
    mid = ~high & ~low
    assert mid.any() and (scaled[mid] < plain[mid]).all() and (scaled[mid] > plain[mid] / 8).all()
    with pytest.raises(ValueError, match="low_freq_factor"):
        jc.Llama3Scaling(low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(ValueError, match="even head_dim"):
        jc.RoPE().inv_freq(7)
