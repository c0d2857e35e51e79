"""Keys stored rotated at their positions (`CacheState.rope`), in every storage format: every kernel backend reads
them as they are (Pallas in interpret mode), and a shared prefix keeps them so."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jcascade.pallas_kernels import Stored
from kernel_inputs import SMALL, XLA, random_inputs

import jcascade as jc

ROPE = jc.RoPE(10000.0)


@pytest.mark.parametrize("fmt", ["model", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("T", [1, 9], ids=["decode", "chunk"])
@pytest.mark.parametrize("backend", ["xla", "triton", "mosaic_tpu"])
def test_every_backend_reads_keys_stored_rotated_in_every_format(backend, T, fmt):
    """Keys stored rotated at their positions, in each format, in a model's stack read at a layer from a first slot:
    every backend (Pallas in interpret mode) reads them without a rotation (rope None; on a GPU backend a decode step
    in place, codes dequantized in registers) and gives the output, log-sum-exp and score increments that the XLA
    reference gives with the un-rotated keys rotated as it reads them."""
    rng = np.random.default_rng(T)
    x = random_inputs(rng, 2, T, 8, 2, 64, 45, jnp.float32, per_head_positions=True)
    plain = [Stored.empty(x[n].shape, fmt, jnp.float32) for n in ("k_cache", "v_cache")]
    k, v = plain[0].encode(ROPE(x["k_cache"], x["cache_positions"])), plain[1].encode(x["v_cache"])
    want = XLA.chunk_attention(
        **x | dict(k_cache=Stored(ROPE(k.decode(), -x["cache_positions"])), v_cache=Stored(v.decode())), rope=ROPE
    )
    first = 7

    def stack(c):  # a model's stack [L, B, Hkv, first + 45, D], the layer's own scales over all its slots
        data = jnp.zeros((3, 2, 2, first + 45, 64), c.dtype).at[1, :, :, first:].set(c.data)
        return Stored(data, jnp.concatenate([jnp.ones((2, 2, first)), c.scale], -1) if c.quantized else None)

    kernels = SMALL.get(backend, XLA)
    if kernels.on_gpu and T == 1:
        assert kernels.quantized_decode_path(stack(k), None) == "in place"
    got = jax.jit(
        lambda x, k, v: kernels.chunk_attention(**x, k_cache=k, v_cache=v, layer=jnp.int32(1), first_slot=first)
    )({n: a for n, a in x.items() if n not in ("k_cache", "v_cache")}, stack(k), stack(v))
    for name, g, w in zip(["out", "lse", "inc_cache", "inc_chunk"], got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("fmt", ["model", "int8"])
@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_a_shared_prefix_of_keys_stored_rotated_is_read_as_it_is(backend, fmt):
    """share_prefix of a cache storing rotated keys at the tokens' own positions (no offset) keeps them as they are
    (codes included) with its rope; every backend reads them without rotating; attend_shared over it equals attend
    over the whole history in one cache."""
    rng = np.random.default_rng(1)
    policy = jc.Full(stride=8, kv_dtype=fmt)
    B, Hq, Hkv, D = 1, 4, 2, 16
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    prefix_kv, q, k, v = (f(B, 12, Hkv, D), f(B, 12, Hkv, D)), f(B, 3, Hq, D), f(B, 3, Hkv, D), f(B, 3, Hkv, D)
    kernels = SMALL.get(backend, XLA)
    make = lambda n: jc.init_cache(policy, B, Hkv, D, max_tokens=n, kernels=kernels, rope=ROPE)
    head = jc.update(policy, make(12), *prefix_kv, None)
    prefix = jc.share_prefix(policy, head, rope=ROPE)
    assert prefix.rope == ROPE and prefix.k.dtype == head.k.dtype
    np.testing.assert_array_equal(np.asarray(prefix.k.data), np.asarray(head.k.data))
    got = jc.attend_shared(policy, make(3), q, k, v, [prefix], rope=ROPE)
    whole, _ = jc.attend(policy, head_plus := jc.update(policy, make(15), *prefix_kv, None), q, k, v, rope=ROPE)
    assert head_plus.seen[0] == 12
    np.testing.assert_allclose(np.asarray(got), np.asarray(whole), rtol=1e-5, atol=1e-5)
