"""Property-based tests over the doors the fourth wave opened (the policies' kv_dtype field is drawn with every
other policy field in test_input_checks.py): `context=` / `context_lengths` of any shape and values, the kernel
configs' fields, and the config.json fields of the Qwen3.5 and Gemma 4 families. Each draw either runs (traced
only: nothing compiles) or is refused by a ValueError or TypeError naming what was given."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
import transformers
from hypothesis import given
from hypothesis import strategies as st

import jcascade as jc
from jcascade import pallas_kernels as pk

VOCAB = 50
MODEL = tiny.model(VOCAB)
ODD = st.one_of(
    st.integers(-3, 70),
    st.just(2**31),
    st.floats(-1, 1),
    st.none(),
    st.text(max_size=3),
    st.booleans(),
    st.lists(st.integers(0, 4), max_size=2),
)


@given(
    batch=st.integers(1, 3),
    rows=st.integers(0, 4),
    width=st.integers(0, 20),
    lengths=st.one_of(st.none(), st.lists(st.integers(-2, 22), min_size=0, max_size=4)),
    top=st.integers(1, VOCAB + 2),
    policy=st.sampled_from([jc.SnapKV(budget=8, window=4, stride=8), jc.Sink(window=8, sinks=2, stride=8)]),
)
def test_context_of_any_shape_and_values_runs_or_is_refused_by_name(batch, rows, width, lengths, top, policy):
    """A context [rows, width] of ids below `top` (VOCAB + 1 or more is out of the vocabulary) with
    context_lengths: the traced score either runs, its log-probs [batch, 6], or a ValueError names context or
    context_lengths."""
    rng = np.random.default_rng(rows * 100 + width)
    context = rng.integers(0, top, (rows, width)).astype(np.int32)
    tokens = np.ones((batch, 6), np.int32)
    try:
        out = jax.eval_shape(
            lambda: jc.score(
                MODEL,
                tokens,
                policy,
                context=context,
                context_lengths=None if lengths is None else np.asarray(lengths, np.int32),
            )
        )
    except ValueError as e:
        assert "context" in str(e), e
        return
    assert out.shape == (batch, 6)
    assert rows in (1, batch) and width >= 1 and (lengths is None or len(lengths) == rows)


CONFIGS = [pk.TritonConfig, pk.TpuConfig, pk.MosaicGpuConfig]


@given(cls=st.sampled_from(CONFIGS), data=st.data())
def test_kernel_config_fields_are_accepted_or_refused_by_name(cls, data):
    """Odd values for one or two fields of a kernel config: refused naming one of them, or a hashable config that
    a `jc.Kernels` of its backend takes."""
    fields = [f.name for f in dataclasses.fields(cls)]
    changed = {f: data.draw(ODD, label=f) for f in data.draw(st.sets(st.sampled_from(fields), min_size=1, max_size=2))}
    try:
        config = cls(**changed)
    except (ValueError, TypeError) as e:
        assert any(f in str(e) for f in changed), (changed, e)
        return
    hash(config)
    assert all(isinstance(getattr(config, f), int) and not isinstance(getattr(config, f), bool) for f in changed)
    backend, name = {
        pk.TritonConfig: ("triton", "triton"),
        pk.TpuConfig: ("mosaic_tpu", "tpu"),
        pk.MosaicGpuConfig: ("mosaic_gpu", "mosaic_gpu"),
    }[cls]
    assert getattr(pk.Kernels(backend, **{name: config}), name) == config


def new_family(kind: str) -> dict:
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        head_dim=8,
    )
    if kind == "qwen3_5":
        config = transformers.Qwen3_5TextConfig(
            **common,
            num_hidden_layers=3,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
        )
        return config.to_dict() | {"architectures": ["Qwen3_5ForCausalLM"]}
    config = transformers.Gemma4TextConfig(
        **common,
        num_hidden_layers=4,
        global_head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=64,
    )
    return config.to_dict() | {"architectures": ["Gemma4ForCausalLM"]}


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma4"])
@given(data=st.data())
def test_new_family_config_fields_load_or_are_refused_naming_the_field(kind, data, tmp_path_factory):
    """One field of a Qwen3.5 or Gemma 4 config.json set to an odd value (or removed): read_config either gives a
    config whose model's cache can be made (traced), or raises a ValueError naming config.json and the field."""
    config = new_family(kind)
    field = data.draw(
        st.sampled_from(
            sorted(k for k, v in config.items() if isinstance(v, int | float | list) and not isinstance(v, bool))
        ),
        label="field",
    )
    value = data.draw(st.one_of(st.just("removed"), ODD), label="value")
    if value == "removed":
        del config[field]
    else:
        config[field] = value
    directory = tmp_path_factory.mktemp(kind)
    (directory / "config.json").write_text(json.dumps(config))
    try:
        read = jc.read_config(directory)
    except ValueError as e:
        assert "config.json" in str(e), e
        return
    state = jax.eval_shape(
        lambda: jc.CausalLM.random(read, jax.random.key(0), jnp.float32).init_cache(jc.Full(), 1, max_tokens=8)
    )
    assert jax.tree.leaves(state)
