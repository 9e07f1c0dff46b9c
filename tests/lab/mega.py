"""Experiment: the decode megakernel (mega.cu), a llama-family decode step (one token) as
an embedding lookup plus one persistent kernel, instead of ~11 launches a layer.

It measured slower than the kernels an op on the H200 (quant/cuda/NOTES.md; L8 Q8_0 with
the bulk-copy ring, session 27: 3.0 ms a step against 2.71), so it left the product for the
lab.  Importing this module hooks it into runtime.backend.cuda.CUDABackend (`_install`):
with LLAMBA_CUDA_MEGA=1 (or ENABLED set), graph-replayed decode steps where `why_not` finds
nothing against it run as the megakernel; results equal the eager kernels' bit for bit.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

_DIR = Path(__file__).resolve().parent
_ROOT = _DIR.parent.parent
_QDIR = _ROOT / "quant" / "cuda"
_BDIR = _ROOT / "runtime" / "backend"        # cuda_attn.cuh: the product's attention, shared
MIN_CC = 80                     # cp.async (the kernel compiles for sm_75 too, unpipelined)
ENABLED = os.environ.get("LLAMBA_CUDA_MEGA", "0") == "1"
WARPS = 16
SUB = 4                         # 1024-weight chunks a ring slot (fewer where the ring would get < MIN_STAGES)
MIN_STAGES = 3
MAX_STAGES = 8
PFA, PFB = 0, 0                 # slots a warp asks the L2 for ahead of its ring: before attention, a barrier
MAX_SPLITS = 64                 # CUDABackend._splits never asks for more
# sm_90+ with Q8_0 weights: each block's matvec weights stream through one ring of whole-row
# slots filled by bulk copies (cp.async.bulk), not through a cp.async ring a warp
# (tests/lab/gpu_q8ring.py measured the structure; LLAMBA_CUDA_MEGA_BULK=0 turns it off)
BULK = os.environ.get("LLAMBA_CUDA_MEGA_BULK", "1") != "0"
BULK_CC = 90
BULK_SB = 32768                 # bytes a slot
BULK_S = 4                      # slots (4 x 32 KB measured best: 6 x 32 KB and 8 x 16 KB were slower)
BULK_ROWS = 32                  # rows a slot, at most (mega.cu MB_ROWS)
TAB_BYTES = 512 * 4             # the block table's static shared memory (mega.cu MG_TABN)
OTHER_STATIC = 512              # the warp rings' other static shared memory, at most
CW = 1024                       # weights a chunk (qint8.cuh MVS_CW)
# GGML type id -> (block elements, block bytes) for the types the kernel decodes
_BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
           12: (256, 144), 13: (256, 176), 14: (256, 210)}
_SEG = 6                        # int64 fields of MSeg
_PHASE = 3 * _SEG + 9           # of MPhase
_SPH = 176                      # bytes of the kernel's shared-memory copy of an MPhase
OPS = ("qkv", "attention", "merge", "o", "gate/up", "down")


def slot_words(ty: int, sub: int) -> int:
    """16-byte words of a ring slot of `sub` chunks of type ty (at any 2-byte alignment, + 1)."""
    qk, bb = _BLOCKS[ty]
    return (15 + sub * CW // qk * bb + 15) // 16 + 1


def bulk_blocks(sb: int) -> int:
    """Q8_0 blocks a bulk slot of sb bytes may hold: a pair a thread, whole blocks' shares (mega.cu MB_BLOCKS)."""
    per = 32 * WARPS
    return 2 * -(-(sb // 68) // per) * per


def smem_bytes(kmax: int, hd: int, g: int, nph: int, slot: int, stages: int, warps: int = WARPS) -> tuple[int, int]:
    """(bytes before the ring, total) of the kernel's dynamic shared memory, as mega.cu lays it out."""
    xq = (kmax + 15) // 16 * 16
    act = xq + kmax // 32 * 4 + kmax // 16 * 4
    att = warps // 4 * (8 * g + 4 * g * hd) * 4
    ring_off = 1024 + nph * _SPH + (max(act, att) + 15) // 16 * 16
    return ring_off, ring_off + warps * stages * slot * 16


def bulk_ok(be, weights) -> bool:
    """Whether the bulk-copy ring can stream these matvec weights: sm_90+, all Q8_0, rows
    and bases 16-byte aligned (a bulk copy's granule), a row (gate/up: two) within a slot
    once padded to whole 32-block chunks."""
    if not BULK or be.device_info["cc"] < BULK_CC:
        return False
    return all(int(W.qtype) == 8 and W.row_nbytes % 16 == 0 and W.data.data.ptr % 16 == 0
               and 2 * -(-W.row_nbytes // (32 * 34)) * 32 * 34 <= BULK_SB for W in weights)


def why_not(be, model) -> str | None:
    """Why the megakernel cannot run this model's decode steps (None: it can)."""
    import quant.cuda as qc
    from models.llama import Llama
    if not ENABLED:
        return "off (LLAMBA_CUDA_MEGA=1 turns it on)"
    if be.device_info["cc"] < MIN_CC:
        return f"compute capability {be.device_info['cc']} < {MIN_CC}"
    if type(model) is not Llama:
        return f"{type(model).__name__} is not the llama-family model"
    if getattr(be.kv, "v_quant", False):
        return "a q8_0 V cache (k16v8): the megakernel reads f16 pools"
    if not qc.INT8_MATVEC:
        return "integer decode path off"
    if qc._int8_kernel() != "mvs":
        # its rows are mvs's sums; the eager steps (prefill, verify) must sum the same way
        return f"the eager integer matvec is {qc._int8_kernel()} (LLAMBA_CUDA_MV=mvs for the megakernel)"
    cfg = model.cfg
    hd = cfg.head_dim
    if hd not in (64, 128, 256) or (cfg.rope_dim or hd) != hd or 2 * model.inv_freq.shape[0] != hd:
        return "head size / partial RoPE"
    if cfg.rope_mscale != 1.0:
        return "YaRN / LongRoPE magnitude on cos and sin (rope_mscale)"
    if cfg.n_heads % cfg.n_kv_heads:
        return "heads"
    if max(cfg.d_model, cfg.d_ff, cfg.n_heads * hd) > 256 * 128:
        return "width"

    def fam(W):
        if not hasattr(W, "qtype") or int(W.qtype) not in _BLOCKS or not qc.int8_ok(W):
            return None
        return _BLOCKS[int(W.qtype)][0]
    groups = []
    for L in model.layers:
        groups += [[L["attn_q"], L["attn_k"], L["attn_v"]], [L["attn_output"]], [L["ffn_gate"], L["ffn_up"]],
                   [L["ffn_down"]]]
        extra = set(L) - {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                          "attn_norm", "ffn_norm", "attn_q.bias", "attn_k.bias", "attn_v.bias"}
        if extra:
            return f"layer tensors {sorted(extra)}"
        if getattr(L["ffn_gate"], "qtype", None) != getattr(L["ffn_up"], "qtype", None):
            return "gate and up of different types"
    groups.append([model.output])
    for grp in groups:
        fams = {fam(W) for W in grp}
        if None in fams or len(fams) != 1:
            return "weight types"
    if model.tok_embd.qtype not in qc.STRUCT:
        return "embedding type"
    return None


class MegaDecode:
    """The megakernel for one model on one backend: module, descriptors, work buffers."""

    def __init__(self, be, model, sub: int | None = None, max_stages: int | None = None,
                 pfa: int | None = None, pfb: int | None = None, prof: bool = False, bulk=None):
        """bulk: (slots, slot bytes, experiment flags such as "XATT") of the bulk-copy ring, in
        place of BULK_S and BULK_SB (where the ring applies)."""
        cp = be.cp
        self.be, self.model, self.cp = be, model, cp
        cfg = model.cfg
        L, D, F = cfg.n_layers, cfg.d_model, cfg.d_ff
        H, KVH, HD = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        G = H // KVH
        self.H, self.KVH, self.HD, self.G, self.L = H, KVH, HD, G, L
        f32 = cp.float32
        self.x = cp.empty((1, D), f32)
        self.q = cp.empty(H * HD, f32)
        self.k = cp.empty(KVH * HD, f32)
        self.v = cp.empty(KVH * HD, f32)
        self.a = cp.empty(H * HD, f32)
        self.h = cp.empty(F, f32)
        self.part_m = cp.empty(KVH * MAX_SPLITS * G, f32)
        self.part_l = cp.empty(KVH * MAX_SPLITS * G, f32)
        self.part_acc = cp.empty(KVH * MAX_SPLITS * G * HD, f32)
        self.cs = cp.empty(HD, f32)
        self.cnt = cp.zeros(8 * L + 8 + L * KVH, cp.uint32)
        self.err = cp.zeros(1, cp.int32)
        self.logits = cp.empty((1, model.output.shape[0]), f32)
        self.kv = cp.asarray(np.array([[be.kv.k[i].data.ptr, be.kv.v[i].data.ptr] for i in range(L)], np.int64))
        self.inv_freq = be._const(model.inv_freq)

        ph = []
        types = set()
        mats = []                   # every matvec weight, for bulk_ok

        def seg(W, y=None, bias=None):
            types.add(int(W.qtype))
            mats.append(W)
            return [W.data.data.ptr, W.row_nbytes, 0 if y is None else y.data.ptr,
                    0 if bias is None else bias.data.ptr, int(W.qtype), W.shape[0]]

        def phase(segs, K, kind, act, src, pw=None, ntasks=None):
            row = np.zeros(_PHASE, np.int64)
            for i, s in enumerate(segs):
                row[i * _SEG:(i + 1) * _SEG] = s
            bs = _BLOCKS[segs[0][4]][0]
            nt = ntasks if ntasks is not None else sum(s[5] for s in segs)
            row[18:26] = [len(segs), K, nt, kind, act, bs, src.data.ptr, 0 if pw is None else pw.data.ptr]
            row[26:27] = np.array([cfg.rms_eps], np.float64).view(np.int64)
            ph.append(row)

        for Ly in model.layers:
            phase([seg(Ly["attn_q"], self.q, Ly.get("attn_q.bias")), seg(Ly["attn_k"], self.k, Ly.get("attn_k.bias")),
                   seg(Ly["attn_v"], self.v, Ly.get("attn_v.bias"))], D, 0, 1, self.x, Ly["attn_norm"])
            phase([seg(Ly["attn_output"], self.x)], H * HD, 1, 0, self.a)
            phase([seg(Ly["ffn_gate"]), seg(Ly["ffn_up"], self.h)], D, 2, 1, self.x, Ly["ffn_norm"], ntasks=F)
            phase([seg(Ly["ffn_down"], self.x)], F, 1, 0, self.h)
        phase([seg(model.output, self.logits)], D, 0, 1, self.x, model.output_norm)
        self.phases = cp.asarray(np.stack(ph))
        self.nph = len(ph)
        self.bulk = bulk_ok(be, mats)
        self.flags = ()

        kmax = max(D, H * HD, F)
        dev = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(dev.id)
        optin = int(props.get("sharedMemPerBlockOptin", 0) or props["sharedMemPerBlock"])
        from quant.cuda import source
        src = source(_DIR / "mega.cu", _BDIR / "cuda_attn.cuh", _QDIR / "qint8.cuh", _QDIR / "qblocks.cuh",
                     _QDIR / "bulk.cuh")
        self.grid = int(props["multiProcessorCount"])
        self.clock_khz = int(props["clockRate"])
        self.prof = cp.zeros(self.grid * (len(OPS) * L + 1) * 4 + self.grid, cp.int64) if prof else None
        self._args = {}
        self.runs = 0               # launches enqueued (eager or captured)
        common = [f"-I{_QDIR}", f"-I{_BDIR}", f"-DMG_WARPS={WARPS}", f"-DMG_KMAX={kmax}", f"-DMG_NPH={self.nph}",
                  f"-DMG_HD={HD}", f"-DMG_G={G}"] + [f"-DMG_T{t}=1" for t in sorted(types)]
        common += (["-DMG_PROF=1"] if prof else []) + (["-lineinfo"] if os.environ.get("LLAMBA_CUDA_LINEINFO") else [])
        if self.bulk:
            S, sb, flags = bulk or (BULK_S, BULK_SB, ())
            ring_off, _ = smem_bytes(kmax, HD, G, self.nph, 0, 0)
            static = TAB_BYTES + S * (8 + 16) + 2 * bulk_blocks(sb) // 32 * 4 + 32 * WARPS * 4   # + mb_full, mb_desc, mb_c, mb_av
            self.smem = ring_off + S * sb
            if self.smem + static > optin:
                raise RuntimeError(f"megakernel: {optin} bytes of shared memory hold no {S} slots of {sb}")
            self.sub, self.stages, self.slot, self.pfa, self.pfb = 0, S, sb // 16, 0, 0
            self.flags = tuple(flags)
            opts = common + ["-std=c++17", "-DMG_BULK=1", f"-DMG_SB={sb}", f"-DMG_S={S}"]
            opts += [f"-DMG_{f}" if "=" in f else f"-DMG_{f}=1" for f in flags]
            self.fn = cp.RawModule(code=src, options=tuple(opts)).get_function("mega_decode")
            self.fn.max_dynamic_shared_size_bytes = self.smem
            return
        # the most chunks a slot (up to SUB) that leave MIN_STAGES slots a warp
        for sb in ([sub] if sub else [SUB, 2, 1]):
            rw = max(slot_words(t, sb) for t in types)
            slot = 2 * rw                   # a task's two rows
            ring_off, _ = smem_bytes(kmax, HD, G, self.nph, slot, 0)
            stages = min(max_stages or MAX_STAGES, (optin - TAB_BYTES - OTHER_STATIC - ring_off) // (WARPS * slot * 16))
            if stages >= MIN_STAGES:
                break
        if stages < 2:
            raise RuntimeError(f"megakernel: {optin} bytes of shared memory leave {stages} ring slots")
        _, self.smem = smem_bytes(kmax, HD, G, self.nph, slot, stages)
        self.sub, self.stages, self.slot = sb, stages, slot
        self.pfa = PFA if pfa is None else pfa
        self.pfb = PFB if pfb is None else pfb
        opts = common + ["-std=c++17", f"-DMG_S={stages}", f"-DMG_SUB={sb}", f"-DMG_RW={rw}",
                         f"-DMG_PFA={self.pfa}", f"-DMG_PFB={self.pfb}"]
        self.fn = cp.RawModule(code=src, options=tuple(opts)).get_function("mega_decode")
        self.fn.max_dynamic_shared_size_bytes = self.smem

    def config(self) -> dict:
        return {"bulk": self.bulk, "flags": self.flags, "sub": self.sub, "stages": self.stages, "pfa": self.pfa,
                "pfb": self.pfb, "smem": self.smem, "grid": self.grid, "runs": self.runs}

    def _argtuple(self, dstep):
        """The kernel's arguments for this step object (device views into its index buffer)."""
        hit = self._args.get(id(dstep))
        if hit is not None and hit[0] is dstep:
            return hit[1]
        t = dstep.block_tables
        i32, f32 = np.int32, np.float32
        args = (self.phases, i32(self.nph), self.kv, i32(self.L), self.q, self.k, self.v, self.a,
                self.part_m, self.part_l, self.part_acc, self.cs, self.cnt, self.err,
                dstep.positions, dstep.slots, t, dstep.seq_of_token, i32(t.shape[1]), i32(dstep.block_size),
                i32(dstep.window(0)), i32(dstep.attn_splits), i32(1 if self.model.cfg.rope_neox else 0),
                i32(self.KVH), self.inv_freq, f32(dstep.attn_scale), f32(1.0),
                self.prof if self.prof is not None else np.uint64(0))
        self._args[id(dstep)] = (dstep, args)
        return args

    @staticmethod
    def step_ok(dstep) -> bool:
        """One token, one KV group (every layer's slots and table are the step's), no windows."""
        return (set(dstep.layer_group) <= {0} and not any(dstep.windows)
                and 1 <= dstep.attn_splits <= MAX_SPLITS and dstep.positions.shape[0] == 1)

    def run(self, dstep):
        """Enqueue the step (embedding + megakernel) on the current stream; logits [1, vocab]."""
        cp = self.cp
        import quant.cuda as qc
        args = self._argtuple(dstep)
        qc.embed_rows(self.model.tok_embd, dstep.tokens, self.x)
        cp.cuda.runtime.memsetAsync(self.cnt.data.ptr, 0, self.cnt.nbytes, cp.cuda.get_current_stream().ptr)
        self.fn((self.grid,), (WARPS * 32,), args, shared_mem=self.smem)
        self.runs += 1
        return self.logits

    def profile(self) -> dict:
        """Where the last step's time went (a MG_PROF build): per op, the slowest block's
        time from the barrier to done, the blocks' mean, the activation rounding, and the
        barrier after it (its shortest wait: the barrier's own latency); microseconds."""
        L, grid, n = self.L, self.grid, len(OPS)
        raw = self.prof.get()
        S = raw[:grid * (n * L + 1) * 4].reshape(grid, n * L + 1, 4).astype(np.float64)
        end = raw[grid * (n * L + 1) * 4:].astype(np.float64)
        us = 1e3 / self.clock_khz
        out = {}
        for st in range(n * L + 1):
            name = "logits" if st == n * L else OPS[st % n]
            start = S[:, st, 2]
            done = end if st == n * L else S[:, st + 1, 1]
            wait = np.zeros(grid) if st == n * L else S[:, st + 1, 2] - S[:, st + 1, 1]
            quant = (S[:, st, 3] - start) if name not in ("attention", "merge") else np.zeros(grid)
            r = out.setdefault(name, {"n": 0, "max_us": 0.0, "mean_us": 0.0, "quant_us": 0.0, "barrier_us": 0.0})
            r["n"] += 1
            r["max_us"] += (done - start).max() * us
            r["mean_us"] += (done - start).mean() * us
            r["quant_us"] += quant.mean() * us
            r["barrier_us"] += wait.min() * us
        for r in out.values():
            for k in ("max_us", "mean_us", "quant_us", "barrier_us"):
                r[k] /= r["n"]
        out["block_total_us"] = float(((end - S[:, 0, 2]) * us).max())
        return out

    def failed(self) -> bool:
        """True when a barrier timed out (not all blocks resident): results are garbage."""
        return bool(int(self.err.get()[0]))


# ---- the hook into CUDABackend ------------------------------------------------------
def mega_for(be, model, dstep):
    """The megakernel for this model and step on backend `be`, or None (the kernels an op)."""
    if not getattr(be, "use_mega", True):
        return None
    megas = be._megas
    hit = megas.get(id(model))
    if hit is None or hit[0] is not model:
        why = why_not(be, model)
        if why is None:
            try:
                why = MegaDecode(be, model)
            except Exception as e:      # compile error, too little shared memory: the kernels an op
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        hit = megas[id(model)] = (model, why)
    m = hit[1]
    if isinstance(m, str) or not m.step_ok(dstep):
        return None
    if m.runs and not be.stream.is_capturing() and m.failed():
        megas[id(model)] = (model, "a grid barrier timed out")   # not all blocks resident
        return None
    return m


def mega_reason(be, model) -> str | None:
    """Why decode steps of `model` do not use the megakernel (None: they do, or will)."""
    hit = be._megas.get(id(model))
    if hit is None:
        return why_not(be, model)
    return hit[1] if isinstance(hit[1], str) else None


def _install():
    from runtime.backend.cuda import CUDABackend
    if getattr(CUDABackend, "_mega_installed", False):
        return
    init, run, plan = CUDABackend.__init__, CUDABackend._run, CUDABackend._attn_plan

    def __init__(self, *a, **kw):
        init(self, *a, **kw)
        self._megas = {}            # id(model) -> (model, MegaDecode | reason it cannot run)
        self.use_mega = True

    def _run(self, model, dstep):
        m = mega_for(self, model, dstep) if ENABLED else None
        return run(self, model, dstep) if m is None else m.run(dstep)

    def _attn_plan(self, n_tokens, ctx, model):
        splits, tiles = plan(self, n_tokens, ctx, model)
        # the megakernel has only the warp-a-key decode attention
        return splits, tiles and not (ENABLED and getattr(self, "use_mega", True))

    CUDABackend.__init__, CUDABackend._run, CUDABackend._attn_plan = __init__, _run, _attn_plan
    CUDABackend._mega_installed = True


_install()
