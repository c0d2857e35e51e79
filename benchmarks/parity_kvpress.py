"""Agreement with kvpress 0.5.5: the tokens each method keeps, per layer and KV head, on the same prompts and the
same model (the packaged SmolLM2-135M-Instruct's GGUF, read by jcascade and by transformers, float32, CPU).

kvpress pins transformers < 5.3, so its side runs in a virtual environment of its own (`--venv`, made on first
use: kvpress 0.5.5 and its transformers from PyPI; torch and gguf are this environment's, reached through a
.pth file). Both sides prefill each prompt (RULER prompts of `--length` tokens) and compress it to
`compute_n_kept(len, ratio)` tokens as kvpress does at `--compression` (the fraction removed); jcascade's
policies get that budget:

    kvpress StreamingLLMPress(n_sink=4)          jc.Sink(sinks=4, window=n - 4)
    SnapKVPress(window_size=64, kernel_size=5)   jc.SnapKV(budget=n, window=64, kernel=5, pooling="avg")
    PyramidKVPress(window_size=64, kernel_size=5) jc.PyramidKV(budget=n, window=64, kernel=5, pooling="avg")
    KnormPress                                   jc.KNorm(budget=n)
    TOVAPress                                    jc.TOVA(cache_size=n), the prompt as one chunk
    ExpectedAttentionPress()                     jc.ExpectedAttention(budget=n, window=len - 4)
    AdaKVPress(SnapKVPress(...))                 jc.AdaKV(jc.SnapKV(...))
    KVzipPress()                                 jc.KVzip.for_tokenizer(tokenizer, n)

kvpress's KVzip ranks every layer's and head's tokens together (layers and heads keep different counts); jcascade's
keeps n per KV head. So for KVzip the script compares the scores: kvpress's reconstruction scores (`score_val`, read
before its global ranking) ranked per KV head as jcascade ranks its own (the 4 sinks first, then the best n - 4).

kvpress's kept set is read from what it leaves: the keys it returns (matched to the prompt's keys) or, for
AdaKV, the `masked_key_indices` it sets. Printed: the mean overlap |ours & theirs| / |theirs| over prompts,
layers and KV heads, and the fraction of (layer, head) sets that are identical; JSON with every set's overlap.

    python benchmarks/parity_kvpress.py [--venv /tmp/kvpress-venv] [--out benchmarks/results/parity-kvpress.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import harness

KVPRESS = "kvpress==0.5.5"
METHODS = ("streamingllm", "snapkv", "pyramidkv", "knorm", "tova", "expectedattention", "adakv", "kvzip")

# The kvpress side, run by the venv's python: argv = model.gguf prompts.json ratio out.json
KVPRESS_SIDE = r"""
import json, pathlib, sys
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers import AutoTokenizer
from kvpress import (AdaKVPress, ExpectedAttentionPress, KnormPress, KVzipPress, PyramidKVPress, SnapKVPress,
                     StreamingLLMPress, TOVAPress)
from kvpress.presses import kvzip_press

gguf, prompts, ratio, out = sys.argv[1], json.load(open(sys.argv[2])), float(sys.argv[3]), sys.argv[4]
model = AutoModelForCausalLM.from_pretrained(str(pathlib.Path(gguf).parent), gguf_file=pathlib.Path(gguf).name,
                                             torch_dtype=torch.float32, attn_implementation="sdpa").eval()
tokenizer = AutoTokenizer.from_pretrained(str(pathlib.Path(gguf).parent), gguf_file=pathlib.Path(gguf).name)
kvzip_press.AutoTokenizer = type("GGUFTokenizer", (), {"from_pretrained": staticmethod(lambda *a, **k: tokenizer)})
presses = {"streamingllm": lambda: StreamingLLMPress(ratio, n_sink=4), "snapkv": lambda: SnapKVPress(ratio),
           "pyramidkv": lambda: PyramidKVPress(ratio), "knorm": lambda: KnormPress(ratio),
           "tova": lambda: TOVAPress(ratio), "expectedattention": lambda: ExpectedAttentionPress(ratio),
           "adakv": lambda: AdaKVPress(SnapKVPress(ratio)), "kvzip": lambda: KVzipPress(ratio)}
