"""Whole-model benchmarks on a Llama-3.1-8B-shaped (or `--shape 70b`: Llama-3-70B-shaped; `--shape gemma-3-270m`:
Gemma 3 270M, 15 sliding layers of a 512-token window beside 3 global ones; `--shape qwen3.5` / `gemma-4`: the
default configs of transformers' Qwen3.5 and Gemma 4 text models, see QWEN3_5 and GEMMA4) model with random bf16
weights made on the device(s), on one device or a `--mesh data=D,model=M` (tensor parallelism). Every run also
prints the state a row holds by layer type (Full at 128K and 1M tokens, the Cascade at 1M) and, for Qwen3.5,
the Gated DeltaNet mixer's time per prefill chunk.

  a  strided prefill (Cascade: 16K + 64 sinks, 4 cascades, stride 4K) streamed over 1M tokens, with the
     elapsed time read at 32K, 128K and 1M tokens; throughput and model FLOP utilisation (MFU) against a
     bf16 matrix product measured in the same run;
  b  decode tokens/s at batch 1, 16 and 32 (`--batches`) over a full 16K cascade cache vs the roofline
     (the weight bytes a step reads, all but an untied embedding table, and the K/V bytes, of one device, over the
     memory bandwidth measured in the same run: `memory_bandwidth`, checked against the card's class; a step
     measured faster than its roofline is reported as a measurement error, never as a fraction above 1);
     each batch size on its own: one whose weights + cache exceed a device's memory (8B at batch 32: 69 GB of
     cache beside 16 GB of weights, over an H100's 80 GB) is reported with the bytes it needs, not run;
  c  compile time of the prefill segment and of the decode step.

The prefill runs as jitted segments of 32K tokens (8 chunks under `lax.scan`) that carry the cache, so
one compilation serves every length.

    python benchmarks/bench_model.py [--out benchmarks/results/model-<device>.json]
    python benchmarks/bench_model.py --shape 70b --mesh model=2 --only a   # 70B prefill on two GPUs
    python benchmarks/bench_model.py --mesh model=2 --processes 2 --only b # decode on that mesh over two processes
    python benchmarks/bench_model.py --tiny      # a dry run of the same code with a tiny model
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys
import tempfile
import warnings

import decode_breakdown
import harness
import jax
import jax.numpy as jnp
from jcascade.models import CausalLM, ModelConfig, delta_net, sharding
from jcascade.models.config import FAMILY_FEATURES, Attention, LinearAttention, Rotary
from jcascade.models.weights import weight_shapes

import jcascade as jc
from jcascade import pallas_kernels as pk
from jcascade.eval import processes

LLAMA31_8B = ModelConfig(
    architecture="llama",
    **FAMILY_FEATURES["llama"],
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rotary=Rotary(theta=500000.0, scaling=jc.Llama3Scaling()),
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    max_position_embeddings=131072,
)
LLAMA3_70B = dataclasses.replace(
    LLAMA31_8B, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8
)
GEMMA3_270M = ModelConfig(
    architecture="gemma3",
    **FAMILY_FEATURES["gemma3"],
    vocab_size=262144,
    hidden_size=640,
    intermediate_size=2048,
    num_layers=18,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    rotary=Rotary(theta=1e6, local_theta=1e4),
    attention=Attention(query_scale=256**-0.5),
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    sliding_window=512,
    layer_types=tuple("global" if (i + 1) % 6 == 0 else "sliding" for i in range(18)),
)
# transformers' Qwen3_5TextConfig defaults: 24 Gated DeltaNet layers (16 key / 32 value heads of 128) and 8 gated
# global ones (16 heads, 4 KV heads of 256, a quarter of each rotated), hidden 4096
QWEN3_5 = ModelConfig(
    architecture="qwen3_5",
    **FAMILY_FEATURES["qwen3_5"],
    vocab_size=248320,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=32,
    num_heads=16,
    num_kv_heads=4,
    head_dim=256,
    rotary=Rotary(theta=1e7, fraction=0.25),
    attention=Attention(output_gate=True),
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=262144,
    layer_types=tuple("global" if (i + 1) % 4 == 0 else "linear" for i in range(32)),
    linear=LinearAttention(key_heads=16, value_heads=32, key_dim=128, value_dim=128, conv_kernel=4),
)
# transformers' Gemma4TextConfig defaults: 25 sliding layers (window 512, 4 KV heads of 256) and 5 global ones (4 KV
# heads of 512, proportional RoPE), per-layer inputs of 256, hidden 2304
GEMMA4 = ModelConfig(
    architecture="gemma4",
    **FAMILY_FEATURES["gemma4"],
    vocab_size=262144,
    hidden_size=2304,
    intermediate_size=9216,
    num_layers=30,
    num_heads=8,
    num_kv_heads=4,
    head_dim=256,
    rotary=Rotary(theta=1e6, local_theta=1e4, fraction=0.25, proportional=True),
    attention=Attention(query_scale=1.0, global_head_dim=512, global_weights=True),
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
    sliding_window=512,
    layer_types=tuple("global" if (i + 1) % 6 == 0 else "sliding" for i in range(30)),
    per_layer_input_size=256,
    per_layer_vocab_size=262144,
)
SHAPES = {"8b": LLAMA31_8B, "70b": LLAMA3_70B, "gemma-3-270m": GEMMA3_270M, "qwen3.5": QWEN3_5, "gemma-4": GEMMA4}
TINY = ModelConfig(
    architecture="llama",
    **FAMILY_FEATURES["llama"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rotary=Rotary(theta=10000.0),
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)


def write(out: pathlib.Path, result: dict) -> None:
    """Writes the JSON (over `--processes`, process 0 alone: the others print nothing either)."""
    if jax.process_index() == 0:
        harness.write_json(out, result)


def matmul_peak(n: int) -> float:
    """bf16 FLOP/s of an n x n matrix product, 10 calls queued back to back."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    return 2 * n**3 / harness.time_it(f, a, b, repeats=1, calls=10).median


