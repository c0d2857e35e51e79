"""The attention layers' projections: q, k, v (with their biases, norms and the query scale) and the output (with
its gate), for every attention kind."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jcascade.models.config import GLOBAL, ModelConfig
from jcascade.models.layers import Context


def weight_name(cfg: ModelConfig, layer_type: str, name: str) -> str:
    """The name of an attention weight of a layer of `layer_type`: the global layers' own ("_global") with
    `Attention.global_weights`."""
    return name + ("_global" if layer_type == GLOBAL and cfg.attention.global_weights else "")


def qkv(ctx: Context, layer_type: str, fetch, h: jax.Array, with_kv: bool):
    """(q [B, T, H, D], the output gate or None, k, v [B, T, Hkv, D]) of an attention layer of `layer_type` from its
    input h [B, T, hidden]; q and k un-rotated (their rotating dims in the kernels' order, `rotary_order`), q scaled
    for the kernels' D ** -0.5; without `with_kv`, k and v are None (a layer reading another layer's cache)."""
    cfg, norm = ctx.cfg, ctx.norm
    att, B, T = cfg.attention, ctx.batch, ctx.tokens
    D, H, Hkv = cfg.head_size(layer_type), cfg.num_heads, cfg.kv_heads(layer_type)
    name = lambda n: weight_name(cfg, layer_type, n)
    # a view of h of its own for the gate: XLA would merge the two products into one over [wq | gate], concatenated
    # anew in every layer of every step
    h, h_gate = jax.lax.optimization_barrier((h, h)) if att.output_gate else (h, None)
    if ctx.fused_qkv and name("wq") == "wq":  # [in, Hkv, H / Hkv + 2, D]: each KV head's queries, key, value (FUSED)
        joined = jnp.einsum("btd,dhgk->bthgk", h, fetch("wqkv"))
        q, k, v = joined[:, :, :, :-2].reshape(B, T, H, D), joined[:, :, :, -2], joined[:, :, :, -1]
    else:  # separate products (the global layers' own weights, or k and v only on the layers keeping a cache)
        # a view of h for each: XLA would merge the projections into one product over [wq | wk | wv]
        h, h_k, h_v = jax.lax.optimization_barrier((h, h, h))
        q = (h @ fetch(name("wq"))).reshape(B, T, H, D)
        k = v = None
        if with_kv:
            k = (h_k @ fetch(name("wk"))).reshape(B, T, Hkv, D)
            v = k if att.k_eq_v and layer_type == GLOBAL else (h_v @ fetch(name("wv"))).reshape(B, T, Hkv, D)
    if att.qkv_bias:
        q = q + fetch("bq").reshape(H, D)
        if with_kv:
            k, v = k + fetch("bk").reshape(Hkv, D), v + fetch("bv").reshape(Hkv, D)
    qk_norm = lambda x, w: norm(x, w) if cfg.norms.qk == "head" else norm(x.reshape(B, T, -1), w).reshape(x.shape)
    q = qk_norm(q, fetch(name("q_norm"))) if cfg.norms.qk else q
    gate = h_gate @ fetch("w_attn_gate") if att.output_gate else None
    scale = 1.0 if att.query_scale is None else att.query_scale * D**0.5
    if scale != 1.0:  # the attention scales by head_dim ** -0.5
        q = q * jnp.asarray(scale, q.dtype)
    if not with_kv:
        return rotary_order(cfg, layer_type, q), gate, None, None
    k = qk_norm(k, fetch(name("k_norm"))) if cfg.norms.qk else k
    if cfg.norms.values:
        v = norm(v, None)
    return rotary_order(cfg, layer_type, q), gate, rotary_order(cfg, layer_type, k), v


def output(ctx: Context, layer_type: str, fetch, out: jax.Array, gate: jax.Array | None) -> jax.Array:
    """The attention's out [B, T, H, D], gated (sigmoid of `gate`, if any), projected back to [B, T, hidden]."""
    out = out.reshape(ctx.batch, ctx.tokens, -1)
    if gate is not None:
        out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
    o = out @ fetch(weight_name(ctx.cfg, layer_type, "wo"))
    return o + fetch("bo") if ctx.cfg.attention.o_bias else o


def rotary_order(cfg: ModelConfig, layer_type: str, x: jax.Array) -> jax.Array:
    """x [..., D] (queries or keys) with a global layer's partially rotated head dims (the first r = D *
    `rotary.fraction` dims rotate in pairs (i, i + r/2)) moved to the rotate-half pairs (i, i + D/2) that the kernels
    rotate (`ModelConfig.rope` gives the other pairs frequency 0); q . k is unchanged by the same order on both.
    Other layers, and a proportional RoPE (already of the whole head): x."""
    if cfg.rotary.proportional or layer_type != GLOBAL or cfg.rotary.fraction == 1:
        return x
    D = x.shape[-1]
    r = int(D * cfg.rotary.fraction)
    rest = list(range(r, D))
    half = D // 2 - r // 2
    order = list(range(r // 2)) + rest[:half] + list(range(r // 2, r)) + rest[half:]
    return x[..., jnp.asarray(order)]
