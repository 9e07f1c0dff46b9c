"""How fast could one persistent kernel stream a decode step's weights?  The ceiling of a
dataflow decode kernel, measured before anyone writes one:

    python -m lab.gpu_stream [--timeline] L8:Q4_K_M Q15:Q4_K_M

The decode step today is a kernel an op (PDL between them), and its matvecs alone read L8's
weights at ~70% of copy bandwidth (quant/cuda/NOTES.md).  The way past that is one kernel
that keeps DRAM busy across op boundaries: each SM streams its share of the next op's
weights into shared memory while it waits for the whole GPU to finish the op before.  This
probe does exactly that with the arithmetic left out: a step's ops in order (q/k/v,
attention over the KV cache at a context, the split merge, o, gate/up, down, per layer;
then the output matrix), each op's bytes shared over one block an SM, copied by cp.async
into a ring of S slots of 16 KB, XOR-ed from there (or, with W > 0, fed to W dp4a a 16
bytes against values from shared memory, a Q4 matvec's arithmetic).  An op's bytes are
shared contiguously (block b reads [B b / n, B (b + 1) / n), as a block owning a range of
rows would), interleaved (block b reads slots b, b + n, ...: all SMs read neighbouring
addresses at any moment), or dealt at run time (a block takes the op's next slot by an
atomic when it issues one).  Variants:

  free      no dependency between ops: the streaming ceiling itself;
  barrier   an op starts (is read from its slots) only once every block has finished the
            op before (a counter an op, as a dataflow kernel would keep), then reads the
            op's input vector from L2; the ring keeps prefetching across the wait
            ("no input read": the same without reading the input);
  segments  only q/k/v, gate/up and the output matrix wait for the op before (a split-K
            dataflow step: see DEPS below), the ops between start at once: an upper bound;
  per-op    the same kernel launched once an op (free), captured in a graph: the ceiling of
            a kernel an op, launch gaps included (no PDL).

A slot is refilled as soon as every thread has read it, before the next slot's wait and
arithmetic.  Its bytes are copied by every thread's 16-byte cp.async or, on sm_90 and
later, by one cp.async.bulk from thread 0 (the TMA engine's 1-D copy), which leaves the
load/store pipe to the arithmetic: session 25 measured it 3-9 points ahead under
dependencies with arithmetic (quant/cuda/NOTES.md).

Figures are bytes per step over time per step (graph replay), against copy bandwidth
measured in the same run.  No model files: byte sizes come from the shape and mix
(tests/lab/synth.py).
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np

# one slot copied by one instruction (sm_90+); also used by tests/lab/gpu_q8ring.py
BULK_SRC = (Path(__file__).resolve().parents[2] / "quant" / "cuda" / "bulk.cuh").read_text()

_SRC = BULK_SRC + r"""
__device__ __forceinline__ void cp16(void* smem, const void* g) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(g));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void wait_groups() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// a slot of nb bytes from shared memory: XOR-ed (W = 0) or, as a Q4 matvec's work on 16
// bytes, its 32 nibbles through W dp4a against values from shared memory
template <int W>
__device__ __forceinline__ void consume(const uint4* sl, long long nb, int k, const int* xs, unsigned& acc, int& dot,
                                        int t, int nt) {
    int d[4] = {0, 0, 0, 0};                     // four chains, as a matvec's unrolled dots run
    for (int i = t; 16LL * i < nb; i += nt) {
        const uint4 v = sl[i];
        if (W == 0) {
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        } else {
            const int x = xs[(i + k) & 511];
            const unsigned q[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < W; j++)
                d[j & 3] = __dp4a((int)((q[j & 3] >> (4 * (j >> 2))) & 0x0F0F0F0Fu), x + j, d[j & 3]);
        }
    }
    dot += d[0] + d[1] + d[2] + d[3];
}

// an op's input (n uint4s, at most 8 a thread), written by other SMs: through L2, as a matvec
// must read it, every load issued before the first is used (one L2 round trip, not eight)
__device__ __forceinline__ unsigned read_input(const uint4* act, int n, int t, int nt) {
    uint4 v[8];
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = t + j * nt < n ? __ldcg(act + t + j * nt) : make_uint4(0, 0, 0, 0);
    unsigned acc = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    return acc;
}