# The memory bandwidth of each card class, bytes/s: what its HBM is rated at (H100 SXM 3.35 TB/s, PCIe about 2.0,
# NVL 3.9; H200 4.8) less what copies fall short of it (`memory_bandwidth`: one H100 SXM 3.04-3.07 TB/s, one H200
# 4.31-4.40; timed one pass a call, as before 2026-11-27's sixth session, four H100 SXM read 2.67-2.81 and H200s
# 3.5-4.0: git history, benchmarks/RESULTS.md "Four GPUs"). A measurement outside its class is reported.
CARD_BANDWIDTH = {"H100": (2.6e12, 3.35e12), "H200": (4.3e12, 4.8e12)}


def memory_bandwidth(devices, sizes: list[int], repeats: int = 10, passes_per_call: int = 8) -> dict:
    """Bytes per second each of `devices` moves: over each of `sizes` bf16 elements made on the device, an
    elementwise pass (bytes read + written) and a sum (bytes read), each run `passes_per_call` times inside one
    jitted loop (so the host's dispatch of a call, tens of microseconds, does not count against a pass of a few
    hundred), called once to warm up, then timed `repeats` times; a device's rate is the best of them all. `rate` is
    the slowest device's (a sharded step waits for it). Returns dict(rate, per_device {device: rate}, card_class
    (low, high) or None)."""
    per_device = {}
    k = passes_per_call
    add = jax.jit(lambda x: jax.lax.fori_loop(0, k, lambda i, y: y + 1, x))
    # each pass's sum depends on the pass, so that XLA cannot hoist it out of the loop
    total = jax.jit(
        lambda x: jax.lax.fori_loop(
            0, k, lambda i, s: s + jnp.sum(x + i.astype(x.dtype), dtype=jnp.float32), jnp.float32(0)
        )
    )
    passes = ((add, 2 * k), (total, k))  # (loop, bytes moved / x's)
    for device in devices:
        best = 0.0
        for n in sizes:
            x = jax.jit(
                lambda: jax.random.normal(jax.random.key(2), (n,), jnp.bfloat16),
                out_shardings=jax.sharding.SingleDeviceSharding(device),
            )()
            for f, times_x in passes:
                best = max(best, times_x * x.nbytes / harness.time_it(f, x, repeats=repeats).min)
            del x
        per_device[str(device)] = best
    kind = devices[0].device_kind
    card = next((rates for name, rates in CARD_BANDWIDTH.items() if name in kind), None)
    return dict(rate=min(per_device.values()), per_device=per_device, card_class=card)


