"""The package's import guard (jcascade/__init__.py), `import jcascade` without the evaluation wing, benchmarks on
public names only, lean benchmark results, and a repository that stands alone (docs/semantics.md)."""

import ast
import pathlib
import re
import subprocess
import sys
import sysconfig

from doc_blocks import anchors, broken_links


def test_an_uninstalled_source_tree_says_how_to_install():
    """From the repository root without the package installed, `import jcascade` finds the bare folder,
    whose models/ and pallas_kernels/ are not yet mapped into it: the import says so instead of failing on
    a circular import."""
    root = pathlib.Path(__file__).resolve().parents[1]
    code = f"import sys; sys.path[:0] = [{str(root)!r}, {sysconfig.get_paths()['purelib']!r}]; import jcascade"
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=root)
    assert done.returncode == 1
    assert "jcascade is not installed" in done.stderr and "pip install -e ." in done.stderr


ROOT = pathlib.Path(__file__).resolve().parents[1]
# Files that live outside the repository (the design notes and papers it was written from). Spelt in pieces so
# that this file does not match itself.
OUTSIDE = re.compile(
    "|".join((r"\bDE" r"SIGN\b", r"\bREFER" r"ENCES\b", r"\bpapers" "/", r"\.\./" "shared", r"/work" "/shared"))
)
SKIPPED = {".git", ".venv", "build", "dist", "__pycache__", ".hypothesis", ".pytest_cache"}