// thread 0 waits for *c to reach need, the block for thread 0; then the op's input
__device__ __forceinline__ unsigned wait_for(const unsigned* c, unsigned need, const uint4* act, int n_in,
                                             bool input) {
    if (threadIdx.x == 0) {
        while (*(volatile const unsigned*)c < need) __nanosleep(20);
        __threadfence();
    }
    __syncthreads();
    return input ? read_input(act, n_in, threadIdx.x, blockDim.x) : 0u;
}

// block b's share of op o, [lo, hi), walked in steps of `step` bytes (a slot read from
// each): contiguous (il = 0: bytes [B b / n, B (b + 1) / n)) or interleaved (il = 1: slots
// b, b + n, b + 2n, ... of the op: all SMs read neighbouring slots at any moment)
__device__ __forceinline__ void share(const long long* bytes, int o, int b, int n, int il, long long SB,
                                      long long& lo, long long& hi, long long& step) {
    const long long B = bytes[o];
    if (il) { lo = b * SB; hi = B; step = n * SB; return; }
    lo = (B * b / n) & ~15LL;
    hi = b == n - 1 ? B : (B * (b + 1) / n) & ~15LL;
    step = SB;
}

__device__ __forceinline__ unsigned long long now() {
    unsigned long long v;
    asm volatile("mov.u64 %0, %globaltimer;\n" : "=l"(v));
    return v;
}

// cnt[o] counts the blocks that have read their share of op o.  An op with dep[o] = 1 starts
// only once every block has passed the op before, then reads its input; dep[o] = 0 starts at
// once.  trace (if given): [op][block] (when the block finished its share of the op, when it
// started it), ns; zero where it had no share.  BULK: each slot copied by cp.async.bulk (sm_90)
// rather than by every thread's cp.async.
template <int S, int W, int BULK>
__global__ void __launch_bounds__(512, 1)
stream_ring(const char* __restrict__ base, const long long* __restrict__ start, const long long* __restrict__ bytes,
            const int* __restrict__ act_v, const int* __restrict__ dep, int op0, int nops, unsigned* cnt,
            const uint4* act, int barriers, int il, unsigned* sink, unsigned long long* trace) {
    extern __shared__ uint4 ring[];
    __shared__ int xs[512];                      // stands in for the rounded activations
    const int t = threadIdx.x, nt = blockDim.x, b = blockIdx.x, n = gridDim.x, op_end = op0 + nops;
    const int SV = 2 * nt;                       // uint4s a slot: 16 KB at 512 threads
    const long long SB = 16LL * SV;
    int pop = op0, cop = op0, read_op = -1;      // read_op: the op of the slot read last
    long long poff, pend, pstep, coff, cend, cstep;
    share(bytes, op0, b, n, il, SB, poff, pend, pstep);
    share(bytes, op0, b, n, il, SB, coff, cend, cstep);
    __shared__ unsigned long long full[S];       // BULK: a slot's bytes have landed
    auto issue = [&](int slot) {
        while (pop < op_end && poff >= pend)
            if (++pop < op_end) share(bytes, pop, b, n, il, SB, poff, pend, pstep);
        if (pop < op_end) {
            const long long nb = min(SB, pend - poff);
            const char* g = base + start[pop] + poff;
            uint4* s = ring + slot * SV;
            if (BULK) {
                if (t == 0) bulk_copy(s, g, (unsigned)nb, full + slot);
            } else {
                for (int i = t; 16LL * i < nb; i += nt) cp16(s + i, g + 16LL * i);
            }
            poff += pstep;
        } else if (BULK && t == 0) {
            bulk_none(full + slot);
        }
        if (!BULK) commit();
    };
    // the consumer passes an op when its share is read (or empty), and says so: the counter
    // of an op reaches n when every block has passed it
    auto pass = [&]() {
        while (cop < op_end && coff >= cend) {
            if (barriers) {
                __syncthreads();
                if (t == 0) {
                    __threadfence();
                    atomicAdd(cnt + cop, 1u);
                    if (trace && read_op == cop) trace[2 * (cop * n + b)] = now();
                }
            }
            if (++cop < op_end) share(bytes, cop, b, n, il, SB, coff, cend, cstep);
        }
    };
    xs[threadIdx.x] = threadIdx.x * 0x01010101;
    if (BULK) bulk_init(full, S);
    for (int s = 0; s < S - 1; ++s) issue(s);
    unsigned acc = 0;
    int dot = 0;
    pass();
    bool first = true;                           // the slot is the first of its op here
    for (int k = 0; cop < op_end; ++k) {
        if (BULK) bulk_wait(full + k % S, (k / S) & 1);   // slot k % S's (k / S)-th filling
        else wait_groups<S - 2>();
        __syncthreads();                         // and slot (k - 1) % S read by all: refilled at once,
        issue((k + S - 1) % S);                  // before this slot's wait and arithmetic
        if (first && barriers && cop > 0 && dep[cop])   // the op before must be done everywhere
            acc ^= wait_for(cnt + cop - 1, n, act, act_v[cop], barriers == 1);
        if (first && trace && t == 0) trace[2 * (cop * n + b) + 1] = now();
        consume<W>(ring + (k % S) * SV, min(SB, cend - coff), k, xs, acc, dot, t, nt);
        read_op = cop;
        coff += cstep;
        const int was = cop;
        pass();
        first = cop != was;
    }
    if ((acc ^ dot) == 0x9e3779b9u) sink[0] = acc;
}

