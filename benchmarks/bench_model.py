"""Whole-model benchmarks on a Llama-3.1-8B-shaped (or `--shape 70b`: Llama-3-70B-shaped; `--shape gemma-3-270m`:
Gemma 3 270M, 15 sliding layers of a 512-token window beside 3 global ones) model with random bf16 weights made on
the device(s), on one device or a `--mesh data=D,model=M` (tensor parallelism).

  a  strided prefill (Cascade: 16K + 64 sinks, 4 cascades, stride 4K) streamed over 1M tokens, with the
     elapsed time read at 32K, 128K and 1M tokens; throughput and model FLOP utilisation (MFU) against a
     bf16 matrix product measured in the same run;
  b  decode tokens/s at batch 1, 16 and 32 (`--batches`) over a full 16K cascade cache vs the roofline
     (the weight bytes a step reads, all but an untied embedding table, and the K/V bytes, of one device, over the
     larger of a copy and a read bandwidth measured in the same run);
     each batch size on its own: one whose weights + cache exceed a device's memory (8B at batch 32: 69 GB of
     cache beside 16 GB of weights, over an H100's 80 GB) is reported with the bytes it needs, not run;
  c  compile time of the prefill segment and of the decode step.

The prefill runs as jitted segments of 32K tokens (8 chunks under `lax.scan`) that carry the cache, so
one compilation serves every length.

    python benchmarks/bench_model.py [--out benchmarks/results/model-<device>.json]
    python benchmarks/bench_model.py --shape 70b --mesh model=2 --only a   # 70B prefill on two GPUs
    python benchmarks/bench_model.py --tiny      # a dry run of the same code with a tiny model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp

import jcascade as jc
from jcascade import pallas_kernels as pk
from jcascade.models import CausalLM, ModelConfig, sharding

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import decode_breakdown  # noqa: E402

LLAMA31_8B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rope_scaling=jc.Llama3Scaling(),
    rms_norm_eps=1e-5, tie_word_embeddings=False, qkv_bias=False, o_bias=False, max_position_embeddings=131072,
)
LLAMA3_70B = dataclasses.replace(LLAMA31_8B, hidden_size=8192, intermediate_size=28672, num_layers=80,
                                 num_heads=64, num_kv_heads=8)
GEMMA3_270M = ModelConfig(
    architecture="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18, num_heads=4,
    num_kv_heads=1, head_dim=256, rope_theta=1e6, rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=True,
    qkv_bias=False, o_bias=False, max_position_embeddings=32768, qk_norm=True, sliding_window=512,
    layer_types=tuple("global" if (i + 1) % 6 == 0 else "sliding" for i in range(18)), rope_local_theta=1e4,
    query_scale=256**-0.5,
)
SHAPES = {"8b": LLAMA31_8B, "70b": LLAMA3_70B, "gemma-3-270m": GEMMA3_270M}
TINY = ModelConfig(
    architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-5,
    tie_word_embeddings=False, qkv_bias=False, o_bias=False, max_position_embeddings=4096,
)


def block(x):
    return jax.block_until_ready(x)


def matmul_peak(n: int) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    block(f(a, b))
    t0 = time.perf_counter()
    for _ in range(10):
        out = f(a, b)
    block(out)
    return 2 * n**3 * 10 / (time.perf_counter() - t0)


def stream_bandwidths(n: int) -> tuple[float, float]:
    """(copy, read) bytes per second over n bf16 elements: an elementwise pass (bytes read + written) and a sum
    (bytes read), each the median of 10 calls. A decode step mostly reads, so its roofline takes the larger."""
    x = jax.random.normal(jax.random.key(2), (n,), jnp.bfloat16)
    rates = []
    for f, moved in ((jax.jit(lambda x: x + 1), 2 * x.nbytes), (jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), x.nbytes)):
        block(f(x))
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            block(f(x))
            times.append(time.perf_counter() - t0)
        rates.append(moved / sorted(times)[len(times) // 2])
    return rates[0], rates[1]


def flops_per_token(cfg: ModelConfig, keys_per_query: float) -> float:
    """Matmul FLOPs per token: the projections and MLP (2 per weight), attention (QK^T and PV at 4 per
    key and head dim, plus the scores pass's QK^T at 2; a sliding layer's query at 4 per key of its window),
    the LM head is not run during prefill."""
    H, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dense = 2 * L * (H * q + 2 * H * kv + q * H + 3 * H * I)
    sliding = len(cfg.sliding_layers)
    attention = cfg.num_heads * cfg.head_dim * ((L - sliding) * keys_per_query * (4 + 2)
                                                + sliding * (cfg.sliding_window or 0) * 4)
    return dense + attention


def bench_prefill(a, model, policy, peak):
    segment = a.segment
    state = model.init_cache(policy, 1)
    lengths = jnp.array([segment], jnp.int32)
    run = jax.jit(lambda model, state, tokens: jc.prefill(model, policy, state, tokens, lengths)[:2],
                  donate_argnums=1, compiler_options=jc.COMPILER_OPTIONS)
    tokens = [jax.random.randint(jax.random.key(i), (1, segment), 0, model.config.vocab_size) for i in range(4)]
    t0 = time.perf_counter()
    compiled = run.lower(model, state, tokens[0]).compile()
    compile_s = time.perf_counter() - t0
    marks, rows = set(a.prefill_marks), []
    t0 = time.perf_counter()
    done = 0
    while done < max(marks):
        state, _ = compiled(model, state, tokens[(done // segment) % 4])
        done += segment
        if done in marks:
            block(state)
            elapsed = time.perf_counter() - t0
            keys = min(done, policy.layout().capacity) + policy.stride / 2  # average keys per query
            rows.append(dict(tokens=done, seconds=elapsed, tokens_per_s=done / elapsed,
                             mfu=flops_per_token(model.config, keys) * done / elapsed / peak))
            print(f"   prefill {done} tokens: {elapsed:.1f} s", flush=True)
    return dict(compile_s=compile_s, segment=segment, rows=rows)


def is_cache(x) -> bool:
    return isinstance(x, jc.CacheState)


def decode_bytes(model, policy, batch: int) -> dict:
    """Bytes one device holds for a decode step at `batch`: its weight shards, of them the ones a step reads (all
    but an untied embedding table, of which a step reads one row per token), and its share of the cache (every
    array of the state; a model with sliding layers has two caches), from shapes alone (nothing is allocated)."""
    devices = 1 if model.mesh is None else model.mesh.size
    on_one_device = lambda x: x.addressable_shards[0].data.nbytes  # noqa: E731 (the shards are equal)
    state = jax.eval_shape(lambda: model.init_cache(policy, batch))
    cache = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) // devices
    kv = sum(2 * c.k.size * c.k.dtype.itemsize for c in jax.tree.leaves(state, is_leaf=is_cache)) // devices
    weights = sum(on_one_device(x) for x in jax.tree.leaves(model))
    unread = on_one_device(model.embed[...]) if model.lm_head is not None else 0
    return dict(weights=weights, weights_read=weights - unread, cache=cache, kv=kv)


def bench_decode_batch(a, model, policy, bandwidth, batch: int, held: dict) -> dict:
    """ms per greedy step at `batch` over a full cache, against the weights + K/V roofline of one device (`held`:
    `decode_bytes`)."""
    cfg = model.config

    def full(state):  # a full cache, as after a long prompt, made in place on its devices
        cap, shape = state.k.shape[-2], state.k.shape
        k1, k2 = jax.random.split(jax.random.key(batch))
        rows = lambda key: jnp.broadcast_to(jax.random.normal(key, (cap, cfg.head_dim), state.k.dtype), shape)
        state = dataclasses.replace(
            state, k=rows(k1), v=rows(k2), score=jnp.full(state.score.shape, 1e-4, jnp.float32),
            pos=jnp.broadcast_to((1 << 20) - cap + jnp.arange(cap, dtype=jnp.int32), state.pos.shape),
            seen=jnp.full(state.seen.shape, 1 << 20, jnp.int32))
        if model.mesh is None:
            return state
        return sharding.place(state, sharding.cache_specs(state, model.mesh), model.mesh)

    # (global layers' cache, sliding layers' window cache) for a model with sliding layers
    state = jax.jit(lambda: jax.tree.map(full, model.init_cache(policy, batch), is_leaf=is_cache))()

    def step(model, state, last):
        hidden, state = model(policy, state, last[:, None], jnp.ones((batch,), jnp.int32))
        return state, jnp.argmax(model.logits(hidden[:, 0]), axis=-1).astype(jnp.int32)

    run = jax.jit(step, donate_argnums=1, compiler_options=jc.COMPILER_OPTIONS)
    last = jnp.zeros((batch,), jnp.int32)
    t0 = time.perf_counter()
    compiled = run.lower(model, state, last).compile()
    compile_s = time.perf_counter() - t0
    state, last = compiled(model, state, last)
    block(last)
    t0 = time.perf_counter()
    for _ in range(a.decode_steps):
        state, last = compiled(model, state, last)
    block(last)
    per_step = (time.perf_counter() - t0) / a.decode_steps
    roofline = (held["weights_read"] + held["kv"]) / bandwidth
    row = dict(ms_per_step=per_step * 1e3, tokens_per_s=batch / per_step, roofline_ms=roofline * 1e3,
               fraction_of_roofline=roofline / per_step, compile_s=compile_s)
    if a.profile_step:  # one more step under the JAX profiler: its kernels by kind (decode_breakdown.py)
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir):
                block(compiled(model, state, last))
            row["breakdown"] = decode_breakdown.breakdown(decode_breakdown.kernels_of_trace(trace_dir),
                                                          model.config.num_layers, per_step * 1e3)
        print("\n".join(decode_breakdown.table(row["breakdown"])), flush=True)
    return row


def bench_decode(a, model, policy, bandwidth) -> list[dict]:
    """One row per batch size: its figures, or why it did not run. A batch whose weights + cache exceed one
    device's memory is not tried; one that fails anyway (out of memory in the step's temporaries) says so."""
    limit = jax.devices()[0].memory_stats()
    limit = limit.get("bytes_limit") if limit else None
    rows = []
    for batch in a.decode_batches:
        held = decode_bytes(model, policy, batch)
        row = dict(batch=batch, weight_bytes=held["weights"], weight_bytes_read=held["weights_read"], kv_bytes=held["kv"],
                   cache_bytes=held["cache"], device_bytes=limit)
        needed = held["weights"] + held["cache"]
        if limit is not None and needed > limit:
            row["error"] = f"does not fit: weights + cache {needed / 1e9:.1f} GB > {limit / 1e9:.1f} GB on one device"
        else:
            try:
                row.update(bench_decode_batch(a, model, policy, bandwidth, batch, held))
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                row["error"] = (f"out of memory beside weights + cache {needed / 1e9:.1f} GB of "
                                f"{(limit or 0) / 1e9:.1f} GB: {str(e).splitlines()[0][:300]}")
        print(f"   decode batch {batch}: " + (row.get("error") or f"{row['ms_per_step']:.2f} ms/step"), flush=True)
        rows.append(row)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--only", default="ab", help="a: prefill, b: decode (compile times come with each)")
    p.add_argument("--batches", default="1,16,32", help="decode batch sizes")
    p.add_argument("--cache-size", type=int, default=16384, help="Cascade cache size (64: weights and fixed costs only)")
    p.add_argument("--shape", choices=SHAPES, default="8b", help="Llama-3.1-8B, Llama-3-70B or Gemma 3 270M shapes")
    p.add_argument("--mesh", type=sharding.parse_mesh, default=(1, 1), metavar="data=D,model=M",
                   help="devices (default: one)")
    p.add_argument("--prefill-tokens", type=int, default=1 << 20, help="longest prefill (32K, 128K marks below it)")
    p.add_argument("--profile-step", action="store_true",
                   help="b: one more step under the JAX profiler, its GPU time by kind of kernel "
                        "(benchmarks/decode_breakdown.py)")
    p.add_argument("--backend", default=None, choices=pk.BACKENDS,
                   help="attention kernels, jc.Kernels(backend) (default: jc.Kernels.default(), the platform's)")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    warnings.filterwarnings("ignore")
    if a.tiny:
        cfg, policy = TINY, jc.Cascade(cache_size=64, sinks=4, num_cascades=4, stride=32)
        a.segment, a.prefill_marks, a.decode_batches, a.decode_steps = 128, [128, 256, 512], [1, 2], 3
        peak, (copy, read) = matmul_peak(256), stream_bandwidths(1 << 20)
    else:
        cfg = SHAPES[a.shape]
        policy = jc.Cascade(cache_size=a.cache_size, sinks=64, num_cascades=4, stride=4096)
        a.segment, a.decode_batches, a.decode_steps = 32768, batches, 20
        a.prefill_marks = sorted({m for m in (32768, 131072) if m < a.prefill_tokens} | {a.prefill_tokens})
        peak, (copy, read) = matmul_peak(8192), stream_bandwidths(1 << 31)
    device = jax.devices()[0]
    mesh = sharding.device_mesh(a.mesh, batched=True)
    model = CausalLM.random(cfg, jax.random.key(0), jnp.bfloat16, mesh=mesh)
    model = model.with_kernels(jc.Kernels.default() if a.backend is None else jc.Kernels(a.backend))
    peak *= 1 if mesh is None else mesh.size  # the MFU is of all the devices
    result = dict(benchmark="model", device=device.device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                  shape=a.shape, backend=model.kernels.backend, mesh=dict(zip(("data", "model"), a.mesh)), policy=jc.policies.spec(policy),
                  matmul_tflops=peak / 1e12, copy_gb_s=copy / 1e9, read_gb_s=read / 1e9)
    bandwidth = max(copy, read)
    out = pathlib.Path(a.out or f"benchmarks/results/model-{device.device_kind.replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{device.device_kind}: bf16 matmul {peak / 1e12:.0f} TFLOP/s, copy {copy / 1e9:.0f} GB/s, read {read / 1e9:.0f} GB/s",
          flush=True)
    if "a" in a.only:
        result["prefill"] = bench_prefill(a, model, policy, peak)
        out.write_text(json.dumps(result, indent=2))
    result["decode"] = bench_decode(a, model, policy, bandwidth) if "b" in a.only else []
    out.write_text(json.dumps(result, indent=2))
    if "prefill" in result:
        pre = result["prefill"]
        print(f"\nprefill ({policy.stride}-token chunks, compile {pre['compile_s']:.0f} s): tokens, seconds, tokens/s, MFU")
        for r in pre["rows"]:
            print(f"   {r['tokens']:>8} {r['seconds']:8.1f} {r['tokens_per_s']:9.0f} {r['mfu']:6.2f}")
    print("decode: batch, ms/step, tokens/s, roofline ms, fraction of roofline, compile s")
    for r in result["decode"]:
        if "error" in r:
            print(f"   {r['batch']:>3} {r['error']}")
        else:
            print(f"   {r['batch']:>3} {r['ms_per_step']:8.2f} {r['tokens_per_s']:8.0f} {r['roofline_ms']:8.2f} "
                  f"{r['fraction_of_roofline']:6.2f} {r['compile_s']:6.0f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
