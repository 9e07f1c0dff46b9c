"""Partial offload (`--gpu-layers N`, like llama.cpp's -ngl): the first N layers on
the GPU, the rest on the CPU.

Each weight goes where its layer runs (the token embedding stays on the host, as in
llama.cpp; the output norm and head go to the GPU only when every layer does), except
the experts --cpu-moe / --n-cpu-moe N keep on the host (cuda_memory.on_gpu: the one
rule); a GPU layer's moe op then runs its router on the GPU and its experts on the CPU
(cuda_host_moe.py).
Each op runs where its weight (or its layer's KV cache) lives; an activation that
arrives from the other device is copied over first.  The residual stream lives on
the GPU when any layer does, so GPU layers copy nothing and each CPU layer copies
a few rows each way.  No CUDA graphs here: a split step runs eagerly.
"""
from __future__ import annotations

import numpy as np

from quant import QTensor

from .cuda_memory import estimate_bytes, format_bytes, on_gpu


class _DualStep:
    """The step as the CPU sees it (host arrays) with its device copy in .dev."""

    def __init__(self, step, dev):
        self.__dict__.update(step.__dict__)
        self._host = step
        self.dev = dev

    def window(self, layer):
        return self._host.window(layer)

    def slots_for(self, layer):
        return self._host.slots_for(layer)

    def tables_for(self, layer):
        return self._host.tables_for(layer)


class SplitKVStorage:
    """GPU pools for layers < N, CPU pools for the rest (the CPU storage is allocated for
    every layer, but untouched pages cost nothing)."""

    def __init__(self, gpu_kv, cpu_kv, n_gpu):
        self.gpu, self.cpu, self.n_gpu = gpu_kv, cpu_kv, n_gpu
        self.cache_type = cpu_kv.cache_type
        self.bytes_per_token = cpu_kv.bytes_per_token
        self.nbytes = (gpu_kv.nbytes if gpu_kv else 0)

    def copy_block(self, src, dst, block_size, layers=None):
        layers = list(range(len(self.cpu.k)) if layers is None else layers)
        g = [i for i in layers if i < self.n_gpu]
        c = [i for i in layers if i >= self.n_gpu]
        if g and self.gpu:
            self.gpu.copy_block(src, dst, block_size, g)
        if c:
            self.cpu.copy_block(src, dst, block_size, c)

    def shift(self, layer, *args, **kw):
        (self.gpu if layer < self.n_gpu else self.cpu).shift(layer, *args, **kw)


