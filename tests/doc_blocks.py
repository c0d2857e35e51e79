"""The Python blocks of README.md and docs/*.md, as the tests run them (tests/test_readme.py).

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
