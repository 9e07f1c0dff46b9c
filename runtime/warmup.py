"""First-run kernel compilation, said aloud.

Numba compiles each kernel for *this* CPU on first use and caches it on disk
(NUMBA_CACHE_DIR, or a folder per version of the kernel sources: quant/kernel_cache.py);
nothing compiled on another machine is ever loaded, so no "illegal instruction" on an older CPU.  The first start
therefore spends tens of seconds compiling: we tell the user, and warm the
kernels with a few throwaway forwards before the real prompt.  A marker per (Llamba
version, Numba version, CPU model, kernel cache location, install path, backend and the weight
types of the model) remembers that it was done: each weight type has kernels of its
own, so a second model of other types (a speculative draft in Q5_0 after a Q4_K_M
target) warms up on its first run too.
"""
from __future__ import annotations

import time
from pathlib import Path

import platformdirs

from . import __version__


def _cache_dir() -> str:
    from quant.kernel_cache import cache_dir
    return cache_dir()


def _marker(engine) -> Path:
    import llvmlite.binding as llvm
    import numba
    import hashlib
    cpu = llvm.get_host_cpu_name().replace("/", "_")
    # a second install (or another cache dir) on the same machine starts cold and needs
    # its own marker: Numba files a kernel under its source file's path and stamp, so a
    # second checkout of the same sources shares the cache folder but none of its kernels
    from quant.kernel_cache import HOME
    tag = hashlib.sha1(f"{_cache_dir()}\0{HOME}".encode()).hexdigest()[:10]
    types = sorted({str(getattr(t, "qtype", "")) for t in engine.loaded.tensors.values()})
    kinds = hashlib.sha1(",".join(types).encode()).hexdigest()[:8]
    backend = engine.backend.name
    if getattr(engine.backend, "host_experts", None) is not None:    # --cpu-moe: the CPU's expert kernels too
        backend += "-cpumoe"
    name = f"kernels-ok-{__version__}-{numba.__version__}-{cpu}-{tag}-{backend}-{kinds}"
    return Path(platformdirs.user_cache_dir("llamba")) / name


def first_run(engine) -> bool:
    """No marker, or a marker whose kernel cache was deleted since (a cleared
    cache dir recompiles everything: the marker alone would let that happen
    inside the first answer)."""
    if not _marker(engine).exists():
        return True
    root = Path(_cache_dir())
    return not (root.is_dir() and next(root.rglob("*.nbi"), None) is not None)


# Row counts that reach every kernel path: a prompt (many rows: dequantize-tile +
# sgemm), a few rows (a follow-up chat turn, speculative verification, batched
# decode: the VNNI row-group kernels) and one row (decode).  Each path is its own
# set of Numba kernels; one left cold compiles, GIL held, inside the first answer
# that needs it, freezing a window's event loop for up to a second at a time.
WARMUP_ROWS = (48, 5, 1)


def warm_up(engine, notice=None, force: bool = False) -> float:
    """On a machine that has not compiled the kernels yet (or when forced), run a
    throwaway forward at each row count in WARMUP_ROWS so compilation happens now,
    with a notice.  Returns the seconds it took (0.0 when skipped)."""
    if not (force or first_run(engine)):
        return 0.0
    if notice:
        notice("Compiling kernels for this CPU (first run only: one to several minutes)…")
    t = time.perf_counter()
    vocab = engine.config.vocab_size
    room = engine.n_ctx
    seq = engine.new_sequence()
    try:
        for n in WARMUP_ROWS:
            n = min(n, room - len(seq))
            if n <= 0:
                break
            # any valid ids do: only the shapes matter
            engine.step([seq], [[(7919 * (len(seq) + i) + 11) % vocab for i in range(n)]])
    finally:
        # throwaway tokens: their blocks must not linger as a reusable cached prefix
        engine.release(seq, keep_cached=False)
    m = _marker(engine)
    m.parent.mkdir(parents=True, exist_ok=True)
    m.touch()
    return time.perf_counter() - t
