"""Set the thread count of numpy's BLAS (the sgemm of the large-batch matmul).

numpy's OpenBLAS starts one thread per core whatever the caller asked for, so
`-t 1` still ran prompt processing on every core; and on a busy machine its
threads spin against Numba's.  Measured (512x576 @ 576x256 sgemm, machine
loaded ~20 on 2 cores): 1 thread 94 GFLOP/s of CPU time, 2 threads 27.
threadpoolctl does this in general; here a ctypes call to the OpenBLAS
builds numpy ships (plain, 64-bit-int and scipy-openblas symbol names) is
enough.  Anything else (MKL, Accelerate): left alone.
"""
from __future__ import annotations

import ctypes
import functools
import os

_SYMBOLS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_", "openblas_set_num_threads")


def _libraries() -> list:
    """The OpenBLAS libraries numpy loaded: from /proc/self/maps (Linux), else
    the ones its wheel ships in numpy.libs (Windows, macOS)."""
    import numpy
    paths = set()
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        import glob
        here = os.path.dirname(numpy.__file__)
        for d in (os.path.join(here, os.pardir, "numpy.libs"), os.path.join(here, ".libs")):
            paths.update(glob.glob(os.path.join(d, "*openblas*")))
    libs = []
    for p in sorted(paths):
        try:
            libs.append(ctypes.CDLL(p))
        except OSError:
            continue
    return libs


def _setters(getters: bool = False):
    found = []
    for lib in _libraries():
        for s in _SYMBOLS:
            if getters:
                s = s.replace("_set_", "_get_")
            fn = getattr(lib, s, None)
            if fn is not None:
                fn.argtypes = [] if getters else [ctypes.c_int]
                fn.restype = ctypes.c_int if getters else None
                found.append(fn)
                break
    return found


def set_blas_threads(n: int) -> bool:
    """Use n threads in numpy's OpenBLAS; False where none was found (other
    BLAS, or no /proc)."""
    fns = _setters()
    for fn in fns:
        fn(int(n))
    return bool(fns)


def get_blas_threads() -> int | None:
    """numpy's OpenBLAS thread count, None where it was not found."""
    fns = _setters(getters=True)
    return fns[0]() if fns else None


# cblas_sgemm symbols of the OpenBLAS builds numpy ships: (name, 64-bit ints)
_SGEMM = (("scipy_cblas_sgemm64_", True), ("cblas_sgemm64_", True), ("scipy_cblas_sgemm", False),
          ("cblas_sgemm", False))


@functools.cache
def sgemm_address() -> tuple[int, bool] | None:
    """(address of numpy's OpenBLAS cblas_sgemm, whether it takes 64-bit ints),
    or None where no OpenBLAS was found (then callers use np.matmul)."""
    for lib in _libraries():
        for name, wide in _SGEMM:
            fn = getattr(lib, name, None)
            if fn is not None:
                return ctypes.cast(fn, ctypes.c_void_p).value, wide
    return None