// The same with slots dealt at run time: a block takes an op's next slot (an atomic a slot)
// when it issues it, so no block idles at an op's end while others still read theirs;
// cnt[o] counts slots taken, cnt[nops + o] slots read.
template <int S, int W>
__global__ void __launch_bounds__(512, 1)
stream_dyn(const char* __restrict__ base, const long long* __restrict__ start, const long long* __restrict__ bytes,
           const int* __restrict__ act_v, int nops, unsigned* cnt, const uint4* act, int barriers, unsigned* sink) {
    extern __shared__ uint4 ring[];
    __shared__ int xs[512];
    __shared__ int slot_op[S], next_op[2];
    __shared__ long long slot_off[S], next_off[2];
    const int t = threadIdx.x, nt = blockDim.x;
    const int SV = 2 * nt;
    const long long SB = 16LL * SV;
    unsigned* take = cnt;
    unsigned* done = cnt + nops;
    // thread 0 fires the atomic for the next slot a whole issue ahead and reads its result
    // only then: the atomic's latency stays off the ring's critical path
    int gop = 0, par = 0;
    unsigned pend_j = 0;
    auto fire = [&]() { if (gop < nops) pend_j = atomicAdd(take + gop, 1u); };
    auto grab = [&](int p) {                     // thread 0: the next slot to issue into next_*[p]
        while (gop < nops && (long long)pend_j * SB >= bytes[gop]) { ++gop; fire(); }
        next_op[p] = gop;
        next_off[p] = (long long)pend_j * SB;
        fire();
    };
    auto issue = [&](int slot) {
        const int o = next_op[par];
        const long long off = next_off[par];
        if (o < nops) {
            const long long nb = min(SB, bytes[o] - off);
            const char* g = base + start[o] + off;
            uint4* s = ring + slot * SV;
            for (int i = t; 16LL * i < nb; i += nt) cp16(s + i, g + 16LL * i);
        }
        commit();
        if (t == 0) { slot_op[slot] = o; slot_off[slot] = off; grab(par ^ 1); }
        par ^= 1;
    };
    xs[t] = t * 0x01010101;
    if (t == 0) { fire(); grab(0); }
    for (int s = 0; s < S - 1; ++s) { __syncthreads(); issue(s); }
    unsigned acc = 0;
    int dot = 0, cur = -1;
    for (int k = 0;; ++k) {
        wait_groups<S - 2>();
        __syncthreads();
        const int o = slot_op[k % S];
        if (o >= nops) break;
        if (o != cur && o > 0 && barriers)       // every slot of the op before read, everywhere
            acc ^= wait_for(done + o - 1, (unsigned)((bytes[o - 1] + SB - 1) / SB), act, act_v[o], barriers == 1);
        cur = o;
        consume<W>(ring + (k % S) * SV, min(SB, bytes[o] - slot_off[k % S]), k, xs, acc, dot, t, nt);
        __syncthreads();
        if (t == 0 && barriers) { __threadfence(); atomicAdd(done + o, 1u); }
        issue((k + S - 1) % S);
    }
    if ((acc ^ dot) == 0x9e3779b9u) sink[0] = acc;
}
"""

SLOT_BYTES = 16 << 10


def kernel_name(S, W, shares):
    """_SRC's kernel for ring slots S, dp4a a 16 bytes W and shares (an index of SHARES)."""
    return f"stream_dyn<{S},{W}>" if shares == 2 else f"stream_ring<{S},{W},{int(shares == BULK)}>"


