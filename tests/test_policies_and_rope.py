"""Policy validation at construction, the RoPE helper, and the package's import guard."""

import pathlib
import subprocess
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcascade as jc
from oracle import np_rope


@pytest.mark.parametrize("make,field", [
    (lambda: jc.Cascade(cache_size=10, num_cascades=4), "num_cascades"),
    (lambda: jc.Cascade(cache_size=0), "cache_size"),
    (lambda: jc.Cascade(cache_size=-8), "cache_size"),
    (lambda: jc.Cascade(cache_size=8, sinks=-1), "sinks"),
    (lambda: jc.Cascade(cache_size=8, num_cascades=0), "num_cascades"),
    (lambda: jc.Cascade(cache_size=8, gamma=1.0), "gamma"),
    (lambda: jc.Cascade(cache_size=8, gamma=0.0), "gamma"),
    (lambda: jc.Cascade(cache_size=8, gamma="0.9"), "gamma"),
    (lambda: jc.Cascade(cache_size=8, head_reduction="sum"), "head_reduction"),
    (lambda: jc.Cascade(cache_size=8, positions="rope"), "positions"),
    (lambda: jc.Cascade(cache_size=8, stride=0), "stride"),
    (lambda: jc.Cascade(cache_size=8.0), "cache_size"),
    (lambda: jc.Sink(window=0), "window"),
    (lambda: jc.Sink(window=8, sinks=-2), "sinks"),
    (lambda: jc.Sink(window=8, positions="absolute"), "positions"),
    (lambda: jc.SlidingWindow(window=-1), "window"),
    (lambda: jc.SlidingWindow(window=4, stride=0), "stride"),
    (lambda: jc.Full(stride=0), "stride"),
    (lambda: jc.H2O(heavy=0, recent=4), "heavy"),
    (lambda: jc.H2O(heavy=4, recent=0), "recent"),
    (lambda: jc.H2O(heavy=4, recent=4, head_reduction="sum"), "head_reduction"),
    (lambda: jc.H2O(heavy=4, recent=4, positions="abs"), "positions"),
])
def test_invalid_policies_raise_value_error_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_policies_are_hashable_and_static_under_jit():
    policy = jc.Cascade(cache_size=8, sinks=2, num_cascades=2)
    assert hash(policy) == hash(jc.Cascade(cache_size=8, sinks=2, num_cascades=2))
    with pytest.raises(AttributeError):
        policy.gamma = 0.5
    f = jax.jit(lambda p, x: x * p.gamma, static_argnums=0)
    assert float(f(policy, jnp.float32(2.0))) == pytest.approx(2 * 0.9999)


def test_non_policy_is_refused():
    state = jc.init_cache(jc.Sink(window=2, sinks=0), 1, 1, 2)
    with pytest.raises(TypeError, match="policy must be one of"):
        jc.update("cascade", state, jnp.zeros((1, 1, 1, 2)), jnp.zeros((1, 1, 1, 2)), None)


def test_rope_matches_rotate_half_formula_and_is_relative():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 2, 16)).astype(np.float32)
    pos = rng.integers(0, 5000, size=(3, 5, 2))
    rope = jc.RoPE(10000.0)
    np.testing.assert_allclose(rope(jnp.asarray(x), jnp.asarray(pos)), np_rope(x.astype(np.float64), pos, 10000.0), atol=2e-4)
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


def test_an_uninstalled_source_tree_says_how_to_install():
    """From the repository root without the package installed, `import jcascade` finds the bare folder,
    whose models/ and pallas_kernels/ are not yet mapped into it: the import says so instead of failing on
    a circular import."""
    root = pathlib.Path(__file__).resolve().parent.parent
    code = f"import sys; sys.path[:0] = [{str(root)!r}, {sysconfig.get_paths()['purelib']!r}]; import jcascade"
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=root)
    assert done.returncode == 1
    assert "jcascade is not installed" in done.stderr and "pip install -e ." in done.stderr
