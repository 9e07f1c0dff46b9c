"""Where Numba keeps the compiled CPU kernels: one folder per version of the kernel sources.

Numba invalidates a cached kernel only when the file that defines it changes.  A kernel that
inlines jitted helpers from another module (`quant/simd.py`, `quant/ir.py`, `quant/vnni_kq.py`, ...)
keeps the machine code of the old helpers after they change: after an edit to an MXFP4 helper,
prompts of 32 rows or more came out NaN until the cache was deleted by hand.  So unless the user
names NUMBA_CACHE_DIR, the cache lives in the user's cache folder under a hash of every kernel
source: any edit, or another Llamba version, starts a fresh folder; a folder unused for a week goes.
This must run before the first `@njit(cache=True)` is decorated (the cache locator is chosen
then): `quant` and `runtime` call `configure()` first thing.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

HOME = Path(__file__).resolve().parent.parent
# every file that defines or inlines a cached kernel
SOURCES = ("quant/*.py", "runtime/backend/*.py", "runtime/bench/kernels.py", "runtime/constrain.py")
STALE_DAYS = 7                             # a kernel folder unused this long is deleted
_chosen: str | None = None


def sources_hash() -> str:
    h = hashlib.sha1()
    for pattern in SOURCES:
        for f in sorted(HOME.glob(pattern)):
            h.update(f.relative_to(HOME).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_dir() -> str:
    """The folder Numba caches into: NUMBA_CACHE_DIR when set (the frozen app and the GPU
    machine's scripts set it), else the user cache's folder for these sources."""
    return os.environ.get("NUMBA_CACHE_DIR") or str(_default())


def _default() -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("llamba")) / "kernels" / sources_hash()


def configure() -> str:
    """Point Numba at cache_dir() (once per process) and prune stale kernel folders."""
    global _chosen
    if _chosen is not None:
        return _chosen
    if os.environ.get("NUMBA_CACHE_DIR"):
        _chosen = os.environ["NUMBA_CACHE_DIR"]
        return _chosen
    try:
        d = _default()
        d.mkdir(parents=True, exist_ok=True)
        os.utime(d)                                      # "used now", for the pruning below
        _prune(d.parent)
    except OSError:                                      # no writable cache folder: beside the sources
        return str(HOME)
    _chosen = str(d)
    os.environ["NUMBA_CACHE_DIR"] = _chosen              # read by numba at import, and by subprocesses
    if "numba" in sys.modules:                           # imported before us: its config is already read
        from numba.core import config
        config.CACHE_DIR = _chosen
    return _chosen


def _prune(root: Path) -> None:
    """By age, not count: several checkouts (or versions) used side by side keep their own."""
    import time
    for p in root.iterdir():
        if p.is_dir() and time.time() - p.stat().st_mtime > STALE_DAYS * 86400:
            shutil.rmtree(p, ignore_errors=True)
