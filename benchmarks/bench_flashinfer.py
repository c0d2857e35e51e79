"""FlashInfer and jcascade side by side: one decode step of one Llama-3.1-8B-shaped attention layer (32 query
heads, 8 KV heads, head_dim 128, bf16) over a 32K-token prefix shared by B requests plus 16 tokens of each
request's own and the new token (B = 1, 8, 64, 256; RoPE theta 5e5).

  replicated cache (every request holds prefix + own tokens):
    flashinfer decode          BatchDecodeWithPagedKVCacheWrapper (HND pages of 16), keys stored rotated
    flashinfer decode (tc)     the same with use_tensor_cores=True
    flashinfer decode, rope    the same, keys rotated in the kernel (pos_encoding_mode="ROPE_LLAMA")
    flashinfer decode fp8      the same over float8_e4m3fn pages (a scale per tensor), keys stored rotated
    jcascade decode            `jc.attend` on a Full cache, keys stored un-rotated and rotated in the kernel
    jcascade decode, stored rotated   the same over keys stored rotated (`CacheState.rope`, as a model's caches
                               store them): the kernel reads them without rotating them
    jcascade decode int8 / fp8 the same over a quantized cache (Full(kv_dtype=...): codes + a scale per slot,
                               dequantized in the kernel; the rows whose 2**31 to 2**32 codes the kernel cannot
                               address by the byte, B = 64 here, say "in place as pairs": read as int16 pairs),
                               keys un-rotated or stored rotated
  shared prefix (stored once):
    flashinfer cascade (fa2)   two-level cascade as MultiLevelCascadeAttentionWrapper runs it (a batch-prefill
                               pass per level, then merge_state_in_place) on the FA2 backend
    jcascade shared            `jc.attend_shared`, the prefix made by `jc.share_prefix(..., rope=)` (keys stored
    rotated)

Two timings per method: wall = median ms per call with a device sync after each call (host dispatch included);
device = ms per call inside one loop of --loop calls (a jitted fori_loop for jcascade, one CUDA graph for
FlashInfer; a plain loop where a graph cannot be captured), i.e. launch gaps but no host per call: the loop is
timed whole, from its one launch to the sync after it, by the same harness (benchmarks/harness.py) on both sides.
GB/s counts the K/V bytes a replicated decode must read (with a quantized cache's scales); the 8-bit rows compare
with FlashInfer's fp8 decode ("vs FlashInfer") and with its fastest bf16 decode ("vs FI bf16"). Each library runs
in its own process (the caches of B = 256 take 34 GB each); a third process checks that the outputs agree on the
same inputs (batches 8 and 64: jcascade's shared prefix runs its Triton kernel at 8, its Mosaic GPU kernel at 64 on
a Hopper GPU).

    python benchmarks/bench_flashinfer.py [--batches 1,8,64,256] [--out benchmarks/results/flashinfer-<device>.json]
    python benchmarks/bench_flashinfer.py --tiny --peers jcascade     # a dry run with small shapes, any platform
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import harness

HQ, HKV, D, PAGE, THETA = 32, 8, 128, 16, 500000.0


def shapes(tiny: bool) -> tuple[int, int]:
    """(prefix tokens, own tokens per request)."""
    return (256, 4) if tiny else (32768, 16)


# --------------------------------------------------------------------------------------------------
# jcascade (JAX)


def jcascade_rows(a) -> list[dict]:
    import jax
    import jax.numpy as jnp

    import jcascade as jc
    from jcascade import pallas_kernels as pk

    S, own = shapes(a.tiny)
    n = S + own  # held tokens per request; the new token is the chunk
    policy, rope = jc.Full(), jc.RoPE(THETA)
    key = jax.random.key(0)

    def wall_ms(fn, *args) -> float:
        return 1e3 * harness.time_it(fn, *args, repeats=a.iters).median

    def device_ms(step, *args):
        """ms per call of step(q, *args) inside one jitted loop; q moves with the loop so nothing is hoisted."""

        def run(q, *args):
            def body(i, acc):
                qi, rest = jax.lax.optimization_barrier((q, args, i))[:2]
                out = step(qi + (acc[0, 0, 0, :1] * 0).astype(q.dtype), *rest)
                return acc + out.astype(jnp.float32)

            return jax.lax.fori_loop(0, a.loop, body, jnp.zeros(q.shape, jnp.float32))

        f = jax.jit(run)
        return wall_ms(f, *args) / a.loop

    def rows_state(B: int, cap: int, held: int, kv_dtype: str = "model", stored_rope=None) -> jc.CacheState:
        """B rows of `held` random tokens (row r = one random row + r / 64: distinct, built in one pass; a
        quantized cache: the codes and scales of one random row in every row); keys stored rotated by
        `stored_rope` (`CacheState.rope`: random keys, so taken as rotated), or un-rotated (None)."""
        k1, k2 = jax.random.split(jax.random.fold_in(key, B))
        pos = jnp.where(jnp.arange(cap) < held, jnp.arange(cap), -1).astype(jnp.int32)
        state = dict(
            score=jnp.zeros((B, HKV, cap), jnp.float32),
            pos=jnp.broadcast_to(pos, (B, HKV, cap)),
            seen=jnp.full((B,), held, jnp.int32),
            kernels=jc.Kernels.default(),
            rope=stored_rope,
        )
        if kv_dtype == "model":
            offset = (jnp.arange(B, dtype=jnp.bfloat16) / 64)[:, None, None, None]
            make = jax.jit(
                lambda k: (
                    jnp.broadcast_to(jax.random.normal(k, (1, HKV, cap, D), jnp.bfloat16), (B, HKV, cap, D)) + offset
                )
            )
            return jc.CacheState(k=jc.Stored(make(k1)), v=jc.Stored(make(k2)), **state)
        dtype = pk.storage.storage_dtype(kv_dtype, jnp.bfloat16)
        one_row = lambda k: pk.storage.quantize(jax.random.normal(k, (1, HKV, cap, D)), dtype)
        make = jax.jit(lambda k: jax.tree.map(lambda x: jnp.broadcast_to(x, (B, *x.shape[1:])), one_row(k)))
        return jc.CacheState(k=jc.Stored(*make(k1)), v=jc.Stored(*make(k2)), **state)  # codes, scales

    prefix = jc.share_prefix(policy, rows_state(1, S, S), rope=rope)  # keys stored rotated, as generate does
    rows = []
    for B in a.batches:
        ks = jax.random.split(jax.random.fold_in(key, 1000 + B), 3)
        q = jax.random.normal(ks[0], (B, 1, HQ, D), jnp.bfloat16)
        k1 = jax.random.normal(ks[1], (B, 1, HKV, D), jnp.bfloat16)
        v1 = jax.random.normal(ks[2], (B, 1, HKV, D), jnp.bfloat16)

        own_state = rows_state(B, own + 1, own)
        shared = lambda q, st, k1, v1: jc.attend_shared(policy, st, q, k1, v1, [prefix], None, rope)
        rows.append(
            dict(
                batch=B,
                method="jcascade shared",
                wall_ms=wall_ms(jax.jit(shared), q, own_state, k1, v1),
                device_ms=device_ms(shared, q, own_state, k1, v1),
                kv_bytes=None,
            )
        )
        del own_state
        decode = lambda q, st, k1, v1: jc.attend(policy, st, q, k1, v1, None, rope)[0]
        for kv_dtype, name in (("model", ""), ("int8", " int8"), ("float8_e4m3fn", " fp8")):
            for stored_rope, how in ((None, ""), (rope, ", stored rotated")):
                state = rows_state(B, n + 1, n, kv_dtype, stored_rope)
                rows.append(
                    dict(
                        batch=B,
                        method=f"jcascade decode{name}{how}",
                        wall_ms=wall_ms(jax.jit(decode), q, state, k1, v1),
                        device_ms=device_ms(decode, q, state, k1, v1),
                        kv_bytes=2 * B * HKV * (n + 1) * (D + 4 if name else 2 * D),
                        path=state.kernels.quantized_decode_path(state.k, rope=None if stored_rope else rope),
                    )
                )
                del state
        print(
            f"   jcascade batch {B}: "
            + ", ".join(f"{r['method']} {r['wall_ms']:.3f} / {r['device_ms']:.3f} ms" for r in rows if r["batch"] == B),
            flush=True,
        )
    return rows


# --------------------------------------------------------------------------------------------------
# FlashInfer (torch)


def torch_timers(a):
    import torch

    def wall_ms(fn) -> float:
        return 1e3 * harness.time_it(fn, repeats=a.iters, sync=harness.TORCH).median

    def device_ms(fn) -> tuple[float, str]:
        """ms per call over a CUDA graph of a.loop calls (or a plain loop of them if capture fails), the median of 5
        replays."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(a.loop):
                    fn()
            run, how = graph.replay, "cuda graph"
        except Exception as e:  # any capture failure: time without a graph, and say so
            print(f"   graph capture failed ({type(e).__name__}: {e}); timing a plain loop", flush=True)

            def run():
                for _ in range(a.loop):
                    fn()

            how = "plain loop"
        return 1e3 * harness.time_it(run, sync=harness.TORCH).median / a.loop, how

    return wall_ms, device_ms