def kernel_names(configs):
    """The kernels configs (S, W, shares) need, each once, in a fixed order."""
    return sorted({kernel_name(*c) for c in configs})


@functools.cache
def _module(cp, names):
    """The kernels, compiled once a run."""
    return cp.RawModule(code=_SRC, options=("-std=c++17",), name_expressions=list(names))


def _kernel(cp, S, W, shares):
    f = _module(cp, (kernel_name(S, W, shares),)).get_function(kernel_name(S, W, shares))
    f.max_dynamic_shared_size_bytes = S * SLOT_BYTES
    return f


def _sizes(shape: str):
    """(layers, d_model, d_ff, query width, key/value width) of a lab.synth shape."""
    from lab.synth import SHAPES
    s = SHAPES[shape]
    hd = s["d_model"] // s["n_heads"]
    return s["n_layers"], s["d_model"], s["d_ff"], s["n_heads"] * hd, s["n_kv_heads"] * hd


def step_matrices(shape: str):
    """[(op, [(tensor, rows, cols)])] of one decode step's matrices, in order: q/k/v, o,
    gate/up and down a layer, then the output matrix."""
    from lab.synth import SHAPES
    L, d, ff, q, kv = _sizes(shape)
    ops = []
    for i in range(L):
        p = f"blk.{i}."
        ops += [("qkv", [(p + "attn_q.weight", q, d), (p + "attn_k.weight", kv, d), (p + "attn_v.weight", kv, d)]),
                ("o", [(p + "attn_output.weight", d, q)]),
                ("gate/up", [(p + "ffn_gate.weight", ff, d), (p + "ffn_up.weight", ff, d)]),
                ("down", [(p + "ffn_down.weight", d, ff)])]
    s = SHAPES[shape]
    ops.append(("output", [("token_embd.weight" if s["tied"] else "output.weight", s["vocab"], d)]))
    return ops


def step_ops(shape: str, mix: str, ctx: int, attention: bool = True):
    """[(name, bytes, input bytes)] of one decode step's ops, in order."""
    from quant import row_nbytes
    from lab.synth import mix_type
    L, _, _, q, kv = _sizes(shape)
    ops = []
    for name, mats in step_matrices(shape):
        cols = mats[0][2]                                  # an op's matrices share their input
        ops.append((name, sum(r * row_nbytes(mix_type(mix, t, L, c), c) for t, r, c in mats), 4 * cols))
        if attention and name == "qkv":
            ops.append(("attention", 2 * 2 * ctx * kv, 4 * q))     # f16 K and V of the context
            ops.append(("merge", 0, 0))
    return ops


# What an op waits for (stream_ring's dep: 0 nothing, 1 all of the op before, then its input):
#   barrier    every op waits for all of the op before: a kernel an op, or a counter an op;
#   segments   only the ops that need all of their input wait (q/k/v and gate/up: the norm
#              needs the whole residual; the output matrix); the rest start at once.  That is
#              a split-K dataflow step: attention head h needs only head h's q/k/v rows, o
#              split by heads needs only head h's attention, down split by ffn chunks only
#              its chunk of gate/up (their outputs summed by atomics), so two all-to-all
#              waits a layer are left.  An upper bound: the waits inside a segment are free.
SEGMENT_STARTS = ("qkv", "gate/up", "output")
DEPS = ("barrier", "segments")


