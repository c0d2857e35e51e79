"""The README and docs/*.md as a reader uses them: every Python block runs as written (doc_blocks.py: a page's
blocks in order, in one namespace, from an empty folder), every `jcascade` command line of a bash block parses,
and every list marked `<!-- list: NAME -->` ... `<!-- end list -->` (policies, RULER tasks, packaged models,
commands, architectures) names exactly what the code has. The results book (docs/results/*.md, where every measured
figure lives and the other pages link to): its links and anchors hold, and the JSON its tables and commands name
exists (no XLA work: the tables themselves are `benchmarks/eval_tables.py`'s)."""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import traceback

import doc_blocks
import pytest
from doc_blocks import BOOK, PAGES, ROOT, python_blocks


def sessions() -> list:
    """A test per page (its blocks in order) and one per block that runs alone; the README's loads a real model."""
    params = []
    for page in PAGES:
        blocks, name = python_blocks(page), page.relative_to(ROOT).as_posix()
        together = [b for b in blocks if b.test is None]
        if together:
            params.append(pytest.param(together, id=name, marks=[pytest.mark.slow] * (page.name == "README.md")))
        params += [
            pytest.param([b], id=b.name, marks=pytest.mark.devices(doc_blocks.devices(b)))
            for b in blocks
            if doc_blocks.devices(b)
        ]
    return params


@pytest.mark.parametrize("blocks", sessions())
def test_the_python_blocks_run_as_written(blocks, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # figures a block writes land here
    environment = dict(os.environ)  # a block may set variables for a fresh process (devices)
    namespace = {"__name__": "__main__"}
    try:
        for block in blocks:
            block.run(namespace)
    finally:  # only what a block changed is put back: clearing the whole environment raced XLA's threads reading
        for name in set(os.environ) - set(environment):  # it (a SIGSEGV in the devices child)
            del os.environ[name]
        for name, value in environment.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


def test_every_block_is_run_by_one_test():
    """A block runs in test_the_python_blocks_run_as_written, or names the one test file that runs it, which reads
    it from its page; no other directive."""
    blocks = [b for page in PAGES for b in python_blocks(page)]
    assert len(blocks) >= 8
    for block in blocks:
        elsewhere = doc_blocks.run_elsewhere(block)
        if elsewhere is not None:
            assert elsewhere.is_file(), f"{block.name}: {block.test!r} is neither devices(n) nor a test file"
            assert block.page.relative_to(ROOT).as_posix() in elsewhere.read_text(), (
                f"{block.name}: {block.test} does not read its page"
            )


def test_a_failing_block_names_its_page_and_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n```python\nx = 1\n```\n\n<!-- test: devices(4) -->\n```python\n"
        "import os\n\ny = x / 0\n```\n\n```bash\nls\n```\n"
    )
    first, second = python_blocks(page)
    assert (first.line, first.code, first.test) == (4, "x = 1\n", None)
    assert (second.line, second.test, doc_blocks.devices(second)) == (9, "devices(4)", 4)
    namespace = {}
    first.run(namespace)
    with pytest.raises(ZeroDivisionError) as failed:
        second.run(namespace)
    frame = traceback.extract_tb(failed.value.__traceback__)[-1]
    assert (frame.filename, frame.lineno) == (str(page), 11)


# ---- lists and command lines --------------------------------------------------------------------------------

LIST = re.compile(r"<!-- list: (?P<name>[\w ]+) -->(?P<body>.*?)<!-- end list -->", re.S)
# how a list names its items: a table's first column(s), a bash block's commands, or every `word`
NAMES = {
    "policies": lambda body: [" ".join(row) for row in re.findall(r"^\| `jc\.(\w+)` \| `(\w+)` \|", body, re.M)],
    "commands": lambda body: re.findall(r"^jcascade ([\w-]+)", body, re.M),
    "packaged models": lambda body: re.findall(r"`(?:jc\.models\.)?([A-Z][A-Z0-9_]+)`", body),
    "architectures": lambda body: re.findall(r"`(\w+For(?:CausalLM|ConditionalGeneration))`", body),
}


def code_lists() -> dict[str, list[str]]:
    from jcascade.models.config import ARCHITECTURES

    import jcascade as jc
    from jcascade import cli
    from jcascade.eval import ruler
    from jcascade.policies import policy_classes

    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert all(getattr(jc, cls.__name__) is cls for cls in policy_classes().values())
    return {
        "policies": [f"{cls.__name__} {name}" for name, cls in policy_classes().items()],
        "policy names": list(policy_classes()),
        "ruler tasks": list(ruler.TASKS),
        "ruler policy names": list(ruler.POLICIES),
        "packaged models": [k for k, v in vars(jc.models).items() if isinstance(v, jc.models.PackagedModel)],
        "commands": list(commands),
        "architectures": list(ARCHITECTURES),
    }


