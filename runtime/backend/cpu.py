"""The CPU backend: numpy arrays, Numba kernels, quantized matmuls from quant/.

Every op writes into buffers from an arena whose order restarts at each layer
(the model calls `end_layer`): every layer asks for the same buffers in the same
order, so one layer's worth of memory serves the whole step, and a step allocates
nothing once warm.
"""
from __future__ import annotations

import os

import numba
import numpy as np

import quant
from quant import QTensor
from quant.blas_threads import set_blas_threads
from quant.dequant import check_rows, deq_rows_kernel
from quant.matmul_cpu import matmul_into, matmul_multi_into, pool_sgemm
from quant import moe_cpu
from quant.types import GGMLType

from ..kv_cache import CACHE_KV_QUANT, CACHE_TYPES, QK8, kv_bytes_per_token_layer  # noqa: F401
from . import cpu_kernels as K
from . import cpu_plan, hugepages, moe


class _Arena:
    """Layer-scoped buffers, handed out in call order; the order restarts at every
    layer (and step), so slot k serves the k-th buffer of every layer: a layer's
    buffers are dead once the next layer starts (only the residual stream, which
    is not from here, crosses layers).  Each slot keeps the largest buffer asked
    of it and hands out views of it, so a prompt step after decode steps (or the
    reverse) allocates nothing: with one buffer per op of every layer, a
    Qwen2.5-1.5B prompt of 512 tokens held 1.4 GB of activations and re-faulted
    it in after decoding (pp512 after tg128 ran 15% slower)."""

    def __init__(self):
        self.flat: list[np.ndarray] = []     # per slot, bytes
        self.views: list[np.ndarray] = []    # per slot, the view handed out last
        self.i = 0

    def reset(self):
        self.i = 0

    def get(self, shape, dtype=np.float32) -> np.ndarray:
        i = self.i
        self.i += 1
        if i < len(self.views):
            v = self.views[i]
            if v.shape == shape and v.dtype == dtype:
                return v
        else:
            self.flat.append(np.empty(0, np.uint8))
            self.views.append(self.flat[i])
        dt = np.dtype(dtype)
        n = dt.itemsize
        for d in shape:
            n *= d
        if self.flat[i].nbytes < n:
            self.flat[i] = np.empty(n, np.uint8)
        v = self.views[i] = self.flat[i][:n].view(dt).reshape(shape)
        return v

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.flat)


# (the cache types and their sizes live in kv_cache.py; imported from here too)
assert K.QK8 == QK8


class CPUKVStorage:
    """K and V pools per layer: [n_slots, kv_heads, head_dim] as f16 bits (uint16), or
    for q8_0 as int8 plus one f16 scale per 32 values ([n_slots, kv_heads, head_dim/32]).
    q8_0 quantizes both, k16v8 only V (k_quant, v_quant)."""

    def __init__(self, n_layers, n_slots, n_kv_heads, head_dim, cache_type="f16"):
        self.cache_type = cache_type
        self.bytes_per_token_layer = kv_bytes_per_token_layer(n_kv_heads, head_dim, cache_type)
        self.bytes_per_token = n_layers * self.bytes_per_token_layer
        self.k_quant, self.v_quant = CACHE_KV_QUANT[cache_type]
        self.quantized = self.k_quant or self.v_quant
        shape = (n_slots, n_kv_heads, head_dim)
        sshape = (n_slots, n_kv_heads, head_dim // K.QK8)
        none = np.zeros((1, 1, 1), np.uint16)
        # np.zeros maps pages lazily: blocks never handed out cost no memory
        self.k = [np.zeros(shape, np.int8 if self.k_quant else np.uint16) for _ in range(n_layers)]
        self.v = [np.zeros(shape, np.int8 if self.v_quant else np.uint16) for _ in range(n_layers)]
        self.k_scale = [np.zeros(sshape, np.uint16) for _ in range(n_layers)] if self.k_quant else [none] * n_layers
        self.v_scale = [np.zeros(sshape, np.uint16) for _ in range(n_layers)] if self.v_quant else [none] * n_layers

    def copy_block(self, src: int, dst: int, block_size: int, layers=None) -> None:
        s, d = slice(src * block_size, (src + 1) * block_size), slice(dst * block_size, (dst + 1) * block_size)
        for i in (range(len(self.k)) if layers is None else layers):
            pools = (self.k[i], self.v[i]) + ((self.k_scale[i],) if self.k_quant else ()) + \
                ((self.v_scale[i],) if self.v_quant else ())
            for pool in pools:
                pool[d] = pool[s]

    def shift(self, layer: int, src, dst, delta: int, inv_freq, neox: bool, pos_scale: float = 1.0) -> None:
        """Context shift: move one layer's K/V from slots src to dst, keys re-rotated by delta positions."""
        K.kv_shift(self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer], self.k_quant,
                   self.v_quant, np.asarray(src, np.int32), np.asarray(dst, np.int32), int(delta),
                   np.asarray(inv_freq, np.float32), bool(neox), np.float32(pos_scale))


