"""Pallas-Triton (GPU) kernel inserting one token per row into a ring-layout cache (decode, T == 1).

docs/semantics.md §3 step 2 for a single token: the row's clock alone says, for each ring, whether the token
arrives, fills, is accepted (and pushes the ring's oldest token on) or competes with the ring's newest
token, so each (row, KV head) program makes N scalar decisions and writes at most N + 1 rows, in place
(the state's arrays are aliased to the outputs). Step 1 (decay and accumulate) stays in XLA, where it
fuses with the attention epilogue that produced the increments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import triton
from .schedule import RingLayout, ring_schedules
from .storage import Stored


def _insert_kernel(
    layer_ref,
    seen_ref,
    n_ref,
    position_ref,
    chunk_mu_ref,
    new_k_ref,
    new_v_ref,
    *refs,
    layout: RingLayout,
    barrier: bool,
    per_slot: int,
):
    """refs: the new token's `per_slot` - 2 other per-slot values (a quantized cache's k and v scales: [1] each),
    then the inputs mu, pos, (scales,) k, v and the outputs in the same order. A slot's items are its K and V rows
    and its per-slot values, mu first."""
    extra = per_slot - 2
    new_extra, ins, outs = refs[:extra], refs[extra : extra + per_slot + 2], refs[extra + per_slot + 2 :]
    slot_refs, (k_ref, v_ref) = ins[:per_slot], ins[per_slot:]
    slot_outs, (k_out, v_out) = outs[:per_slot], outs[per_slot:]
    S0, W = layout.sinks, layout.ring_size
    layer, b, h = layer_ref[0], pl.program_id(0), pl.program_id(1)
    row = lambda ref, slot: ref.at[layer, b, h, slot, :]  # a slot of this program's (layer, row, head) in the stack
    D = k_ref.shape[-1]
    seen = seen_ref[...]
    present = n_ref[...] > 0
    t = jnp.maximum(seen - S0, 0)
    scheds = ring_schedules(layout)

    # Phase A: read everything that phase B may overwrite (rings occupy disjoint slots).
    oldest = [S0 + i * W + s.writes(t) % W for i, s in enumerate(scheds)]
    newest = [S0 + i * W + (s.writes(t) - 1) % W for i, s in enumerate(scheds)]
    evicted = [
        (plgpu.load(row(k_ref, w)), plgpu.load(row(v_ref, w)), tuple(ref[w] for ref in slot_refs)) for w in oldest
    ]
    newest_mu = [slot_refs[0][z] for z in newest]
    if barrier:
        plgpu.debug_barrier()

    def write(slot, item, pred):
        k, v, values = item
        plgpu.store(row(k_out, slot), k, mask=jnp.broadcast_to(pred, (D,)))
        plgpu.store(row(v_out, slot), v, mask=jnp.broadcast_to(pred, (D,)))
        for out, value in zip(slot_outs, values):
            plgpu.store(out.at[slot], value, mask=pred)

    # Phase B: the token walks down the rings.
    item = (new_k_ref[...], new_v_ref[...], (chunk_mu_ref[0], position_ref[...], *(r[0] for r in new_extra)))
    if S0:
        write(jnp.minimum(seen, S0 - 1), item, present & (seen < S0))
    active = present & (seen >= S0)
    for sched, w, z, y, z_mu in zip(scheds, oldest, newest, evicted, newest_mu):
        fill = sched.arrivals(t) < W
        accept = sched.accepting(t)
        wins = active & ~fill & ~accept & (item[2][0] > z_mu)
        write(jnp.where(wins, z, w), item, (active & (fill | accept)) | wins)
        item = y
        active = active & ~fill & accept


def insert_one(
    layout: RingLayout,
    mu,
    pos,
    k_cache,
    v_cache,
    chunk_mu,
    new_k,
    new_v,
    seen,
    n,
    position,
    *,
    layer=None,
    interpret: bool = False,
):
    """In-place single-token insertion. mu f32 / pos int32 [B, H, cap] (mu after decay and accumulate);
    k_cache, v_cache `Stored` [B, H, cap, D], or a stack [L, B, H, cap, D] of which layer `layer` (int32 scalar) is
    written (with the layer's own scales [B, H, cap] for codes); chunk_mu f32 [B, H, 1]; new_k, new_v `Stored`
    [B, 1, H, D] in the cache's format; seen int32 [B] the row's slot clock (tokens placed so far), n int32 [B] 1 or
    0 (padding), position int32 [B] the token's original position (= seen, except in compressed append caches). A
    quantized cache's scales move with their tokens as mu and pos do. A stack of 2**31 to 2**32 8-bit codes, which
    the lowering cannot address by the byte (`triton.addresses_fit`), is written as int16 pairs (`triton.as_pairs`,
    D even): the kernel copies rows. Returns the new (mu, pos, k_cache, v_cache), the caches `Stored` of the shapes
    given."""
    stacked = layer is not None
    held = [c.scale for c in (k_cache, v_cache) if c.quantized]
    token = [c.scale for c in (new_k, new_v) if c.quantized]
    k_cache, v_cache = (c.data if stacked else c.data[None] for c in (k_cache, v_cache))
    layer = layer if stacked else 0
    new_k, new_v = new_k.data.astype(k_cache.dtype), new_v.data.astype(v_cache.dtype)
    codes_dtype = k_cache.dtype
    paired = not (triton.addresses_fit(k_cache) and triton.addresses_fit(v_cache))
    if paired:  # 8-bit codes the lowering cannot address by the byte: the same bytes as int16 pairs, copied as rows
        k_cache, v_cache, new_k, new_v = (triton.as_pairs(x) for x in (k_cache, v_cache, new_k, new_v))
    _, B, H, cap, D = k_cache.shape
    per_slot = 2 + len(held)
    row = lambda b, h: (b,)
    slots = lambda b, h: (b, h, 0)
    slot_spec = pl.BlockSpec((None, None, cap), slots)
    cache_specs = [slot_spec] * per_slot + [pl.BlockSpec()] * 2  # K, V: the whole stack, each program its own rows
    in_specs = [
        pl.BlockSpec(),
        pl.BlockSpec((None,), row),
        pl.BlockSpec((None,), row),
        pl.BlockSpec((None,), row),
        pl.BlockSpec((None, None, 1), slots),
        pl.BlockSpec((None, None, None, D), lambda b, h: (b, 0, h, 0)),
        pl.BlockSpec((None, None, None, D), lambda b, h: (b, 0, h, 0)),
        *[pl.BlockSpec((None, None, 1), lambda b, h: (b, 0, h))] * len(token),
        *cache_specs,
    ]
    state = (mu, pos, *held, k_cache, v_cache)
    first = 7 + len(token)
    out = pl.pallas_call(
        functools.partial(_insert_kernel, layout=layout, barrier=not interpret, per_slot=per_slot),
        grid=(B, H),
        in_specs=in_specs,
        out_specs=cache_specs,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state],
        input_output_aliases={first + i: i for i in range(len(state))},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="jcascade_insert_one",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), seen, n, position, chunk_mu, new_k, new_v, *token, *state)
    mu, pos, *held, k_cache, v_cache = out
    if paired:
        k_cache, v_cache = (triton.from_pairs(x, codes_dtype) for x in (k_cache, v_cache))
    if not stacked:
        k_cache, v_cache = k_cache[0], v_cache[0]
    scales = held or [None, None]
    return mu, pos, Stored(k_cache, scales[0]), Stored(v_cache, scales[1])
