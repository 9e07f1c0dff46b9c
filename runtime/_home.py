"""Our top-level packages, found where they were installed, whatever the working folder holds.

Llamba's packages have short names (`runtime`, `models`, `quant`, `app`) that a user's folder
may hold too: many keep their GGUF files in `./models`.  `python -m runtime` puts the working
folder first on sys.path, and Python takes a plain folder there for a namespace package before
it asks the finder of an editable install, so `import models` found the user's files
(ImportError: cannot import name 'config_from_gguf' from 'models').  The finder below sits first
on sys.meta_path and resolves exactly these four names to the folders beside this package, so
the working folder, or another distribution's `models` later on the path, cannot shadow them.
(A working folder that holds a `runtime/` of its own still shadows `python -m runtime` itself,
before any of our code runs: `llamba-cli` is immune to that.)
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

HOME = Path(__file__).resolve().parent.parent
PACKAGES = ("quant", "models", "runtime", "app")


class OwnPackages(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in PACKAGES:
            return None
        init = HOME / name / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(HOME / name)])


def claim() -> None:
    """Install the finder (once), and drop any of our names already bound elsewhere."""
    if not any(isinstance(f, OwnPackages) for f in sys.meta_path):
        sys.meta_path.insert(0, OwnPackages())
    for name in PACKAGES:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None) is None:   # a namespace package: not ours
            del sys.modules[name]
