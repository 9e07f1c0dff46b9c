"""Programmatic dependent launch (PDL, sm_90 and newer) for captured decode steps.

A CUDA graph still runs its kernels one after another: each waits for the one before
to finish and flush, then its blocks are scheduled, then its first weight loads go out,
so DRAM idles a few microseconds at every kernel boundary (~350 of them in an 8B decode
step).  Launched with the programmatic-stream-serialization attribute, a kernel's blocks
may start as soon as every block of the kernel before it has triggered (pdl.cuh): the
matvecs issue their first weight loads, which no kernel writes, and then wait
(`griddepcontrol.wait`) for the previous kernel's results.

CuPy cannot set launch attributes, so `Kernel` launches through the driver's
cuLaunchKernelEx by ctypes inside `capturing(True)` (a decode step being captured: the
ctypes cost is paid once, at capture) and through CuPy otherwise.  Every kernel the backends
launch through it waits (pdl.cuh) before it reads anything an earlier kernel of the step
writes, so a kernel launched either way computes the same thing.

MODE (LLAMBA_CUDA_PDL): 0 off, 1 (the default) a kernel triggers after its wait (one
kernel ahead resident), 2 at its first instruction (two ahead).  H200, graph replay of a
decode step (quant/cuda/NOTES.md): L8 Q4_K_M 2.447 -> 2.258 ms (mode 2: 2.283), Q15
Q4_K_M 1.271 -> 1.077 ms; results bit-identical (tests/gpu/test_pdl.py).  Only devices of compute capability
9.0 and newer (with a 12.3+ driver) take it; `available()` says whether a backend uses it.
"""
from __future__ import annotations

import contextlib
import ctypes
import os

from pathlib import Path

import numpy as np

MODE = int(os.environ.get("LLAMBA_CUDA_PDL", "1"))
HEADER = Path(__file__).with_name("pdl.cuh")
MIN_CC = 90
MIN_DRIVER = 12030      # CUDA 12.3: programmatic launches inside a stream capture
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6     # CUlaunchAttributeID

_on = False
_fence = False          # the next launch goes out plain: the op before it was no kernel of ours
_lib = None


def options() -> tuple:
    """NVRTC options the kernels' trigger placement needs (pdl.cuh)."""
    return ("-DLLAMBA_PDL_EARLY=1",) if MODE == 2 else ()


class _Value(ctypes.Union):                     # CUlaunchAttributeValue (64 bytes)
    _fields_ = [("flag", ctypes.c_int), ("pad", ctypes.c_ubyte * 64)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_ubyte * 4), ("value", _Value)]


class _Config(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


def _driver():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1") if os.name != "nt" else ctypes.WinDLL("nvcuda.dll")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        _lib = lib
    return _lib


def available(cc: int, driver: int) -> bool:
    """Whether captured steps use PDL: on (MODE), the device sm_90+, the driver 12.3+."""
    return MODE > 0 and cc >= MIN_CC and driver >= MIN_DRIVER


@contextlib.contextmanager
def capturing(enabled: bool):
    """Kernels launched inside go out with the PDL attribute (if enabled), except the
    first one and the first after each fence()."""
    global _on, _fence
    prev, _on, _fence = _on, bool(enabled), True
    try:
        yield
    finally:
        _on = prev


def fence() -> None:
    """Call after enqueueing anything but a Kernel (a copy, a CuPy routine): the next
    kernel goes out plain.  Its wait only covers kernels (griddepcontrol.wait waits for
    prerequisite grids), so a PDL kernel right after a copy could read before the copy
    lands; a plain launch waits for everything before it, as usual."""
    global _fence
    _fence = True


def _param(a):
    """A kernel argument as a one-element host array holding its bytes (CuPy's conventions)."""
    import cupy as cp
    if isinstance(a, cp.ndarray):
        return np.array([a.data.ptr], np.uint64)
    if isinstance(a, np.generic):
        return np.array([a], a.dtype)
    if isinstance(a, bool):
        return np.array([a], np.bool_)
    if isinstance(a, int):
        return np.array([a], np.int64)
    if isinstance(a, float):
        return np.array([a], np.float64)
    if a is None:
        return np.array([0], np.uint64)
    raise TypeError(f"no PDL launch for an argument of type {type(a).__name__}")


def launch(fn, grid, block, args, shared_mem: int = 0) -> None:
    """fn (a cupy RawKernel) launched on the current stream with the PDL attribute."""
    import cupy as cp
    grid = tuple(grid) + (1,) * (3 - len(grid))
    block = tuple(block) + (1,) * (3 - len(block))
    keep = [_param(a) for a in args]
    params = (ctypes.c_void_p * max(1, len(keep)))(*[k.ctypes.data for k in keep])
    attr = _Attr()
    attr.id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.flag = 1          # programmaticStreamSerializationAllowed
    cfg = _Config(*grid, *block, int(shared_mem), ctypes.c_void_p(cp.cuda.get_current_stream().ptr),
                  ctypes.pointer(attr), 1)
    f = getattr(fn, "kernel", fn)
    rc = _driver().cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(f.ptr), params, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed (CUresult {rc})")


class Kernel:
    """A compiled kernel called as CuPy's are: f(grid, block, args, shared_mem=0)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, grid, block, args, shared_mem: int = 0):
        global _fence
        if _on and not _fence:
            launch(self.fn, grid, block, args, shared_mem)
        else:
            self.fn(grid, block, args, shared_mem=shared_mem)
            _fence = False

    def __getattr__(self, name):            # attributes (max_dynamic_shared_size_bytes, ...)
        return getattr(self.fn, name)
