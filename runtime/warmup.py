"""First-run kernel compilation, said aloud.

Numba compiles each kernel for *this* CPU on first use and caches it on disk
(NUMBA_CACHE_DIR, or beside the sources); nothing compiled on another machine is
ever loaded, so no "illegal instruction" on an older CPU.  The first start
therefore spends tens of seconds compiling: we tell the user, and warm the
kernels with one tiny forward before the real prompt.  A marker per (Llamba
version, Numba version, CPU model) remembers that this machine has done it.
"""
from __future__ import annotations

import time
from pathlib import Path

import platformdirs

from . import __version__


def _marker() -> Path:
    import llvmlite.binding as llvm
    import numba
    cpu = llvm.get_host_cpu_name().replace("/", "_")
    return Path(platformdirs.user_cache_dir("llamba")) / f"kernels-ok-{__version__}-{numba.__version__}-{cpu}"


def first_run() -> bool:
    return not _marker().exists()


def warm_up(engine, notice=None, force: bool = False) -> float:
    """On a machine that has not compiled the kernels yet (or when forced), run one
    tiny prefill and decode step so compilation happens now, with a notice."""
    if not (force or first_run()):
        return 0.0
    if notice:
        notice("Compiling kernels for this CPU (first run only, about a minute)…")
    t = time.perf_counter()
    seq = engine.new_sequence()
    try:
        ids = engine.tokenizer.encode("Hello, world")
        logits = engine.prefill(seq, ids)
        engine.step([seq], [[int(logits.argmax())]])
    finally:
        engine.release(seq)
    m = _marker()
    m.parent.mkdir(parents=True, exist_ok=True)
    m.touch()
    return time.perf_counter() - t
