"""Qwen3.5's Gated DeltaNet mixer (linear attention with a gated delta rule), as Hugging Face's
`Qwen3_5GatedDeltaNet` computes it.

For x [B, T, E], one layer projects qkv = x @ W_qkv [B, T, C] (C = 2 Hk dk + Hv dv), z [B, T, Hv, dv] and two
per-head scalars b, a [B, T, Hv]; runs a depthwise causal convolution of kernel K with SiLU over qkv (its left
context is the last K - 1 inputs of the previous call, `LinearState.conv`); splits it into q, k [B, T, Hk, dk] and
v [B, T, Hv, dv], l2-normalises q and k, scales q by dk^-1/2 and repeats each key head for Hv / Hk value heads.
Each value head h then carries a state S [dk, dv] (`LinearState.recurrent`) through the gated delta rule of
"Gated Delta Networks: Improving Mamba2 with Delta Rule" (Yang, Kautz, Hatamizadeh; arXiv 2412.06464):
S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T and o_t = S_t^T q_t, with the learning rate
beta = sigmoid(b) and the log-decay g = -exp(A_log) softplus(a + dt_bias) <= 0. The output o [B, T, Hv, dv] goes
through an RMSNorm per head, gated by silu(z), and out_proj back to [B, T, E]. The state is constant in T. A
multi-token call uses the chunked (WY / UT-transform) form of the rule, a single token the recurrence, as Hugging
Face does; both agree. Rows are right-padded to `lengths`: padding positions leave the state untouched.

Weights use the x @ W convention (W is [in, out], the transpose of PyTorch's Linear weight).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearState:
    """One linear-attention layer's state per row (layers stacked on a leading axis in the model)."""

    recurrent: jax.Array  # float32 [B, Hv, dk, dv]: the delta rule's state S
    conv: jax.Array  # [B, K - 1, C] (model dtype): the last K - 1 pre-convolution qkv inputs (zeros at start)


def init_linear_state(
    batch: int,
    *,
    num_value_heads: int,
    key_dim: int,
    value_dim: int,
    conv_channels: int,
    kernel: int,
    dtype,
    num_layers: int | None = None,
) -> LinearState:
    """The zero state of `batch` rows; with `num_layers`, a leading layer axis on both arrays."""
    lead = (batch,) if num_layers is None else (num_layers, batch)
    return LinearState(
        recurrent=jnp.zeros(lead + (num_value_heads, key_dim, value_dim), jnp.float32),
        conv=jnp.zeros(lead + (kernel - 1, conv_channels), dtype),
    )


