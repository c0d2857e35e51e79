"""The package's import guard (jcascade/__init__.py)."""

import pathlib
import subprocess
import sys
import sysconfig


def test_an_uninstalled_source_tree_says_how_to_install():
    """From the repository root without the package installed, `import jcascade` finds the bare folder,
    whose models/ and pallas_kernels/ are not yet mapped into it: the import says so instead of failing on
    a circular import."""
    root = pathlib.Path(__file__).resolve().parents[1]
    code = f"import sys; sys.path[:0] = [{str(root)!r}, {sysconfig.get_paths()['purelib']!r}]; import jcascade"
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=root)
    assert done.returncode == 1
    assert "jcascade is not installed" in done.stderr and "pip install -e ." in done.stderr