def flops_per_token(cfg: ModelConfig, keys_per_query: float) -> float:
    """Matmul FLOPs per token: every layer weight matrix (2 per weight), attention (QK^T and PV at 4 per
    key and head dim, plus the scores pass's QK^T at 2; a sliding layer's query at 4 per key of its window), a
    Gated DeltaNet layer's chunked delta rule (64-token chunks: per value head about 4 * 64 * dk + 2 * 64 * dv +
    6 * dk * dv); the LM head is not run during prefill."""
    dense = 2 * sum(math.prod(shape) for shape in weight_shapes(cfg).values() if len(shape) >= 3)  # layer matrices
    types = cfg.types
    attention = cfg.num_heads * (
        cfg.head_size("global") * types.count("global") * keys_per_query * (4 + 2)
        + cfg.head_dim * types.count("sliding") * (cfg.sliding_window or 0) * 4
    )
    linear = 0
    if cfg.linear is not None:
        dk, dv = cfg.linear.key_dim, cfg.linear.value_dim
        linear = types.count("linear") * cfg.linear.value_heads * (4 * 64 * dk + 2 * 64 * dv + 6 * dk * dv)
    return dense + attention + linear


def bench_prefill(a, model, policy, peak):
    segment = a.segment
    state = model.init_cache(policy, 1)
    lengths = jnp.array([segment], jnp.int32)
    run = jax.jit(
        lambda model, state, tokens: jc.prefill(model, policy, state, tokens, lengths)[:2],
        donate_argnums=1,
        compiler_options=jc.COMPILER_OPTIONS,
    )
    tokens = [jax.random.randint(jax.random.key(i), (1, segment), 0, model.config.vocab_size) for i in range(4)]
    compiled, compile_s = harness.time_once(lambda: run.lower(model, state, tokens[0]).compile())
    # one untimed segment first: a mesh's first call also sets up its collectives (about 1 s on four H100s)
    jax.block_until_ready(compiled(model, state, tokens[0]))
    state = model.init_cache(policy, 1)
    marks, rows = set(a.prefill_marks), []
    since_start = harness.Stopwatch()
    done = 0
    while done < max(marks):
        state, _ = compiled(model, state, tokens[(done // segment) % 4])
        done += segment
        if done in marks:
            elapsed = since_start.elapsed(state)
            keys = min(done, policy.layout().capacity) + policy.stride / 2  # average keys per query
            rows.append(
                dict(
                    tokens=done,
                    seconds=elapsed,
                    tokens_per_s=done / elapsed,
                    mfu=flops_per_token(model.config, keys) * done / elapsed / peak,
                )
            )
            print(f"   prefill {done} tokens: {elapsed:.1f} s", flush=True)
    result = dict(compile_s=compile_s, segment=segment, rows=rows)
    if a.profile_step:  # one more segment, after the longest prefill: the cache as full as it gets
        result.update(
            profiled(
                lambda: compiled(model, state, tokens[0]),
                model.config.num_layers,
                rows[-1]["seconds"] / (rows[-1]["tokens"] / segment) * 1e3,
            )
        )
    return result


def delta_rule_ms(model, tokens: int) -> float:
    """ms of one Gated DeltaNet layer's mixer (`delta_net.gated_delta_net`, XLA) over a chunk of `tokens` tokens of
    one row, with the first linear layer's weights: the median of 10 calls."""
    cfg = model.config
    first = cfg.types.index("linear")
    w = {
        name: p[...][cfg.layers_with_state("linear").index(first)]
        for name, p in model.layers.items()
        if name.startswith("lin_")
    }
    states = model.init_cache(jc.Full(), 1, max_tokens=1)
    state = jax.tree.map(lambda a: a[0], states.linear)  # the first linear layer's
    x = jax.random.normal(jax.random.key(3), (1, tokens, cfg.hidden_size), model.dtype)
    run = jax.jit(
        lambda w, x, state: delta_net.gated_delta_net(
            w,
            x,
            state,
            jnp.array([tokens], jnp.int32),
            num_key_heads=cfg.linear.key_heads,
            num_value_heads=cfg.linear.value_heads,
            key_dim=cfg.linear.key_dim,
            value_dim=cfg.linear.value_dim,
            eps=cfg.rms_norm_eps,
        )
    )
    return harness.time_it(run, w, x, state, repeats=10).median * 1e3


def is_cache(x) -> bool:
    return isinstance(x, jc.CacheState)


def is_linear(x) -> bool:
    return isinstance(x, delta_net.LinearState)


def state_memory(cfg: ModelConfig, policy, tokens: int) -> dict:
    """Bytes of a model's state per row (bf16 K/V; scores, positions and recurrent states as stored) holding
    `tokens` tokens under `policy` (Full: every token), by layer type, from shapes alone (nothing is allocated)."""
    state = jax.eval_shape(
        lambda: CausalLM.random(cfg, jax.random.key(0), jnp.bfloat16).init_cache(policy, 1, max_tokens=tokens)
    )
    states = {"global": state.cache, "sliding": state.window, "linear": state.linear}
    return {t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s)) for t, s in states.items() if s is not None}


def decode_bytes(model, policy, batch: int) -> dict:
    """Bytes one device holds for a decode step at `batch`: its weight shards, of them the ones a step reads (all
    but an untied embedding table, of which a step reads one row per token), and its share of the cache (every
    array of the state; a model with sliding layers has two caches), from shapes alone (nothing is allocated)."""
    devices = 1 if model.mesh is None else model.mesh.size
    on_one_device = lambda x: x.addressable_shards[0].data.nbytes  # the shards are equal
    state = jax.eval_shape(lambda: model.init_cache(policy, batch, decode_slots(policy)))
    cache = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) // devices
    kv = (
        sum(
            x.size * x.dtype.itemsize
            for c in jax.tree.leaves(state, is_leaf=is_cache)
            if is_cache(c)
            for x in jax.tree.leaves((c.k, c.v))
        )
        // devices
    )  # a quantized one's scales too
    recurrent = (
        sum(
            x.size * x.dtype.itemsize
            for s in jax.tree.leaves(state, is_leaf=is_linear)
            if is_linear(s)
            for x in jax.tree.leaves(s)
        )
        // devices
    )  # read and written by each step
    weights = sum(on_one_device(x) for x in jax.tree.leaves(model))
    unread = (
        on_one_device(model.embed[...]) if model.lm_head is not None else 0
    ) + sum(  # tables a step reads a row of
        on_one_device(p[...]) for name, p in model.per_layer_inputs.items() if name == "embed_per_layer"
    )
    return dict(weights=weights, weights_read=weights - unread, cache=cache, kv=kv + 2 * recurrent)


