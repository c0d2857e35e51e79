"""The stacked cache is held once: jc.generate compiled inside a user's jit needs, beyond the cache itself,
at most half a byte of temporaries per cache byte (the layer loop carries the cache and updates each
layer's slice in place; it used to take the cache as scan input and emit a new one)."""

import jax
import jax.numpy as jnp

import jcascade as jc
import tiny


def test_generate_holds_the_cache_once():
    model = tiny.model(97, num_layers=8, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64)
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