result = {}
for name, make in presses.items():
    press, kept = make(), {}
    if name == "kvzip":  # its scores, before its global ranking: ranked per KV head below, as jcascade ranks
        def scored(model, press=press, kept=kept):
            scores = press.score_val[:, 0].clone()  # [layers, KV heads, prompt]
            scores[..., : press.n_sink] = torch.inf
            n_kept = int(scores.shape[-1] * (1 - ratio))
            for layer, heads in enumerate(scores):
                kept[layer] = [sorted(torch.topk(h, n_kept).indices.tolist()) for h in heads]
        press.compress_post = scored

    def capture(compress):
        def wrapped(module, hidden_states, keys, values, attentions, kwargs):
            new_keys, new_values = compress(module, hidden_states, keys, values, attentions, kwargs)
            layer, (B, H, S, D) = module.layer_idx, keys.shape
            if getattr(module, "masked_key_indices", None) is not None:  # AdaKV masks instead of pruning
                _, heads, seqs = module.masked_key_indices
                masked = [set() for _ in range(H)]
                for h, s in zip(heads.tolist(), seqs.tolist()):
                    masked[h].add(s)
                kept[layer] = [sorted(set(range(S)) - m) for m in masked]
            else:  # the returned keys, found among the prompt's
                same = (new_keys[0][:, :, None, :] == keys[0][:, None, :, :]).all(-1)  # [H, kept, S]
                kept[layer] = [sorted(same[h].nonzero()[:, 1].tolist()) for h in range(H)]
            return new_keys, new_values
        return wrapped

    press.compress = capture(press.compress)
    result[name] = []
    for ids in prompts:
        kept.clear()
        with torch.no_grad(), press(model):
            model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache())
        result[name].append([kept[layer] for layer in sorted(kept)])
json.dump(result, open(out, "w"))
"""


def kvpress_python(venv: pathlib.Path, wheels: pathlib.Path | None = None) -> pathlib.Path:
    """The venv's python, made on first use: kvpress and its transformers from PyPI, or every wheel in `wheels`
    (no index, no dependency resolution: the folder holds what this environment lacks); torch, gguf and the rest
    from this environment."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    import gguf
    import torch

    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    shared = {pathlib.Path(torch.__file__).parents[1], pathlib.Path(gguf.__file__).parents[1]}
    (site / "jcascade-shared.pth").write_text("".join(f"{p}\n" for p in shared))  # after the venv's own
    install = (
        ["--no-index", "--no-deps", *map(str, sorted(wheels.glob("*.whl")))]
        if wheels
        else [KVPRESS, "transformers>=4.56,<5.3"]
    )
    subprocess.run([str(python), "-m", "pip", "install", "-q", *install], check=True)
    return python


def jcascade_kept(model, policy, ids) -> list[list[list[int]]]:
    """[layer][KV head] sorted positions held after the prompt `ids` under `policy`, as generate keeps them."""
    import jax.numpy as jnp
    import numpy as np

    import jcascade as jc
    from jcascade import generation

    state, _ = generation.prompt_cache(model.with_kernels(jc.Kernels("xla")), policy, jnp.asarray([ids]))
    pos = np.asarray(jc.cached_positions(state.cache))[:, 0]  # [L, H, slots]
    return [[sorted(p[p >= 0].tolist()) for p in layer] for layer in pos]


