"""Kernel benchmarks on the Llama-3.1-8B layer shape (32 query heads, 8 KV heads, D = 128, bf16).

a  chunk attention with exact scores (chunk 4096 vs a 16K + 64 cache), the kernels of each GPU backend
   (Triton; Mosaic GPU on a Hopper GPU) in several tilings, vs cuDNN attention on the same shapes without
   scores (jax.nn.dot_product_attention(implementation="cudnn"), non-causal over cache + chunk keys,
   about 11 % more key positions than the causal chunk needs);
b  the paper's Figure 6b: one attention layer over 1M tokens with strided prefill (cache 16K + 64 sinks,
   4 cascades, attend + update per chunk) on each GPU backend vs cuDNN causal attention over the same
   tokens, and the stride sweep of Figure 6c (default kernels);
c  the paper's Figure 6a: 16K tokens pushed one at a time into a 16K cache (fill phase), then 16K more
   (steady phase), with 1 and 4 cascades, vs a concatenation-based sink cache written in JAX;
d  decode attention (one query per row, scores on, RoPE fused) over a 16K cache at batch 1 and 32, over
   the layers of a stacked cache inside one jitted loop, in each storage format asked for (bf16; int8 and
   float8 codes dequantized in the kernel's registers), with --decode-ablation also without the RoPE and
   without the scores: achieved bandwidth vs the memory bandwidth measured in the same run (best of copies and
   reads over three sizes, as bench_model.py measures it).

  python benchmarks/bench_kernels.py [--only abcd] [--decode-sweep] [--decode-kv-dtypes model,int8,float8_e4m3fn]
      [--decode-ablation]
      [--out benchmarks/results/kernels-<device>.json]
  python benchmarks/bench_kernels.py --tiny     # a seconds-long dry run of the same code on the CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import warnings

import harness
import jax
import jax.numpy as jnp
import numpy as np
from bench_model import memory_bandwidth

import jcascade as jc
from jcascade import pallas_kernels as pk

HQ, HKV, D = 32, 8, 128
DT = jnp.bfloat16


def rand(key, shape, dtype=DT):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def full_cache(policy, batch, key, kernels=None, seen=1 << 20):
    """A steady-phase cache on `kernels`: every slot held, random K/V and scores."""
    state = jc.init_cache(policy, batch, HKV, D, DT, kernels=kernels)
    k1, k2, k3 = jax.random.split(key, 3)
    return dataclasses.replace(
        state,
        k=jc.Stored(rand(k1, state.k.shape)),
        v=jc.Stored(rand(k2, state.v.shape)),
        score=jax.random.uniform(k3, state.score.shape) * 1e-3,
        pos=jnp.broadcast_to(jnp.arange(state.capacity, dtype=jnp.int32), state.pos.shape),
        seen=jnp.full((batch,), seen, jnp.int32),
    )


# --------------------------------------------------------------------------------------------------


def bench_chunk(a, cudnn):
    T, S = a.chunk, a.cache + a.sinks
    ks = jax.random.split(jax.random.key(0), 5)
    q, k, v = rand(ks[0], (1, T, HQ, D)), rand(ks[1], (1, T, HKV, D)), rand(ks[2], (1, T, HKV, D))
    kc, vc = rand(ks[3], (1, HKV, S, D)), rand(ks[4], (1, HKV, S, D))
    stored_k, stored_v = jc.Stored(kc), jc.Stored(vc)  # the cache as the kernels take it
    valid = jnp.ones((1, HKV, S), bool)
    positions = jnp.zeros((1, 1, S), jnp.int32)
    lengths = jnp.array([T], jnp.int32)
    weights = jc.Cascade(cache_size=a.cache).query_weights(lengths, T)
    useful = 4 * T * (S + (T + 1) / 2) * D * HQ  # QK^T + PV of the causal chunk over the cache
    rows = []
    for kernels in a.configs:
        f = jax.jit(
            lambda w: kernels.chunk_attention(q, k, v, stored_k, stored_v, valid, positions, lengths, w, "max", None)
        )
        g = jax.jit(
            lambda: kernels.chunk_attention(q, k, v, stored_k, stored_v, valid, positions, lengths, None, "max", None)
        )
        row = dict(implementation=kernels.backend, config=str(getattr(kernels, kernels.backend)))
        try:
            t_scores, t_plain = harness.time_it(f, weights).median, harness.time_it(g).median
        except Exception as e:  # a config the compiler rejects (e.g. shared memory) is reported, not fatal
            rows.append(row | dict(error=f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        rows.append(
            row
            | dict(
                ms_with_scores=t_scores * 1e3, ms_without_scores=t_plain * 1e3, tflops_forward=useful / t_plain / 1e12
            )
        )
    kf, vf = jnp.concatenate([jnp.swapaxes(kc, 1, 2), k], 1), jnp.concatenate([jnp.swapaxes(vc, 1, 2), v], 1)
    base = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=cudnn))
    try:
        t_base = harness.time_it(base, q, kf, vf).median
    except Exception:  # no grouped-query support: give the baseline its K/V repeated to every query head
        t_base = harness.time_it(base, q, jnp.repeat(kf, HQ // HKV, 2), jnp.repeat(vf, HQ // HKV, 2)).median
    best = {}
    for impl in dict.fromkeys(r["implementation"] for r in rows):
        timed_rows = [r for r in rows if r["implementation"] == impl and "error" not in r]
        if timed_rows:
            fastest = min(timed_rows, key=lambda r: r["ms_with_scores"])
            best[impl] = fastest | dict(
                ratio_with_scores=fastest["ms_with_scores"] / (t_base * 1e3),
                ratio_without_scores=fastest["ms_without_scores"] / (t_base * 1e3),
            )
    return dict(
        T=T,
        S=S,
        baseline=cudnn or "xla",
        baseline_ms=t_base * 1e3,
        baseline_tflops=4 * T * (S + T) * D * HQ / t_base / 1e12,
        configs=rows,
        best=best,
    )


def prefill_layer(policy, tokens, kernels, key):
    """Seconds for one attention layer (attend + update per stride chunk) over `tokens` tokens on `kernels`."""
    T = policy.stride
    chunks = tokens // T
    state = jc.init_cache(policy, 1, HKV, D, DT, kernels=kernels)
    rope = jc.RoPE(500000.0, jc.Llama3Scaling())

    @jax.jit
    def run(state, key):
        def step(state, i):
            kq, kk, kv = jax.random.split(jax.random.fold_in(key, i), 3)
            q, k, v = rand(kq, (1, T, HQ, D)), rand(kk, (1, T, HKV, D)), rand(kv, (1, T, HKV, D))
            out, scores = jc.attend(policy, state, q, k, v, rope=rope)
            return jc.update(policy, state, k, v, scores), out[0, -1, 0, 0]

        state, outs = jax.lax.scan(step, state, jnp.arange(chunks))
        return state, outs

    return harness.time_it(run, state, key, repeats=1).median


def bench_prefill(a, kernels, cudnn):
    n = a.tokens
    policy = jc.Cascade(cache_size=a.cache, sinks=a.sinks, num_cascades=4, stride=a.chunk)
    ours = {backend: prefill_layer(policy, n, jc.Kernels(backend), jax.random.key(1)) for backend in a.backends}
    sweep = []
    for stride in a.strides:
        p = jc.Cascade(cache_size=a.cache, sinks=a.sinks, num_cascades=4, stride=stride)
        sweep.append(dict(stride=stride, seconds=prefill_layer(p, n, kernels, jax.random.key(2))))
    full = []
    for length in a.full_lengths:
        try:
            ks = jax.random.split(jax.random.key(3), 3)
            q, k, v = (
                rand(ks[0], (1, length, HQ, D)),
                rand(ks[1], (1, length, HKV, D)),
                rand(ks[2], (1, length, HKV, D)),
            )
            f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=cudnn))
            full.append(dict(tokens=length, seconds=harness.time_it(f, q, k, v, repeats=1).median))
            del q, k, v
        except Exception as e:
            full.append(dict(tokens=length, error=f"{type(e).__name__}: {str(e)[:200]}"))
    measured = [(r["tokens"], r["seconds"]) for r in full if "seconds" in r]
    x, y = np.array(measured, float).T
    coeffs = np.polyfit(x, y, 2)
    at_n = dict(measured).get(n, float(np.polyval(coeffs, n)))
    return dict(
        tokens=n,
        ours_s=ours,
        full_attention=full,
        quadratic_fit=coeffs.tolist(),
        full_attention_at_tokens_s=at_n,
        full_measured_at_tokens=n in dict(measured),
        speedup={backend: at_n / t for backend, t in ours.items()},
        stride_sweep=sweep,
    )


def push_tokens(policy, state, num, key):
    """Seconds to push `num` tokens one at a time (update only, on the state's kernels) inside one jitted loop."""
    B, H, cap = state.score.shape
    ks = jax.random.split(key, 3)
    new_k, new_v = rand(ks[0], (num, B, 1, H, D)), rand(ks[1], (num, B, 1, H, D))
    chunk_mu = jax.random.uniform(ks[2], (num, B, H, 1)) * 1e-4
    cache_inc = jnp.full((B, H, cap), 1e-8, jnp.float32)

    @jax.jit
    def run(state):
        def body(i, state):
            scores = jc.Scores(cache_inc, chunk_mu[i]) if isinstance(policy, jc.Cascade) else None
            return jc.update(policy, state, new_k[i], new_v[i], scores)

        return jax.lax.fori_loop(0, num, body, state)

    return harness.time_it(run, state, repeats=1).median, run(state)


def push_concat(num, cap, sinks, batch, key):
    """The same with a concatenation-based sink cache: every token rebuilds the whole cache."""
    ks = jax.random.split(key, 2)
    new_k, new_v = rand(ks[0], (num, batch, HKV, 1, D)), rand(ks[1], (num, batch, HKV, 1, D))

    @jax.jit
    def run(k, v):
        def body(i, kv):
            k, v = kv
            k = jnp.concatenate([k[:, :, :sinks], k[:, :, sinks + 1 :], new_k[i]], axis=2)
            v = jnp.concatenate([v[:, :, :sinks], v[:, :, sinks + 1 :], new_v[i]], axis=2)
            return k, v

        return jax.lax.fori_loop(0, num, body, (k, v))

    zeros = jnp.zeros((batch, HKV, cap, D), DT)
    return harness.time_it(run, zeros, zeros, repeats=1).median


def bench_push(a, kernels):
    rows = []
    for batch in a.push_batches:
        for n_casc in (1, 4):
            policy = jc.Cascade(cache_size=a.cache, sinks=a.sinks, num_cascades=n_casc)
            empty = jc.init_cache(policy, batch, HKV, D, DT, kernels=kernels)
            t_fill, filled = push_tokens(policy, empty, a.cache, jax.random.key(4))
            t_steady, _ = push_tokens(policy, filled, a.cache, jax.random.key(5))
            rows.append(
                dict(
                    batch=batch,
                    cascades=n_casc,
                    implementation=kernels.backend,
                    fill_us_per_token=t_fill / a.cache * 1e6,
                    steady_us_per_token=t_steady / a.cache * 1e6,
                )
            )
        if kernels.backend != "xla":  # the vectorised XLA formulation, single tokens (slow: a short sample)
            policy = jc.Cascade(cache_size=a.cache, sinks=a.sinks, num_cascades=4)
            xla = full_cache(policy, batch, jax.random.key(7), jc.Kernels("xla"))
            t_xla, _ = push_tokens(policy, xla, a.xla_tokens, jax.random.key(5))
            rows.append(
                dict(batch=batch, cascades=4, implementation="xla", steady_us_per_token=t_xla / a.xla_tokens * 1e6)
            )
        pushed = a.cache if batch == 1 else a.cache // 8  # each token copies the whole cache: keep it short
        t_concat = push_concat(pushed, a.cache + a.sinks, a.sinks, batch, jax.random.key(6))
        rows.append(
            dict(batch=batch, cascades=1, implementation="concatenation", steady_us_per_token=t_concat / pushed * 1e6)
        )
    return rows


def decode_inputs(policy, batch: int, layers: int, kv_dtype: str = "model") -> dict:
    """The decode op's inputs on a full cache: a stack of `layers` layers (stack_k, stack_v: `Stored`, bf16, or the
    codes of `kv_dtype` with each layer's scales [layers, B, Hkv, S]), one token's q, k, v, lengths, weights, the
    cache's positions and validity."""
    cache = full_cache(policy, batch, jax.random.key(7))
    offsets = jnp.arange(layers, dtype=DT)[:, None, None, None, None]
    ks = jax.random.split(jax.random.key(8), 3)
    lengths = jnp.ones((batch,), jnp.int32)
    x = dict(
        stack_k=jc.Stored(jnp.broadcast_to(cache.k.data, (layers, *cache.k.shape)) + offsets),
        stack_v=jc.Stored(jnp.broadcast_to(cache.v.data, (layers, *cache.v.shape)) + offsets),
        q=rand(ks[0], (batch, 1, HQ, D)),
        k=rand(ks[1], (batch, 1, HKV, D)),
        v=rand(ks[2], (batch, 1, HKV, D)),
        lengths=lengths,
        weights=policy.query_weights(lengths, 1),
        positions=cache.pos[:, :1],
        valid=cache.pos >= 0,
    )
    if kv_dtype != "model":
        dtype = pk.storage.storage_dtype(kv_dtype, DT)
        quantize = jax.jit(lambda stack: jc.Stored(*pk.storage.quantize(stack.data, dtype)))
        x["stack_k"], x["stack_v"] = quantize(x["stack_k"]), quantize(x["stack_v"])
    return x


def decode_loop(x: dict, weights, rope, layers: int, calls: int, kernels):
    """jit (stack_k, stack_v) -> sums of out and scores: `calls` decode ops on `kernels`, call i reading layer
    i % layers of the stack in place (with that layer's scales, for codes); `weights` None turns the scores off."""

    def run(stack_k, stack_v):
        def one(i, acc):
            layer = i % layers
            out, _, inc, _ = kernels.chunk_attention(
                x["q"],
                x["k"],
                x["v"],
                stack_k.map_scale(lambda scale: scale[layer]),  # the stack's data, the layer's own scales
                stack_v.map_scale(lambda scale: scale[layer]),
                x["valid"],
                x["positions"],
                x["lengths"],
                weights,
                "max",
                rope,
                layer=layer,
            )
            return acc[0] + out.astype(jnp.float32), acc[1] + (0 if inc is None else inc)

        zeros = (jnp.zeros(x["q"].shape, jnp.float32), jnp.zeros(x["valid"].shape, jnp.float32))
        return jax.lax.fori_loop(0, calls, one, zeros)

    return jax.jit(run)


def bench_decode(a, kernels, bandwidth):
    """The decode attention op (kernel + epilogue, scores and RoPE on) on a full cache, as the model's layer
    loop runs it: `a.decode_layers` layers of a stacked cache, each read in place at its layer index, inside
    one jitted loop of `a.decode_calls` calls (one dispatch for all, so that the host's ~40 us per jit call
    does not hide a batch-1 op; each layer's cache is evicted from L2 by the next ones), for each storage format of
    `a.decode_kv_dtypes` (8-bit codes and their scales read by the kernel)."""
    S = a.cache + a.sinks
    policy = jc.Cascade(cache_size=a.cache, sinks=a.sinks, num_cascades=4)
    rope = jc.RoPE(500000.0, jc.Llama3Scaling())
    rows = []
    for batch, kv_dtype in ((b, f) for b in a.decode_batches for f in a.decode_kv_dtypes):
        x = decode_inputs(policy, batch, a.decode_layers, kv_dtype)
        kv_bytes = 2 * batch * HKV * S * (D * 2 if kv_dtype == "model" else D + 4)  # codes and their scales
        meta_bytes = batch * HKV * S * (4 + 1) + batch * S * 4  # validity, positions
        logit_bytes = 2 * batch * HQ * S * 4  # logits written by the kernel and read by the epilogue
        variants = [("RoPE, scores", rope, x["weights"])]
        if a.decode_ablation:  # what the kernel's RoPE and the scores' logits cost
            variants += [("no RoPE, scores", None, x["weights"]), ("no RoPE, no scores", None, None)]
        for cfg, (variant, variant_rope, weights) in ((c, v) for c in a.decode_configs for v in variants):
            run = decode_loop(
                x, weights, variant_rope, a.decode_layers, a.decode_calls, dataclasses.replace(kernels, triton=cfg)
            )
            t = harness.time_it(run, x["stack_k"], x["stack_v"], repeats=3).median / a.decode_calls
            rows.append(
                dict(
                    batch=batch,
                    kv_dtype=kv_dtype,
                    variant=variant,
                    config=str(cfg),
                    us_per_step=t * 1e6,
                    kv_gb_per_s=(kv_bytes + meta_bytes) / t / 1e9,
                    fraction_of_bandwidth=(kv_bytes + meta_bytes) / t / bandwidth,
                    all_bytes_fraction=(kv_bytes + meta_bytes + (logit_bytes if weights is not None else 0))
                    / t
                    / bandwidth,
                )
            )
        del x
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="abcd")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on any platform (a dry run of the script)")
    p.add_argument("--out", default=None)
    p.add_argument("--budget-s", type=float, default=480, help="skip the sections that would start after this")
    p.add_argument(
        "--decode-sweep", action="store_true", help="d: time nine tilings and grid orders, not only the default one"
    )
    p.add_argument("--decode-batches", default="1,32", help="d: comma-separated batch sizes")
    p.add_argument("--decode-ablation", action="store_true", help="d: also without the fused RoPE, and without scores")
    p.add_argument(
        "--decode-kv-dtypes", default="model", help=f"d: comma-separated storage formats of {pk.storage.KV_DTYPES}"
    )
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    a.decode_batches = [int(b) for b in a.decode_batches.split(",")]
    a.decode_kv_dtypes = a.decode_kv_dtypes.split(",")
    for kv_dtype in a.decode_kv_dtypes:
        pk.storage.storage_dtype(kv_dtype, DT)  # a clear error for an unknown format
    on_gpu = jax.default_backend() == "gpu"
    kernels, cudnn = (jc.Kernels.default(), "cudnn") if on_gpu else (jc.Kernels("triton"), None)
    # the chunk kernels of each GPU backend side by side (Mosaic GPU on Hopper; interpret mode on the CPU)
    a.backends = ["triton", "mosaic_gpu"] if pk.is_hopper() or not on_gpu else ["triton"]
    a.chunk, a.cache, a.sinks, a.tokens = 4096, 16384, 64, 1 << 20
    a.strides = [1024, 16384]
    a.full_lengths = [1 << 17, 1 << 18, 1 << 19, 1 << 20]
    a.push_batches, a.xla_tokens = [1, 32], 512
    G, M = pk.TritonConfig, pk.MosaicGpuConfig
    triton = lambda cfg: jc.Kernels("triton", triton=cfg)
    mosaic = lambda cfg: jc.Kernels("mosaic_gpu", fallback=False, mosaic_gpu=cfg)
    a.configs = [
        triton(G()),
        triton(G(block_q=64, block_k=128, score_block_q=128, score_block_k=64, num_stages=3)),
        triton(G(block_q=64, block_k=128, score_block_q=64, score_block_k=128, num_stages=3)),
        triton(G(block_q=128, block_k=128, score_block_q=128, score_block_k=128, num_warps=8, num_stages=2)),
    ]
    if "mosaic_gpu" in a.backends:
        a.configs += [
            mosaic(M()),
            mosaic(M(score_block_k=64, score_block_q=64)),
            mosaic(M(score_block_k=64)),
            mosaic(M(block_k=64)),
        ]
    a.decode_configs = (
        [
            G(decode_block_k=bk, decode_num_stages=stages, decode_num_warps=warps, decode_programs=programs)
            for bk, stages, warps, programs in (
                (64, 3, 4, 256),
                (64, 4, 4, 256),
                (64, 3, 4, 512),
                (64, 3, 4, 1024),
                (128, 3, 4, 256),
                (128, 3, 8, 256),
                (128, 2, 8, 512),
                (32, 4, 4, 512),
            )
        ]
        + [G(decode_heads_first=False)]
        if a.decode_sweep
        else [G()]
    )
    a.decode_layers, a.decode_calls = 8, 64
    sizes = [1 << 28, 1 << 30, 1 << 31]  # bf16 elements
    if a.tiny:
        a.chunk, a.cache, a.sinks, a.tokens = 32, 64, 4, 256
        a.strides, a.full_lengths = [16, 64], [64, 128, 256]
        a.push_batches, a.decode_batches, a.xla_tokens = [1, 2], [1, 2], 8
        a.decode_layers, a.decode_calls = 2, 4
        a.decode_configs = [G(16, 16, 16, 16, 16, 8)]
        a.configs = [triton(G(16, 16, 16, 16, 16, 8)), mosaic(M())]
        sizes = [1 << 20]
    device = jax.devices()[0]
    bandwidth = memory_bandwidth([device], sizes)["rate"]  # the best of copies and reads over three sizes
    result = dict(benchmark="kernels", implementation=kernels.backend, bandwidth_gb_s=bandwidth / 1e9)
    out = pathlib.Path(a.out or f"benchmarks/results/kernels-{device.device_kind.replace(' ', '_')}.json")
    sections = dict(
        a=("a_chunk", lambda: bench_chunk(a, cudnn)),
        b=("b_prefill_1m", lambda: bench_prefill(a, kernels, cudnn)),
        c=("c_push", lambda: bench_push(a, kernels)),
        d=("d_decode", lambda: bench_decode(a, kernels, bandwidth)),
    )
    since_start = harness.Stopwatch()
    for letter in a.only:
        name, run = sections[letter]
        if since_start.elapsed() > a.budget_s:
            print(f"[{name} skipped: past the {a.budget_s} s budget]", flush=True)
            continue
        result[name], seconds = harness.time_once(run)
        print(f"[{name} done in {seconds:.0f} s]", flush=True)
        harness.write_json(out, result)  # keep what is measured if a later part fails
    report(harness.run_info() | result)
    print(f"wrote {out}")


