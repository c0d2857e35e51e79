"""The Mosaic TPU kernels (pallas_kernels/tpu.py) lower for TPU from the CPU. Against the reference in
interpret mode: test_pallas_kernels.py."""

import jax
import pytest

import jcascade as jc
from jcascade import pallas_kernels as pk
from kernel_inputs import LOWERING_SHAPES, abstract_inputs


@pytest.mark.parametrize("shape", LOWERING_SHAPES, ids=str)
def test_kernels_lower_for_tpu(shape):
    f = jax.jit(lambda *a: pk.tpu.chunk_attention(*a, "max", jc.RoPE(500000.0)))
    text = f.trace(*abstract_inputs(*shape)).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 4
