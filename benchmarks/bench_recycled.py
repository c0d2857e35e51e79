"""Decoding after a long prompt on a Llama-3.1-8B-shaped model (random bf16 weights): Full vs Recycled
Attention (top_k 4096, refresh every 50 steps) vs SnapKV (budget 4096, window 32, kernel 7), in the setting of
Table 2 of Xu et al., "Recycled Attention: Efficient Inference for Long-Context Language Models" (arXiv
2411.05787): a 32K-token prompt; the paper generates 50 tokens at batch 1 on an A100: 1.71 s Full, 1.26 s
Recycled, 1.64 s SnapKV for the generation phase. At batch 1 and larger batches (`--batches`).

Per policy, the prompt is prefilled once at batch 1 as `jc.generate` does and its cache copied to every row
of the batch (a decode step's cost does not depend on what the rows hold). Then one Recycled refresh period
of greedy decode steps is timed as two jitted loops, the cache donated: the first 49 steps (recycled ones,
the paper's 50 new tokens after the prompt's) and the 50th (a full step with the re-selection); the other
policies run the same steps. Reported: the median ms per step of the 49, the 50th's ms, and the mean over
the 50.

    python benchmarks/bench_recycled.py [--batches 1,16] [--out benchmarks/results/recycled-<device>.json]
    python benchmarks/bench_recycled.py --tiny      # a dry run of the same code with a tiny model
"""

from __future__ import annotations

import argparse
import pathlib
import warnings

import harness
import jax
import jax.numpy as jnp
from bench_model import LLAMA31_8B, TINY
from jcascade.models import CausalLM

import jcascade as jc
from jcascade import generation


def decode_block(policy, steps: int):
    """jitted (model, state, last) -> (state, last) after `steps` greedy decode steps; the state is donated."""

    def run(model, state, last):
        def step(_, carry):
            state, last = carry
            hidden, state = model(policy, state, last[:, None], jnp.ones(last.shape, jnp.int32))
            return state, jnp.argmax(model.logits(hidden[:, 0]), axis=-1).astype(jnp.int32)

        return jax.lax.fori_loop(0, steps, step, (state, last))

    return jax.jit(run, donate_argnums=1, compiler_options=jc.COMPILER_OPTIONS)


def prompt_cache(model, policy, prompt, room: int):
    """The cache after `prompt` [1, S] with room for `room` more tokens, and the first new token [1]."""
    run = jax.jit(
        lambda model, tokens: generation.prompt_cache(model, policy, tokens, room=room),
        compiler_options=jc.COMPILER_OPTIONS,
    )
    state, hidden = run(model, prompt)
    return state, jnp.argmax(model.logits(hidden), axis=-1).astype(jnp.int32)


def bench_decode(model, policy, prompt_state, first, batch: int, steps: int, repeats: int) -> dict:
    """Times of `steps - 1` decode steps, then one more, from `batch` copies of the prompt's cache, repeated."""
    state = jax.jit(lambda s: jax.tree.map(lambda x: jnp.repeat(x, batch, axis=1), s))(prompt_state)
    last = jnp.repeat(first, batch)
    blocks, compile_s = harness.time_once(
        lambda state, last: [decode_block(policy, n).lower(model, state, last).compile() for n in (steps - 1, 1)],
        state,
        last,
    )

    def phase(block):  # the state is donated: each block decodes on from the last one's
        def run():
            nonlocal state, last
            state, last = block(model, state, last)
            return state, last

        return run

    # a period is both blocks in turn; the first period warms up
    timings = harness.time_phases([phase(block) for block in blocks], warmup=1, repeats=repeats)
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves((state.cache.k, state.cache.v)))
    del state
    first_steps, last_step = (t.median for t in timings)
    return dict(
        spec=jc.policies.spec(policy),
        batch=batch,
        compile_s=compile_s,
        period_s=[list(period) for period in zip(*(t.seconds for t in timings))],
        ms_per_step=1e3 * first_steps / (steps - 1),
        last_step_ms=1e3 * last_step,
        mean_ms_per_step=1e3 * (first_steps + last_step) / steps,
        cache_gb=cache_bytes / 1e9,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--batches", default="1", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=3, help="timed blocks per policy and batch")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    if a.tiny:
        cfg, prompt_len, steps, top_k, stride = TINY, 512, 10, 64, 128
    else:
        cfg, prompt_len, steps, top_k, stride = LLAMA31_8B, 32768, 50, 4096, 4096
    policies = {
        "Full": jc.Full(stride=stride),
        "Recycled": jc.Recycled(top_k=top_k, refresh_every=steps, stride=stride),
        "SnapKV": jc.SnapKV(budget=top_k, window=32, kernel=7, stride=stride),
    }
    device = jax.devices()[0]
    model = CausalLM.random(cfg, jax.random.key(0), jnp.bfloat16)
    prompt = jax.random.randint(jax.random.key(1), (1, prompt_len), 0, cfg.vocab_size)
    result = dict(benchmark="recycled", prompt_tokens=prompt_len, steps_per_block=steps, rows=[])
    out = pathlib.Path(a.out or f"benchmarks/results/recycled-{device.device_kind.replace(' ', '_')}.json")
    for name, policy in policies.items():
        prompt_state, first = prompt_cache(model, policy, prompt, room=steps * (a.repeats + 1))
        for batch in map(int, a.batches.split(",")):
            row = dict(policy=name, **bench_decode(model, policy, prompt_state, first, batch, steps, a.repeats))
            result["rows"].append(row)
            print(
                f"   batch {batch} {name}: {row['ms_per_step']:.2f} ms/step, step {steps} {row['last_step_ms']:.1f} ms "
                f"(compile {row['compile_s']:.0f} s)",
                flush=True,
            )
            harness.write_json(out, result)
    print(
        f"\n{device.device_kind}, prompt {prompt_len}: batch, policy, ms/step of steps 1-{steps - 1} and speed-up "
        f"vs Full, ms of step {steps}, mean ms/step over the {steps} and speed-up, cache GB"
    )
    for r in sorted(result["rows"], key=lambda r: r["batch"]):
        full = next(f for f in result["rows"] if f["batch"] == r["batch"] and f["policy"] == "Full")
        print(
            f"   {r['batch']:>3} {r['policy']:<9} {r['ms_per_step']:8.2f} "
            f"{full['ms_per_step'] / r['ms_per_step']:6.2f} "
            f"{r['last_step_ms']:8.2f} {r['mean_ms_per_step']:8.2f} "
            f"{full['mean_ms_per_step'] / r['mean_ms_per_step']:6.2f} {r['cache_gb']:7.1f}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