def report(r):
    print(
        f"\n{r['device']}, jax {r['jax']}, {r['implementation']}; memory bandwidth {r['bandwidth_gb_s']:.0f} GB/s "
        f"(best of copies and reads)"
    )
    if "a_chunk" in r:
        c = r["a_chunk"]
        print(
            f"a) chunk {c['T']} x cache {c['S']}: baseline {c['baseline']} {c['baseline_ms']:.2f} ms "
            f"({c['baseline_tflops']:.0f} TFLOP/s)"
        )
        for row in c["configs"]:
            if "error" in row:
                print(f"   {row['implementation']} {row['config']}: {row['error']}")
            else:
                print(
                    f"   {row['implementation']} {row['config']}: {row['ms_with_scores']:.2f} ms with scores, "
                    f"{row['ms_without_scores']:.2f} ms without ({row['tflops_forward']:.0f} TFLOP/s)"
                )
        for impl, best in c["best"].items():
            print(
                f"   best {impl}: {best['ratio_with_scores']:.2f}x baseline with scores, "
                f"{best['ratio_without_scores']:.2f}x without"
            )
    if "b_prefill_1m" in r:
        b = r["b_prefill_1m"]
        ours = ", ".join(f"{impl} {t:.2f} s ({b['speedup'][impl]:.1f}x)" for impl, t in b["ours_s"].items())
        print(
            f"b) one layer over {b['tokens']} tokens: cascade {ours}; full causal "
            f"{b['full_attention_at_tokens_s']:.2f} s "
            f"({'measured' if b['full_measured_at_tokens'] else 'quadratic fit'})"
        )
        print(
            "   full attention: "
            + ", ".join(f"{x['tokens']}: {x.get('seconds', x.get('error'))}" for x in b["full_attention"])
        )
        print("   stride sweep: " + ", ".join(f"{x['stride']}: {x['seconds']:.2f} s" for x in b["stride_sweep"]))
    if "c_push" in r:
        print("c) tokens pushed one at a time (us/token): batch, cascades, implementation, fill, steady")
        for x in r["c_push"]:
            print(
                f"   {x['batch']:>3} {x['cascades']} {x['implementation']:<14} "
                f"{x.get('fill_us_per_token', float('nan')):9.2f} {x['steady_us_per_token']:9.2f}"
            )
    if "d_decode" in r:
        print(
            "d) decode attention over the cache: batch, format, variant, us/step, GB/s (K, V, scales, metadata), "
            "fraction of the measured bandwidth, config"
        )
        for x in r["d_decode"]:
            print(
                f"   {x['batch']:>3} {x['kv_dtype']:<13} {x['variant']:<18} {x['us_per_step']:9.1f} "
                f"{x['kv_gb_per_s']:8.0f} {x['fraction_of_bandwidth']:6.2f} "
                f"(with logits {x['all_bytes_fraction']:.2f}) "
                f"{x['config'][9:]}"
            )


if __name__ == "__main__":
    main()
