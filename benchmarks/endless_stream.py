"""An endless stream at constant memory: `jcascade.eval.perplexity.stream` (the loop behind `jc.score` and
`jcascade perplexity`) over many tokens through a bounded cache, on a tiny random model on the CPU.

Reports host RSS after warm-up (the CPU's device memory is host memory; growth = median of the last third
of the samples over the median of the first third, so that allocator noise does not read as a leak), the
number of live device arrays, the compilations of the chunk step and non-finite log-probabilities; writes
JSON.

    python benchmarks/endless_stream.py --tokens 1M --out benchmarks/results/endless-stream-cpu.json
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import numpy as np

import jcascade as jc
from jcascade.eval import perplexity

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]  # also when loaded as a module (tests/test_stream.py)
import harness  # noqa: E402  (the benchmarks' harness and the tests' tiny random Llama, importable once on the path)
import tiny  # noqa: E402


def rss_mib() -> float:
    """Resident set size of this process (Linux /proc)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def run(num_tokens: int, policy, samples: int = 20, warmup: float = 0.1, seed: int = 0) -> dict:
    """Streams `num_tokens` random tokens through the tiny model under `policy`; RSS is sampled at `samples`
    evenly spaced chunks after the first `warmup` fraction."""
    model = tiny.model(512)
    tokens = np.random.default_rng(seed).integers(0, 512, num_tokens).astype(np.int32)
    chunks = -(-num_tokens // policy.stride)
    sample_at = set(np.linspace(int(warmup * chunks), chunks - 1, samples).astype(int).tolist())
    rss, live, done = [], [], [0]

    def progress(n):
        if done[0] in sample_at:
            rss.append(rss_mib())
            live.append(len(jax.live_arrays()))
        done[0] += 1

    compiled = perplexity.step_compilations()
    logps, seconds = harness.time_once(lambda: perplexity.stream(model, policy, tokens, progress=progress))
    return {
        "tokens": num_tokens,
        "policy": jc.policies.spec(policy),
        "seconds": seconds,
        "tokens_per_s": num_tokens / seconds,
        "compilations": perplexity.step_compilations() - compiled,
        "non_finite": int((~np.isfinite(logps)).sum()),
        "rss_mib": rss,
        "rss_growth": float(np.median(rss[-len(rss) // 3 :]) / np.median(rss[: len(rss) // 3]) - 1),
        "live_arrays": live,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1M", help="stream length, e.g. 200K or 1M")
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args()
    scale = {"K": 1_000, "M": 1_000_000}.get(args.tokens[-1:].upper(), 1)
    num_tokens = int(args.tokens.rstrip("kKmM")) * scale
    rows = [
        run(num_tokens, policy)
        for policy in (jc.Cascade(cache_size=256, sinks=4, stride=512), jc.Sink(window=256, sinks=4, stride=512))
    ]
    print(
        f"{'policy':<10}{'tokens':>9}{'tok/s':>8}{'compiles':>9}{'non-finite':>11}{'RSS MiB':>13}{'growth':>8}"
        f"{'live arrays':>12}"
    )
    for r in rows:
        print(
            f"{r['policy'].split(':')[0]:<10}{r['tokens']:>9}{r['tokens_per_s']:>8.0f}{r['compilations']:>9}"
            f"{r['non_finite']:>11}{min(r['rss_mib']):>7.0f}-{max(r['rss_mib']):<5.0f}{100 * r['rss_growth']:>7.1f}%"
            f"{min(r['live_arrays']):>6}-{max(r['live_arrays'])}"
        )
    if args.out:
        harness.write_json(args.out, dict(benchmark="endless_stream", rows=rows))


if __name__ == "__main__":
    main()