def test_the_lists_of_the_pages_are_the_codes():
    code = code_lists()
    found = [
        (
            page,
            m.group("name"),
            NAMES.get(m.group("name"), lambda body: re.findall(r"`([\w-]+)`", body))(m.group("body")),
        )
        for page in PAGES
        for m in LIST.finditer(page.read_text(encoding="utf-8"))
    ]
    in_readme = {name for page, name, _ in found if page.name == "README.md"}
    assert {"policies", "ruler tasks", "packaged models", "commands", "architectures"} <= in_readme
    for page, name, names in found:
        assert name in code, f"{page.name}: unknown list {name!r}"
        assert sorted(names) == sorted(code[name]), f"{page.name}, list {name!r}: {names} != the code's {code[name]}"


def command_lines(page) -> list[str]:
    """The `jcascade ...` lines of a page's bash blocks, continuation lines joined, comments and redirections cut."""
    blocks = re.findall(r"^```bash\n(.*?)^```$", page.read_text(encoding="utf-8"), re.M | re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [re.split(r"\s[>|]\s", line)[0] for line in lines if line.startswith("jcascade ")]


def test_the_command_lines_of_the_pages_parse(capsys):
    from jcascade import cli

    parser = cli.build_parser()
    lines = {page.name: command_lines(page) for page in PAGES}
    assert len(lines["README.md"]) >= 6
    for page, found in lines.items():
        for line in found:
            try:
                parser.parse_args(shlex.split(line, comments=True)[1:])
            except SystemExit:
                pytest.fail(f"{page}: {line!r} does not parse: {capsys.readouterr().err}")


# ---- the results book ---------------------------------------------------------------------------------------


def test_the_results_books_links_and_anchors_hold():
    """Every relative link of docs/results/*.md names a file or folder (figures included), and its #anchor a heading
    of the page it names; the book's README links each of its pages. (README.md and docs/*.md, which link into the
    book: tests/test_package.py.)"""
    pages = {page.name for page in BOOK}
    assert {"README.md", "accuracy.md", "ruler.md", "decode.md", "multi-gpu.md"} <= pages
    broken = [link for page in BOOK for link in doc_blocks.broken_links(page)]
    assert not broken, f"links to files or headings that do not exist: {broken}"
    contents = {target.partition("#")[0] for target in doc_blocks.links(ROOT / "docs" / "results" / "README.md")}
    assert pages - {"README.md"} <= contents, f"pages the book's README does not link: {pages - contents}"


def test_the_results_book_names_json_that_exists():
    """Each file a results page names, as its tables' JSON column or in the command that prints a table
    (`python benchmarks/eval_tables.py ... benchmarks/results/dir/{a,b}.json`), is in benchmarks/results/: a result
    the book cites is not deleted from under it."""
    named = {(page.name, name): patterns for page in BOOK for name, patterns in doc_blocks.named_files(page).items()}
    assert len(named) > 100
    missing = sorted(
        f"{page}: {name}"
        for (page, name), patterns in named.items()
        if not any(glob.glob(pattern, root_dir=ROOT) for pattern in patterns)
    )
    assert not missing, f"files the results book names that do not exist: {missing}"


def test_the_helpers_read_links_braces_and_json_columns(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n## Two GPUs: `x --mesh model=2` (4K)\n\n```bash\n# Not a heading\n"
        "python benchmarks/eval_tables.py decode benchmarks/results/d/{a,b}-{1,2}.json \\\n"
        "    benchmarks/results/*.gz\n"
        "```\n\n| JSON | GPU |\n|---|---|\n| `d/c` | H100 |\n\n[x](#a-page), [y](page.md#nowhere), [z](https://e.org)\n"
    )
    assert doc_blocks.anchors(page) == {"a-page", "two-gpus-x---mesh-model2-4k"}
    assert doc_blocks.links(page) == ["#a-page", "page.md#nowhere"]
    assert [b.rpartition(": ")[2] for b in doc_blocks.broken_links(page)] == ["page.md#nowhere"]
    assert list(doc_blocks.named_files(page)) == [
        "benchmarks/eval_tables.py",
        "benchmarks/results/d/a-1.json",
        "benchmarks/results/d/a-2.json",
        "benchmarks/results/d/b-1.json",
        "benchmarks/results/d/b-2.json",
        "benchmarks/results/*.gz",
        "d/c",
    ]
