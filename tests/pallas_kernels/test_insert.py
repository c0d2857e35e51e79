"""The single-token insertion kernel (pallas_kernels/triton_insert.py, Triton) in interpret mode equals the vectorised
XLA update bit for bit, and lowers for an H100 from the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_inputs import h100_mesh

import jcascade as jc


@pytest.mark.parametrize(
    "policy",
    [
        jc.Cascade(cache_size=12, sinks=2, num_cascades=3, gamma=0.5),
        jc.Cascade(cache_size=8, sinks=0, num_cascades=4, gamma=0.9),
        jc.Sink(window=5, sinks=1),
    ],
    ids=["cascade3", "cascade4-nosinks", "sink"],
)
def test_single_token_insertion_kernel_equals_xla_update(policy):
    """Decode-time updates through the Triton insertion kernel (interpret mode) equal the vectorised
    update bit for bit, ties included, from the empty cache deep into the steady phase."""
    rng = np.random.default_rng(3)
    B, H, D = 3, 2, 16
    update = jax.jit(jc.update, static_argnums=0)
    xla = jc.init_cache(policy, B, H, D)
    kernel = jc.init_cache(policy, B, H, D, kernels=jc.Kernels("triton"))
    for _ in range(60):
        k = jnp.asarray(rng.normal(size=(B, 1, H, D)), jnp.float32)
        lengths = jnp.asarray(rng.integers(0, 2, B), jnp.int32)
        scores = None
        if isinstance(policy, jc.Cascade):
            scores = jc.Scores(
                jnp.asarray(rng.choice([0.0, 0.25, 0.5], (B, H, xla.capacity)), jnp.float32),
                jnp.asarray(rng.choice([0.0, 0.5, 1.0], (B, H, 1)), jnp.float32),
            )
        xla = update(policy, xla, k, -k, scores, lengths)
        kernel = update(policy, kernel, k, -k, scores, lengths)
        for a, b in zip(jax.tree.leaves(xla), jax.tree.leaves(kernel)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(np.asarray(xla.seen).max()) > xla.capacity


def test_insertion_kernel_lowers_for_gpu():
    from jcascade.pallas_kernels.triton_insert import insert_one

    layout = jc.Cascade(cache_size=16384, sinks=64, num_cascades=4).layout()
    B, H, cap, D = 32, 8, layout.capacity, 128
    s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    args = (
        s(B, H, cap, dtype=jnp.float32),
        s(B, H, cap, dtype=jnp.int32),
        jc.Stored(s(B, H, cap, D)),
        jc.Stored(s(B, H, cap, D)),
        s(B, H, 1, dtype=jnp.float32),
        jc.Stored(s(B, 1, H, D)),
        jc.Stored(s(B, 1, H, D)),
        s(B, dtype=jnp.int32),
        s(B, dtype=jnp.int32),
        s(B, dtype=jnp.int32),
    )
    with jax.sharding.use_abstract_mesh(h100_mesh()):
        text = jax.jit(lambda *a: insert_one(layout, *a)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