class SplitBackend:
    name = "cuda+cpu"

    def __init__(self, gpu_layers: int, threads=None, cpu_moe: int | None = 0):
        from .cpu import CPUBackend
        from .cuda import CUDABackend
        self.cpu = CPUBackend(threads=threads)
        self.gpu = CUDABackend(graphs=False, cpu_moe=cpu_moe, host=self.cpu)
        self.cpu_moe = cpu_moe
        self.cp = self.gpu.cp
        self.exact_rows = min(self.gpu.exact_rows, self.cpu.exact_rows)
        self.n_gpu = max(0, int(gpu_layers))
        self.n_layers = None
        self.threads = self.cpu.threads
        self.kv = None
        self.device_name = f"{self.gpu.device_name} for {self.n_gpu} layers + {self.cpu.device_name}"

    # ---- placement -------------------------------------------------------------
    def check_fits(self, lm, n_ctx, block_size=16, cache_blocks=0, cache_type="f16"):
        cfg = lm.config
        self.n_layers = cfg.n_layers
        self.n_gpu = min(self.n_gpu, cfg.n_layers)
        self.device_name = (f"{self.gpu.device_info['name']} for layers 0-{self.n_gpu - 1} of {cfg.n_layers}, "
                            f"{self.cpu.device_name} for the rest" if self.n_gpu else self.cpu.device_name)
        est = estimate_bytes(cfg, lm.tensors, n_ctx, block_size, cache_blocks, gpu_layers=self.n_gpu,
                             cache_type=cache_type, cpu_moe=self.cpu_moe)
        if self.cpu_moe and cfg.n_experts and self.n_gpu:
            self.device_name += "; " + self.gpu.host_experts.describe(cfg)
        free = self.cp.cuda.runtime.memGetInfo()[0]
        self.estimate = est
        if est["total"] > free:
            from . import DeviceUnavailable
            raise DeviceUnavailable(
                f"{self.n_gpu} GPU layers need about {format_bytes(est['total'])} of GPU memory but "
                f"{format_bytes(free)} is free: use fewer --gpu-layers or a smaller context (-c)")
        return est

    def upload(self, t: QTensor, streamed: bool = True):
        n_layers = self.n_layers if self.n_layers is not None else self.n_gpu + 1   # (before check_fits)
        if on_gpu(t.name, n_layers, self.n_gpu):    # (the GPU backend keeps --cpu-moe's experts on the host)
            return self.gpu.upload(t, streamed)
        return self.cpu.upload(t, streamed)

    def alloc_kv(self, n_layers, n_slots, n_kv_heads, head_dim, cache_type="f16"):
        g = self.gpu.alloc_kv(self.n_gpu, n_slots, n_kv_heads, head_dim, cache_type) if self.n_gpu else None
        c = self.cpu.alloc_kv(n_layers, n_slots, n_kv_heads, head_dim, cache_type)
        self.kv = SplitKVStorage(g, c, self.n_gpu)
        return self.kv

    def memory_report(self) -> dict:
        return self.gpu.memory_report()

    # ---- moving activations ----------------------------------------------------
    def _dev(self, a) -> bool:
        return isinstance(a, self.cp.ndarray)

    def _w_dev(self, w) -> bool:
        return not isinstance(w, (QTensor, np.ndarray))

    def _to(self, a, gpu: bool):
        if a is None:
            return None
        if gpu and not self._dev(a):
            return self.cp.asarray(a)
        if not gpu and self._dev(a):
            self.gpu._flush()
            self.gpu._check(a)
            return a.get()
        return a

    def _be(self, gpu):
        return self.gpu if gpu else self.cpu

    # ---- one step ----------------------------------------------------------------
    def forward(self, model, step) -> np.ndarray:
        from .cuda import _DevStep, _pack_step, _views
        cp = self.cp
        with self.gpu.stream:
            flat, layout = _pack_step(step)
            dev = _DevStep(step, _views(cp.asarray(flat), layout), 1)
            self.gpu._begin_forward()
            self.cpu.arena.reset()
            out = model.forward(self, _DualStep(step, dev))
            self.gpu._flush()
            return self._to(out, False)

    # ---- ops: each runs where its weight lives -----------------------------------
    def end_layer(self):
        self.cpu.end_layer()
        self.gpu.end_layer()

    def embed(self, W, ids, scale: float = 1.0):
        if self._w_dev(W):
            return self.gpu.embed(W, self.cp.asarray(np.asarray(ids, np.int32)), scale)
        x = self.cpu.embed(W, ids, scale)
        return self._to(np.ascontiguousarray(x), self.n_gpu > 0)

    def rmsnorm(self, x, w, eps):
        g = self._w_dev(w)
        return self._be(g).rmsnorm(self._to(x, g), w, eps)

    def heads(self, x, n_heads):
        return x.reshape(x.shape[0], n_heads, -1)

    def matmul(self, x, W, bias=None):
        g = self._w_dev(W)
        return self._be(g).matmul(self._to(x, g), W, bias)

    def matmuls(self, x, Ws, biases=None):
        g = self._w_dev(Ws[0])
        return self._be(g).matmuls(self._to(x, g), Ws, biases)

    def matmul_add(self, x, W, acc):
        g = self._w_dev(W)
        if g == self._dev(acc):
            self._be(g).matmul_add(self._to(x, g), W, acc)
        else:
            y = self._be(g).matmul(self._to(x, g), W)
            self.add(acc, y)

    def add(self, x, y):
        self._be(self._dev(x)).add(x, self._to(y, self._dev(x)))

    def glu(self, g, u, kind):
        return self._be(self._dev(g)).glu(g, self._to(u, self._dev(g)), kind)

    def moe(self, x, router, experts, top_k, norm_topk, **options):
        # where the router is: a GPU layer's experts may be on the host (--cpu-moe), which the
        # GPU backend's op handles
        g = self._w_dev(router)
        return self._be(g).moe(self._to(x, g), router, experts, top_k, norm_topk, **options)

    def rope(self, x, step, inv_freq, neox, pos_scale=1.0, mscale=1.0):
        if self._dev(x):
            self.gpu.rope(x, step.dev, inv_freq, neox, pos_scale, mscale)
        else:
            self.cpu.rope(x, step, inv_freq, neox, pos_scale, mscale)

    def rows(self, x, idx):
        if self._dev(x):
            return self.gpu.rows(x, idx)
        return self.cpu.rows(x, idx)

    def logits(self, x, W):
        g = self._w_dev(W)
        return self._be(g).logits(self._to(x, g), W)

    def attention(self, q, k, v, layer, step, sinks=None):
        g = layer < self.n_gpu
        q, k, v = (self._to(a, g) for a in (q, k, v))
        if g:
            return self.gpu.attention(q, k, v, layer, step.dev, sinks=sinks)
        return self.cpu.attention(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v),
                                  layer, step, sinks=sinks)
