"""The CUDA backend (CuPy): the same ops as the CPU backend, on an NVIDIA GPU.

* Weights are uploaded once in their GGUF block layout (quant/cuda); matmuls
  decode blocks in registers (n <= 8 rows) or dequantize a tile at a time to
  fp16 for cuBLAS (prompt processing).  No dequantized weight matrix stays.
* Activations are float32, the KV cache fp16 [n_slots, kv_heads, head_dim] per
  layer, indexed by slot exactly as on the CPU.
* Step buffers come from an arena that hands out the same buffers in the same
  order every step, so a decode step has fixed pointers: it is captured once as
  a CUDA graph per block-table width and replayed: the graph copies the step's
  index arrays in from pinned memory and, for greedy decoding, ends in the argmax,
  which writes the token into pinned host memory; Python fills the step in place,
  launches the graph and waits (forward_argmax; forward copies the logits out).
* Prompt chunks of PROMPT_GRAPH_ROWS tokens (every chunk of a long prompt but its
  last) are captured too, one graph per table width, cuBLAS GEMMs included, and
  replayed from the second chunk of that length on; other multi-token steps run
  eagerly (~750 launches through Python a step: on small models the host, not the
  GPU, sets an eager prompt's speed).
* A mixture of experts routes decode steps (up to GRAPH_ROWS rows) on the device
  (quant/cuda qmoe.cuh: top-k, matvecs by expert id, the weighted sum), so they are
  captured and replayed like a dense model's; prompts, and experts of a type without an
  id-indexed kernel, route on the host (moe.py) and run eagerly.
"""
from __future__ import annotations

import os
import weakref
from pathlib import Path

import numpy as np

import quant
from quant import QTensor

from ..kv_cache import QK8, kv_bytes_per_token_layer
from . import DeviceUnavailable, moe
from .cuda_memory import MIN_COMPUTE_CAPABILITY, estimate_bytes, format_bytes

_SRC = Path(__file__).resolve().parent / "cuda_kernels.cu"
# the glu() kinds' kernels (cuda_kernels.cu)
_GLU_KERNELS = {"silu": "silu_mul", "gelu": "gelu_mul", "swiglu_oai": "swiglu_oai_mul"}
MV_MAX_ROWS = 8        # quant.cuda.MV_MAX_ROWS (that module needs CuPy to import; CUDABackend checks they agree)


def probe() -> dict:
    """The GPU we would use, or DeviceUnavailable with a one-line reason."""
    try:
        import cupy as cp
    except ImportError:
        raise DeviceUnavailable("CuPy is not installed (pip install 'llamba[cuda]' or cupy-cuda12x)") from None
    except Exception as e:   # a broken CuPy install: say what it said
        raise DeviceUnavailable(f"CuPy failed to import: {str(e).splitlines()[0]}") from None
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:
        raise DeviceUnavailable(f"no usable NVIDIA driver ({str(e).splitlines()[0]})") from None
    if n == 0:
        raise DeviceUnavailable("CuPy found no NVIDIA GPU")
    props = cp.cuda.runtime.getDeviceProperties(0)
    cc = props["major"] * 10 + props["minor"]
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    if cc < MIN_COMPUTE_CAPABILITY:
        raise DeviceUnavailable(f"{name} has compute capability {props['major']}.{props['minor']}; "
                                f"Llamba's CUDA kernels need 7.5 or newer")
    free, total = cp.cuda.runtime.memGetInfo()
    return {"name": name, "cc": cc, "free": int(free), "total": int(total),
            "sms": int(props.get("multiProcessorCount", 0))}


# most tokens of one sequence a step replayed from a CUDA graph has (speculative
# verify: k + 1 rows; longer steps, prompts, run op by op), and of a step whose
# attention is split by the graph's table width (_split_ctx).  The integer matvec's
# range: past it the matmuls go to cuBLAS, which a CUDA graph capture cannot hold and
# whose sums are not a one-token step's
GRAPH_ROWS = MV_MAX_ROWS
# decode attention by key tiles (attn_tiles) once a context split holds this many keys
# (0: never), and the most context splits.  H200, graph replay of random-weight L8 / Q15
# Q4_K_M decode steps (quant/cuda/NOTES.md, session 17): from 16 keys a split the tiles
# won at every depth measured (8000 tokens of context: L8 3.231 -> 2.562 ms, Q15 1.750 ->
# 1.367), from 8 (contexts below ~300 tokens) they lost up to 5% on Q15; 128 splits lost
# to 64 at every depth.
ATT_TILE_KEYS = int(os.environ.get("LLAMBA_ATT_TILE_KEYS", "16"))
ATT_MAX_SPLITS = int(os.environ.get("LLAMBA_ATT_SPLITS", "64"))
# a mixture of experts' decode steps (up to GRAPH_ROWS rows) routed on the device (moe:
# _moe_on_device), so they are captured as CUDA graphs; 0: every step routed on the host
# (the grouped path prompts take), the tests' reference.  On since its first GPU run (session
# 32, H100: bit for bit the host routing, graphs, batch invariance; Qwen3-30B-A3B shape tg128
# 337 t/s, 1.13x llama.cpp's CUDA build); LLAMBA_MOE_DEVICE=0 turns it off.
MOE_ON_DEVICE = os.environ.get("LLAMBA_MOE_DEVICE", "1") == "1"


# prompt chunks of exactly this many tokens (Engine.prefill's chunk: every chunk of a long
# prompt but its last) are replayed from CUDA graphs, one per block-table width, from the
# second chunk of this length on (a one-off prompt pays no capture); 0: always eager.
# A prompt step is otherwise ~750 launches through Python: on small models the host,
# not the GPU, sets the prompt's speed
PROMPT_GRAPH_ROWS = int(os.environ.get("LLAMBA_PROMPT_GRAPH_ROWS", "512"))

# steps of more tokens than this (prompts) take the tiled prompt attention (attn_prefill);
# up to it (decode, speculative verify) every token gets the decode kernel's sums
PREFILL_TILED_MIN = 16
# query rows (tokens x the heads of a kv head) a block of attn_prefill takes (head dims
# of 256: 8, for shared memory).  16 passed test_ops/test_models/test_greedy_argmax_gpu
# (63, session 14) and is ~3% faster on L8 pp512 (16028 vs 15551 t/s), but Q15 (host-bound)
# went 28332 vs 29375 in the same run and the speculative GPU tests have not run with it
PREFILL_ROWS = 32


# prompt attention on the tensor cores (attn_prefill_mma: the head dims in MMA_HEAD_DIMS,
# fp16 operands like the prompt's GEMMs); 0: attn_prefill's float32 sums for every head dim.
PREFILL_MMA = os.environ.get("LLAMBA_ATT_MMA", "1") != "0"
MMA_HEAD_DIMS = tuple(int(v) for v in os.environ.get("LLAMBA_ATT_MMA_DIMS", "64,128,256").split(",") if v)
# Its key splits: with few KV heads (Q15's 2, Gemma 3's 1) a chunk's query tiles x KV
# heads make fewer blocks than the GPU runs at once, so each block's key tiles are split
# over up to PREFILL_MAX_SPLITS blocks (for PREFILL_SPLIT_WAVES x the SMs in all), merged
# by attn_merge as decode's splits are; 1: never.  Writing and merging the shares costs
# ~20 us a layer, which short contexts do not win back unless the blocks are very few:
# so a chunk seeing fewer than PREFILL_SPLIT_MIN_KEYS keys splits only when its blocks are
# under half the SMs.  H200, prompts from graphs (quant/cuda/NOTES.md, session 22), 4096
# tokens in chunks of 512: Gemma-3-like head dim 256 and 1 KV head 70.5k t/s split, 26.8k
# unsplit; Q15 49.1k against 40.7k; Q15's first chunk split at 512 keys 68.5k, unsplit 73.1k.
PREFILL_MAX_SPLITS = int(os.environ.get("LLAMBA_ATT_PRE_SPLITS", "8"))
PREFILL_SPLIT_WAVES = 2
PREFILL_SPLIT_MIN_KEYS = 1024
MMA_ROWS = 64       # its query rows a block (4 warps x 16): MMA_ROWS // G tokens