class CPUBackend:
    name = "cpu"
    # steps up to this many tokens are batch-invariant (the matmuls' integer path, engine._splits'
    # rule): 8 clients' decode rows and a new request's prompt tail share one forward
    exact_rows = quant.BATCH_INVARIANT_MAX_ROWS
    plans_ok = True             # a subclass that overrides an op must route its kernels through
                                # scratch.call and set this again to keep the plans (cpu_plan.py)
    moe_fused = True            # VNNI-type experts through quant/moe_cpu.py (False: one matmul an expert)
    # ... at up to this many tokens a step (prompts too: int8 activations on the experts' rows,
    # as llama.cpp's; LLAMBA_MOE_FUSED_ROWS=16 keeps prompts on the per-expert bf16 GEMMs)
    moe_fused_rows = int(os.environ.get("LLAMBA_MOE_FUSED_ROWS", 1 << 30))

    def __init__(self, threads: int | None = None):
        if threads:
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        self.threads = numba.get_num_threads()
        # prompt processing's sgemm: one OpenBLAS thread per Numba worker where
        # the pool path applies (quant/gemm_tiles.py), else as many as we were given
        set_blas_threads(1 if pool_sgemm() else self.threads)
        self.arena = _Arena()
        self.scratch = quant.Scratch()   # matmul work buffers (the engine's thread only)
        # every kernel an op runs goes through self.scratch.call, so small steps can be
        # recorded once and replayed (cpu_plan.py)
        self.plans = cpu_plan.Plans() if cpu_plan.ENABLED else None
        self.recordable = True          # False: an op of the step being recorded ran outside call()
        self.setup_events = 0           # steps that recorded or checked a plan (one-time costs)
        self._resid = np.empty(0, np.float32)   # the residual stream (lives across layers: not the arena's)
        self.kv: CPUKVStorage | None = None
        self.hugepages = hugepages.HugePageArena() if hugepages.available() else None
        self.device_name = f"CPU ({os.cpu_count()} cores, {self.threads} threads)"

    # ---- set-up ----------------------------------------------------------------
    def upload(self, t: QTensor, streamed: bool = True):
        """Weights keep their file's block layout: the matrices decoding streams are
        copied into huge-page memory where the system offers it (hugepages.py), the
        rest stay memory-mapped (streamed=False: an embedding table of which a token
        reads one row); 1-D tensors (norms, biases) become float32 vectors (experts'
        biases [E, cols] float32 matrices); 3-D expert
        tensors a list of 2-D views, one an expert (QTensor.experts)."""
        if len(t.shape) == 1 or t.name.endswith(".bias"):     # (experts' biases: [E, cols])
            return quant.dequantize(t).astype(np.float32).reshape(t.shape)
        if self.hugepages is not None and streamed:
            data = self.hugepages.place(t.data)
            if data is not None:
                t = QTensor(t.name, t.qtype, t.shape, data)
        return _Experts(t) if len(t.shape) == 3 else t

    def alloc_kv(self, n_layers, n_slots, n_kv_heads, head_dim, cache_type="f16"):
        self.kv = CPUKVStorage(n_layers, n_slots, n_kv_heads, head_dim, cache_type)
        self.invalidate_plans()
        return self.kv

    def invalidate_plans(self) -> None:
        """Forget the recorded steps: call after changing a model's weights or the KV pools."""
        if self.plans is not None:
            self.plans.clear()

    def plain_forward(self, model, step) -> np.ndarray:
        self.arena.reset()
        return model.forward(self, step)

    def _planned(self, model, step):
        if self.plans is None or not (type(self) is CPUBackend or type(self).__dict__.get("plans_ok")):
            return None
        return self.plans.run(self, model, step)

    def forward(self, model, step) -> np.ndarray:
        """Run the model's forward for one step; logits come back as a host array
        (the caller's own).  Small steps replay a recording (cpu_plan.py)."""
        out = self._planned(model, step)
        if out is not None:
            return out.copy()
        return self.plain_forward(model, step)

    def forward_argmax(self, model, step, masks=None) -> np.ndarray:
        """The step's greedy next tokens: np.argmax of each logits row (int64 [rows]);
        masks: a callable giving the rows' allowed-token bitmasks (constrain.apply_mask's),
        whose disallowed logits are set to -inf first."""
        out = self._planned(model, step)
        if out is None:
            out = self.plain_forward(model, step)
        if masks is not None:       # (in place: a replayed plan's output is written anew every step)
            from runtime.constrain import apply_mask
            apply_mask(out, masks())
        return np.argmax(out, axis=-1)

    def end_layer(self):
        """The model finished a layer: its buffers are free for the next one."""
        self.arena.reset()

    # ---- ops ----------------------------------------------------------------
    def embed(self, W, ids, scale: float = 1.0):
        call = self.scratch.call
        if W.qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
            self.recordable = False
            x = quant.dequantize_rows(W, np.asarray(ids))
        else:
            ids = np.asarray(ids)
            check_rows(W, ids)
            n = len(ids)
            rows = self.arena.get((n,), np.int64)
            call(np.copyto, rows, ids)
            size = n * W.cols
            if self._resid.size < size:
                self._resid = np.empty(size, np.float32)
            x = self._resid[:size].reshape(n, W.cols)
            call(deq_rows_kernel, int(W.qtype), W.data, rows, x, 32)
        if scale != 1.0:
            call(np.multiply, x, np.float32(scale), x)
        return x

    def rmsnorm(self, x, w, eps):
        out = self.arena.get(x.shape)
        d = x.shape[-1]
        self.scratch.call(K.rmsnorm, x.reshape(-1, d), w, np.float32(eps), out.reshape(-1, d))
        return out

    def heads(self, x, n_heads):
        return x.reshape(x.shape[0], n_heads, -1)

    # matmuls go straight to quant's unchecked entries: the model's shapes were
    # checked at load, and the checks cost a visible share of a small model's token
    def matmul(self, x, W, bias=None):
        x = self._rows2d(x)
        out = self.arena.get((x.shape[0], W.shape[0]))
        matmul_into(x, W, out, self.scratch)
        self._add_biases([out], [bias])
        return out

    def matmuls(self, x, Ws, biases=None):
        x = self._rows2d(x)
        outs = [self.arena.get((x.shape[0], W.shape[0])) for W in Ws]
        matmul_multi_into(x, Ws, outs, self.scratch)
        if biases:
            self._add_biases(outs, biases)
        return outs

    def _add_biases(self, outs, biases):
        """outs[i] += biases[i] (None: nothing); q/k/v's three in one call."""
        if len(outs) == 3 and all(b is not None for b in biases):
            self.scratch.call(K.add_bias3, outs[0], biases[0], outs[1], biases[1], outs[2], biases[2])
            return
        for o, bias in zip(outs, biases):
            if bias is not None:
                self.scratch.call(K.add_bias, o, bias)

    def matmul_add(self, x, W, acc):
        self.scratch.call(K.add_inplace, acc, self.matmul(x, W))

    def add(self, x, y):
        self.scratch.call(K.add_inplace, x, y)

    def glu(self, g, u, kind):
        """g = act(g) * u in place; kind: silu, gelu (tanh form) or swiglu_oai (gpt-oss)."""
        self.scratch.call(_GLU[kind], g, u)
        return g

    def moe(self, x, router, experts, top_k, norm_topk, router_bias=None, biases=None, glu="silu"):
        """Mixture of experts: out[t] = sum over token t's top_k experts e (by softmax of
        x[t] @ router.T, renormalized when norm_topk) of w[t, e] * down_e(silu(gate_e x[t])
        * up_e x[t]).  experts: (gates, ups, downs), a 2-D matrix an expert each.  The
        step's rows are gathered by expert (moe.py), so each chosen expert's weights are
        read once and the others not at all.  Options (gpt-oss; moe.py): router_bias
        added to the logits, biases (gate, up, down) [E, cols] added to each expert's
        outputs, glu the experts' activation (a glu() kind).

        Experts of the VNNI kernels' types (K-quants, the 32-element formats and MXFP4) on
        VNNI CPUs (quant/moe_cpu.py): routing, grouping and every chosen
        expert's matmuls in a fixed sequence of kernel calls on the 3-D tensors' bytes, so
        a small step records and replays (cpu_plan.py); bit for bit what the
        expert-by-expert path gives wherever that runs int8 activations (runs of fewer
        than 32 rows: any step of up to exact_rows tokens).  A prompt's longer runs take
        int8 activations here where that path ran bf16 GEMMs (a tiny Q4_K_M qwen3moe,
        400-token prompt against transformers: top-1 0.765 both, mean KL 0.00798 ->
        0.00800).  Other expert types: one matmul call per chosen expert."""
        x = self._rows2d(x)
        return self.moe_routed(x, self.matmul(x, router, router_bias), experts, top_k, norm_topk, biases, glu)

    def moe_routed(self, x, logits, experts, top_k, norm_topk, biases=None, glu="silu"):
        """The moe op from the router's logits [n, E] on: routing, the chosen experts and
        their weighted sum (x: float32 [n, d], C-contiguous).  The CUDA backend's experts
        kept in system memory (--cpu-moe: cuda_host_moe.py) run here, on the logits its
        router computed on the GPU."""
        n = x.shape[0]
        if self.moe_fused and n <= self.moe_fused_rows and isinstance(experts[0], _Experts):
            kinds = moe_cpu.fused_kinds(*(e.whole for e in experts))
            if kinds is not None:
                return self._moe_fused(x, logits, experts, top_k, norm_topk, kinds, biases, glu)
        return self._moe_by_expert(x, logits, experts, top_k, norm_topk, biases, glu)

    def _moe_fused(self, x, logits, experts, top_k, norm_topk, kinds, biases=None, glu="silu"):
        """quant/moe_cpu.py's fused kernels, each through Scratch.call (recorded, on the
        arena's buffers).  moe_host_fn.moe_rows makes the same calls in one Numba function
        (--cpu-moe's host functions, which cannot call Python); tests/runtime/test_moe_fused.py
        holds the two to the same bits: a change here goes there too."""
        call, get = self.scratch.call, self.arena.get
        n, d = x.shape
        gw, uw, dw = (e.whole for e in experts)
        E = len(experts[0])
        ff = gw.shape[0] // E
        P = n * top_k
        ids, w, pos = get((n, top_k), np.int32), get((n, top_k)), get((n, top_k), np.int32)
        tokens, starts = get((P,), np.int32), get((E + 1,), np.int64)
        act, nact = get((E,), np.int64), get((1,), np.int64)
        call(moe.route_group, logits, int(top_k), bool(norm_topk), ids, w, tokens, starts, pos, act, nact)
        target = 8 * self.threads
        res = get((target + 2 * P + 16, 16))

        def q8(a, fam, gather=False):
            """a's rows rounded to int8 (act_quant's quantize_q8_256_i8 or quantize_q8_32_i8
            by the weights' family, row by row: a row's codes depend on that row alone) into
            flat buffers; gather: the pairs' tokens' rows, copied from xa (x rounded once a
            token)."""
            m, K = (P if gather else a.shape[0]), a.shape[1]
            bufs = moe_cpu.act_buffers(fam, m, K, get)
            nch = min(m // 32, 4 * self.threads)      # a prompt's rows in parallel
            if gather:
                if nch > 1:
                    call(moe_cpu.q8_gather_par, fam, tokens, K, *xa, *bufs, nch)
                else:
                    call(moe_cpu.q8_gather, fam, tokens, K, *xa, *bufs)
            elif nch > 1:
                call(moe_cpu.q8_rows_par, fam, a, tokens[:0], *bufs, nch)
            else:
                call(moe_cpu.q8_rows, fam, a, tokens[:0], *bufs)
            return bufs

        fx, fh = moe_cpu.family(kinds[0]), moe_cpu.family(kinds[2])
        xa = q8(x, fx)
        xq, xq4, xd, _, xb16, xbf = q8(x, fx, gather=True)
        xa = (xq, xq4, xd, xb16, xbf)
        gx = moe_cpu.grp_buffers(fx, P, E, d, get)
        if fx == moe_cpu.LEG_FAM:
            call(moe_cpu.group_runs, d, starts, act, nact, xq, xd, xb16, xbf, *gx)
        g, u = get((P, ff)), get((P, ff))
        call(moe_cpu.gate_up, kinds[0], kinds[1], gw.data, uw.data, ff, d, *xa, gx, starts, act, nact, g, u, res,
             target)
        if biases is not None:
            call(moe.add_run_bias, g, biases[0], starts, act, nact)
            call(moe.add_run_bias, u, biases[1], starts, act, nact)
        call(_GLU[glu], g, u)
        hq, hq4, hd, _, hb16, hbf = q8(g, fh)
        ha = (hq, hq4, hd, hb16, hbf)
        gh = moe_cpu.grp_buffers(fh, P, E, ff, get)
        if fh == moe_cpu.LEG_FAM:
            call(moe_cpu.group_runs, ff, starts, act, nact, hq, hd, hb16, hbf, *gh)
        y = get((P, d))
        call(moe_cpu.down, kinds[2], dw.data, d, ff, *ha, gh, starts, act, nact, y, res, target)
        if biases is not None:
            call(moe.add_run_bias, y, biases[2], starts, act, nact)
        out = get((n, d))
        call(moe.combine, y, pos, w, out)
        return out

    def _moe_by_expert(self, x, logits, experts, top_k, norm_topk, biases=None, glu="silu"):
        self.recordable = False             # the experts a step runs depend on its data
        n, d = x.shape
        w, tokens, starts, pos = moe.plan(logits, top_k, norm_topk)
        gates, ups, downs = experts
        ff = gates[0].shape[0]
        xs = self.arena.get((n * top_k, d))
        np.take(x, tokens, 0, xs)
        g = self.arena.get((n * top_k, ff))
        u = self.arena.get((n * top_k, ff))
        y = self.arena.get((n * top_k, d))
        for e in np.flatnonzero(starts[1:] > starts[:-1]):
            a, b = starts[e], starts[e + 1]
            matmul_multi_into(xs[a:b], (gates[e], ups[e]), (g[a:b], u[a:b]), self.scratch)
            if biases is not None:
                K.add_bias(g[a:b], biases[0][e])
                K.add_bias(u[a:b], biases[1][e])
            _GLU[glu](g[a:b], u[a:b])
            matmul_into(g[a:b], downs[e], y[a:b], self.scratch)
            if biases is not None:
                K.add_bias(y[a:b], biases[2][e])
        out = self.arena.get((n, d))
        moe.combine(y, pos, w, out)
        return out

    def rope(self, x, step, inv_freq, neox, pos_scale=1.0, mscale=1.0):
        self.scratch.call(K.rope, x, step.positions, inv_freq, neox, np.float32(pos_scale), np.float32(mscale))

    def rows(self, x, idx):
        out = self.arena.get((len(idx),) + x.shape[1:], x.dtype)
        self.scratch.call(np.take, x, idx, 0, out)
        return out

    def logits(self, x, W):
        x = self._rows2d(x)
        out = np.empty((x.shape[0], W.shape[0]), np.float32)   # outlives the step: not from the arena
        matmul_into(x, W, out, self.scratch)
        return out

    def _rows2d(self, x):
        x = x.reshape(x.shape[0], -1)
        if x.flags.c_contiguous:
            return x
        out = self.arena.get(x.shape, x.dtype)
        self.scratch.call(np.copyto, out, x)
        return out

    def attention(self, q, k, v, layer, step, sinks=None):
        """Causal attention of q's rows over the layer's cache (after writing k, v to it),
        inside the layer's window.  sinks: a float32 logit per query head that joins each
        row's softmax denominator (gpt-oss's attention sinks), or None."""
        n, h, d = q.shape
        kv = self.kv
        slots, tables = step.slots_for(layer), step.tables_for(layer)
        call = self.scratch.call
        call(K.kv_write, k, v, kv.k[layer], kv.v[layer], kv.k_scale[layer], kv.v_scale[layer], kv.k_quant,
             kv.v_quant, slots)
        kvh = k.shape[1]
        g = h // kvh
        splits = step.attn_splits
        tile_t0 = self.arena.get((n,), np.int32)
        tile_n = self.arena.get((n,), np.int32)
        n_tiles = self.arena.get((1,), np.int32)
        window = step.window(layer)
        # steps of up to 16 tokens (decode, speculative verify) must give each token
        # the arithmetic it would get alone: tiles never mix differently split rows
        call(K.attention_tiles_into, step.seq_of_token, step.positions, ATTN_TILE, tile_t0, tile_n,
             window, splits, step.block_size, n <= self.exact_rows, n_tiles)
        pshape = (n, kvh, splits, g) if splits > 1 else (1, 1, 1, 1)
        part_m = self.arena.get(pshape)
        part_l = self.arena.get(pshape)
        part_acc = self.arena.get(pshape + ((d,) if splits > 1 else (1,)))
        out = self.arena.get((n, h, d))
        call(K.paged_attention, q, kv.k[layer], kv.v[layer], kv.k_scale[layer], kv.v_scale[layer], kv.k_quant,
             kv.v_quant, step.block_size, tables, step.seq_of_token, step.positions, window,
             np.float32(step.attn_scale), splits, tile_t0, tile_n, n_tiles,
             part_m, part_l, part_acc, out, _NO_SINKS if sinks is None else sinks)
        return out.reshape(n, h * d)


class _Experts(list):
    """A 3-D expert tensor as uploaded: one 2-D QTensor view an expert (QTensor.experts),
    and the whole tensor as one [E*M, K] matrix of blocks (`whole`: the fused kernels,
    quant/moe_cpu.py, read expert e's rows e*M.. of it)."""
    __slots__ = ("whole",)

    def __init__(self, t: QTensor):
        super().__init__(t.experts())
        E, M, K = t.shape
        self.whole = QTensor(t.name, t.qtype, (E * M, K), t.data)


# queries per prefill tile: each K/V block is converted once per tile and kv head
ATTN_TILE = 16
_NO_SINKS = np.zeros(0, np.float32)     # paged_attention's "no attention sinks"
_GLU = {"silu": K.silu_mul, "gelu": K.gelu_mul, "swiglu_oai": K.swiglu_oai_mul}