def bench_decode_batch(a, model, policy, bandwidth, batch: int, held: dict) -> dict:
    """ms per greedy step at `batch` over a full cache, against the weights + K/V roofline of one device (`held`:
    `decode_bytes`)."""

    def full(state):  # a full cache, as after a long prompt, made in place on its devices
        cap, shape = state.k.shape[-2], state.k.shape
        held = policy.budget if cap == decode_slots(policy) else cap  # SnapKV's compressed cache leaves ROOM free
        k1, k2 = jax.random.split(jax.random.key(batch))
        rows = lambda key: jnp.broadcast_to(jax.random.normal(key, (cap, shape[-1]), model.dtype), shape)
        slot = jnp.arange(cap, dtype=jnp.int32)
        state = dataclasses.replace(
            state,
            score=jnp.full(state.score.shape, 1e-4, jnp.float32),
            pos=jnp.broadcast_to(jnp.where(slot < held, (1 << 20) - held + slot, -1), state.pos.shape),
            seen=jnp.full(state.seen.shape, 1 << 20, jnp.int32),
        )
        if not state.k.quantized:
            state = dataclasses.replace(state, k=jc.Stored(rows(k1)), v=jc.Stored(rows(k2)))
        else:  # a quantized cache: codes and scales of random rows
            (k, k_scale), (v, v_scale) = (
                pk.storage.quantize(jax.random.normal(key, (cap, shape[-1])), state.k.dtype) for key in (k1, k2)
            )
            state = dataclasses.replace(
                state,
                k=jc.Stored(jnp.broadcast_to(k, shape), jnp.broadcast_to(k_scale, shape[:-1])),
                v=jc.Stored(jnp.broadcast_to(v, shape), jnp.broadcast_to(v_scale, shape[:-1])),
            )
        if model.mesh is None:
            return state
        return sharding.place(state, sharding.cache_specs(state, model.mesh), model.mesh)

    # every KV cache full (the global layers' and the sliding layers' window caches; recurrent states stay zero)
    state = jax.jit(
        lambda: jax.tree.map(
            lambda s: full(s) if is_cache(s) else s,
            model.init_cache(policy, batch, decode_slots(policy)),
            is_leaf=lambda s: is_cache(s) or is_linear(s),
        )
    )()

    def placed(tokens):
        """The tokens a step feeds and returns, rows over "data" where they divide (as the cache's), placed alike so
        that each step's output enters the next as compiled."""
        if model.mesh is None:
            return tokens
        rows = "data" if batch % model.mesh.shape["data"] == 0 else None
        return sharding.place(tokens, jax.sharding.PartitionSpec(rows), model.mesh)

    def step(model, state, last):
        hidden, state = model(policy, state, last[:, None], jnp.ones((batch,), jnp.int32))
        return state, placed(jnp.argmax(model.logits(hidden[:, 0]), axis=-1).astype(jnp.int32))

    run = jax.jit(step, donate_argnums=1, compiler_options=jc.COMPILER_OPTIONS)
    # made on the devices: over --processes, an array one process made on its own device cannot enter the program
    last = jax.jit(lambda: placed(jnp.zeros((batch,), jnp.int32)))()
    compiled, compile_s = harness.time_once(lambda: run.lower(model, state, last).compile())

    def step():  # the state is donated: each step decodes on from the last one's
        nonlocal state, last
        state, last = compiled(model, state, last)
        return last

    # one untimed step, then the steps queued back to back, timed until the last one's token is out
    per_step = harness.time_it(step, repeats=1, calls=a.decode_steps).median
    roofline = (held["weights_read"] + held["kv"]) / bandwidth
    row = dict(
        ms_per_step=per_step * 1e3,
        tokens_per_s=batch / per_step,
        roofline_ms=roofline * 1e3,
        fraction_of_roofline=roofline / per_step,
        compile_s=compile_s,
    )
    if row["fraction_of_roofline"] > 1:  # a roofline no step can beat was beaten: the bandwidth was measured low
        row["fraction_of_roofline"] = None
        row["roofline_error"] = (
            f"the step ({per_step * 1e3:.2f} ms) beat its roofline ({roofline * 1e3:.2f} ms): "
            f"the bandwidth measured, {bandwidth / 1e12:.2f} TB/s, is below what the device moves"
        )
    if a.profile_step:
        row.update(profiled(lambda: compiled(model, state, last), model.config.num_layers, per_step * 1e3))
    return row


