"""Qwen3.5's Gated DeltaNet mixer (models/delta_net.py): the chunked delta rule equals the token-by-token one
(any T, any chunk size, strongly negative decays), both equal transformers' torch functions, the whole mixer
equals transformers' Qwen3_5GatedDeltaNet and continues across calls (prefill, decode, another chunk), and
ragged rows equal each row alone."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jcascade.models import delta_net as dn
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

B, HK, HV, DK, DV, E, K = 2, 2, 4, 8, 16, 32, 4
C = 2 * HK * DK + HV * DV
EPS = 1e-6
mixer = jax.jit(
    functools.partial(dn.gated_delta_net, num_key_heads=HK, num_value_heads=HV, key_dim=DK, value_dim=DV, eps=EPS)
)
reference = jax.jit(dn.delta_rule_reference)
chunked = jax.jit(dn.delta_rule_chunked, static_argnames="chunk")


def raw_rule_inputs(T: int, seed: int = 0) -> dict[str, np.ndarray]:
    """q, k [B, T, Hk, dk] as the mixer's convolution gives them, v, g (with strongly negative stretches), beta
    and a nonzero initial state, float32."""
    rng = np.random.default_rng(seed)
    g = -np.log1p(np.exp(rng.normal(size=(B, T, HV))))  # -softplus: the mixer's range
    g[0, T // 3 : T // 3 + 3, 1] = -60.0
    g[1, T // 2, 2] = -500.0
    x = dict(
        q=rng.normal(size=(B, T, HK, DK)),
        k=rng.normal(size=(B, T, HK, DK)),
        v=rng.normal(size=(B, T, HV, DV)),
        g=g,
        beta=1 / (1 + np.exp(-rng.normal(size=(B, T, HV)))),
        state=0.3 * rng.normal(size=(B, HV, DK, DV)),
    )
    return {name: a.astype(np.float32) for name, a in x.items()}


def rule_inputs(raw: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    """(q, k, v, g, beta, state) as the delta rule takes them: q, k l2-normalised, q scaled, heads repeated."""

    def prepared(t):
        t = t / np.sqrt(np.sum(t * t, axis=-1, keepdims=True) + 1e-6)
        return np.repeat(t, HV // HK, axis=2)

    return prepared(raw["q"]) * DK**-0.5, prepared(raw["k"]), raw["v"], raw["g"], raw["beta"], raw["state"]


def assert_close(actual, expected, tol):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=tol, atol=tol)


def test_chunked_rule_equals_the_recurrence():
    """Nonzero initial state, decays down to -500 a step; T from one token to several chunks, not multiples."""
    for T in (1, 63, 64, 150):
        args = rule_inputs(raw_rule_inputs(T))
        out, state = chunked(*args)
        ref_out, ref_state = reference(*args)
        assert_close(out, ref_out, 1e-5)
        assert_close(state, ref_state, 1e-5)


def test_chunk_size_does_not_matter():
    args = rule_inputs(raw_rule_inputs(150, seed=1))
    out_16, state_16 = chunked(*args, chunk=16)
    out_64, state_64 = chunked(*args, chunk=64)
    assert_close(out_16, out_64, 1e-5)
    assert_close(state_16, state_64, 1e-5)


def test_rules_equal_transformers_torch_functions():
    """transformers' torch fallbacks take raw q, k at Hk heads and normalise, scale and repeat them."""
    raw = raw_rule_inputs(100, seed=2)
    torch_args = {name: torch.from_numpy(a) for name, a in raw.items()}
    state = torch_args.pop("state")
    q, k, v, g, beta = (torch_args[n] for n in ("q", "k", "v", "g", "beta"))
    args = rule_inputs(raw)
    for ours, theirs in ((chunked, hf.torch_chunk_gated_delta_rule), (reference, hf.torch_recurrent_gated_delta_rule)):
        expected_out, expected_state = theirs(
            q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        out, final = ours(*args)
        assert_close(out, expected_out.numpy(), 1e-5)
        assert_close(final, expected_state.numpy(), 1e-5)


def hf_layer() -> tuple[hf.Qwen3_5GatedDeltaNet, dict[str, jax.Array]]:
    """transformers' layer from a tiny config (A_log, dt_bias and the norm weight randomised: their inits hide
    bugs) and its weights in our layout."""
    config = Qwen3_5TextConfig(
        vocab_size=128,
        hidden_size=E,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=K,
        full_attention_interval=2,
        rms_norm_eps=EPS,
    )
    torch.manual_seed(0)
    layer = hf.Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        layer.A_log.copy_(torch.randn(HV))
        layer.dt_bias.copy_(torch.randn(HV))
        layer.norm.weight.copy_(1 + 0.5 * torch.randn(DV))
    t = {name: p.detach().numpy() for name, p in layer.named_parameters()}
    w = {
        "lin_qkv": t["in_proj_qkv.weight"].T,
        "lin_z": t["in_proj_z.weight"].T,
        "lin_b": t["in_proj_b.weight"].T,
        "lin_a": t["in_proj_a.weight"].T,
        "lin_conv": t["conv1d.weight"][:, 0],
        "lin_dt_bias": t["dt_bias"],
        "lin_a_log": t["A_log"],
        "lin_norm": t["norm.weight"],
        "lin_out": t["out_proj.weight"].T,
    }
    return layer, {name: jnp.asarray(a) for name, a in w.items()}


def zero_state(batch: int) -> dn.LinearState:
    return dn.init_linear_state(
        batch, num_value_heads=HV, key_dim=DK, value_dim=DV, conv_channels=C, kernel=K, dtype=jnp.float32
    )


def test_mixer_equals_transformers_and_continues_across_calls():
    """One call over 100 tokens (crossing the 64-token chunk) equals transformers' layer; prefill 70 tokens, decode
    3 one at a time, then a 27-token chunk equals that one call (outputs and state)."""
    layer, w = hf_layer()
    x = np.random.default_rng(3).normal(size=(B, 100, E)).astype(np.float32)
    with torch.no_grad():
        expected = layer(torch.from_numpy(x)).numpy()
    full = lambda n: jnp.full((B,), n, jnp.int32)
    out, final = mixer(w, x, zero_state(B), full(100))
    assert_close(out, expected, 1e-4)

    pieces, state = [], zero_state(B)
    for start, stop in ((0, 70), (70, 71), (71, 72), (72, 73), (73, 100)):
        piece, state = mixer(w, x[:, start:stop], state, full(stop - start))
        pieces.append(piece)
    assert_close(jnp.concatenate(pieces, axis=1), out, 1e-5)
    assert_close(state.recurrent, final.recurrent, 1e-5)
    assert_close(state.conv, final.conv, 1e-6)  # the same inputs, up to the projection's rounding
    assert_close(state.conv, x[:, -(K - 1) :] @ w["lin_qkv"], 1e-6)


def test_ragged_rows_equal_each_row_alone():
    """Right-padded rows with garbage padding, from a nonzero state: a row of 2 tokens (fewer than K - 1, so its
    conv tail keeps one input from before) beside one of 9, then the other way round, then a decode step that
    only the second row takes; each equals the row run alone on its valid tokens."""
    _, w = hf_layer()
    rng = np.random.default_rng(4)
    start = dn.LinearState(
        recurrent=jnp.asarray(0.3 * rng.normal(size=(B, HV, DK, DV)), jnp.float32),
        conv=jnp.asarray(rng.normal(size=(B, K - 1, C)), jnp.float32),
    )
    calls = [
        (rng.normal(size=(B, T, E)).astype(np.float32), lengths)
        for T, lengths in ((9, (2, 9)), (9, (9, 2)), (1, (0, 1)))
    ]
    state = start
    outs = []
    for x, lengths in calls:
        out, state = mixer(w, x, state, jnp.asarray(lengths, jnp.int32))
        outs.append(out)
    for row in range(B):
        alone = jax.tree.map(lambda a: a[row : row + 1], start)
        for (x, lengths), out in zip(calls, outs):
            n = lengths[row]
            if n:
                out_alone, alone = mixer(w, x[row : row + 1, :n], alone, jnp.asarray([n], jnp.int32))
                assert_close(out[row, :n], out_alone[0], 1e-5)
            np.testing.assert_array_equal(out[row, n:], 0)
        assert_close(state.recurrent[row], alone.recurrent[0], 1e-5)
        assert_close(state.conv[row], alone.conv[0], 1e-6)


def test_bad_shapes_are_refused_by_name():
    args = rule_inputs(raw_rule_inputs(5))
    with pytest.raises(ValueError, match=r"k must have shape \[B, T, Hv, dk\]"):
        dn.delta_rule_chunked(args[0], args[1][:, :4], *args[2:])
    with pytest.raises(ValueError, match=r"state must have shape \[B, Hv, dk, dv\]"):
        dn.delta_rule_reference(*args[:5], args[5][:, :, :4])
    x, tail = jnp.zeros((B, 5, C)), jnp.zeros((B, K, C))
    with pytest.raises(ValueError, match=r"tail must have shape \[B, K - 1, C\]"):
        dn.causal_conv(x, jnp.zeros((C, K)), tail, jnp.zeros((B,), jnp.int32))
    _, w = hf_layer()
    with pytest.raises(ValueError, match=r"w\['lin_out'\] must have shape \[Hv dv, E\]"):
        mixer({**w, "lin_out": w["lin_out"].T}, jnp.zeros((B, 5, E)), zero_state(B), jnp.zeros((B,), jnp.int32))
    stacked = dn.init_linear_state(
        3, num_value_heads=HV, key_dim=DK, value_dim=DV, conv_channels=C, kernel=K, dtype=jnp.bfloat16, num_layers=5
    )
    assert stacked.recurrent.shape == (5, 3, HV, DK, DV) and stacked.recurrent.dtype == jnp.float32
    assert stacked.conv.shape == (5, 3, K - 1, C) and stacked.conv.dtype == jnp.bfloat16