def _prefill_pq(hd: int, g: int) -> int:
    """Tokens a block of attn_prefill takes (compiled in as PRE_PQ)."""
    return max(1, (8 if hd >= 256 else PREFILL_ROWS) // g)


class _Arena:
    """Step buffers handed out in call order: a ring of RING buffers per (capacity,
    dtype), cursors reset every step, so a step sees the same buffers each time
    (fixed pointers for graph replay).  A buffer is reused only RING same-shape
    requests later, far beyond any op's lifetime (at most one layer).  Row counts
    are rounded up to a power of two so prompts of any length share buffers."""

    RING = 8

    def __init__(self, cp):
        self.cp = cp
        self.rings: dict = {}
        self.cursor: dict = {}
        self.pinned: dict = {}

    def reset(self):
        self.cursor.clear()

    def get(self, shape, dtype=np.float32, tag=None):
        shape = tuple(int(s) for s in shape)
        rows = shape[0]
        cap = 1 << max(0, (rows - 1).bit_length())
        key = (cap,) + shape[1:] + (np.dtype(dtype).str, tag)
        ring = self.rings.setdefault(key, [])
        i = self.cursor.get(key, 0)
        self.cursor[key] = i + 1
        slot = i if tag is not None else i % self.RING
        while len(ring) <= slot:
            ring.append(self.cp.empty((cap,) + shape[1:], dtype))
        return ring[slot][:rows]

    def nbytes(self) -> int:
        return sum(int(b.nbytes) for r in self.rings.values() for b in r)


class CUDAKVStorage:
    """K and V pools per layer, fp16 [n_slots, kv_heads, head_dim] on the device; for the
    k16v8 cache V as q8_0, the CPU backend's layout: int8 [n_slots, kv_heads, head_dim]
    and an fp16 scale per 32 values (v_scale [n_slots, kv_heads, head_dim / 32])."""

    def __init__(self, cp, n_layers, n_slots, n_kv_heads, head_dim, cache_type="f16"):
        if cache_type not in ("f16", "k16v8"):
            raise ValueError(f"the CUDA backend keeps the KV cache in f16 or k16v8 (asked for '{cache_type}')")
        self.cp = cp
        self.cache_type = cache_type
        self.v_quant = cache_type == "k16v8"
        shape = (n_slots, n_kv_heads, head_dim)
        self.k = [cp.zeros(shape, cp.float16) for _ in range(n_layers)]
        self.v = [cp.zeros(shape, cp.int8 if self.v_quant else cp.float16) for _ in range(n_layers)]
        self.v_scale = ([cp.zeros((n_slots, n_kv_heads, head_dim // QK8), cp.float16) for _ in range(n_layers)]
                        if self.v_quant else [])
        self.bytes_per_token_layer = kv_bytes_per_token_layer(n_kv_heads, head_dim, cache_type)
        self.bytes_per_token = n_layers * self.bytes_per_token_layer
        self.nbytes = sum(int(a.nbytes) for a in self.k + self.v + self.v_scale)

    def v_args(self, layer: int) -> tuple:
        """The V pool as the attention kernels take it: (values,) or (values, scales)."""
        return (self.v[layer], self.v_scale[layer]) if self.v_quant else (self.v[layer],)

    def copy_block(self, src: int, dst: int, block_size: int, layers=None) -> None:
        s, d = slice(src * block_size, (src + 1) * block_size), slice(dst * block_size, (dst + 1) * block_size)
        for i in (range(len(self.k)) if layers is None else layers):
            self.k[i][d] = self.k[i][s]
            self.v[i][d] = self.v[i][s]
            if self.v_quant:
                self.v_scale[i][d] = self.v_scale[i][s]

    def shift(self, layer: int, src, dst, delta: int, inv_freq, neox: bool, pos_scale: float = 1.0) -> None:
        """Context shift (rare): move K/V from slots src to dst, keys re-rotated by delta.
        Done on the host with the CPU backend's arithmetic."""
        cp = self.cp
        src = cp.asarray(np.asarray(src, np.int64))
        dst = cp.asarray(np.asarray(dst, np.int64))
        k = self.k[layer][src].get().astype(np.float32)
        v = self.v[layer][src]
        inv_freq = np.asarray(inv_freq, np.float32)
        half = inv_freq.shape[0]
        ang = (np.float64(delta) / pos_scale) * inv_freq.astype(np.float64)
        c = np.cos(ang).astype(np.float32)
        s = np.sin(ang).astype(np.float32)
        if neox:
            a, b = k[..., :half].copy(), k[..., half:2 * half].copy()
            k[..., :half], k[..., half:2 * half] = a * c - b * s, a * s + b * c
        else:
            a, b = k[..., 0:2 * half:2].copy(), k[..., 1:2 * half:2].copy()
            k[..., 0:2 * half:2], k[..., 1:2 * half:2] = a * c - b * s, a * s + b * c
        self.k[layer][dst] = cp.asarray(k.astype(np.float16))
        self.v[layer][dst] = v
        if self.v_quant:                        # V moves as stored (not rotated)
            self.v_scale[layer][dst] = self.v_scale[layer][src]


class _DevStep:
    """A Step whose index arrays live on the device (views into one int32 buffer)."""

    def __init__(self, step, views: dict, n_splits: int, attn_tiles: bool = False):
        self.tokens = views["tokens"]
        self.positions = views["positions"]
        self.seq_of_token = views["seq_of_token"]
        self.logit_rows = views["logit_rows"]
        self._slots = views["slots"]          # [n_groups, N]
        self._tables = views["tables"]        # [n_groups, S, MB]
        self.slots = self._slots[0]
        self.block_tables = self._tables[0]
        self.block_size = step.block_size
        self.attn_scale = step.attn_scale
        self.attn_splits = n_splits
        self.attn_tiles = attn_tiles          # decode attention by key tiles (attn_tiles)
        self.windows = step.windows
        self.layer_group = list(getattr(step, "layer_group", None) or [])
        # a prompt's tokens (one sequence, consecutive positions, more than a verify
        # step's): attention by query tiles (attn_prefill); other steps by the decode kernel
        n = len(step.positions)
        self.prompt_tiles = False
        if n > PREFILL_TILED_MIN:       # decode and verify steps skip the checks
            pos, seqs = np.asarray(step.positions), np.asarray(step.seq_of_token)
            self.prompt_tiles = bool(np.all(seqs == seqs[0]) and np.array_equal(pos, pos[0] + np.arange(n)))

    def window(self, layer):
        return self.windows[layer]

    def slots_for(self, layer):
        return self._slots[self.layer_group[layer]] if self.layer_group else self.slots

    def tables_for(self, layer):
        return self._tables[self.layer_group[layer]] if self.layer_group else self.block_tables


def _pack_step(step, max_blocks: int | None = None):
    """The step's index arrays as one int32 host array, and where each one lies."""
    n = len(step.tokens)
    group_slots = getattr(step, "group_slots", None)
    group_tables = getattr(step, "group_tables", None) or [step.block_tables]
    if group_slots is None:
        group_slots = np.asarray(step.slots, np.int32)[None]
    S, mb = group_tables[0].shape
    MB = max_blocks or mb
    parts = [("tokens", np.asarray(step.tokens, np.int32), (n,)),
             ("positions", np.asarray(step.positions, np.int32), (n,)),
             ("seq_of_token", np.asarray(step.seq_of_token, np.int32), (n,)),
             ("logit_rows", np.asarray(step.logit_rows, np.int32), (len(step.logit_rows),)),
             ("slots", np.asarray(group_slots, np.int32), group_slots.shape)]
    tables = np.zeros((len(group_tables), S, MB), np.int32)
    for g, t in enumerate(group_tables):
        tables[g, :, :t.shape[1]] = t
    parts.append(("tables", tables, tables.shape))
    layout, off = {}, 0
    for name, a, shape in parts:
        layout[name] = (off, shape)
        off += int(np.prod(shape))
    flat = np.empty(off, np.int32)
    for name, a, shape in parts:
        o, _ = layout[name]
        flat[o:o + a.size] = a.reshape(-1)
    return flat, layout


def _views(buf, layout):
    return {name: buf[o:o + int(np.prod(shape))].reshape(shape) for name, (o, shape) in layout.items()}


def _decode_fill_views(host, layout):
    """Views into a decode graph's packed host buffer (_pack_step's layout: n tokens of
    one sequence, or one token of each of n sequences) for the fields that change from
    step to step."""
    v = _views(host, layout)
    return v["tokens"], v["positions"], v["slots"], v["tables"]


def _fill_decode(fill, step):
    """Write a step of one sequence (a decode token, or a verify step's rows), or of a
    decode token each of several sequences, into its graph's host buffer in place: what
    _pack_step would write, without building a new array (seq_of_token and logit_rows,
    fixed by the graph's key, stay as packed).  Table entries past a group's width are
    zeroed: a table can shrink (a rollback, a sequence replaced) within one graph width."""
    tokens, positions, slots, tables = fill
    tokens[:] = step.tokens
    positions[:] = step.positions
    group_slots = getattr(step, "group_slots", None)
    if group_slots is None:
        slots[0] = step.slots
        group_tables = [step.block_tables]
    else:
        slots[:] = group_slots
        group_tables = step.group_tables or [step.block_tables]
    for g, t in enumerate(group_tables):
        w = t.shape[1]
        tables[g, :, :w] = t
        tables[g, :, w:] = 0


class _Profiler:
    """Stands in for the backend during one forward and brackets each op with events."""

    def __init__(self, be):
        self.be = be
        self.events = []

    def __getattr__(self, name):
        f = getattr(self.be, name)
        if name in ("heads", "end_layer") or not callable(f):     # no GPU work to time
            return f

        def timed(*a, **k):
            label = name
            if name in ("matmul", "matmuls", "matmul_add", "logits"):
                Ws = a[1] if name == "matmuls" else [a[1]]
                label += " " + "+".join(f"{W.qtype.name}[{W.shape[0]}x{W.shape[1]}]" for W in Ws)
            s, e = self.be.cp.cuda.Event(), self.be.cp.cuda.Event()
            self.be._fn("spin")((1,), (1,), (np.int64(400_000),))    # ~0.2 ms: covers the host's enqueue
            s.record(self.be.stream)
            r = f(*a, **k)
            e.record(self.be.stream)
            self.events.append((label, s, e))
            return r
        return timed


def _mask_rows(m, rows: int) -> np.ndarray:
    """A step's token masks as C-contiguous uint32 [rows, words]."""
    return np.ascontiguousarray(m, np.uint32).reshape(rows, -1)


def _overlaps(a, b) -> bool:
    """Whether device arrays a and b share any byte."""
    a0, b0 = a.data.ptr, b.data.ptr
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


class CUDABackend:
    name = "cuda"
    # most tokens a step may have with each row's logits equal to a one-token step's
    # bit for bit (speculative verify: k + 1 rows): the integer matvec's and the
    # decode attention's range
    exact_rows = GRAPH_ROWS

    def __init__(self, graphs: bool | None = None, cpu_moe: int | None = 0, threads: int | None = None,
                 host=None):
        """cpu_moe (--cpu-moe: CPU_MOE_ALL, --n-cpu-moe N: N): the expert tensors of those
        layers stay in system memory and run on the CPU with `threads` threads (host: a
        CPUBackend to run them on, else a new one); cuda_host_moe.py."""
        import cupy as cp
        import quant.cuda as qc
        assert qc.MV_MAX_ROWS == MV_MAX_ROWS, "quant.cuda.MV_MAX_ROWS changed: GRAPH_ROWS follows it"
        self.cp, self.qc = cp, qc
        info = probe()
        self.device_info = info
        self._pdl = qc.pdl
        # captured decode steps launch their kernels with programmatic dependent launch
        self.use_pdl = qc.pdl.available(info["cc"], cp.cuda.runtime.driverGetVersion())
        self.device_name = (f"{info['name']} (sm_{info['cc']}, {format_bytes(info['total'])}, "
                            f"CuPy {cp.__version__})")
        self.threads = 1
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.arena = _Arena(cp)
        self.ws = qc.Workspace()
        self.kv: CUDAKVStorage | None = None
        self.weight_bytes = 0
        self._consts: dict = {}
        self._attn_mods: dict = {}
        self._mod = None
        self._graphs: dict = {}
        self._seen: set = set()
        self._prompt_warm: dict = {}       # (model, rows) of prompt chunks run eagerly -> their logits' shape
        self.prompt_graph_error = None     # why a prompt chunk could not be captured, if one could not
        if graphs is None:
            graphs = os.environ.get("LLAMBA_CUDA_GRAPHS", "1") != "0"
        self.use_graphs = graphs
        self.host_experts = None        # --cpu-moe: the experts kept in system memory (cuda_host_moe.py)
        if cpu_moe:
            from .cuda_host_moe import HostExperts
            self.host_experts = HostExperts(self, cpu_moe, threads, host)
            self.threads = self.host_experts.cpu.threads
        self.graph_replays = 0
        self.setup_events = 0           # steps that captured a graph (one-time costs)
        self._last_graph = None
        self._pnorm = None          # deferred RMSNorm (x, w, eps, out)
        self._pnorm2 = None         # a second one of the same width, launched with it (rmsnorm2)
        self._pglu = None           # deferred GLU (g, u, kind)
        self._propes = []           # deferred RoPEs (x, positions, inv_freq, neox, pos_scale, mscale)
        self._unmat: set = set()    # outputs of folded ops: never written
        self.profile_next = False
        self.last_profile = None
        self._argmax_state: dict = {}   # rows -> (best u64, count u32 (zeroed), ids int32) [rows]
        self._mask_dev: dict = {}       # shape -> the device copy of a step's token masks
        self._pmoe = None               # deferred weighted sum of a decode moe op (y, w, k, out): see add
        self._host_combine = None       # the host-routed moe op's weighted sum (ElementwiseKernel)
        self.moe_on_device = MOE_ON_DEVICE
        # the moe ops of the step being run: [all, routed on the device]; and per model,
        # whether its last eager step of up to GRAPH_ROWS rows routed every one on the
        # device (then its decode steps may be captured: _graph_safe)
        self._moe_calls = [0, 0]
        self._moe_device_models = weakref.WeakKeyDictionary()

    # ---- memory ------------------------------------------------------------------
    def check_fits(self, lm, n_ctx: int, block_size: int = 16, cache_blocks: int = 0, cache_type="f16"):
        """Refuse, before anything is uploaded, a model that will not fit in free GPU memory."""
        cpu_moe = self.host_experts.cpu_moe if self.host_experts else 0
        est = estimate_bytes(lm.config, lm.tensors, n_ctx, block_size, cache_blocks, cache_type=cache_type,
                             cpu_moe=cpu_moe)
        free = self.cp.cuda.runtime.memGetInfo()[0]
        self.estimate = est
        if cpu_moe and lm.config.n_experts:
            self.device_name += "; " + self.host_experts.describe(lm.config)
        if est["total"] > free:
            raise DeviceUnavailable(
                f"{lm.path.name if getattr(lm, 'path', None) else 'model'} needs about "
                f"{format_bytes(est['total'])} of GPU memory (weights {format_bytes(est['weights'])}, "
                f"KV cache {format_bytes(est['kv_cache'])} for {n_ctx} tokens, work buffers "
                f"{format_bytes(est['work'])}) but {self.device_info['name']} has {format_bytes(free)} free: "
                f"use a smaller context (-c), fewer --gpu-layers, "
                + ("--cpu-moe or --n-cpu-moe N (experts in system memory), " if lm.config.n_experts else "")
                + "or a smaller quantization")
        return est

    def memory_report(self) -> dict:
        free, total = self.cp.cuda.runtime.memGetInfo()
        return {"device": self.device_name, "weights_bytes": int(self.weight_bytes),
                "host_weights_bytes": int(self.host_experts.weight_bytes) if self.host_experts else 0,
                "kv_cache_bytes": int(self.kv.nbytes) if self.kv else 0,
                "work_bytes": int(self.arena.nbytes()) + int(self.ws.w16.nbytes if self.ws.w16 is not None else 0),
                "device_free_bytes": int(free), "device_total_bytes": int(total)}

    # ---- set-up ------------------------------------------------------------------
    def upload(self, t: QTensor, streamed: bool = True):
        """Matrices keep their block layout on the device; 1-D tensors (norms, biases)
        become float32 vectors."""
        cp = self.cp
        if self.host_experts is not None and self.host_experts.holds(t.name):
            return self.host_experts.upload(t)      # (its steps are captured where they wait for nothing)
        if len(t.shape) == 1 or t.name.endswith(".bias"):       # (experts' biases: [E, cols])
            v = cp.asarray(quant.dequantize(t).astype(np.float32).reshape(t.shape))
            self.weight_bytes += v.nbytes
            return v
        if len(t.shape) == 3:
            return self._upload_experts(t)
        if not self.qc.kernel_supports(t):
            raise ValueError(f"tensor '{t.name}' ({t.qtype.name}, shape {t.shape}) has no CUDA kernel")
        w = self.qc.upload(t)
        self.weight_bytes += w.nbytes
        return w

    def _upload_experts(self, t: QTensor):
        """A layer's experts [E, M, K] in one device buffer, each expert's bytes starting
        on a 256-byte boundary; a DeviceWeight view an expert, which the matmul kernels
        take as any matrix."""
        cp, qc = self.cp, self.qc
        views = t.experts()
        if not qc.kernel_supports(views[0]):
            raise ValueError(f"tensor '{t.name}' ({t.qtype.name}, shape {t.shape}) has no CUDA kernel")
        per = views[0].nbytes
        stride = -(-per // 256) * 256
        data = cp.zeros(stride * len(views) + 256, cp.uint8)    # (+: the matvecs' aligned loads past the end)
        if stride == per:
            data[:per * len(views)].set(np.ascontiguousarray(t.data).reshape(-1))
        else:
            for e, v in enumerate(views):
                data[e * stride:e * stride + per].set(np.ascontiguousarray(v.data).reshape(-1))
        self.weight_bytes += data.nbytes
        return qc.DeviceExperts([qc.DeviceWeight(v.name, v.qtype, tuple(v.shape), data[e * stride:(e + 1) * stride],
                                                 v.row_nbytes) for e, v in enumerate(views)], data, stride)

    def alloc_kv(self, n_layers, n_slots, n_kv_heads, head_dim, cache_type="f16"):
        self.kv = CUDAKVStorage(self.cp, n_layers, n_slots, n_kv_heads, head_dim, cache_type)
        return self.kv

    # ---- one step --------------------------------------------------------------
    def forward(self, model, step) -> np.ndarray:
        """Run one step; logits come back as a host float32 array [rows, vocab] that the
        caller owns."""
        return self._forward(model, step, False)

    def forward_argmax(self, model, step, masks=None) -> np.ndarray:
        """Run one step; the argmax of each logits row (np.argmax's: the first maximum) as
        int64 [rows], computed on the device: 4 bytes a row cross to the host, not the
        row's vocab floats.  masks: a callable giving the rows' allowed-token bitmasks
        (uint32 [rows, words], constrain.apply_mask's layout), called once the forward is
        enqueued, so the host computes them while the device runs; they go up (4 bytes a
        32 tokens) and the argmax is taken among allowed tokens."""
        return self._forward(model, step, "masked" if masks is not None else True, masks)

    def _apply_masks(self, logits, m, staging=None):
        """Upload the masks m (uint32 [rows, words]; through pinned `staging` when given)
        and set the logits of disallowed tokens to -inf on the device, on the step's stream."""
        from runtime.constrain import apply_mask
        if staging is None or staging.shape != m.shape:
            dev = self.cp.asarray(m)
        else:
            staging[:] = m
            dev = self._mask_dev.get(m.shape)
            if dev is None:
                dev = self._mask_dev[m.shape] = self.cp.empty(m.shape, self.cp.uint32)
            rt = self.cp.cuda.runtime
            rt.memcpyAsync(dev.data.ptr, staging.ctypes.data, staging.nbytes, rt.memcpyHostToDevice, self.stream.ptr)
        apply_mask(logits, dev)

    def _forward(self, model, step, argmax, masks=None) -> np.ndarray:
        cp = self.cp
        n = len(step.tokens)
        if self.profile_next:
            self.profile_next = False
            self.last_profile = self.profile_step(model, step)
        with self.stream:
            # one-token decode steps, and speculative verify steps (up to GRAPH_ROWS
            # tokens of one sequence, logits for every row): each shape its own graph
            # (a mixture of experts only where it routes on the device: _graph_safe),
            # and decode steps of several sequences, a token each (the server's batches):
            # a graph per sequence count too (the same kernels and split counts as eager)
            S = step.block_tables.shape[0]
            graphable = (self.use_graphs and self._graph_safe(model, n)
                         and (S == 1 and (n == 1 and len(step.logit_rows) == 1
                                          or 1 < n <= GRAPH_ROWS and len(step.logit_rows) == n
                                          or n == PROMPT_GRAPH_ROWS and len(step.logit_rows) == 1 and not argmax)
                              or 1 < S == n <= GRAPH_ROWS and len(step.logit_rows) == n
                              and np.array_equal(step.seq_of_token, np.arange(n))))
            if graphable:
                return self._forward_graph(model, step, argmax, masks)
            flat, layout = _pack_step(step)
            buf = cp.asarray(flat)
            dstep = _DevStep(step, _views(buf, layout), *self._attn_plan(n, self._split_ctx(step), model))
            self._moe_calls = [0, 0]
            out = self._run(model, dstep)
            if self._moe_calls[0] and n <= GRAPH_ROWS:
                self._moe_device_models[model] = self._moe_calls[0] == self._moe_calls[1]
            if argmax:
                if masks is not None:
                    self._apply_masks(out, _mask_rows(masks(), out.shape[0]))
                return self._argmax(out).get().astype(np.int64)
            return out.get()

    def _graph_safe(self, model, n: int) -> bool:
        """Whether a step of n tokens may be captured: yes unless the model routes tokens
        (a mixture of experts: which experts run depends on the data) and its moe ops wait
        for the host.  They do not in decode steps (n <= GRAPH_ROWS) of a model whose last
        eager such step routed every moe op on the device (moe: experts with an id-indexed
        kernel), so its first decode step runs eagerly and the next ones replay."""
        if not getattr(model, "routes_tokens", False):
            return True
        return n <= GRAPH_ROWS and self._moe_device_models.get(model, False)

    def _argmax(self, x, host_out=None):
        """Device argmax of each row of x [rows, n] float32 (argmax_rows): int32 [rows] on
        the device, or written straight into host_out (pinned host memory, int32 [rows]:
        the device writes it over the bus; read it after the stream is synchronized)."""
        cp = self.cp
        rows, n = x.shape
        st = self._argmax_state.get(rows)
        if st is None:
            st = self._argmax_state[rows] = (cp.zeros(rows, cp.uint64), cp.zeros(rows, cp.uint32),
                                             cp.empty(rows, cp.int32))
        out = st[2] if host_out is None else np.uintp(host_out.ctypes.data)
        nb = max(1, min(256, (n + 1023) // 1024))     # ~1024 values a block: 4 loads a thread
        self._fn("argmax_rows")((nb, rows), (256,), (x, np.int32(n), np.int64(x.strides[0] // 4),
                                                      st[0], st[1], out))
        return st[2] if host_out is None else host_out

    def _run(self, model, dstep):
        return self._run_as(model, dstep, self)

    def _begin_forward(self):
        """A forward's start: the arena's buffers free again, no op deferred."""
        self.arena.reset()
        self._pnorm, self._pnorm2, self._pglu, self._propes, self._pmoe = None, None, None, [], None
        self._unmat.clear()

    def _run_as(self, model, dstep, ops):
        self._begin_forward()
        out = model.forward(ops, dstep)
        self._flush()
        return out

    @staticmethod
    def _graph_width(mb: int) -> int:
        """Block-table width of the decode graph for mb blocks: 8, 16, 32, ..."""
        return 1 << max(3, (mb - 1).bit_length())

    def _split_ctx(self, step) -> int:
        """The context length attention splits are sized for.  Steps of a few tokens use
        the block-table width a decode graph would have, so a step computes the same
        sums whether replayed from a graph or run eagerly: with the integer path's
        rounding, a different summation order can flip an activation code, and logits
        would move by 1e-3 between the two."""
        if len(step.tokens) <= GRAPH_ROWS:
            return self._graph_width(step.block_tables.shape[1]) * step.block_size
        return int(np.max(step.positions)) + 1

    def _splits(self, n_tokens, ctx, model) -> int:
        """Context splits of attention: enough blocks when few tokens attend (decode),
        each split about 8 keys (2 a warp) up to 64 splits: a warp walks its keys one
        after another (dependent loads), so at short contexts the walk, not the bytes,
        is the time (L8 decode at 65 keys: 21 us a layer with 32-key splits).

        Steps of up to GRAPH_ROWS tokens (decode, speculative verify) get the count of a
        one-token step whatever their rows: the splits set the order a token's keys are
        summed in, and a verify row must equal its one-token step bit for bit.  Only
        larger steps (prompts), which have blocks enough without, go unsplit."""
        if n_tokens > GRAPH_ROWS and n_tokens * model.cfg.n_kv_heads >= 64 or ctx < 16:
            return 1
        return max(1, min(ATT_MAX_SPLITS, ctx // 8))

    def _prefill_splits(self, blocks: int, ctx: int) -> int:
        """Key splits of a tensor-core prompt attention launch of this many blocks, for a
        step whose block tables span ctx keys (the graph width's, so a chunk replayed from
        its prompt graph and the same chunk run eagerly split alike)."""
        sms = self.device_info.get("sms", 0)
        target = PREFILL_SPLIT_WAVES * sms
        if (PREFILL_MAX_SPLITS <= 1 or blocks >= target
                or ctx < PREFILL_SPLIT_MIN_KEYS and 2 * blocks >= sms):
            return 1
        return min(PREFILL_MAX_SPLITS, -(-target // blocks))

    def _attn_plan(self, n_tokens, ctx, model) -> tuple[int, bool]:
        """(context splits, by key tiles): the decode kernel `attention` walks a split's
        keys a warp at a time, `attn_tiles` a tile of DEC_BK at a time, which pays once a
        split holds ATT_TILE_KEYS keys (a long context).  Both follow from the context
        width alone, like the splits, so a verify row keeps its one-token step's sums.
        """
        splits = self._splits(n_tokens, ctx, model)
        tiles = (ATT_TILE_KEYS > 0 and ctx // splits >= ATT_TILE_KEYS
                 and model.cfg.head_dim % 64 == 0 and n_tokens <= GRAPH_ROWS)
        return splits, tiles

    def _forward_graph(self, model, step, argmax, masks=None):
        """Decode: replay the step captured for this block-table width (and output).

        The graph holds the whole step: the step's index arrays copied in from a pinned
        host buffer, the forward, and either the device argmax of the logits, which writes
        the token (one int32) into pinned host memory itself, or the logits row's copy
        into pinned memory.  A token's host work
        is writing its token, position, slots and block tables into that buffer, one
        graph launch and one wait."""
        MB = self._graph_width(step.block_tables.shape[1])
        n = len(step.tokens)
        # "masked": the graph ends with the logits on the device; the mask goes up and the
        # argmax runs after it (eagerly: the mask is known only once the graph is launched)
        key = (id(model), MB, n, step.block_tables.shape[0], {True: "ids", False: "logits", "masked": "dev"}[argmax])
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._new_decode_graph(model, step, MB, argmax)
        _fill_decode(g["fill"], step)
        if n > GRAPH_ROWS:          # (logits only: forward_argmax's prompts stay eager)
            return self._forward_prompt_graph(model, g, (id(model), n))
        self._last_graph = g
        if g["graph"] is None:
            # eager once (compiles kernels, sizes the arena), then capture for the next tokens
            self.setup_events += 1
            self._decode_body(model, g, capture=False)
            if argmax == "masked":
                self._masked_argmax(g, masks)
            self.stream.synchronize()
            res = g["host_out"].copy()
            try:
                self._capture(model, g)
            except Exception:
                if not self.use_pdl:
                    raise
                self.use_pdl = False    # a driver that refuses programmatic launches in a capture
                self._capture(model, g)
        else:
            g["graph"].launch(self.stream)
            self.graph_replays += 1
            if argmax == "masked":
                self._masked_argmax(g, masks)
            self.stream.synchronize()
            res = g["host_out"].copy()
        return res.astype(np.int64) if argmax else res   # the caller's own array either way

    def _masked_argmax(self, g, masks):
        """After a "masked" graph's forward: its logits (on the device) masked, then argmax
        into the pinned ids."""
        out = g["dev_out"]
        m = _mask_rows(masks(), out.shape[0])
        if g.get("mask_host") is None or g["mask_host"].shape != m.shape:
            g["mask_host"] = self._pinned(m.shape, np.uint32)
        self._apply_masks(out, m, g["mask_host"])
        self._argmax(out, host_out=g["host_out"])

    def _forward_prompt_graph(self, model, g, warm_key):
        """A prompt chunk of PROMPT_GRAPH_ROWS tokens: the first of its length (on this
        model) runs eagerly, which compiles its kernels and sizes the arena and the fp16
        tiles; a later one at a new width is captured and then launched (about one eager
        step's host time), the next ones at that width replayed.  The graph is recaptured
        if the fp16 tiles have since been reallocated; where capture fails (a cuBLAS that
        cannot be captured), prompts stay eager."""
        ws = self.ws
        if g["graph"] is not None and g["ws_gen"] != ws.generation:
            g["graph"] = None
        if g["graph"] is None and warm_key in self._prompt_warm and not g.get("eager"):
            self.setup_events += 1
            if g["host_out"] is None:       # (no host allocation inside a capture)
                g["host_out"] = self._pinned(self._prompt_warm[warm_key], np.float32)
            gen = ws.generation
            try:
                self._capture(model, g)
                g["ws_gen"] = gen
            except Exception as e:
                g["graph"], g["eager"] = None, True
                self.prompt_graph_error = f"{type(e).__name__}: {e}"
        if g["graph"] is None:
            if warm_key not in self._prompt_warm:
                self.setup_events += 1      # (a first chunk of its length: its timing is no later one's)
            self._decode_body(model, g, capture=False)
            self._prompt_warm[warm_key] = g["host_out"].shape
        else:
            g["graph"].launch(self.stream)
            self.graph_replays += 1
        self.stream.synchronize()
        return g["host_out"].copy()

    def _pinned(self, shape, dtype):
        """A host array in pinned memory (what the device copies into or out of inside a graph)."""
        n = int(np.prod(shape))
        mem = self.cp.cuda.alloc_pinned_memory(n * np.dtype(dtype).itemsize)
        return np.frombuffer(mem, dtype, n).reshape(shape)

    def _capture(self, model, g):
        g["graph"] = None
        self.stream.begin_capture()
        try:
            with self._pdl.capturing(self.use_pdl):
                self._decode_body(model, g, capture=True)
        finally:
            g["graph"] = self.stream.end_capture()

    def _new_decode_graph(self, model, step, MB, argmax):
        cp = self.cp
        flat, layout = _pack_step(step, MB)
        host = self._pinned(flat.shape, np.int32)
        host[:] = flat
        dev = cp.empty(flat.size, cp.int32)
        dstep = _DevStep(step, _views(dev, layout), *self._attn_plan(len(step.tokens), MB * step.block_size, model))
        return {"host": host, "dev": dev, "dstep": dstep, "graph": None, "argmax": argmax,
                "fill": _decode_fill_views(host, layout), "host_out": None, "ws_gen": None}

    def _decode_body(self, model, g, capture: bool):
        """Enqueue one decode step on the stream: copy in, forward, argmax or copy out."""
        cp = self.cp
        rt = cp.cuda.runtime
        sp = self.stream.ptr
        rt.memcpyAsync(g["dev"].data.ptr, g["host"].ctypes.data, g["host"].nbytes, rt.memcpyHostToDevice, sp)
        out = self._run(model, g["dstep"])
        if g["host_out"] is None:
            g["host_out"] = (self._pinned(out.shape[:1], np.int32) if g["argmax"]
                             else self._pinned(out.shape, out.dtype))
        if g["argmax"] == "masked":     # the logits stay on the device (_masked_argmax)
            g["dev_out"] = out
        elif g["argmax"]:   # the kernel writes the ids into pinned host memory itself
            self._argmax(out, host_out=g["host_out"])
        else:
            rt.memcpyAsync(g["host_out"].ctypes.data, out.data.ptr, out.nbytes, rt.memcpyDeviceToHost, sp)

    def invalidate_plans(self) -> None:
        """Forget the captured steps (call after changing a model's weights, or how its moe ops
        run): they hold the old ones, and whether a mixture of experts' steps may be captured
        is worked out again by its next eager step."""
        self._graphs.clear()
        self._last_graph = None
        self._moe_device_models.clear()

    # ---- measuring -------------------------------------------------------------
    def replay_ms(self, reps: int = 50) -> float:
        """GPU time of one decode step: the last captured graph replayed back to back."""
        cp = self.cp
        g = self._last_graph
        s, e = cp.cuda.Event(), cp.cuda.Event()
        g["graph"].launch(self.stream)
        s.record(self.stream)
        for _ in range(reps):
            g["graph"].launch(self.stream)
        e.record(self.stream)
        e.synchronize()
        return cp.cuda.get_elapsed_time(s, e) / reps

    def profile_step(self, model, step) -> list:
        """[(op label, GPU ms)] of one eager run of `step`, summed by label, largest first.
        Deferred ops show up in the op that launched them (RMSNorm in the matmul after it)."""
        cp = self.cp
        with self.stream:
            flat, layout = _pack_step(step)
            buf = cp.asarray(flat)
            dstep = _DevStep(step, _views(buf, layout),
                             *self._attn_plan(len(step.tokens), self._split_ctx(step), model))
            prof = _Profiler(self)
            self._run_as(model, dstep, prof)
            self.stream.synchronize()
        tot = {}
        for label, a, b in prof.events:
            tot[label] = tot.get(label, 0.0) + cp.cuda.get_elapsed_time(a, b)
        return sorted(tot.items(), key=lambda kv: -kv[1])

    # ---- kernels -------------------------------------------------------------
    @staticmethod
    def _src():
        from quant.cuda import pdl, source
        return source(_SRC, _SRC.parent / "cuda_attn.cuh", pdl.HEADER)

    def _fn(self, name):
        if self._mod is None:
            self._mod = self.cp.RawModule(code=self._src(), options=self._options())
        return self._pdl.Kernel(self._mod.get_function(name))

    def _attn_fn(self, hd, g, name, v8=False):
        """Kernel `name` compiled for head dim hd and GQA group g (v8: V pools in q8_0)."""
        pq = _prefill_pq(hd, g)
        key = (hd, g, pq, v8)
        mod = self._attn_mods.get(key)
        if mod is None:
            mod = self._attn_mods[key] = self.cp.RawModule(
                code=self._src(), options=self._options() + (f"-DATT_HD={hd}", f"-DATT_G={g}", f"-DPRE_PQ={pq}")
                + (("-DATT_V8=1",) if v8 else ()))
        return self._pdl.Kernel(mod.get_function(name))

    def _options(self):
        return ("-std=c++17", f"-I{_SRC.parent}", f"-I{self._pdl.HEADER.parent}") + self._pdl.options()

    def _launch(self, name, n, args, block=256):
        self._fn(name)(((n + block - 1) // block,), (block,), args)

    def _const(self, a):
        """A host constant (e.g. RoPE frequencies) on the device, uploaded once."""
        k = id(a)
        hit = self._consts.get(k)
        if hit is None or hit[0] is not a:
            hit = self._consts[k] = (a, self.cp.asarray(np.ascontiguousarray(a, np.float32)))
        return hit[1]

    # ---- deferred ops ----------------------------------------------------------
    # RMSNorm and GLU are not launched when called: the next matmul folds them into
    # its activations' int8 quantization (integer decode path) or its fp16 conversion
    # (prompt GEMM); else the next op launches them.  (Folded into the float matvec's
    # loads, every block recomputed the row's rms: L8 decode 7.1 vs 4.9 ms, H200; removed.)
    # RoPE of q and k waits for attention, which does RoPE + the KV write in one kernel.
    # The delay never crosses another op, so inputs are unchanged when a deferred op runs.  A folded op's own output is never written: reading it raises
    # (no model does).
    def _flush(self, keep_ropes=False):
        if self._pmoe is not None:             # a decode moe op's sum, not taken by add
            y, w, k, out = self._pmoe
            self._pmoe = None
            self.qc.moe_combine(y, w, k, out)
            self._unmat.discard(out.data.ptr)
        if self._pnorm is not None or self._pnorm2 is not None:
            # (the second alone where a matmul folded the first into its input's rounding)
            one, two = self._pnorm or self._pnorm2, self._pnorm2 if self._pnorm else None
            self._pnorm = self._pnorm2 = None
            x, w, eps, out = one
            d = x.shape[-1]
            threads = (min(256, (d + 31) // 32 * 32),)
            if two is None:
                self._fn("rmsnorm")((x.size // d,), threads, (x, w, np.float32(eps), out, np.int32(d)))
            else:
                x2, w2, _, out2 = two
                self._fn("rmsnorm2")((x.size // d + x2.size // d,), threads,
                                     (x, w, out, np.int32(x.size // d), x2, w2, out2, np.float32(eps), np.int32(d)))
        if self._pglu is not None:
            g, u, kind = self._pglu
            self._pglu = None
            self._launch(_GLU_KERNELS[kind], g.size, (g, u, np.int64(g.size)))
        if self._propes and not keep_ropes:
            ropes, self._propes = self._propes, []
            for x, pos, inv_freq, neox, pos_scale, mscale in ropes:
                self._rope_now(x, pos, inv_freq, neox, pos_scale, mscale)

    def _check(self, *arrays):
        for a in arrays:
            if a is not None and not isinstance(a, np.ndarray) and a.data.ptr in self._unmat:
                raise RuntimeError("internal: an op read the output of an RMSNorm/GLU that was folded into a matmul")

    def _buf(self, shape, dtype=np.float32, tag=None):
        b = self.arena.get(shape, dtype, tag)
        self._unmat.discard(b.data.ptr)
        return b

    # ---- ops ----------------------------------------------------------------
    def embed(self, W, ids, scale: float = 1.0):
        self._flush()
        n = ids.shape[0]
        out = self._buf((n, W.shape[1]), tag="residual")
        self.qc.embed_rows(W, ids, out, scale)
        return out

    def rmsnorm(self, x, w, eps):
        p = self._pnorm
        if (p is not None and self._pnorm2 is None and self._pglu is None and self._pmoe is None and not self._propes
                and x.shape[-1] == p[0].shape[-1] and eps == p[2] and x.flags.c_contiguous
                and not _overlaps(x, p[3])):
            # a second norm of the same width that does not read the first's output (Qwen3's
            # and Gemma 3's k heads after q): both in one launch, each row's bits unchanged
            self._check(x)
            out = self._buf(x.shape)
            self._pnorm2 = (x, w, eps, out)
            return out
        self._flush()
        self._check(x)
        out = self._buf(x.shape)
        self._pnorm = (x, w, eps, out)
        return out

    def heads(self, x, n_heads):
        return x.reshape(x.shape[0], n_heads, -1)

    def _mm(self, x, Ws, biases=None, acc=None):
        n = x.shape[0]
        prologue, src = None, x
        # the integer path folds a pending RMSNorm/GLU into its activation quantization,
        # the prompt path into its fp16 conversion (one launch, not two)
        if self.qc.int8_applies(n, Ws) or self.qc.gemm_applies(n):
            if self._pnorm is not None and self._pnorm[3] is x:
                xin, w, eps, _ = self._pnorm
                self._pnorm = None
                prologue, src = ("rmsnorm", w, eps), xin
            elif self._pglu is not None and self._pglu[0] is x:
                g, u, kind = self._pglu
                self._pglu = None
                prologue, src = (kind, u.reshape(n, -1)), g
        self._flush()
        src = src.reshape(n, -1)
        if prologue is None:
            self._check(src)
        if not src.flags.c_contiguous:
            src = self.cp.ascontiguousarray(src)
            self._pdl.fence()
        outs = [acc] if acc is not None else [self._buf((n, W.shape[0])) for W in Ws]
        self.qc.matmul(src, list(Ws), outs, biases, accumulate=acc is not None, ws=self.ws, prologue=prologue)
        if prologue is not None:
            self._unmat.add(x.data.ptr)       # never written: see _check
        return outs

    def matmul(self, x, W, bias=None):
        return self._mm(x, [W], [bias] if bias is not None else None)[0]

    def matmuls(self, x, Ws, biases=None):
        return self._mm(x, Ws, biases)

    def matmul_add(self, x, W, acc):
        self._mm(x, [W], acc=acc)

    def add(self, x, y):
        pm = self._pmoe
        if pm is not None and pm[3] is y and x.shape == y.shape and x.flags.c_contiguous:
            # the decode moe op's weighted sum, added into x where it is made (one launch)
            self._pmoe = None
            self._flush()
            self._check(x)
            self.qc.moe_combine(pm[0], pm[1], pm[2], x, accumulate=True)
            return
        self._flush()
        self._check(x, y)
        self._launch("add_inplace", x.size, (x, y, np.int64(x.size)))

    def glu(self, g, u, kind):
        self._flush()
        self._check(g, u)
        if kind not in ("silu", "gelu"):      # (the matmuls fold these two only: run it now)
            self._launch(_GLU_KERNELS[kind], g.size, (g, u, np.int64(g.size)))
            return g
        self._pglu = (g, u, kind)
        return g

    def moe(self, x, router, experts, top_k, norm_topk, router_bias=None, biases=None, glu="silu"):
        """Mixture of experts, as the CPU backend's (cpu.py): steps of up to exact_rows rows
        (decode, speculative verify, the server's batched decode) route on the device where
        the experts have id-indexed kernels (_moe_on_device: no host wait, so decode steps are
        captured as CUDA graphs); other steps (prompts) on the host (_moe_on_host).  Both give
        a row the same bits.  Experts kept in system memory (--cpu-moe) run on the CPU
        (cuda_host_moe.py).  A branch that waits for the host must not count in
        self._moe_calls[1] (the step could not be captured).  Options as the CPU's (gpt-oss:
        router_bias, biases (gate, up, down) [E, cols], glu the experts' activation: both
        paths take them)."""
        self._moe_calls[0] += 1
        if self.host_experts is not None and self.host_experts.owns(experts):
            # experts kept in system memory (--cpu-moe): the router here, the experts on the CPU
            return self.host_experts.moe(x, router, experts, top_k, norm_topk, router_bias, biases, glu)
        if self.moe_on_device and x.shape[0] <= self.exact_rows and self.qc.moe_ids_ok(experts, top_k):
            self._moe_calls[1] += 1
            return self._moe_on_device(x, router, experts, top_k, norm_topk, router_bias, biases, glu)
        return self._moe_on_host(x, router, experts, top_k, norm_topk, router_bias, biases, glu)

    def _moe_on_device(self, x, router, experts, top_k, norm_topk, router_bias=None, biases=None, glu="silu"):
        """The moe op without the host: the router's logits (a matvec), each row's top k and
        weights with x's rounding in one launch (moe_route: moe.py's route bit for bit), gate
        and up of every (row, slot) pair by expert id (matvec_ids), down with SiLU . up folded
        into its rounding, then the rows' weighted sums, deferred to the add that takes them
        (summed into the residual there: one launch).  A pair's sums are those the host path's
        matvec of its expert makes, so both paths agree bit for bit.  gpt-oss: the router's
        bias in its matvec, the experts' biases added by expert id (add_bias_ids: the single
        add the host path's matvec store makes), and its clamped SwiGLU by the host path's
        own kernel before down's rounding."""
        cp, qc = self.cp, self.qc
        self._flush()
        self._check(x)
        x = x.reshape(x.shape[0], -1)
        if not x.flags.c_contiguous:
            x = cp.ascontiguousarray(x)
            self._pdl.fence()
        n, d = x.shape
        gates, ups, downs = experts
        ff, P = gates.shape[0], n * top_k
        logits = self._buf((n, len(gates)))
        qc.matmul(x, [router], [logits], [router_bias] if router_bias is not None else None, ws=self.ws)
        ids, w = self._buf((P,), np.int32), self._buf((P,))
        acts = qc.moe_route(x, logits, top_k, norm_topk, ids, w, qc.act_block(gates), self.ws)
        g, u = self._buf((P, ff)), self._buf((P, ff))
        qc.matvec_ids(x, [gates, ups], ids, [g, u], top_k, self.ws, acts=acts)
        y = self._buf((P, d))
        if biases is None and glu == "silu":
            qc.matvec_ids(g, [downs], ids, [y], 1, self.ws, prologue=("silu", u))
        else:
            if biases is not None:
                self._add_bias_ids(g, biases[0], ids)
                self._add_bias_ids(u, biases[1], ids)
            self._launch(_GLU_KERNELS[glu], g.size, (g, u, np.int64(g.size)))
            qc.matvec_ids(g, [downs], ids, [y], 1, self.ws)
            if biases is not None:
                self._add_bias_ids(y, biases[2], ids)
        out = self._buf((n, d))
        self._pmoe = (y, w, top_k, out)
        self._unmat.add(out.data.ptr)         # written by the add that takes it, or by _flush
        return out

    def _add_bias_ids(self, y, bias, ids):
        """y [P, M] += bias [E, M] row ids[p] (add_bias_ids)."""
        assert y.flags.c_contiguous and bias.flags.c_contiguous and bias.shape[1] == y.shape[1]
        self._launch("add_bias_ids", y.size, (y, bias, ids, np.int32(y.shape[1]), np.int64(y.size)))

    def _moe_on_host(self, x, router, experts, top_k, norm_topk, router_bias=None, biases=None, glu="silu"):
        """The router's logits go to the host, which picks each token's experts and groups
        the step's rows by expert (moe.py); each chosen expert then runs once on its run of
        gathered rows, the others are not read.  The host wait makes this op's steps eager
        (no CUDA graph)."""
        cp = self.cp
        self._flush()
        self._check(x)
        x = x.reshape(x.shape[0], -1)
        if not x.flags.c_contiguous:
            x = cp.ascontiguousarray(x)
        n, d = x.shape
        gates, ups, downs = experts
        logits = self._buf((n, len(gates)))
        self.qc.matmul(x, [router], [logits], [router_bias] if router_bias is not None else None, ws=self.ws)
        self.stream.synchronize()
        w, tokens, starts, pos = moe.plan(logits.get(), top_k, norm_topk)
        if self.qc.gemm_applies(n):
            return self._moe_prompt(x, experts, top_k, w, tokens, starts, pos, biases, glu)
        rows, ff = n * top_k, gates[0].shape[0]
        idx = cp.asarray(np.concatenate([tokens, pos.reshape(-1), w.reshape(-1).view(np.int32)]))
        tok_d, pos_d, w_d = idx[:rows], idx[rows:2 * rows], idx[2 * rows:].view(cp.float32)
        self._pdl.fence()
        xs, y = self._buf((rows, d)), self._buf((rows, d))
        g, u = self._buf((rows, ff)), self._buf((rows, ff))
        self._launch("gather_rows", rows * d, (x, tok_d, np.int32(rows), np.int32(d), xs))
        runs = [(int(starts[e]), int(starts[e + 1]), e) for e in np.flatnonzero(np.diff(starts))]
        gb, ub, db = biases if biases is not None else (None, None, None)
        for a, b, e in runs:
            self.qc.matmul(xs[a:b], [gates[e], ups[e]], [g[a:b], u[a:b]],
                           [gb[e], ub[e]] if biases is not None else None, ws=self.ws)
        self._launch(_GLU_KERNELS[glu], g.size, (g, u, np.int64(g.size)))
        for a, b, e in runs:
            self.qc.matmul(g[a:b], [downs[e]], [y[a:b]], [db[e]] if biases is not None else None, ws=self.ws)
        return self._combine_pairs(y, pos_d, w_d, top_k, n)

    def _combine_pairs(self, y, pos_d, w_d, top_k, n):
        """out[t] = sum over j of w[t, j] * y[pos[t, j]] (moe.combine's order), a fresh buffer."""
        out = self._buf((n, y.shape[1]))
        # (the ElementwiseKernel run on an H100 in session 30, kept while qc.moe_combine's pos=
        # form, this path's, has not run on a GPU: the device-routed path's forms have, session 32)
        if self._host_combine is None:
            self._host_combine = self.cp.ElementwiseKernel(
                "raw float32 y, raw int32 pos, raw float32 w, int32 k, int32 d", "float32 out",
                "const int t = i / d, c = i % d; float s = 0.f;"
                "for (int j = 0; j < k; ++j) s += w[t * k + j] * y[(long long)pos[t * k + j] * d + c];"
                "out = s;", "llamba_moe_combine")
        self._host_combine(y, pos_d, w_d, np.int32(top_k), np.int32(y.shape[1]), out)
        self._pdl.fence()
        return out

    def _moe_prompt(self, x, experts, top_k, w, tokens, starts, pos, biases, glu):
        """The host-routed moe op of a prompt (more rows than the matvecs take): the pairs
        laid out in chunks of experts (moe.ExpertChunks), each chunk one dequantization and
        one batched GEMM a weight (qc.matmul_experts), then the same combine.  A chunk's pad
        rows are computed and never read."""
        cp, qc = self.cp, self.qc
        n, d = x.shape
        gates, ups, downs = experts
        ff = gates.shape[0]
        ck = moe.ExpertChunks(starts, tokens, pos, max(1, qc.GEMM_TILE_ELEMS // (ff * d)))
        rows, P = ck.rows, n * top_k
        idx = cp.asarray(np.concatenate([ck.src, ck.eid, ck.pos.reshape(-1), w.reshape(-1).view(np.int32),
                                         ck.experts]))
        src_d, eid_d = idx[:rows], idx[rows:2 * rows]
        pos_d, w_d = idx[2 * rows:2 * rows + P], idx[2 * rows + P:2 * rows + 2 * P].view(cp.float32)
        ck.experts_d = idx[2 * rows + 2 * P:]
        self._pdl.fence()
        xs, g, u = self._buf((rows, d)), self._buf((rows, ff)), self._buf((rows, ff))
        self._launch("gather_rows", rows * d, (x, src_d, np.int32(rows), np.int32(d), xs))
        x16 = qc.f16_activations(xs, None, self.ws.get("x16", rows * d))
        qc.matmul_experts(x16, gates, ck, g, self.ws)
        qc.matmul_experts(x16, ups, ck, u, self.ws)
        if biases is not None:
            self._add_bias_ids(g, biases[0], eid_d)
            self._add_bias_ids(u, biases[1], eid_d)
        if biases is None and glu == "silu":
            g16 = qc.f16_activations(g, ("silu", u), self.ws.get("x16", rows * ff))
        else:
            self._launch(_GLU_KERNELS[glu], g.size, (g, u, np.int64(g.size)))
            g16 = qc.f16_activations(g, None, self.ws.get("x16", rows * ff))
        y = self._buf((rows, d))
        qc.matmul_experts(g16, downs, ck, y, self.ws)
        if biases is not None:
            self._add_bias_ids(y, biases[2], eid_d)
        return self._combine_pairs(y, pos_d, w_d, top_k, n)

    def rope(self, x, step, inv_freq, neox, pos_scale=1.0, mscale=1.0):
        self._flush(keep_ropes=True)
        self._check(x)
        self._propes.append((x, step.positions, inv_freq, neox, pos_scale, mscale))

    def _rope_now(self, x, positions, inv_freq, neox, pos_scale, mscale):
        n, h, d = x.shape
        half = inv_freq.shape[0]
        self._launch("rope", n * h * half, (x, positions, self._const(inv_freq), np.int32(n), np.int32(h),
                                            np.int32(d), np.int32(half), np.int32(1 if neox else 0),
                                            np.float32(pos_scale), np.float32(mscale)))

    def end_layer(self):
        """Nothing: every op keeps its own buffers, at the addresses the captured
        decode graph was recorded with."""

    def rows(self, x, idx):
        self._flush()
        self._check(x)
        n, d = len(idx), x.shape[-1]
        if isinstance(idx, np.ndarray) or not hasattr(idx, "data"):
            idx = self.cp.asarray(np.asarray(idx, np.int32))
        out = self._buf((n, d))
        self._launch("gather_rows", n * d, (x, idx, np.int32(n), np.int32(d), out))
        return out

    def logits(self, x, W):
        return self._mm(x, [W])[0]

    def attention(self, q, k, v, layer, step, sinks=None):
        """As the CPU backend's; sinks: a float32 logit per query head (gpt-oss) joining each
        row's softmax denominator, taken where a row's result is final (the kernel's end
        with one split, else attn_merge)."""
        n, h, d = q.shape
        sk = np.uint64(0) if sinks is None else sinks        # (null: no sinks)
        kv = self.kv
        kvh = k.shape[1]
        g = h // kvh
        slots, tables = step.slots_for(layer), step.tables_for(layer)
        r = self._propes
        fused = (len(r) == 2 and r[0][0] is q and r[1][0] is k and r[0][2] is r[1][2] and r[0][3:] == r[1][3:]
                 and 2 * r[0][2].shape[0] == d and self._pnorm is None and self._pnorm2 is None and self._pglu is None
                 and not kv.v_quant)     # (a q8_0 V needs a block's max: kv_write_v8 below)
        if fused:
            self._propes = []
            _, pos, inv_freq, neox, pos_scale, mscale = r[0]
            self._launch("rope_qk_kv_write", n * (h + kvh) * (d // 2),
                         (q, k, v, kv.k[layer], kv.v[layer], slots, pos, self._const(inv_freq), np.int32(n),
                          np.int32(h), np.int32(kvh), np.int32(d), np.int32(1 if neox else 0), np.float32(pos_scale),
                          np.float32(mscale)))
        else:
            self._flush()
            self._check(q, k, v)
            self._launch("kv_write_v8" if kv.v_quant else "kv_write", n * kvh * d,
                         (k, v, kv.k[layer]) + kv.v_args(layer) + (slots, np.int32(n), np.int32(kvh * d)))
        splits = step.attn_splits
        out = self._buf((n, h, d))
        if getattr(step, "prompt_tiles", False) and splits == 1:
            mma = PREFILL_MMA and d in MMA_HEAD_DIMS and g <= MMA_ROWS
            pq = MMA_ROWS // g if mma else _prefill_pq(d, g)
            qtiles = (n + pq - 1) // pq
            args = (q, kv.k[layer]) + kv.v_args(layer) + (tables, np.int32(tables.shape[1]), step.seq_of_token,
                    step.positions, np.int32(n), np.int32(step.block_size), np.int32(step.window(layer)),
                    np.float32(step.attn_scale), np.int32(kvh), out)
            if not mma:
                self._attn_fn(d, g, "attn_prefill", kv.v_quant)((qtiles, kvh), (128,), args + (sk,))
                return out.reshape(n, h * d)
            ns = self._prefill_splits(qtiles * kvh, self._graph_width(tables.shape[1]) * step.block_size)
            parts = self._attn_parts(n, kvh, ns, g, d) if ns > 1 else (np.uint64(0),) * 3   # (null: writes out)
            self._attn_fn(d, g, "attn_prefill_mma", kv.v_quant)((qtiles, kvh, ns), (128,), args + parts + (sk,))
            if ns > 1:
                self._attn_merge(parts, ns, n, h, kvh, g, d, out, sk)
            return out.reshape(n, h * d)
        parts = self._attn_parts(n, kvh, splits, g, d) if splits > 1 else (out,) * 3
        self._attn_fn(d, g, "attn_tiles" if getattr(step, "attn_tiles", False) else "attention", kv.v_quant)(
            (splits, kvh, n), (128,),
            (q, kv.k[layer]) + kv.v_args(layer) + (tables, np.int32(tables.shape[1]), step.seq_of_token, step.positions,
             np.int32(step.block_size), np.int32(step.window(layer)), np.float32(step.attn_scale),
             np.int32(splits), np.int32(kvh)) + parts + (out, sk))
        if splits > 1:
            self._attn_merge(parts, splits, n, h, kvh, g, d, out, sk)
        return out.reshape(n, h * d)

    def _attn_parts(self, n, kvh, ns, g, d):
        """(max, sum, unnormalized output) of ns key splits of every query row, for attn_merge."""
        return self._buf((n * kvh * ns * g,)), self._buf((n * kvh * ns * g,)), self._buf((n * kvh * ns * g * d,))

    def _attn_merge(self, parts, ns, n, h, kvh, g, d, out, sinks=np.uint64(0)):
        self._attn_fn(d, g, "attn_merge")((n * h,), (min(d, 256),), parts + (np.int32(ns), np.int32(kvh), out, sinks))