def deps(ops, kind):
    """stream_ring's dep of each op (int32) for a kind in DEPS."""
    out = [1 if kind == "barrier" or name in SEGMENT_STARTS else 0 for name, _, _ in ops]
    out[0] = 0
    return np.array(out, np.int32)


# (ring slots S, dp4a a 16 bytes W, shares: an index of SHARES); session 23 measured more
# (quant/cuda/NOTES.md): ring depth changed nothing.  The bulk copies need sm_90.
SHARES = ("contiguous", "interleaved", "dealt at run time", "interleaved, a bulk copy a slot")
BULK = 3
CONFIGS = ((4, 0, 0), (8, 0, 1), (8, 4, 1), (8, 8, 1), (8, 0, 2), (8, 0, BULK), (8, 4, BULK), (8, 8, BULK), (12, 8, BULK))


def runnable(cp, configs):
    """configs this GPU can run: the bulk copies need compute capability 9.0."""
    cc = int(cp.cuda.Device().compute_capability)
    return [c for c in configs if c[2] != BULK or cc >= 90]


def _buffers(cp, ops):
    """The device side of a step's ops: weights (ones), op tables, inputs, counters."""
    import types
    sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    floor = 16 * sms * 4                      # every op at least 16 bytes a block
    sizes = [max(floor, (b + 15) // 16 * 16) for _, b, _ in ops]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    if max(a for _, _, a in ops) > 8 * 512 * 16:      # read_input's registers: 8 uint4s a thread
        raise ValueError("an op's input is over 64 KB: read_input would read only part of it")
    return types.SimpleNamespace(
        sms=sms, base=cp.ones(int(sum(sizes)) // 4, cp.uint32),
        start=cp.asarray(starts), bytes=cp.asarray(np.array(sizes, np.int64)),
        act_v=cp.asarray(np.array([a // 16 for _, _, a in ops], np.int32)),
        act=cp.ones(max(a for _, _, a in ops) // 4 + 4, cp.uint32),
        cnt=cp.zeros(2 * len(ops), cp.uint32),           # blocks past an op (stream_dyn: slots taken, read)
        deps={kind: cp.asarray(deps(ops, kind)) for kind in DEPS},
        sink=cp.zeros(1, cp.uint32))


def _ring_args(d, dep, o0, n, bar, il, trace=None):
    """stream_ring's arguments: ops [o0, o0 + n) of d (_buffers), waiting as `dep` (DEPS)
    says when bar (barriers) is set, shares il, traced into trace if given."""
    return (d.base, d.start, d.bytes, d.act_v, d.deps[dep], np.int32(o0), np.int32(n), d.cnt, d.act,
            np.int32(bar), np.int32(il), d.sink, np.uint64(0) if trace is None else trace)


def measure(cp, ops, configs=CONFIGS, reps=20):
    """(bytes a step, [(S, W, shares, variant, seconds a step, bytes a second)])."""
    from lab.gpu_bench import _graph_seconds
    d = _buffers(cp, ops)
    step_bytes = sum(b for _, b, _ in ops)

    def variants(f, S, il):
        """(name, launch) of each variant of kernel f with S slots and shares il."""
        def args(o0, n, bar, dep):
            if il == 2:
                return d.base, d.start, d.bytes, d.act_v, np.int32(n), d.cnt, d.act, np.int32(bar), d.sink
            return _ring_args(d, dep, o0, n, bar, 1 if il == BULK else il)

        def whole(bar, dep="barrier"):
            def launch(_):
                d.cnt.fill(0)
                f((d.sms,), (512,), args(0, len(ops), bar, dep), shared_mem=S * SLOT_BYTES)
            return launch

        def per_op(_):
            for o in range(len(ops)):
                f((d.sms,), (512,), args(o, 1, 0, "barrier"), shared_mem=S * SLOT_BYTES)

        out = [("free", whole(0)), ("barrier", whole(1)), ("barrier, no input read", whole(2))]
        if il == 2:
            return out
        return out + [("segments", whole(1, "segments")), ("per-op", per_op)]

    rows = []
    for S, W, il in runnable(cp, configs):
        f = _kernel(cp, S, W, il)
        for name, launch in variants(f, S, il):
            t = _graph_seconds(cp, launch, 1, reps)
            rows.append((S, W, il, name, t, step_bytes / t))
    return step_bytes, rows


def timeline(cp, ops, dep="barrier", S=8, W=0, shares=1):
    """Where one step's time goes between ops, from one traced launch of stream_ring
    (interleaved shares, copied per thread or, shares = BULK, by bulk copies; each op waiting
    as `dep` says, inputs read): for each op, in ns, (median block's start, median block's
    finish, last block's finish), blocks that had no share of it left out, relative to the
    step's first start."""
    d = _buffers(cp, ops)
    f = _kernel(cp, S, W, shares)
    trace = cp.zeros((len(ops), d.sms, 2), cp.uint64)
    for _ in range(3):                                   # the last launch's trace is kept
        d.cnt.fill(0)
        trace.fill(0)
        f((d.sms,), (512,), _ring_args(d, dep, 0, len(ops), 1, 1, trace), shared_mem=S * SLOT_BYTES)
    tr = cp.asnumpy(trace).astype(np.int64)
    t0 = tr[tr > 0].min()
    out = []
    for o in range(len(ops)):
        fin = tr[o, :, 0][tr[o, :, 0] > 0] - t0
        beg = tr[o, :, 1][tr[o, :, 1] > 0] - t0
        out.append((int(np.median(beg)) if len(beg) else 0, int(np.median(fin)), int(fin.max())))
    return out


def timeline_table(ops, tl, bw) -> str:
    """timeline()'s step summed over the layers, an op name a row, in us (markdown)."""
    rows, before = {}, 0
    for (name, nbytes, _), (beg, med, last) in zip(ops, tl):
        r = rows.setdefault(name, np.zeros(4))
        r += (beg - before, med - beg, last - med, nbytes / bw * 1e9)
        before = last
    head = ("| op | start after the last block finished the op before | median block's run | "
            "last block after the median | at copy bandwidth |")
    out = [head, "|---|---|---|---|---|"]
    out += [f"| {name} | " + " | ".join(f"{x / 1e3:.1f}" for x in r) + " |" for name, r in rows.items()]
    return "\n".join(out) + f"\n(step: {tl[-1][2] / 1e3:.1f} us)"


def main(argv=None) -> int:
    import cupy as cp

    from lab.gpu_bench import copy_bandwidth, read_bandwidth
    args = list(argv or sys.argv[1:])
    traced = "--timeline" in args                    # also where a step's time goes, by op
    specs = [a for a in args if a != "--timeline"] or ["L8:Q4_K_M"]
    bw = copy_bandwidth(cp)
    read = read_bandwidth(cp, 1 << 30)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: copy {bw / 1e9:.0f} GB/s, "
          f"a grid-stride read of 1 GB {read / 1e9:.0f} GB/s ({100 * read / bw:.1f}%)", flush=True)
    for spec in specs:
        shape, mix, *ctx = spec.split(":")
        ctx = int(ctx[0]) if ctx else 128
        for attention in (False, True):
            ops = step_ops(shape, mix, ctx, attention)
            step_bytes, rows = measure(cp, ops)
            what = f"ctx {ctx}, attention and merge as ops" if attention else "matrices only"
            print(f"\n{shape} {mix}, {what}: {len(ops)} ops, {step_bytes / 1e6:.1f} MB a step")
            print("| ring slots | dp4a a 16 B | shares | variant | ms a step | GB/s | % of copy |")
            print("|---|---|---|---|---|---|---|")
            for S, W, il, name, t, g in rows:
                print(f"| {S} | {W} | {SHARES[il]} | {name} | {t * 1e3:.4f} | "
                      f"{g / 1e9:.0f} | {100 * g / bw:.1f} |", flush=True)
            for _, _, sh in runnable(cp, [(8, 0, 1), (8, 0, BULK)]) if traced else ():
                for dep in DEPS:
                    print(f"\ntimeline, {SHARES[sh]}, {dep} (summed over the layers, us):")
                    print(timeline_table(ops, timeline(cp, ops, dep, shares=sh), bw), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
