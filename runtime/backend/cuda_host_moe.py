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

A step of up to NODE_ROWS rows whose experts the fused kernels take (quant/moe_cpu.py:
K-quants and the 32-element formats, on CPUs with AVX512-VNNI) does not wait: the copy
down, the CPU's work and the copy up are queued on the stream, the CPU's work as a host
function (moe_host_fn.py: one native call a layer, no Python, no GIL), so decode steps
are captured as CUDA graphs like an all-GPU model's, and an eager step's Python runs
ahead of the CPU.  Other steps (a prompt chunk, experts of other types) copy down, wait,
run CPUBackend.moe_routed and copy up: the same arithmetic, eagerly.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from .cuda_memory import experts_on_host, layer_of

NODE_ROWS = 32          # most rows a step's host function takes (decode graphs: up to GRAPH_ROWS)
_CUDA_SUCCESS = 0
_CU_CTX_SCHED_BLOCKING_SYNC = 4


def sleep_while_waiting(device: int) -> bool:
    """Make threads that wait on the GPU sleep instead of spinning (the primary context's
    CU_CTX_SCHED_BLOCKING_SYNC).  With the experts on the CPU, the CPU's -t threads run
    beside a Python thread that waits for each step: spinning, it takes a core, and a
    parallel region waits for its slowest thread (H100 machine, 16 cores, M30 --cpu-moe
    -t 16: 1.8 tokens/s spinning, 44.0 sleeping).  Sleeping costs each host function a
    wake-up (-t 8: 47.6 spinning, 39.6 sleeping), so HostExperts asks for it only when
    its threads leave no core free.  False where the driver refused."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        dev, ctx, flags = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint()
        if lib.cuInit(0) != _CUDA_SUCCESS or lib.cuDeviceGet(ctypes.byref(dev), device) != _CUDA_SUCCESS:
            return False
        lib.cuDevicePrimaryCtxSetFlags_v2(dev, _CU_CTX_SCHED_BLOCKING_SYNC)
        # a context already current (CuPy made it): its own flags (CUDA 12.1's cuCtxSetFlags)
        if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == _CUDA_SUCCESS and ctx.value:
            if lib.cuCtxSetFlags(_CU_CTX_SCHED_BLOCKING_SYNC) != _CUDA_SUCCESS:
                return False
            return lib.cuCtxGetFlags(ctypes.byref(flags)) == _CUDA_SUCCESS and flags.value & 7 == 4
        return lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(ctypes.c_int())) == 0 \
            and flags.value & 7 == 4
    except (OSError, AttributeError):
        return False


class HostExperts:
    """The host half of the CUDA backend's moe op for the layers --cpu-moe names."""

    def __init__(self, gpu, cpu_moe: int, threads: int | None = None, cpu=None):
        from .cpu import CPUBackend
        self.gpu = gpu
        self.cpu_moe = int(cpu_moe)
        cores = len(os.sched_getaffinity(0))
        # by default every core but one: the one the Python thread waiting on the GPU spins on
        self.cpu = cpu if cpu is not None else CPUBackend(threads=threads or max(1, cores - 1))
        self.blocking_sync = self.cpu.threads >= cores and sleep_while_waiting(gpu.cp.cuda.Device().id)
        self.weight_bytes = 0           # bytes of the expert tensors kept here
        self.layers: set = set()        # layers whose experts are here
        self._staging: dict = {}        # name -> pinned host buffer, grown to the largest step
        self._node: dict = {}           # (d, E) -> pinned x, logits, y of NODE_ROWS rows (host functions)
        self._kinds: dict = {}          # layer's experts -> (them, fused kinds or None)
        self._descs: dict = {}          # (layer's experts, rows) -> host function descriptor and what it names
        self._launch_host = None        # the driver's cuLaunchHostFunc

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
        if n <= NODE_ROWS and self._node_kinds(experts) is not None:
            return self._moe_node(x, logits, experts, top_k, norm_topk, biases, glu)
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

    def _node_kinds(self, experts):
        """The fused kernels' kinds for these experts (moe_cpu.fused_kinds), or None: the
        step waits for the host instead.  Worked out once a layer."""
        hit = self._kinds.get(id(experts[0]))
        if hit is None:
            from quant import moe_cpu
            kinds = moe_cpu.fused_kinds(*(e.whole for e in experts)) if self.cpu.moe_fused else None
            hit = self._kinds[id(experts[0])] = (experts, kinds)       # (experts kept: the id stays theirs)
        return hit[1]

    def _moe_node(self, x, logits, experts, top_k, norm_topk, biases, glu):
        """x and the logits copied down, the CPU's moe as a host function, the sum copied
        up: all queued on the stream (capturable), nothing waited for."""
        g = self.gpu
        rt = g.cp.cuda.runtime
        n, d = x.shape
        E = logits.shape[1]
        bufs = self._node.get((d, E))
        if bufs is None:
            bufs = self._node[(d, E)] = tuple(g._pinned(s, np.float32) for s in
                                              ((NODE_ROWS, d), (NODE_ROWS, E), (NODE_ROWS, d)))
        hx, hl, hy = bufs
        key = (id(experts[0]), n)
        entry = self._descs.get(key)
        if entry is None:
            from .moe_host_fn import descriptor, host_fn
            dsc = descriptor(n, hx, hl, hy, experts, top_k, norm_topk, self._node_kinds(experts), glu,
                             self.cpu.threads, biases)
            entry = self._descs[key] = (dsc, experts, biases)      # (what the words point at, kept alive)
            if self._launch_host is None:
                fn = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
                fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p), ctypes.c_int
                self._launch_host = (fn, host_fn().address)
        sp = g.stream.ptr
        rt.memcpyAsync(hx.ctypes.data, x.data.ptr, n * d * 4, rt.memcpyDeviceToHost, sp)
        rt.memcpyAsync(hl.ctypes.data, logits.data.ptr, n * E * 4, rt.memcpyDeviceToHost, sp)
        launch, addr = self._launch_host
        err = launch(sp, addr, entry[0].ctypes.data)
        if err != _CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchHostFunc failed (CUresult {err})")
        out = g._buf((n, d))
        rt.memcpyAsync(out.data.ptr, hy.ctypes.data, n * d * 4, rt.memcpyHostToDevice, sp)
        g._pdl.fence()
        g._moe_calls[1] += 1            # nothing waited for: the step may be captured
        return out
