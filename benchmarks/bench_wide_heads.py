"""Triton tiles for heads of 512 (Gemma 4's global layers): each candidate `TritonConfig` against the XLA reference,
8 query / 4 KV heads, bf16: decode over a 16K + 64 cache at batch 1 and 16, a 4096-token chunk over 4160 slots.
A config that fails to compile (shared memory) is reported as such; the others with their median time of 10 calls
and their relative error against the reference. `triton.WIDE` (`Kernels.triton_wide`) was chosen from this table.

    python benchmarks/bench_wide_heads.py [--out benchmarks/results/triton-wide-heads-<device>.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import check_kernels_gpu as check
import harness
import jax
import jax.numpy as jnp
import numpy as np

import jcascade as jc
from jcascade import pallas_kernels as pk

BASE = pk.TritonConfig()
SMALL = dict(block_q=32, block_k=32, score_block_q=32, score_block_k=32, decode_block_k=32, decode_num_stages=2)
CONFIGS = {
    "XLA reference": None,
    "default tiles": BASE,
    "32-key tiles, 2 stages": dataclasses.replace(BASE, **SMALL),
    "32-key tiles, 8 warps": dataclasses.replace(BASE, **SMALL, num_warps=8, decode_num_warps=8),
    "adopted (triton.WIDE)": pk.triton.WIDE,
}
CASES = (("decode", 1, 1, 16448), ("decode", 16, 1, 16448), ("chunk", 1, 4096, 4160))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("bench_wide_heads.py needs a GPU")
    check.HQ, check.HKV, check.D = 8, 4, 512
    rope, layer = jc.RoPE(1e6), jnp.int32(check.LAYER)
    rows = []
    for case, B, T, S in CASES:
        x = check.stored(check.inputs(jax.random.key(B + T), B, T, S))
        want = None
        for name, config in CONFIGS.items():

            def run(x, config=config):
                if config is None:
                    return jc.Kernels("xla").chunk_attention(**x, head_reduction="max", rope=rope, layer=layer)
                return pk.triton.chunk_attention(
                    *(
                        x[k]
                        for k in (
                            "q",
                            "k",
                            "v",
                            "k_cache",
                            "v_cache",
                            "cache_valid",
                            "cache_positions",
                            "lengths",
                            "query_weights",
                        )
                    ),
                    "max",
                    rope,
                    layer,
                    0,
                    config=config,
                    interpret=False,
                )

            row = dict(case=case, batch=B, T=T, S=S, config=name)
            try:
                f = jax.jit(run)
                out = jax.block_until_ready(f(x))  # compiled here: a config the compiler rejects raises
                row["ms"] = harness.time_it(f, x, warmup=0, repeats=10).median * 1e3
            except jax.errors.JaxRuntimeError as e:
                row["error"] = str(e).splitlines()[0][:200]
            else:
                want = out if want is None else want
                row["relative_error"] = max(
                    check.relative_error(np.where(np.isfinite(w), g, 0), np.where(np.isfinite(w), w, 0))[0]
                    for g, w in zip(out[:2], want[:2])
                )
            rows.append(row)
            print(
                f"{case:6} B={B:<3} {name:24} "
                + (row.get("error") or f"{row['ms']:7.2f} ms, error {row['relative_error']:.1e}"),
                flush=True,
            )
    device = jax.devices()[0].device_kind
    out = pathlib.Path(a.out or f"benchmarks/results/triton-wide-heads-{device.replace(' ', '_')}.json")
    harness.write_json(out, dict(benchmark="wide_heads", rows=rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