def repository_files() -> list[pathlib.Path]:
    """The repository's files: git's tracked and not-ignored ones, or, outside a git checkout, every file but
    virtual environments, caches and build outputs."""
    try:
        listed = (
            subprocess.run(
                ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                cwd=ROOT,
                capture_output=True,
                check=True,
            )
            .stdout.decode()
            .split("\0")
        )
        return [ROOT / name for name in listed if name and (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [
            path
            for path in ROOT.rglob("*")
            if path.is_file()
            and not SKIPPED & set(path.relative_to(ROOT).parts)
            and not path.parent.name.endswith(".egg-info")
        ]


def text_files() -> dict[str, str]:
    """Relative path -> text of every repository file that is UTF-8 text (images and other binaries left out)."""
    texts = {}
    for path in repository_files():
        try:
            texts[path.relative_to(ROOT).as_posix()] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    return texts


def test_the_repository_cites_no_file_outside_it():
    """The repository stands alone: no docstring, help text, test or document points at the design notes or
    papers it was written from (a folder of papers, the design and references notes); papers are cited by title
    and arXiv id, the semantics live in docs/semantics.md."""
    texts = text_files()
    assert "README.md" in texts and "jcascade/cache_api.py" in texts
    found = [
        f"{name}:{number}: {line.strip()}"
        for name, text in texts.items()
        for number, line in enumerate(text.splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not found, "references to files outside the repository:\n" + "\n".join(found)


def test_semantics_sections_cited_exist():
    """Every "docs/semantics.md §n" (and §n-m) in the repository names a section that the page has."""
    texts = text_files()
    sections = set(re.findall(r"^## (\d+)\. ", texts["docs/semantics.md"], re.M))
    cited = {
        (name, number)
        for name, text in texts.items()
        for first, last in re.findall(r"docs/semantics\.md §(\d+)(?:-(\d+))?", text)
        for number in {first, last or first}
    }
    assert len(cited) > 10
    missing = sorted(f"{name}: §{number}" for name, number in cited if number not in sections)
    assert not missing, f"sections cited but not in docs/semantics.md ({sorted(sections, key=int)}): {missing}"


def test_anchors_follow_github(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n## Two GPUs: `bench_model.py --mesh model=2` (Qwen2.5, 4K-32K)\n\n## Notes\n\n"
        "```\n# not a heading\n```\n\n## Notes\n"
    )
    assert anchors(page) == {"a-page", "two-gpus-bench_modelpy---mesh-model2-qwen25-4k-32k", "notes", "notes-1"}


def test_relative_markdown_links_point_at_files_that_exist():
    """Every relative link of README.md and docs/*.md ([text](path), images too) names a file or folder of the
    repository, and its #anchor, if any, a heading of that Markdown page (or of this page: a bare #anchor); web
    links are not checked."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [link for page in pages for link in broken_links(page)]
    assert len(pages) > 1
    assert not broken, f"links to files or headings that do not exist: {broken}"


def test_import_jcascade_loads_no_evaluation_code(tmp_path):
    """`import jcascade` is the library: it imports nothing of the evaluation wing (`jcascade.eval`: the command
    line's sweeps, statistics, reports and plots); `jc.save_stream` / `jc.load_stream` come from
    `jcascade.checkpoint`. Run in a fresh interpreter, outside the repository root."""
    code = (
        "import sys, jcascade as jc; jc.save_stream, jc.load_stream; "
        "print([m for m in sys.modules if m.startswith('jcascade.eval')])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"import jcascade loaded evaluation modules: {done.stdout.strip()}"


def private_jcascade_names(source: str) -> list[str]:
    """The private names of jcascade (a leading underscore, dunders aside) that Python `source` uses: imported
    from a jcascade module (`from jcascade.cli import _positive`), or read as an attribute of a name bound by an
    import from jcascade, directly or through public attributes (`generation._prompt`,
    `jc.eval.perplexity._step`). Objects reached otherwise (a local variable holding a model) are not followed."""
    private = lambda name: name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
    tree = ast.parse(source)
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in (a for a in node.names if a.name.split(".")[0] == "jcascade"):
                bound.add(alias.asname or "jcascade")
                if any(map(private, alias.name.split("."))):
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "jcascade":
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if private(alias.name) or any(map(private, node.module.split("."))):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute) and not private(root.attr):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_private_names_are_found():
    source = (
        "import jcascade as jc\nfrom jcascade.cli import _positive, count\nfrom jcascade import generation\n"
        "import numpy as np\ngeneration._prompt(1)\njc.eval.perplexity._step.top_level._cache_size()\n"
        "np._private\ngeneration.prompt_cache(1)._x\njc.__version__\n"
    )
    assert private_jcascade_names(source) == [
        "line 2: from jcascade.cli import _positive",
        "line 5: generation._prompt",
        "line 6: jc.eval.perplexity._step",
    ]


def test_benchmarks_use_public_names_of_jcascade_only():
    """The benchmarks are users of the library: they reach jcascade through its public names only (what they
    need is exposed where it belongs, e.g. `generation.prompt_cache`, `perplexity.step_compilations`,
    `cli.options.count`), so that they keep running, unchanged, while the library's insides change."""
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    found = [
        f"{path.relative_to(ROOT)}: {use}"
        for path in scripts
        for use in private_jcascade_names(path.read_text(encoding="utf-8"))
    ]
    assert len(scripts) > 10
    assert not found, "benchmarks using private names of jcascade:\n" + "\n".join(found)


RESULTS_MOST_BYTES = 5_000_000
PLAIN_JSON_MOST_BYTES = 16 * 1024


def test_benchmark_results_stay_lean():
    """benchmarks/results/ (its files in git, or to be added) holds at most 5 MB, and no plain JSON over 16 KiB.
    It holds what the results book (docs/results/) cites: most of it (about 2.6 MB) the evaluation wing's
    per-prompt records, which every accuracy table is recomputed from; a result that only superseded figures used
    is deleted (git keeps it), as are figures no page links (`jcascade.eval.plots` draws them from the JSON).
    The threshold: the JSON of timing runs, read by people, is at most 13 KB, while the per-prompt, per-trial and
    per-block records that tables are recomputed from run from 19 KB to 3 MB a file and shrink 5-50x under
    gzip; those are kept as NAME.json.gz, which eval_tables.load reads as it reads NAME.json."""
    results = ROOT / "benchmarks" / "results"
    files = [path for path in repository_files() if path.is_relative_to(results)]
    total = sum(path.stat().st_size for path in files)
    assert len(files) > 100
    assert total <= RESULTS_MOST_BYTES, f"benchmarks/results/ holds {total:,} bytes, more than {RESULTS_MOST_BYTES:,}"
    plain = [
        f"{path.relative_to(ROOT)} ({path.stat().st_size:,} bytes)"
        for path in files
        if path.suffix == ".json" and path.stat().st_size > PLAIN_JSON_MOST_BYTES
    ]
    assert not plain, f"JSON over {PLAIN_JSON_MOST_BYTES:,} bytes, to keep gzip-compressed as NAME.json.gz: {plain}"


def test_the_kernel_choice_is_carried_not_passed_along():
    """The kernels are a value chosen where a cache or model is made (`jc.Kernels` on `init_cache`, `CausalLM`) and
    carried as static data: at most 6 functions of the library take it (or its predecessor, `implementation`), none
    of them a policy hook or the model's layer loop."""
    takers = [
        f"{path.relative_to(ROOT)}:{f.name}"
        for folder in ("jcascade", "models", "pallas_kernels")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for f in ast.walk(ast.parse(path.read_text()))
        if isinstance(f, ast.FunctionDef)
        if {"implementation", "kernels"} & {a.arg for a in f.args.args + f.args.kwonlyargs}
    ]
    assert len(takers) <= 6, takers
    assert not [t for t in takers if "policies/" in t or t.endswith(("__call__", "_layers"))], takers


def test_only_the_translations_name_a_family():
    """Family differences are features of the config (`ModelConfig`), never names: outside the translations of a
    config.json (models/config.py) and of GGUF metadata (models/loading.py), no code compares `architecture` or spells
    a family's name (the decoder, its layer kinds, the weight declarations and the policies test features)."""
    from jcascade.models.config import ARCHITECTURES

    families = set(ARCHITECTURES.values())
    found = []
    for folder in ("jcascade", "models", "pallas_kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() in ("models/config.py", "models/loading.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                named = isinstance(node, ast.Constant) and node.value in families
                compared = isinstance(node, ast.Compare) and any(
                    isinstance(n, ast.Attribute) and n.attr == "architecture" for n in (node.left, *node.comparators)
                )
                if named or compared:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_the_tests_the_docs_cite_exist():
    """Each test a doc cites (docs/reliability.md names the tests behind each promise) is a test of its file under
    tests/: `path.py::test_name`, and the names cut short after it on its line, `..._end` (a test of that file
    ending so), `..._middle_...` (containing it) and `path.py::test_start_...` (starting so). Each test file a doc
    names (`tests/eval/test_cli.py`, `eval/test_cli.py`) exists."""
    root = pathlib.Path(__file__).parent
    tests = lambda path: re.findall(r"^def (test_\w+)\(", (root / path).read_text(), re.MULTILINE)
    matches = {
        "whole": lambda test, name: test == name,
        "end": lambda test, name: test.endswith(name),
        "middle": lambda test, name: name + "_" in test,
        "start": lambda test, name: test.startswith(name),
    }
    cited, missing = [], []
    for doc in (root.parent / "docs").glob("*.md"):
        text = doc.read_text()
        files = re.findall(r"\b(?:tests/)?((?:\w+/)*test_\w+\.py)\b", text)
        missing += [(doc.name, path) for path in files if not (root / path).is_file()]
        for line in text.splitlines():
            path = None
            for m in re.finditer(r"`(?:([\w/]+\.py)::(test_\w+?)|\.\.\.(_\w+?))(_\.\.\.)?`", line):
                path = m[1] or path
                name = m[2] or m[3]
                kind = ("middle" if m[4] else "end") if m[3] else ("start" if m[4] else "whole")
                cited.append((doc.name, path, m[0]))
                if path is None or not (root / path).is_file() or not any(matches[kind](t, name) for t in tests(path)):
                    missing.append(cited[-1])
    assert len(cited) > 50
    assert not missing, missing
