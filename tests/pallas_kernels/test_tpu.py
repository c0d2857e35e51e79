"""The Mosaic TPU kernels (pallas_kernels/tpu.py) lower for TPU from the CPU, on a cache in the model's dtype and on
a quantized one's codes. Against the reference in interpret mode: test_pallas_kernels.py, test_quantization.py."""

import jax
import jax.numpy as jnp
import pytest
from kernel_inputs import LOWERING_SHAPES, abstract_inputs

import jcascade as jc
from jcascade import pallas_kernels as pk


@pytest.mark.parametrize("shape", LOWERING_SHAPES, ids=str)
def test_kernels_lower_for_tpu(shape):
    f = jax.jit(lambda *a: pk.tpu.chunk_attention(*a, "max", jc.RoPE(500000.0)))
    args = list(abstract_inputs(*shape))
    args[3:5] = map(pk.Stored, args[3:5])  # the caches as the kernels take them
    text = f.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 4


@pytest.mark.parametrize("codes", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("shape", LOWERING_SHAPES[1:], ids=str)
def test_kernels_lower_for_tpu_on_codes(shape, codes):
    """A quantized cache's codes and scales: the segment kernel reads the value codes (an 8-bit operand)."""
    args = list(abstract_inputs(*shape))
    B, Hkv, S, D = args[3].shape
    scale = jax.ShapeDtypeStruct((B, Hkv, S), jnp.float32)
    args[3] = args[4] = pk.Stored(jax.ShapeDtypeStruct((B, Hkv, S, D), codes), scale)
    f = jax.jit(lambda *a: pk.tpu.chunk_attention(*a, "max", jc.RoPE(500000.0)))
    text = f.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 4
    assert f"tensor<{B}x{Hkv}x{S}x{D}x{'i8' if codes == jnp.int8 else 'f8E4M3FN'}>" in text
