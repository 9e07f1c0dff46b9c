"""Backends run the model's ops: `cpu` (Numba) and `cuda` (CuPy).

A model file calls only the ops of `Backend` (see cpu.py for the reference
implementation); it never learns which backend runs it.
"""
from __future__ import annotations


class DeviceUnavailable(RuntimeError):
    """The asked-for device cannot be used; the message says why in one line."""


def check_cpu_moe(device: str, cpu_moe: int | None) -> None:
    """--cpu-moe (-1) / --n-cpu-moe N make sense only beside a GPU: refuse them on --device cpu."""
    if cpu_moe is not None and cpu_moe < -1:
        raise ValueError(f"--n-cpu-moe must be 0 or more (got {cpu_moe})")
    if cpu_moe and device == "cpu":
        raise ValueError("--cpu-moe / --n-cpu-moe keep a mixture of experts' experts on the CPU beside a GPU: "
                         "they need --device cuda or auto (with --device cpu everything runs on the CPU)")


def make_backend(device: str = "cpu", *, threads: int | None = None, announce=None, gpu_layers: int | None = None,
                 cpu_moe: int | None = 0):
    """`cpu`, `cuda` or `auto` (the GPU when CuPy finds one, else the CPU, said aloud).
    gpu_layers: with cuda/auto, only the first N layers on the GPU, the rest on the CPU.
    cpu_moe (--cpu-moe: -1, --n-cpu-moe N: N): with cuda/auto, the expert tensors of
    every layer or of the first N stay in system memory and run on the CPU
    (cuda_host_moe.py)."""
    check_cpu_moe(device, cpu_moe)
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
                return SplitBackend(gpu_layers, threads=threads, cpu_moe=cpu_moe)
            return CUDABackend(cpu_moe=cpu_moe, threads=threads)
        except (ImportError, DeviceUnavailable) as e:
            if device != "auto":
                raise DeviceUnavailable(str(e)) from None
            if announce:
                announce(f"device auto: using the CPU ({e})" + ("; --cpu-moe has nothing to do there" if cpu_moe else ""))
            from .cpu import CPUBackend
            cpu = CPUBackend(threads=threads)
            cpu.device_name += f" — no GPU: {e}"    # shown wherever the device is (info, bench, app panel)
            return cpu
    raise ValueError(f"unknown device '{device}' (use cpu, cuda or auto)")
