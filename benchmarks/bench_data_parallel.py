"""RULER prompts through `ruler.sweep` on one device and on each `--mesh` (rows split over its "data" axis D, the
same rows per data shard as on one device; weights and KV heads over its "model" axis): throughput in prompts/s
after compilation, whether every prompt's output is identical to one device's, and the RULER score of each mesh
with its difference from one device's (paired on the same prompts, 95 % intervals, tasks as strata).

Each mesh runs the sweep twice on the same prompts: the first run compiles (every policy at the length) and is not
timed; the second is timed from the end of its first batch to its return (the prompts of the batches after the
first), so neither the prompts' building, which comes first, nor the first batch counts. One device takes
`--rows` rows per call, a mesh D x `--rows`. With `--processes N` the script runs as N processes of one device each
(`jcascade.eval.processes`, as `jcascade ruler --processes N`): process 0 runs the one-device sweep alone (on a 1 x 1
mesh, which no process splits) while the others wait, then all N run it with each batch's rows split over them
(gathered at the end: the timing waits for the slowest process, which may also have started later);
process 0 prints and writes.

    python benchmarks/bench_data_parallel.py --mesh data=4 --mesh data=2,model=2 --length 4K --samples 16 \
        --out results/data-parallel.json
    python benchmarks/bench_data_parallel.py --processes 4 --length 4K --samples 64 --out results/dp-processes.json
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/bench_data_parallel.py --tiny   # dry run
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import harness
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jcascade.models import sharding
from jcascade.models.config import FAMILY_FEATURES, Rotary

import jcascade as jc
from jcascade.cli.options import count
from jcascade.eval import processes, ruler, stats, texts


def sweep(model, tokenizer, prose, tasks, length, names, budget, samples, rows) -> tuple[list, int, float]:
    """(the sweep's results, the prompts timed, their seconds): from the end of the first batch to the sweep's
    return (over processes: process 0's first batch, and every process's rows gathered)."""
    ends, since_start = [], harness.Stopwatch()
    out = ruler.sweep(
        model,
        tokenizer,
        ruler.policy_grid(names, [budget]),
        [length],
        tasks=tasks,
        prose=prose,
        samples=samples,
        batch_size=rows,
        progress=lambda n: ends.append((n, since_start.elapsed())),
    )
    if len(ends) < 2:
        raise SystemExit(
            f"--samples {samples}: one batch of {rows} rows holds every prompt, so none is timed; use more samples"
        )
    return out, sum(n for n, _ in ends[1:]), since_start.elapsed() - ends[0][1]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory or .gguf file (default: SmolLM2-135M-Instruct from PyPI)")
    p.add_argument(
        "--mesh",
        action="append",
        type=sharding.parse_mesh,
        metavar="data=D,model=M",
        help="a mesh to compare with one device; repeatable (default: data=every device)",
    )
    p.add_argument("--length", type=count, default=4096, help="context length (e.g. 4K)")
    p.add_argument("--samples", type=count, default=16, help="prompts per task")
    p.add_argument("--tasks", default="all", help="comma-separated RULER tasks, or all")
    p.add_argument("--policy", default="full,cascade", help="comma-separated `ruler.policies_at` names")
    p.add_argument("--budget", type=float, default=0.25, help="KV slots kept, a fraction of the context")
    p.add_argument("--rows", type=count, default=8, help="rows per device per generate call")
    p.add_argument("--book", default="paradise_lost", help="prose haystack")
    p.add_argument("--tiny", action="store_true", help="a random tiny model and two short tasks (dry run)")
    p.add_argument("--processes", type=count, default=1, help="run as this many processes of one device each")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.processes > 1 and a.mesh:
        raise SystemExit("--mesh: with --processes the rows go over the processes, one device each; leave --mesh out")
    if a.processes > 1 and not processes.launched():
        if not (a.model or a.tiny):  # fetched once, on the CPU, before the processes start
            jax.config.update("jax_platforms", "cpu")
            jc.models.fetch(jc.models.SMOLLM2_135M_INSTRUCT)
        raise SystemExit(processes.launch([__file__, *sys.argv[1:]], a.processes))
    if processes.launched():  # process 0 alone on a 1 x 1 mesh (no split over processes), then all N
        processes.join()
        alone = Mesh(np.array(jax.local_devices()[:1]).reshape(1, 1), sharding.AXES)
        runs_of = [("data=1,model=1", alone, a.rows), (f"processes={a.processes}", None, a.rows * a.processes)]
    else:
        for data, model in a.mesh or []:
            if data * model < 2 or data * model > len(jax.devices()):
                raise SystemExit(
                    f"--mesh data={data},model={model}: needs 2 to the {len(jax.devices())} devices present"
                )
        runs_of = [("data=1,model=1", None, a.rows)] + [
            (f"data={d},model={m}", sharding.device_mesh((d, m), batched=True), a.rows * d)
            for d, m in a.mesh or [(len(jax.devices()), 1)]
        ]
    first = jax.process_index() == 0  # prints and writes
    tasks = list(ruler.TASKS) if a.tasks == "all" else a.tasks.split(",")
    names = a.policy.split(",")
    path = pathlib.Path(a.model) if a.model else (None if a.tiny else jc.models.fetch(jc.models.SMOLLM2_135M_INSTRUCT))
    tokenizer = jc.load_tokenizer(path if path else jc.models.fetch(jc.models.SMOLLM2_135M_INSTRUCT))
    if a.tiny:
        tasks, a.length, a.samples = ["niah_single_1", "vt"], 1024, 2
        config = jc.models.ModelConfig(
            architecture="llama",
            **FAMILY_FEATURES["llama"],
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rotary=Rotary(theta=1e4),
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
        )
    prose = texts.load_book(a.book) if any(ruler.TASKS[t].needs_prose for t in tasks) else None
    runs, one_outputs, one_scores = {}, None, None
    result = dict(
        benchmark="data_parallel",
        processes=a.processes,
        model=path.name if path else "tiny random",
        length=a.length,
        tasks=tasks,
        samples=a.samples,
        policies=names,
        budget=a.budget,
        rows_per_data_shard=a.rows,
        runs=runs,
    )
    for label, mesh, rows in runs_of:  # one device first: the reference every run's outputs are compared with
        model = (
            jc.CausalLM.random(config, jax.random.key(0), mesh=mesh)
            if a.tiny  # every process: orbax syncs them
            else jc.load_pretrained(path, mesh=mesh)
        )
        alone = mesh is not None and jax.process_count() > 1  # process 0's device alone, the others waiting
        if alone and not first:
            multihost_utils.sync_global_devices("one device")
            continue
        run = (model, tokenizer, prose, tasks, a.length, names, a.budget, a.samples, rows)
        _, compile_s = harness.time_once(sweep, *run)
        results, timed, seconds = sweep(*run)
        if alone:
            multihost_utils.sync_global_devices("one device")
        if not first:
            continue
        outputs, scores = [r.output for r in results], [r.score for r in results]
        strata = [r.task for r in results]
        if one_outputs is None:  # the first mesh is one device
            one_outputs, one_scores = outputs, scores
        r = runs[label] = dict(
            seconds=seconds,
            timed_prompts=timed,
            first_run_s=compile_s,
            prompts=len(results),
            prompts_per_s=timed / seconds,
        )
        r.update(
            speedup=r["prompts_per_s"] / runs["data=1,model=1"]["prompts_per_s"],
            identical_outputs=sum(x == y for x, y in zip(one_outputs, outputs)),
            score=stats.mean(scores, strata=strata, bounds=(0, 1)).as_dict(),
            score_minus_one_device=stats.paired_difference(scores, one_scores, strata=strata, bounds=(0, 1)).as_dict(),
        )
        print(
            f"{label}: {timed} of {len(results)} prompts timed, {seconds:.1f} s ({timed / seconds:.1f} prompts/s; "
            f"first run, compiling: {compile_s:.1f} s)",
            flush=True,
        )
        if a.out:  # after each mesh: a run stopped later keeps what it measured
            harness.write_json(a.out, result)
    if not first:
        return
    one = runs["data=1,model=1"]
    print(
        f"\nrun, prompts/s, timed seconds, speed-up, identical outputs, score, score - one device ({result['model']}, "
        f"{a.length} tokens, {len(tasks)} tasks x {a.samples}, {', '.join(names)} at {a.budget:.0%})"
    )
    for name, r in runs.items():
        s, d = r["score"], r["score_minus_one_device"]
        print(
            f"  {name:16s} {r['prompts_per_s']:8.2f} {r['seconds']:8.1f} {r['speedup']:6.2f}x "
            f"{r['identical_outputs']}/{one['prompts']}  {s['value']:.3f} [{s['low']:.3f}, {s['high']:.3f}]  "
            f"{d['value']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
        )


if __name__ == "__main__":
    main()
