"""Backends run the model's ops: `cpu` (Numba) and `cuda` (CuPy).

A model file calls only the ops of `Backend` (see cpu.py for the reference
implementation); it never learns which backend runs it.
"""
from __future__ import annotations


class DeviceUnavailable(RuntimeError):
    """The asked-for device cannot be used; the message says why in one line."""


def make_backend(device: str = "cpu", *, threads: int | None = None, announce=None, gpu_layers: int | None = None):
    """`cpu`, `cuda` or `auto` (the GPU when CuPy finds one, else the CPU, said aloud).
    gpu_layers: with cuda/auto, only the first N layers on the GPU, the rest on the CPU."""
    if device == "cpu":
        if gpu_layers:
            raise ValueError("--gpu-layers needs --device cuda or auto")
        from .cpu import CPUBackend
        return CPUBackend(threads=threads)
    if device in ("cuda", "gpu", "auto"):
        try:
            from .cuda import CUDABackend, probe
            gpu = probe()
            if device == "auto" and announce:
                announce(f"device auto: using the GPU ({gpu['name']})")
            if gpu_layers is not None:
                from .cuda_split import SplitBackend
                return SplitBackend(gpu_layers, threads=threads)
            return CUDABackend()
        except (ImportError, DeviceUnavailable) as e:
            if device != "auto":
                raise DeviceUnavailable(str(e)) from None
            if announce:
                announce(f"device auto: using the CPU ({e})")
            from .cpu import CPUBackend
            cpu = CPUBackend(threads=threads)
            cpu.device_name += f" — no GPU: {e}"    # shown wherever the device is (info, bench, app panel)
            return cpu
    raise ValueError(f"unknown device '{device}' (use cpu, cuda or auto)")
