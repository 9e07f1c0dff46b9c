"""`--cpu-moe` / `--n-cpu-moe N` (llama.cpp's names and meaning): the expert tensors of
every layer, or of the first N, stay in system memory and run on the CPU; everything
else (attention, the router, norms, the KV cache, the output) runs on the GPU.  This is
how a 30B mixture of experts (Qwen3-30B-A3B) fits an 8-16 GB card: its experts are
nearly all of its bytes, and a token reads only k of them.

The placement rule is cuda_memory.experts_on_host (the memory estimate uses it too);
the CUDA backend hands such tensors to `HostExperts.upload` (the CPU backend's upload:
the blocks as stored, memory-mapped or copied to huge pages, never to the GPU, never
expanded to float) and a `moe` op whose experts came from here to `HostExperts.moe`:

  GPU: the router's logits [n, E] from the step's normed rows x [n, d]
  ->   x and the logits to pinned host memory (n * (d + E) floats), one stream sync
  CPU: routing and the chosen experts' weighted sum (CPUBackend.moe_routed: the CPU
       backend's own kernels, quant/moe_cpu.py for K-quant experts, on its -t threads)
  ->   the sum [n, d] back to the device; the model adds it to the residual there.

Every step that passes such a layer waits on the host mid-step, so the backend captures
no CUDA graph once any expert is on the host (a step of a MoE model runs eagerly).
"""
from __future__ import annotations

import numpy as np

from .cuda_memory import experts_on_host, layer_of


class HostExperts:
    """The host half of the CUDA backend's moe op for the layers --cpu-moe names."""

    def __init__(self, gpu, cpu_moe: int, threads: int | None = None, cpu=None):
        from .cpu import CPUBackend
        self.gpu = gpu
        self.cpu_moe = int(cpu_moe)
        self.cpu = cpu if cpu is not None else CPUBackend(threads=threads)
        self.weight_bytes = 0           # bytes of the expert tensors kept here
        self.layers: set = set()        # layers whose experts are here
        self._staging: dict = {}        # name -> pinned host buffer, grown to the largest step

    def describe(self, cfg) -> str:
        """Which layers' experts are here, for the device line (info, bench, the app's panel)."""
        n = cfg.n_layers if self.cpu_moe < 0 else min(self.cpu_moe, cfg.n_layers)
        which = "every layer" if n == cfg.n_layers else f"layers 0-{n - 1}" if n > 1 else "layer 0"
        return f"the experts of {which} on the CPU ({self.cpu.threads} threads)"

    def holds(self, name: str) -> bool:
        return experts_on_host(name, self.cpu_moe)

    def upload(self, t):
        """An expert tensor kept in system memory, as the CPU backend keeps it."""
        self.weight_bytes += int(t.nbytes)
        self.layers.add(layer_of(t.name))
        return self.cpu.upload(t)

    def owns(self, experts) -> bool:
        """Whether a moe op's experts are this side's (the CPU backend's expert lists)."""
        from .cpu import _Experts
        return isinstance(experts[0], _Experts)

    def _pinned(self, name: str, shape) -> np.ndarray:
        n = int(np.prod(shape))
        buf = self._staging.get(name)
        if buf is None or buf.size < n:
            buf = self._staging[name] = self.gpu._pinned((max(n, 2 * (0 if buf is None else buf.size)),), np.float32)
        return buf[:n].reshape(shape)

    def moe(self, x, router, experts, top_k, norm_topk, router_bias=None, biases=None, glu="silu"):
        """The moe op (CUDABackend.moe's arguments) for experts in system memory: the
        result is a device array [n, d], as the all-GPU op's.  (gpt-oss: the router's bias
        is on the GPU with the router; the experts' biases, `_exps.bias`, here with them.)"""
        g = self.gpu
        cp = g.cp
        rt = cp.cuda.runtime
        g._flush()
        g._check(x)
        x = x.reshape(x.shape[0], -1)
        if not x.flags.c_contiguous:
            x = cp.ascontiguousarray(x)
        n, d = x.shape
        E = len(experts[0])
        logits = g._buf((n, E))
        g.qc.matmul(x, [router], [logits], [router_bias] if router_bias is not None else None, ws=g.ws)
        hx, hl = self._pinned("x", (n, d)), self._pinned("logits", (n, E))
        sp = g.stream.ptr
        rt.memcpyAsync(hx.ctypes.data, x.data.ptr, hx.nbytes, rt.memcpyDeviceToHost, sp)
        rt.memcpyAsync(hl.ctypes.data, logits.data.ptr, hl.nbytes, rt.memcpyDeviceToHost, sp)
        # (the wait also covers the previous host layer's copy up from `hy`, which is reused below)
        g.stream.synchronize()
        self.cpu.arena.reset()          # its buffers live for this op only
        hy = self._pinned("y", (n, d))
        hy[...] = self.cpu.moe_routed(hx, hl, experts, top_k, norm_topk, biases, glu)
        out = g._buf((n, d))
        rt.memcpyAsync(out.data.ptr, hy.ctypes.data, hy.nbytes, rt.memcpyHostToDevice, sp)
        g._pdl.fence()
        return out
