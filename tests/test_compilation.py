"""jcascade's jitted entry points compile with `jc.COMPILER_OPTIONS` at the top level and inline as plain
jits inside a user's jit (where jax refuses compiler options); importing jcascade adds the cuBLAS trace-cache flag
to XLA_FLAGS."""

import os

import jax
import jax.numpy as jnp
import pytest
import tiny

import jcascade as jc
from jcascade import compilation, generation


def test_top_level_calls_carry_the_options_and_nested_calls_inline():
    f = compilation.jit(lambda x: x @ x.T)
    x = jnp.ones((4, 8))
    assert f(x).shape == (4, 4) and f.top_level._cache_size() == 1
    assert jax.jit(lambda y: f(y) + 1)(x).shape == (4, 4) and f.top_level._cache_size() == 1  # inlined
    with pytest.raises(ValueError, match="top-level"):  # why the nested call must not carry the options
        jax.jit(lambda y: jax.jit(lambda z: z + 1, compiler_options=jc.COMPILER_OPTIONS)(y))(x)


def test_generate_runs_at_the_top_level_and_inside_a_users_jit():
    tiny_model = tiny.model(97)
    tokens = jnp.ones((1, 5), jnp.int32)
    policy = jc.Sink(window=8, sinks=2, stride=4)
    top = jc.generate(tiny_model, tokens, policy, max_new_tokens=3)
    inner = jax.jit(
        lambda t: jc.generate(tiny_model, t, policy, max_new_tokens=3), compiler_options=jc.COMPILER_OPTIONS
    )(tokens)
    assert generation._generate.top_level._cache_size() >= 1
    assert (top == inner).all()


def test_the_trace_cache_flag_is_added_to_xla_flags_and_a_users_own_size_kept():
    assert "--xla_cmd_buffer_trace_cache_size=" in os.environ["XLA_FLAGS"]  # added at import (or the user's own)
    assert compilation.with_trace_cache_flag("") == compilation.TRACE_CACHE_FLAG
    assert compilation.with_trace_cache_flag("--xla_dump_to=/tmp/d").split() == [
        "--xla_dump_to=/tmp/d",
        compilation.TRACE_CACHE_FLAG,
    ]
    assert (
        compilation.with_trace_cache_flag("--xla_cmd_buffer_trace_cache_size=7")
        == "--xla_cmd_buffer_trace_cache_size=7"
    )
