"""The Python blocks of README.md and docs/*.md, as the tests run them (tests/test_readme.py), and the links and
file names of the results book (docs/results/*.md), which those tests check.

A page's ```python blocks run as written, in order, in one namespace: a reader's Python session. An HTML comment
on the line before a block's fence changes that, unseen on the rendered page:
    <!-- test: devices(8) -->        the block runs alone, in a process with 8 CPU devices;
    <!-- test: tests/path.py -->     that test file runs the block its own way (and only it).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BOOK = sorted((ROOT / "docs" / "results").glob("*.md"))  # the results book: the one place a measured figure lives
_FENCE = re.compile(r"^(?:<!-- test: (?P<test>[^>]*?) -->\n)?```python\n(?P<code>.*?)^```$", re.M | re.S)


@dataclasses.dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # the page's line of the code's first line (1-based)
    code: str
    test: str | None  # the directive of the comment before the fence, if any

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"

    def run(self, namespace: dict) -> None:
        """Executes the code in `namespace`; a traceback names the page and the page's line."""
        exec(compile("\n" * (self.line - 1) + self.code, str(self.page), "exec", dont_inherit=True), namespace)


def python_blocks(page: pathlib.Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    return [
        Block(page, text.count("\n", 0, m.start("code")) + 1, m.group("code"), m.group("test"))
        for m in _FENCE.finditer(text)
    ]


def devices(block: Block) -> int | None:
    """n of a `devices(n)` block (it runs alone with n devices), else None."""
    found = re.fullmatch(r"devices\((\d+)\)", block.test or "")
    return int(found.group(1)) if found else None


def run_elsewhere(block: Block) -> pathlib.Path | None:
    """The test file a block names as the one that runs it, else None."""
    return ROOT / block.test if block.test and devices(block) is None else None


# ---- links and the files a page names ------------------------------------------------------------------------


def anchors(page: pathlib.Path) -> set[str]:
    """The anchors GitHub gives a Markdown page's headings: lower case, punctuation dropped, spaces as hyphens,
    "-1", "-2" after repeats (headings inside code blocks are not headings)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        repeat, k = slug, 0
        while repeat in found:
            k += 1
            repeat = f"{slug}-{k}"
        found.add(repeat)
    return found


def links(page: pathlib.Path) -> list[str]:
    """The relative link targets of a page ([text](path), images too); web links left out."""
    targets = re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8"))
    return [target for target in targets if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def broken_links(page: pathlib.Path) -> list[str]:
    """The relative links of a page that name no file or folder, or whose #anchor is no heading of the Markdown
    page they name (a bare #anchor: of this page)."""
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        linked = page.parent / path if path else page
        if not linked.exists() or anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page}: {target}")
    return broken


def braces(word: str) -> list[str]:
    """A shell word's brace expansion, as the book writes it: `a/{b,c}-{1,2}.json` -> `a/b-1.json`, `a/b-2.json`,
    `a/c-1.json`, `a/c-2.json`."""
    found = re.search(r"\{([^{}]*,[^{}]*)\}", word)
    if found is None:
        return [word]
    return [
        expanded
        for alternative in found.group(1).split(",")
        for expanded in braces(word[: found.start()] + alternative + word[found.end() :])
    ]


def named_files(page: pathlib.Path) -> dict[str, list[str]]:
    """What a results page names under benchmarks/, each with the glob patterns (from the repository root) of which
    one must match: every path of its bash blocks' command lines (braces expanded, `*` kept), and every name in the
    JSON column of its tables (a file under benchmarks/results/, read as NAME.json or NAME.json.gz)."""
    text = page.read_text(encoding="utf-8")
    blocks = re.findall(r"^```bash\n(.*?)^```$", text, re.M | re.S)
    words = " ".join(blocks).replace("\\\n", " ").split()
    named = {path: [path] for word in words if word.startswith("benchmarks/") for path in braces(word)}
    for rows in re.findall(r"^\| JSON \|.*\n\|[-| ]+\|\n((?:\|.*\n)*)", text, re.M):
        for name in re.findall(r"^\| `([^`]+)` \|", rows, re.M):
            named[name] = [f"benchmarks/results/{name}.json", f"benchmarks/results/{name}.json.gz"]
    return named
