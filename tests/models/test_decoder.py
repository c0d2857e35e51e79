"""The stacked cache is held once: jc.generate compiled inside a user's jit needs, beyond the cache itself,
at most half a byte of temporaries per cache byte (the layer loop carries the cache and updates each
layer's slice in place; it used to take the cache as scan input and emit a new one). A model with sliding
layers keeps a window cache for them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcascade as jc
import tiny


GEMMA3 = dict(architecture="gemma3", qk_norm=True, layer_types=("sliding",) * 4 + ("global",) * 4, sliding_window=64,
              rope_local_theta=10000.0)


@pytest.mark.parametrize("family", [{}, GEMMA3], ids=["llama", "gemma3"])
def test_generate_holds_the_cache_once(family):
    """(Gemma 3: both caches, through the `lax.cond` on the layer type.)"""
    model = tiny.model(97, num_layers=8, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64, **family)
    tokens = jnp.zeros((2, 256), jnp.int32)
    measured = []
    for cache_size in (1024, 4096):
        policy = jc.Cascade(cache_size=cache_size, sinks=16, stride=16)
        generate = jax.jit(lambda t: jc.generate(model, t, policy, max_new_tokens=16))
        temp = generate.lower(tokens).compile().memory_analysis().temp_size_in_bytes
        state = jax.eval_shape(lambda: model.init_cache(policy, 2))
        measured.append((sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)), temp))
    (cache_0, temp_0), (cache_1, temp_1) = measured
    slope = (temp_1 - temp_0) / (cache_1 - cache_0)
    assert slope <= 1.5, f"{slope:.2f} bytes of temporaries per cache byte (the cache itself is 1)"


def test_sliding_layers_get_a_window_cache_of_their_own():
    """Gemma 3's layer types: the global layers get the policy's cache, the sliding layers one of window - 1
    slots (the query itself makes the window), each stacked over its own layers; ragged rows equal each row
    alone, across the window."""
    model = tiny.model(97, seed=2, architecture="gemma3", qk_norm=True, num_layers=3, sliding_window=8,
                       layer_types=("sliding", "global", "sliding"), rope_local_theta=10000.0, query_scale=0.3)
    policy = jc.Cascade(cache_size=16, sinks=2, num_cascades=2, stride=8)
    global_cache, window_cache = model.init_cache(policy, 2)
    assert global_cache.k.shape == (1, 2, 2, 18, 8) and window_cache.k.shape == (2, 2, 2, 7, 8)
    tokens = np.random.default_rng(3).integers(0, 97, (2, 40))
    both = np.asarray(jc.score(model, tokens, policy, lengths=np.array([40, 23])))
    alone = np.asarray(jc.score(model, tokens[1:, :23], policy))
    np.testing.assert_allclose(both[1, :22], alone[0], atol=1e-5)
    assert not both[1, 22:].any()
    with pytest.raises(ValueError, match="num_samples is not supported yet for models with sliding layers"):
        jc.generate(model, tokens[:1], policy, max_new_tokens=4, num_samples=2)
