"""First use: a short chat prompt (37 tokens on SmolLM2-135M-Instruct) under policies at their default stride
(4096), as a newcomer writes them. Times one `jc.generate` call (greedy, --new tokens) after its compilation:
the first call's seconds (compilation included) and the median of --iters calls after it.

    python benchmarks/bench_first_use.py [--out benchmarks/results/first-use-<device>.json]
"""

from __future__ import annotations

import argparse

import harness
import jax
import numpy as np

import jcascade as jc

QUESTION = "What is the capital of France? Answer in one short sentence."


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--new", type=int, default=16, help="new tokens per call")
    p.add_argument(
        "--policy",
        action="append",
        choices=("sink", "cascade", "kvzip", "snapkv"),
        help="the policies to time (default: all four)",
    )
    args = p.parse_args()

    path = jc.models.fetch(jc.models.SMOLLM2_135M_INSTRUCT)
    model, tokenizer = jc.load_pretrained(path), jc.load_tokenizer(path)
    prompt = np.array(
        [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_dict=False
            )
        ]
    )
    policies = {
        "sink": ("Sink(window=64, sinks=4)", jc.Sink(window=64, sinks=4)),
        "cascade": ("Cascade(cache_size=64, sinks=4)", jc.Cascade(cache_size=64, sinks=4)),
        "kvzip": ("KVzip(budget=32)", jc.KVzip.for_tokenizer(tokenizer, budget=32)),
        "snapkv": ("SnapKV(budget=64)", jc.SnapKV(budget=64)),
    }
    policies = dict(v for k, v in policies.items() if args.policy is None or k in args.policy)
    device = jax.devices()[0].device_kind
    rows = []
    print(f"{prompt.shape[1]}-token prompt, {args.new} new tokens, {device}")
    print(f"{'policy':<34}{'stride':>8}{'first call (s)':>16}{'after (s)':>12}")
    for label, policy in policies.items():
        call = lambda: jc.generate(model, prompt, policy, max_new_tokens=args.new, eos_id=tokenizer.eos_token_id)
        _, first = harness.time_once(call)
        after = harness.time_it(call, warmup=0, repeats=args.iters).median
        rows.append(dict(policy=label, stride=policy.stride, first_call_s=round(first, 3), after_s=round(after, 3)))
        print(f"{label:<34}{policy.stride:>8}{first:>16.2f}{after:>12.3f}", flush=True)
    if args.out:
        harness.write_json(
            args.out,
            dict(
                benchmark="first_use",
                prompt_tokens=int(prompt.shape[1]),
                new_tokens=args.new,
                iters=args.iters,
                rows=rows,
            ),
        )


if __name__ == "__main__":
    main()
