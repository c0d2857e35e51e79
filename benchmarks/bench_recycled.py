"""Generation after a long prompt on a Llama-3.1-8B-shaped model (random bf16 weights): Full vs Recycled
Attention (top_k 4096, refresh every 50 steps) vs SnapKV (budget 4096, window 32, kernel 7), as in
papers/002 Table 2 (32K-token prompt, 50 new tokens; the paper reports 1.71 s Full, 1.26 s Recycled,
1.64 s SnapKV for the generation phase on an A100).

For each policy, `jc.generate` is compiled twice: with 1 new token (prefill and the first token) and with
50; the generation phase is the difference (49 decode steps), timed as the median of --repeats runs.

    python benchmarks/bench_recycled.py [--out benchmarks/results/recycled-<device>.json]
    python benchmarks/bench_recycled.py --tiny      # a dry run of the same code with a tiny model
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
import warnings

import jax
import jax.numpy as jnp

import jcascade as jc
from bench_model import LLAMA31_8B, TINY
from jcascade.models import CausalLM


def timed(compiled, model, tokens, repeats: int) -> float:
    jax.block_until_ready(compiled(model, tokens))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(model, tokens))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    if a.tiny:
        cfg, prompt_len, new, top_k, stride = TINY, 512, 10, 64, 128
    else:
        cfg, prompt_len, new, top_k, stride = LLAMA31_8B, 32768, 50, 4096, 4096
    policies = {
        "Full": jc.Full(stride=stride),
        "Recycled": jc.Recycled(top_k=top_k, refresh_every=new, stride=stride),
        "SnapKV": jc.SnapKV(budget=top_k, window=32, kernel=7, stride=stride),
    }
    device = jax.devices()[0]
    model = CausalLM.random(cfg, jax.random.key(0), jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(1), (1, prompt_len), 0, cfg.vocab_size)
    result = dict(benchmark="recycled", device=device.device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                  prompt_tokens=prompt_len, new_tokens=new, rows=[])
    out = pathlib.Path(a.out or f"benchmarks/results/recycled-{device.device_kind.replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, policy in policies.items():
        row = dict(policy=name, spec=repr(policy))
        for steps in (1, new):
            run = jax.jit(lambda model, tokens, policy=policy, steps=steps: jc.generate(model, tokens, policy,
                                                                                       max_new_tokens=steps),
                          compiler_options=jc.COMPILER_OPTIONS)
            t0 = time.perf_counter()
            compiled = run.lower(model, tokens).compile()
            row[f"compile_s_{steps}"] = time.perf_counter() - t0
            row[f"seconds_{steps}"] = timed(compiled, model, tokens, a.repeats)
        row["generation_s"] = row[f"seconds_{new}"] - row["seconds_1"]
        row["ms_per_step"] = 1e3 * row["generation_s"] / (new - 1)
        result["rows"].append(row)
        print(f"   {name}: prefill+1 {row['seconds_1']:.2f} s, +{new - 1} steps {row['generation_s']:.3f} s", flush=True)
        out.write_text(json.dumps(result, indent=2))
    full = result["rows"][0]["generation_s"]
    print(f"\n{device.device_kind}, prompt {prompt_len}, {new} new tokens: policy, prefill + first token s, "
          f"generation s ({new - 1} steps), ms/step, speed-up vs Full")
    for r in result["rows"]:
        print(f"   {r['policy']:<9} {r['seconds_1']:8.2f} {r['generation_s']:8.3f} {r['ms_per_step']:8.2f} "
              f"{full / r['generation_s']:6.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