def paged(k, v):
    """[B, H, n, D] keys and values -> HND pages [B * ceil(n / PAGE), 2, H, PAGE, D] and last_page_len."""
    import torch

    B, H, n, Dh = k.shape
    pages = -(-n // PAGE)
    kv = torch.stack([k, v], 1)  # [B, 2, H, n, D]
    kv = torch.nn.functional.pad(kv, (0, 0, 0, pages * PAGE - n))
    kv = kv.reshape(B, 2, H, pages, PAGE, Dh).permute(0, 3, 1, 2, 4, 5).reshape(B * pages, 2, H, PAGE, Dh)
    return kv.contiguous(), n - (pages - 1) * PAGE


def decode_wrapper(workspace, B, pages, last, **options):
    """A planned BatchDecodeWithPagedKVCacheWrapper over B requests of `pages` consecutive pages each (options:
    the wrapper's, pos_encoding_mode, and kv_dtype, the pages' torch dtype)."""
    import flashinfer
    import torch

    rope = options.pop("pos_encoding_mode", "NONE")
    kv_dtype = options.pop("kv_dtype", torch.bfloat16)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", **options)
    i32 = dict(dtype=torch.int32, device="cuda")
    w.plan(
        torch.arange(B + 1, **i32) * pages,
        torch.arange(B * pages, **i32),
        torch.full((B,), last, **i32),
        HQ,
        HKV,
        D,
        PAGE,
        pos_encoding_mode=rope,
        rope_theta=THETA,
        data_type=kv_dtype,
        q_data_type=torch.bfloat16,
    )
    return w


def cascade_wrappers(workspace, B, shared_pages, own_pages, own_last):
    """Level 0: the shared prefix's pages [0, shared_pages), read by all B queries; level 1: request r's
    own pages after them. Both on the FA2 batch-prefill backend, as MultiLevelCascadeAttentionWrapper plans."""
    import flashinfer
    import torch

    i32 = dict(dtype=torch.int32, device="cuda")
    levels = [
        (
            torch.tensor([0, B], **i32),
            torch.tensor([0, shared_pages], **i32),
            torch.arange(shared_pages, **i32),
            torch.tensor([PAGE], **i32),
        ),
        (
            torch.arange(B + 1, **i32),
            torch.arange(B + 1, **i32) * own_pages,
            shared_pages + torch.arange(B * own_pages, **i32),
            torch.full((B,), own_last, **i32),
        ),
    ]
    wrappers = []
    for qo, indptr, indices, last in levels:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND", backend="fa2")
        w.plan(
            qo,
            indptr,
            indices,
            last,
            HQ,
            HKV,
            D,
            PAGE,
            causal=False,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
        )
        wrappers.append(w)
    return wrappers


def run_cascade(wrappers, q, cache):
    import flashinfer

    out, lse = wrappers[1].run(q, cache, return_lse=True)
    prefix_out, prefix_lse = wrappers[0].run(q, cache, return_lse=True)
    flashinfer.merge_state_in_place(out, lse, prefix_out, prefix_lse)
    return out


def flashinfer_rows(a) -> list[dict]:
    import torch

    S, own = shapes(a.tiny)
    n = S + own + 1  # the new token is in the cache
    wall_ms, device_ms = torch_timers(a)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for B in a.batches:
        q = torch.randn(B, HQ, D, generator=gen, device="cuda").bfloat16()
        pages = -(-n // PAGE)
        replicated = torch.randn(B * pages, 2, HKV, PAGE, D, generator=gen, device="cuda", dtype=torch.bfloat16)
        for method, options in (
            ("flashinfer decode", {}),
            ("flashinfer decode (tc)", dict(use_tensor_cores=True)),
            ("flashinfer decode, rope", dict(pos_encoding_mode="ROPE_LLAMA")),
        ):
            w = decode_wrapper(workspace, B, pages, n - (pages - 1) * PAGE, **options)
            fn = lambda w=w: w.run(q, replicated)
            dev, how = device_ms(fn)
            rows.append(
                dict(
                    batch=B,
                    method=method,
                    wall_ms=wall_ms(fn),
                    device_ms=dev,
                    timing=how,
                    kv_bytes=2 * B * HKV * n * D * 2,
                )
            )
        replicated = replicated.to(torch.float8_e4m3fn)
        w = decode_wrapper(workspace, B, pages, n - (pages - 1) * PAGE, kv_dtype=torch.float8_e4m3fn)
        fn = lambda w=w: w.run(q, replicated, k_scale=1.0, v_scale=1.0)
        dev, how = device_ms(fn)
        rows.append(
            dict(
                batch=B,
                method="flashinfer decode fp8",
                wall_ms=wall_ms(fn),
                device_ms=dev,
                timing=how,
                kv_bytes=2 * B * HKV * n * D,
            )
        )
        replicated = None  # freed before the next cache (the timed lambdas hold the name, not the tensor)
        shared_pages, own_pages = S // PAGE, -(-(own + 1) // PAGE)
        shared = torch.randn(
            shared_pages + B * own_pages, 2, HKV, PAGE, D, generator=gen, device="cuda", dtype=torch.bfloat16
        )
        wrappers = cascade_wrappers(workspace, B, shared_pages, own_pages, own + 1 - (own_pages - 1) * PAGE)
        fn = lambda: run_cascade(wrappers, q, shared)
        dev, how = device_ms(fn)
        rows.append(
            dict(
                batch=B,
                method="flashinfer cascade (fa2)",
                wall_ms=wall_ms(fn),
                device_ms=dev,
                timing=how,
                kv_bytes=None,
            )
        )
        shared = None
        print(
            f"   flashinfer batch {B}: "
            + ", ".join(f"{r['method']} {r['wall_ms']:.3f} / {r['device_ms']:.3f} ms" for r in rows if r["batch"] == B),
            flush=True,
        )
    return rows


# --------------------------------------------------------------------------------------------------
# Agreement: the same inputs through both libraries.


def agreement(a) -> dict:
    """Max |difference| of jcascade's outputs from FlashInfer's at each of --agree-batches (bf16 outputs): the
    shared prefix at every batch, the replicated decode up to batch 8 (its cache is B copies of the prefix)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")  # JAX frees what it drops: torch needs it
    return {f"batch {B}": agreement_at(a, B) for B in a.agree_batches}


def agreement_at(a, B: int) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    import jcascade as jc

    S, own = shapes(a.tiny)
    n = S + own + 1
    policy, rope = jc.Full(), jc.RoPE(THETA)
    ks = jax.random.split(jax.random.key(5), 6)
    prefix_k, prefix_v = (jax.random.normal(k, (1, HKV, S, D), jnp.bfloat16) for k in ks[:2])
    own_k, own_v = (jax.random.normal(k, (B, HKV, own + 1, D), jnp.bfloat16) for k in ks[2:4])  # the new token last
    q = jax.random.normal(ks[4], (B, 1, HQ, D), jnp.bfloat16)
    new_k, new_v = own_k[:, :, -1:].swapaxes(1, 2), own_v[:, :, -1:].swapaxes(1, 2)

    def state_of(k, v, held):
        pos = jnp.broadcast_to(jnp.arange(held, dtype=jnp.int32), (k.shape[0], HKV, held))
        return jc.CacheState(
            k=jc.Stored(k),
            v=jc.Stored(v),
            score=jnp.zeros(pos.shape, jnp.float32),
            pos=pos,
            seen=jnp.full((k.shape[0],), held, jnp.int32),
            kernels=jc.Kernels.default(),
        )

    t = lambda x: torch.from_dlpack(jax.block_until_ready(x))
    rotate = lambda x, start: rope(x, start + jnp.arange(x.shape[2], dtype=jnp.int32)[None, None, :])
    # FlashInfer's inputs: keys rotated at their positions, q at the new token's (n - 1)
    rot_q = t(rope(q.swapaxes(1, 2), jnp.full((B, 1, 1), n - 1, jnp.int32))[:, :, 0]).contiguous()
    rot_prefix, rot_own = rotate(prefix_k, 0), rotate(own_k, S)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    result = {}
    if B <= 8:
        all_k = jnp.concatenate([jnp.broadcast_to(prefix_k, (B, HKV, S, D)), own_k], 2)  # [B, H, n, D]
        all_v = jnp.concatenate([jnp.broadcast_to(prefix_v, (B, HKV, S, D)), own_v], 2)
        got = jc.attend(policy, state_of(all_k[:, :, :-1], all_v[:, :, :-1], n - 1), q, new_k, new_v, None, rope)[0]
        rot_all = jnp.concatenate([jnp.broadcast_to(rot_prefix, (B, HKV, S, D)), rot_own], 2)
        for name, keys, query, options in (
            ("flashinfer decode vs jcascade decode", rot_all, rot_q, {}),
            (
                "flashinfer decode, rope vs jcascade decode",
                all_k,
                t(q[:, 0]).contiguous(),
                dict(pos_encoding_mode="ROPE_LLAMA"),
            ),
        ):
            cache, last = paged(t(keys), t(all_v))
            w = decode_wrapper(workspace, B, cache.shape[0] // B, last, **options)
            result[name] = float((w.run(query, cache).float() - t(got[:, 0]).float()).abs().max())
            del cache
        del all_k, all_v, rot_all, got
    prefix = jc.share_prefix(policy, state_of(prefix_k, prefix_v, S), rope=rope)
    got = jc.attend_shared(
        policy, state_of(own_k[:, :, :-1], own_v[:, :, :-1], own), q, new_k, new_v, [prefix], None, rope
    )
    prefix_cache, _ = paged(t(rot_prefix), t(prefix_v))
    own_cache, own_last = paged(t(rot_own), t(own_v))
    cache = torch.cat([prefix_cache, own_cache])
    wrappers = cascade_wrappers(workspace, B, prefix_cache.shape[0], own_cache.shape[0] // B, own_last)
    want = run_cascade(wrappers, rot_q, cache)
    result["flashinfer cascade vs jcascade shared"] = float((want.float() - t(got[:, 0]).float()).abs().max())
    return result


# --------------------------------------------------------------------------------------------------


def table(rows: list[dict]) -> list[str]:
    eight_bit = lambda r: " int8" in r["method"] or " fp8" in r["method"]  # compared with FlashInfer's fp8 (and bf16)
    best_decode = {
        (r["batch"], eight_bit(r)): min(
            (
                x["device_ms"]
                for x in rows
                if x["batch"] == r["batch"]
                and x["method"].startswith("flashinfer decode")
                and eight_bit(x) == eight_bit(r)
            ),
            default=None,
        )
        for r in rows
    }
    cascade = {r["batch"]: r["device_ms"] for r in rows if r["method"].startswith("flashinfer cascade")}
    lines = [
        f"{'batch':>5} {'method':<38} {'wall ms':>8} {'device ms':>9} {'TB/s':>5} {'vs FlashInfer':>13} "
        f"{'vs FI bf16':>11}"
    ]
    for r in sorted(rows, key=lambda r: (r["batch"], r["method"])):
        tbs = f"{r['kv_bytes'] / r['device_ms'] / 1e9:5.2f}" if r.get("kv_bytes") else ""
        peer = best_decode.get((r["batch"], eight_bit(r))) if r.get("kv_bytes") else cascade.get(r["batch"])
        ratio = f"{r['device_ms'] / peer:13.2f}" if peer else " " * 13
        bf16 = best_decode.get((r["batch"], False)) if eight_bit(r) and r.get("kv_bytes") else None
        versus_bf16 = f" {r['device_ms'] / bf16:11.2f}" if bf16 else ""
        path = f"  ({r['path']})" if r.get("path", "in place") != "in place" else ""
        lines.append(
            f"{r['batch']:>5} {r['method']:<38} {r['wall_ms']:8.3f} {r['device_ms']:9.3f} {tbs:>5} {ratio}"
            f"{versus_bf16}{path}"
        )
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,64,256", help="comma-separated batch sizes")
    p.add_argument("--peers", default="jcascade,flashinfer,agree", help="which parts run: jcascade, flashinfer, agree")
    p.add_argument("--iters", type=int, default=50, help="calls timed for the wall clock (median)")
    p.add_argument("--loop", type=int, default=64, help="calls per timed loop for the device time")
    p.add_argument("--agree-batches", default="8,64", help="batch sizes of the agreement check (comma-separated)")
    p.add_argument("--tiny", action="store_true", help="small shapes (a dry run; `--peers jcascade` on the CPU)")
    p.add_argument("--out", default=None)
    p.add_argument("--peer", choices=PEERS, help=argparse.SUPPRESS)
    p.add_argument("--peer-out", help=argparse.SUPPRESS)
    a = p.parse_args()
    for name in ("batches", "agree_batches"):
        try:
            setattr(a, name, [int(b) for b in getattr(a, name).split(",")])
            if min(getattr(a, name)) < 1:
                raise ValueError
        except ValueError:
            p.error(f"--{name.replace('_', '-')} must be comma-separated positive integers, got {getattr(a, name)!r}")
    peers = a.peers.split(",")
    if not set(peers) <= set(PEERS):
        p.error(f"--peers must name some of {PEERS}, got {a.peers!r}")
    if a.peer:  # one library in this process
        got = PEERS[a.peer](a)
        pathlib.Path(a.peer_out).write_text(json.dumps(dict(device=device_kind(a.peer), result=got)))
        return

    # the parent touches no device: each library runs in its own process, with the memory to itself
    result = dict(
        benchmark="flashinfer_side_by_side",
        shape=dict(prefix=shapes(a.tiny)[0], own=shapes(a.tiny)[1], heads=[HQ, HKV, D], page=PAGE),
        iters=a.iters,
        loop=a.loop,
        rows=[],
        agreement=None,
        failures={},
    )
    out = pathlib.Path(a.out or "benchmarks/results/flashinfer.json")
    device = None  # named by the peers
    for peer in peers:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [
                sys.executable,
                __file__,
                "--peer",
                peer,
                "--peer-out",
                f.name,
                "--batches",
                ",".join(map(str, a.batches)),
                "--iters",
                str(a.iters),
                "--loop",
                str(a.loop),
                "--agree-batches",
                ",".join(map(str, a.agree_batches)),
            ] + (["--tiny"] if a.tiny else [])
            print(f"{peer} ...", flush=True)
            done = subprocess.run(cmd)
            if done.returncode:
                result["failures"][peer] = f"exit {done.returncode}"
                continue
            got = json.loads(pathlib.Path(f.name).read_text())
        device = got["device"]
        if peer == "agree":
            result["agreement"] = got["result"]
        else:
            result["rows"] += got["result"]
        harness.write_json(out, result, device=device)
    print(
        f"\n{device}: one decode step, {result['shape']['prefix']}-token prefix + "
        f"{result['shape']['own']} own tokens per request; ratio = device time over FlashInfer's best decode "
        "(replicated cache) or its cascade (shared prefix)"
    )
    print("\n".join(table(result["rows"])))
    if result["agreement"]:
        print("max |difference|:", result["agreement"])
    if result["failures"]:
        print("failed:", result["failures"])
    print(f"wrote {out}")


def device_kind(peer: str) -> str:
    """The device's name, asked of the peer's library (jax would take the GPU's memory in torch's process)."""
    if peer == "flashinfer":
        import torch

        return torch.cuda.get_device_name()
    import jax

    return jax.devices()[0].device_kind


PEERS = dict(jcascade=jcascade_rows, flashinfer=flashinfer_rows, agree=agreement)


if __name__ == "__main__":
    main()