def profiled(call, layers: int, step_ms: float) -> dict:
    """One more `call()` (a decode step or a prefill segment) under the JAX profiler: {"breakdown": its GPU kernels
    by kind (decode_breakdown.py)}, or {"breakdown_error": why there is none}; the table is printed."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(call())
        try:
            found = dict(
                breakdown=decode_breakdown.breakdown(decode_breakdown.kernels_of_trace(trace_dir), layers, step_ms)
            )
        except ValueError as e:  # a profile without GPU kernels: say so, keep the timings
            found = dict(breakdown_error=str(e))
    print(
        "\n".join(decode_breakdown.table(found["breakdown"])) if "breakdown" in found else found["breakdown_error"],
        flush=True,
    )
    return found


ROOM = 64  # the free slots of an append cache (SnapKV's after its compression) for the decode steps


def decode_slots(policy) -> int | None:
    """The `max_tokens` of a decode benchmark's cache: a compressed append cache of the policy's budget and ROOM free
    slots (SnapKV); None for a bounded policy (Cascade), full to its capacity."""
    return None if policy.bounded else policy.budget + ROOM


def bench_decode(a, model, policy, bandwidth) -> list[dict]:
    """One row per batch size: its figures, or why it did not run. A batch whose weights + cache exceed one
    device's memory is not tried; one that fails anyway (out of memory in the step's temporaries) says so."""
    limit = jax.local_devices()[0].memory_stats()
    limit = limit.get("bytes_limit") if limit else None
    rows = []
    for batch in a.decode_batches:
        held = decode_bytes(model, policy, batch)
        row = dict(
            batch=batch,
            weight_bytes=held["weights"],
            weight_bytes_read=held["weights_read"],
            kv_bytes=held["kv"],
            cache_bytes=held["cache"],
            device_bytes=limit,
        )
        needed = held["weights"] + held["cache"]
        if limit is not None and needed > limit:
            row["error"] = f"does not fit: weights + cache {needed / 1e9:.1f} GB > {limit / 1e9:.1f} GB on one device"
        else:
            try:
                row.update(bench_decode_batch(a, model, policy, bandwidth, batch, held))
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                row["error"] = (
                    f"out of memory beside weights + cache {needed / 1e9:.1f} GB of "
                    f"{(limit or 0) / 1e9:.1f} GB: {str(e).splitlines()[0][:300]}"
                )
        print(f"   decode batch {batch}: " + (row.get("error") or f"{row['ms_per_step']:.2f} ms/step"), flush=True)
        rows.append(row)
    return rows


def make_policy(name: str, size: int, sinks: int, stride: int, kv_dtype: str):
    """--policy: Cascade of `size` slots + `sinks` sinks (4 cascades), or SnapKV of a `size` budget."""
    if name == "cascade":
        return jc.Cascade(cache_size=size, sinks=sinks, num_cascades=4, stride=stride, kv_dtype=kv_dtype)
    return jc.SnapKV(budget=size, window=min(32, size // 2), stride=stride, kv_dtype=kv_dtype)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--only", default="ab", help="a: prefill, b: decode (compile times come with each)")
    p.add_argument("--batches", default="1,16,32", help="decode batch sizes")
    p.add_argument(
        "--cache-size", type=int, default=16384, help="Cascade cache size (64: weights and fixed costs only)"
    )
    p.add_argument(
        "--kv-dtype",
        default="model",
        choices=pk.storage.KV_DTYPES,
        help="the cache's storage format (the policy's kv_dtype)",
    )
    p.add_argument(
        "--policy",
        choices=("cascade", "snapkv"),
        default="cascade",
        help="the decode's cache: Cascade (--cache-size + 64 sinks, 4 cascades) or SnapKV's compressed cache "
        "(a budget of --cache-size, and 64 free slots)",
    )
    p.add_argument(
        "--shape",
        choices=SHAPES,
        default="8b",
        help="Llama-3.1-8B, Llama-3-70B, Gemma 3 270M, Qwen3.5 or Gemma 4 shapes",
    )
    p.add_argument(
        "--mesh", type=sharding.parse_mesh, default=(1, 1), metavar="data=D,model=M", help="devices (default: one)"
    )
    p.add_argument("--prefill-tokens", type=int, default=1 << 20, help="longest prefill (32K, 128K marks below it)")
    p.add_argument(
        "--profile-step",
        action="store_true",
        help="one more prefill segment (a) and decode step (b) under the JAX profiler, their GPU time "
        "by kind of kernel (benchmarks/decode_breakdown.py)",
    )
    p.add_argument(
        "--backend",
        default=None,
        choices=pk.BACKENDS,
        help="attention kernels, jc.Kernels(backend) (default: jc.Kernels.default(), the platform's)",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="decode (--only b) as N processes of one device each on this host (jax.distributed on "
        "localhost), the --mesh (of N devices) over all of them: each process's host issues only its "
        "own device's kernels; the bandwidth and roofline are process 0's device's",
    )
    a = p.parse_args()
    if a.processes < 1:
        p.error(f"--processes must be >= 1, got {a.processes}")
    if a.processes > 1 and not processes.launched():
        if a.processes != a.mesh[0] * a.mesh[1]:
            p.error(
                f"--processes {a.processes} needs a --mesh of as many devices, got data={a.mesh[0]},model={a.mesh[1]}"
            )
        if a.only != "b":
            p.error(f"--processes runs the decode alone: give --only b, got --only {a.only}")
        sys.exit(processes.launch([__file__, *sys.argv[1:]], a.processes))
    if processes.launched():
        processes.join()
        if jax.local_device_count() != 1:
            sys.exit(
                f"--processes: each process must see one device, process {jax.process_index()} sees "
                f"{jax.local_device_count()}"
            )
    batches = [int(b) for b in a.batches.split(",")]
    warnings.filterwarnings("ignore")
    if a.tiny:  # the --shape's family at a tiny size (Llama for the Llama shapes)
        cfg, policy = TINY, make_policy(a.policy, 64, 4, 32, a.kv_dtype)
        if SHAPES[a.shape].layer_types:
            big = SHAPES[a.shape]
            cfg = dataclasses.replace(
                big,
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_layers=6,
                num_heads=4,
                num_kv_heads=2,
                head_dim=16,
                layer_types=big.layer_types[-6:],
                attention=dataclasses.replace(big.attention, global_head_dim=big.attention.global_head_dim and 32),
                per_layer_input_size=big.per_layer_input_size and 8,
                per_layer_vocab_size=big.per_layer_vocab_size and 256,
                linear=None
                if big.linear is None
                else dataclasses.replace(
                    big.linear,
                    **{
                        n: min(getattr(big.linear, n), 4 if "heads" in n else 8)
                        for n in ("key_heads", "value_heads", "key_dim", "value_dim")
                    },
                ),
            )
        a.segment, a.prefill_marks, a.decode_batches, a.decode_steps = 128, [128, 256, 512], [1, 2], 3
        peak, sizes = matmul_peak(256), [1 << 20]
    else:
        cfg = SHAPES[a.shape]
        policy = make_policy(a.policy, a.cache_size, 64, 4096, a.kv_dtype)
        a.segment, a.decode_batches, a.decode_steps = 32768, batches, 20
        a.prefill_marks = sorted({m for m in (32768, 131072) if m < a.prefill_tokens} | {a.prefill_tokens})
        peak, sizes = matmul_peak(8192), [1 << 28, 1 << 30, 1 << 31]
    device = jax.devices()[0]
    mesh = sharding.device_mesh(a.mesh, batched=True)
    # every device of this process (over --processes: the others measure their own)
    measured = memory_bandwidth(
        [d for d in mesh.devices.flat if d.process_index == jax.process_index()] if mesh is not None else [device],
        sizes,
    )
    bandwidth, card = measured["rate"], measured["card_class"]
    model = CausalLM.random(cfg, jax.random.key(0), jnp.bfloat16, mesh=mesh)
    model = model.with_kernels(jc.Kernels.default() if a.backend is None else jc.Kernels(a.backend))
    peak *= 1 if mesh is None else mesh.size  # the MFU is of all the devices
    result = dict(
        benchmark="model",
        shape=a.shape,
        backend=model.kernels.backend,
        mesh=dict(zip(("data", "model"), a.mesh)),
        processes=a.processes,
        policy=jc.policies.spec(policy),
        matmul_tflops=peak / 1e12,
        bandwidth=measured,
    )
    out = pathlib.Path(a.out or f"benchmarks/results/model-{device.device_kind.replace(' ', '_')}.json")
    print(
        f"{device.device_kind}: bf16 matmul {peak / 1e12:.0f} TFLOP/s, memory {bandwidth / 1e12:.2f} TB/s (the "
        f"slowest of {len(measured['per_device'])} device(s), best of copies and reads)",
        flush=True,
    )
    if card is not None and not card[0] <= bandwidth <= card[1]:
        print(
            f"   measurement error? {bandwidth / 1e12:.2f} TB/s lies outside the {device.device_kind}'s class, "
            f"{card[0] / 1e12:.2f}-{card[1] / 1e12:.2f} TB/s",
            flush=True,
        )
    result["state_bytes_per_row"] = {
        f"{name} {tokens}": state_memory(cfg, p, tokens)
        for name, p, tokens in (
            ("Full", jc.Full(stride=policy.stride), 1 << 17),
            ("Full", jc.Full(stride=policy.stride), 1 << 20),
            (policy.label, policy, 1 << 20 if policy.bounded else decode_slots(policy)),  # SnapKV: compressed
        )
    }
    if "a" in a.only:
        result["prefill"] = bench_prefill(a, model, policy, peak)
        if "linear" in cfg.types:
            result["prefill"]["delta_rule_ms_per_chunk_and_layer"] = delta_rule_ms(model, policy.stride)
        write(out, result)
    result["decode"] = bench_decode(a, model, policy, bandwidth) if "b" in a.only else []
    write(out, result)
    if "prefill" in result:
        pre = result["prefill"]
        print(
            f"\nprefill ({policy.stride}-token chunks, compile {pre['compile_s']:.0f} s): "
            "tokens, seconds, tokens/s, MFU"
        )
        for r in pre["rows"]:
            print(f"   {r['tokens']:>8} {r['seconds']:8.1f} {r['tokens_per_s']:9.0f} {r['mfu']:6.2f}")
        if "delta_rule_ms_per_chunk_and_layer" in pre:
            chunk_ms = pre["rows"][-1]["seconds"] / (pre["rows"][-1]["tokens"] / policy.stride) * 1e3
            share = pre["delta_rule_ms_per_chunk_and_layer"] * cfg.types.count("linear") / chunk_ms
            print(
                f"   Gated DeltaNet mixer (XLA): {pre['delta_rule_ms_per_chunk_and_layer']:.2f} ms per "
                f"{policy.stride}-token chunk and layer, {share:.0%} of a chunk's {chunk_ms:.0f} ms"
            )
    print(
        "state per row by layer type, MB: "
        + "; ".join(
            f"{k}: " + ", ".join(f"{t} {b / 1e6:.1f}" for t, b in v.items()) + f" (all {sum(v.values()) / 1e6:.1f})"
            for k, v in result["state_bytes_per_row"].items()
        )
    )
    print("decode: batch, ms/step, tokens/s, roofline ms, fraction of roofline, compile s")
    for r in result["decode"]:
        if "error" in r:
            print(f"   {r['batch']:>3} {r['error']}")
        elif r["fraction_of_roofline"] is None:
            print(
                f"   {r['batch']:>3} {r['ms_per_step']:8.2f} {r['tokens_per_s']:8.0f} measurement error: "
                f"{r['roofline_error']}"
            )
        else:
            print(
                f"   {r['batch']:>3} {r['ms_per_step']:8.2f} {r['tokens_per_s']:8.0f} {r['roofline_ms']:8.2f} "
                f"{r['fraction_of_roofline']:6.2f} {r['compile_s']:6.0f}"
            )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