def policies_for(n_kept: int, length: int, tokenizer) -> dict:
    import jcascade as jc

    snap = jc.SnapKV(budget=n_kept, window=64, kernel=5, pooling="avg", head_reduction="mean", stride=length)
    return {
        "streamingllm": jc.Sink(sinks=4, window=n_kept - 4, positions="original", stride=length),
        "snapkv": snap,
        "knorm": jc.KNorm(budget=n_kept, stride=length),
        "pyramidkv": jc.PyramidKV(budget=n_kept, window=64, kernel=5, pooling="avg", stride=length),
        "kvzip": jc.KVzip.for_tokenizer(tokenizer, n_kept, stride=length),
        "tova": jc.TOVA(cache_size=n_kept, stride=length),
        "expectedattention": jc.ExpectedAttention(budget=n_kept, window=length - 4, stride=length),
        "adakv": jc.AdaKV(snap),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", default="/tmp/kvpress-venv")
    p.add_argument("--length", type=int, default=1024, help="prompt tokens (RULER prompts of this length)")
    p.add_argument("--tasks", default="niah_single_2,niah_multikey_1,vt,fwe")
    p.add_argument("--book", default="paradise_lost", help="the prose haystack (a shipped book or a text file)")
    p.add_argument("--compression", type=float, default=0.75, help="kvpress's compression ratio (fraction removed)")
    p.add_argument("--out", default="benchmarks/results/parity-kvpress.json")
    a = p.parse_args()
    import numpy as np
    from jcascade.models import packaged

    import jcascade as jc
    from jcascade.eval import ruler, texts

    python = kvpress_python(pathlib.Path(a.venv))
    spec = jc.models.SMOLLM2_135M_INSTRUCT
    jc.models.fetch(spec)  # the wheels, into the cache
    with tempfile.TemporaryDirectory() as tmp:
        gguf = pathlib.Path(tmp) / "smollm2.gguf"
        packaged.checked_gguf(spec, packaged.cache_dir() / "wheels", gguf, print)
        model, tokenizer = jc.load_pretrained(gguf, dtype="float32"), jc.load_tokenizer(gguf)
        generator = ruler.Generator(tokenizer, texts.load_book(a.book))
        prompts = [generator.sample(task, a.length, 0).prompt.tolist() for task in a.tasks.split(",")]
        (pathlib.Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
        since_start = harness.Stopwatch()
        subprocess.run(
            [
                str(python),
                "-c",
                KVPRESS_SIDE,
                str(gguf),
                str(pathlib.Path(tmp) / "prompts.json"),
                str(a.compression),
                str(pathlib.Path(tmp) / "kvpress.json"),
            ],
            check=True,
        )
        theirs = json.loads((pathlib.Path(tmp) / "kvpress.json").read_text())
        print(f"kvpress side: {since_start.elapsed():.0f} s")
    rows, detail = [], {}
    for method in METHODS:
        overlaps, identical = [], []
        for ids, their_sets in zip(prompts, theirs[method]):
            n_kept = max(1, int(len(ids) * (1 - a.compression)))
            ours = jcascade_kept(model, policies_for(n_kept, len(ids), tokenizer)[method], ids)
            for our_layer, their_layer in zip(ours, their_sets):
                for o, t in zip(our_layer, their_layer):
                    overlaps.append(len(set(o) & set(t)) / max(1, len(t)))
                    identical.append(o == t)
        detail[method] = overlaps
        rows.append((method, float(np.mean(overlaps)), float(np.mean(identical)), len(overlaps)))
    out = pathlib.Path(a.out)
    harness.write_json(
        out,
        {
            "benchmark": "parity_kvpress",
            "kvpress": KVPRESS,
            "model": spec.name,
            "length": a.length,
            "tasks": a.tasks,
            "compression": a.compression,
            "prompt_tokens": [len(ids) for ids in prompts],
            "rows": [dict(zip(("method", "overlap", "identical", "sets"), r)) for r in rows],
            "overlaps": detail,
        },
    )
    print(f"\n{'method':<18} {'overlap':>8} {'identical':>10} {'sets':>6}")
    for method, overlap, same, n in rows:
        print(f"{method:<18} {overlap:8.3f} {same:10.3f} {n:6d}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
