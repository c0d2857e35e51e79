"""Loaded by every Python process a test run starts (the conftest puts this folder on PYTHONPATH): once the process
imports jax, its compilations are counted (compile_count.py)."""

import importlib.abc
import importlib.util
import sys


class _AfterMonitoring(importlib.abc.MetaPathFinder):
    """Installs the counter right after jax's monitoring module is first imported."""

    def find_spec(self, name, path, target=None):
        if name != "jax._src.monitoring":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import compile_count

            compile_count.install()

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterMonitoring())