def _check_shape(name: str, x: jax.Array, dims: str, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape [{dims}] = {tuple(shape)}, got {tuple(x.shape)}")


def _check_rule_inputs(q, k, v, g, beta, state) -> None:
    if q.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q and v must be 4-D ([B, T, Hv, dk], [B, T, Hv, dv]), got {q.shape} and {v.shape}")
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    _check_shape("k", k, "B, T, Hv, dk", q.shape)
    _check_shape("v", v, "B, T, Hv, dv", (B, T, H, dv))
    _check_shape("g", g, "B, T, Hv", (B, T, H))
    _check_shape("beta", beta, "B, T, Hv", (B, T, H))
    _check_shape("state", state, "B, Hv, dk, dv", (B, H, dk, dv))


def _f32(*xs: jax.Array) -> list[jax.Array]:
    return [x.astype(jnp.float32) for x in xs]


def delta_rule_reference(q, k, v, g, beta, state) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token (`lax.scan`), in float32: S = exp(g_t) S; S += k_t (beta_t (v_t -
    k_t^T S))^T; o_t = S^T q_t. q, k [B, T, Hv, dk] (normalised and scaled), v [B, T, Hv, dv], g, beta [B, T, Hv],
    state float32 [B, Hv, dk, dv]. Returns out float32 [B, T, Hv, dv] and the final state."""
    _check_rule_inputs(q, k, v, g, beta, state)

    def step(S, inputs):
        q_t, k_t, v_t, g_t, beta_t = inputs
        S = S * jnp.exp(g_t)[..., None, None]
        delta = beta_t[..., None] * (v_t - jnp.einsum("bhk,bhkv->bhv", k_t, S, precision=HIGHEST))
        S = S + k_t[..., :, None] * delta[..., None, :]
        return S, jnp.einsum("bhk,bhkv->bhv", q_t, S, precision=HIGHEST)

    time_major = [jnp.moveaxis(x, 1, 0) for x in _f32(q, k, v, g, beta)]
    state, out = jax.lax.scan(step, state.astype(jnp.float32), time_major)
    return jnp.moveaxis(out, 0, 1), state


def delta_rule_chunked(q, k, v, g, beta, state, *, chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """The same rule as `delta_rule_reference`, `chunk` tokens at a time (the WY / UT-transform form): within a
    chunk, with G the cumulative sum of g, the unit lower-triangular system (I + tril(beta_i k_i^T k_j
    exp(G_i - G_j), -1)) gives the chunk's corrected values U and decayed keys W at once; the state then passes
    from chunk to chunk (`lax.scan`). Decays are exponentials of differences G_i - G_j <= 0, masked above the
    diagonal, so nothing overflows. T is padded to a multiple of `chunk` with g = beta = 0 (no effect)."""
    _check_rule_inputs(q, k, v, g, beta, state)
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    n = -(-T // chunk)

    def chunks(x):  # [B, T, H, ...] -> [n, B, H, chunk, ...], zero-padded
        x = jnp.pad(x, [(0, 0), (0, n * chunk - T)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(B, n, chunk, H, *x.shape[3:]), (1, 3), (0, 2))

    q, k, v, g, beta = (chunks(x) for x in _f32(q, k, v, g, beta))
    G = jnp.cumsum(g, axis=-1)  # [n, B, H, chunk]
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    decay = jnp.exp(jnp.where(lower, G[..., :, None] - G[..., None, :], -jnp.inf))  # exp(G_i - G_j), j <= i
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = jnp.einsum("...ik,...jk->...ij", k_beta, k, precision=HIGHEST) * decay
    system = jnp.where(lower & ~jnp.eye(chunk, dtype=bool), system, 0.0)  # (I + this) X = rhs

    def solve(rhs):
        return jax.scipy.linalg.solve_triangular(system, rhs, lower=True, unit_diagonal=True)

    corrected_v = solve(v_beta)  # U [n, B, H, chunk, dv]
    decayed_k = solve(k_beta * jnp.exp(G)[..., None])  # W [n, B, H, chunk, dk]
    intra = jnp.einsum("...ik,...jk->...ij", q, k, precision=HIGHEST) * decay  # [n, B, H, chunk, chunk]
    q_decayed = q * jnp.exp(G)[..., None]
    k_to_end = k * jnp.exp(G[..., -1:] - G)[..., None]  # each key decayed to the chunk's end
    chunk_decay = jnp.exp(G[..., -1])[..., None, None]  # [n, B, H, 1, 1]

    def step(S, inputs):
        U, W, q_c, k_c, P, d = inputs
        v_new = U - jnp.einsum("bhck,bhkv->bhcv", W, S, precision=HIGHEST)
        out = jnp.einsum("bhck,bhkv->bhcv", q_c, S, precision=HIGHEST) + jnp.einsum(
            "bhcj,bhjv->bhcv", P, v_new, precision=HIGHEST
        )
        S = S * d + jnp.einsum("bhck,bhcv->bhkv", k_c, v_new, precision=HIGHEST)
        return S, out

    state, out = jax.lax.scan(
        step, state.astype(jnp.float32), (corrected_v, decayed_k, q_decayed, k_to_end, intra, chunk_decay)
    )
    out = jnp.moveaxis(out, (0, 2), (1, 3)).reshape(B, n * chunk, H, dv)  # [n, B, H, c, dv] -> [B, n c, H, dv]
    return out[:, :T], state


def causal_conv(x, weight, tail, lengths) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal convolution with SiLU: y[t, c] = silu(sum_j weight[c, j] h[t + j, c]) over the history
    h = tail ++ x. x [B, T, C] (pre-convolution qkv), weight [C, K], tail [B, K - 1, C] (the inputs before x),
    lengths int32 [B] (valid tokens of each row, right padding). Returns y [B, T, C] in x.dtype (summed in
    float32, then cast and activated) and the new tail: the last K - 1 valid inputs of each row's history
    (tail ++ x[:lengths])."""
    if x.ndim != 3 or weight.ndim != 2:
        raise ValueError(f"x must be [B, T, C] and weight [C, K], got {x.shape} and {weight.shape}")
    B, T, C = x.shape
    K = weight.shape[1]
    _check_shape("weight", weight, "C, K", (C, K))
    _check_shape("tail", tail, "B, K - 1, C", (B, K - 1, C))
    _check_shape("lengths", lengths, "B", (B,))
    history = jnp.concatenate([tail.astype(x.dtype), x], axis=1)  # [B, K - 1 + T, C]
    hf, wf = _f32(history, weight)
    y = jax.nn.silu(sum(hf[:, j : j + T] * wf[:, j] for j in range(K)).astype(x.dtype))
    index = lengths[:, None] + jnp.arange(K - 1)  # the history positions lengths .. lengths + K - 2
    new_tail = jnp.take_along_axis(history, index[:, :, None], axis=1).astype(tail.dtype)
    return y, new_tail


def gated_delta_net(
    w: dict,
    x,
    state: LinearState,
    lengths,
    *,
    num_key_heads: int,
    num_value_heads: int,
    key_dim: int,
    value_dim: int,
    eps: float,
) -> tuple[jax.Array, LinearState]:
    """One Gated DeltaNet layer's mixer on x [B, T, E] (already input-normed), rows right-padded to `lengths`
    int32 [B]. `w` holds "lin_qkv" [E, 2 Hk dk + Hv dv] (columns q | k | v), "lin_z" [E, Hv dv], "lin_b",
    "lin_a" [E, Hv], "lin_conv" [C, K], "lin_dt_bias", "lin_a_log" [Hv], "lin_norm" [dv] and "lin_out"
    [Hv dv, E]. Returns out [B, T, E] in x.dtype (zeros at padding positions) and the state after each row's
    valid tokens. T == 1 runs the recurrent form, T > 1 the chunked one."""
    Hk, Hv, dk, dv = num_key_heads, num_value_heads, key_dim, value_dim
    if x.ndim != 3:
        raise ValueError(f"x must have shape [B, T, E], got {x.shape}")
    if Hv % Hk:
        raise ValueError(f"num_value_heads ({Hv}) must be a multiple of num_key_heads ({Hk})")
    B, T, E = x.shape
    C, K = 2 * Hk * dk + Hv * dv, w["lin_conv"].shape[-1]
    expected = {
        "lin_qkv": ("E, 2 Hk dk + Hv dv", (E, C)),
        "lin_z": ("E, Hv dv", (E, Hv * dv)),
        "lin_b": ("E, Hv", (E, Hv)),
        "lin_a": ("E, Hv", (E, Hv)),
        "lin_conv": ("C, K", (C, K)),
        "lin_dt_bias": ("Hv", (Hv,)),
        "lin_a_log": ("Hv", (Hv,)),
        "lin_norm": ("dv", (dv,)),
        "lin_out": ("Hv dv, E", (Hv * dv, E)),
    }
    for name, (dims, shape) in expected.items():
        _check_shape(f"w[{name!r}]", w[name], dims, shape)
    _check_shape("lengths", lengths, "B", (B,))
    _check_shape("state.recurrent", state.recurrent, "B, Hv, dk, dv", (B, Hv, dk, dv))
    _check_shape("state.conv", state.conv, "B, K - 1, C", (B, K - 1, C))

    valid = jnp.arange(T)[None, :] < lengths[:, None]  # [B, T]
    # four views of x: XLA would merge the four products into one over [qkv | z | b | a], concatenated anew in every
    # layer of every step (1.6 ms of a 16 ms batch-16 decode step of Qwen3.5's default shape on an H100)
    x, x_z, x_b, x_a = jax.lax.optimization_barrier((x, x, x, x))
    qkv, conv_tail = causal_conv(x @ w["lin_qkv"], w["lin_conv"], state.conv, lengths)
    q, k, v = jnp.split(qkv, [Hk * dk, 2 * Hk * dk], axis=-1)

    def heads(t, n, d):  # [B, T, n d] -> [B, T, Hv, d] in float32, key heads repeated for their value heads
        return jnp.repeat(t.reshape(B, T, n, d).astype(jnp.float32), Hv // n, axis=2)

    def l2_normalised(t):
        return t * jax.lax.rsqrt(jnp.sum(t * t, axis=-1, keepdims=True) + 1e-6)

    q, k, v = l2_normalised(heads(q, Hk, dk)) * dk**-0.5, l2_normalised(heads(k, Hk, dk)), heads(v, Hv, dv)
    beta = jnp.where(valid[..., None], jax.nn.sigmoid(x_b @ w["lin_b"]).astype(jnp.float32), 0.0)
    a = (x_a @ w["lin_a"]).astype(jnp.float32) + w["lin_dt_bias"].astype(jnp.float32)
    g = jnp.where(valid[..., None], -jnp.exp(w["lin_a_log"].astype(jnp.float32)) * jax.nn.softplus(a), 0.0)
    if T == 1:
        o, recurrent = delta_rule_reference(q, k, v, g, beta, state.recurrent)
    else:
        o, recurrent = delta_rule_chunked(q, k, v, g, beta, state.recurrent)

    # the gated RMSNorm per head: normalised in float32, cast, scaled by its weight, gated by silu(z) in float32
    o = o.astype(x.dtype).astype(jnp.float32)
    normed = (o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    z = (x_z @ w["lin_z"]).reshape(B, T, Hv, dv).astype(jnp.float32)
    gated = ((w["lin_norm"] * normed) * jax.nn.silu(z)).astype(x.dtype)
    gated = jnp.where(valid[..., None, None], gated, 0).reshape(B, T, Hv * dv)
    return gated @ w["lin_out"], LinearState(recurrent=recurrent, conv=conv_tail)
