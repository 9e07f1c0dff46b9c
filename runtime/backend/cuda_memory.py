"""How much GPU memory a model will take, computed before anything is uploaded
(no CuPy needed: `info` prints it on any machine)."""
from __future__ import annotations

import math
import re

MIN_COMPUTE_CAPABILITY = 75      # sm_75 (Turing) and newer
PREFILL_CHUNK = 512              # rows of the largest eager step (Engine.prefill's chunk)
ARENA_RING = 8                   # buffers per shape in the CUDA backend's step arena
GEMM_TILE_BYTES = 128 << 20      # fp16 tile of a dequantized weight (quant.cuda.GEMM_TILE_ELEMS * 2)
RUNTIME_BYTES = 64 << 20         # cuBLAS workspace, kernel modules, graphs


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


# llama.cpp's LLM_FFN_EXPS_REGEX (common/common.h): the tensors --cpu-moe keeps in system memory
_EXPERT_TENSOR = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")
CPU_MOE_ALL = -1        # --cpu-moe: the experts of every layer (--n-cpu-moe N: of the first N)


def layer_of(name: str) -> int | None:
    """The layer a tensor belongs to (`blk.N.*`), None for the others (embedding, output)."""
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def experts_on_host(name: str, cpu_moe: int | None) -> bool:
    """--cpu-moe / --n-cpu-moe N (llama.cpp's names and rule): the expert tensors
    (`blk.L.ffn_{gate,up,down}_exps`) of every layer (cpu_moe CPU_MOE_ALL) or of layers
    L < N stay in system memory and run on the CPU; 0 or None: none."""
    if not cpu_moe:
        return False
    i = layer_of(name)
    return i is not None and (cpu_moe < 0 or i < cpu_moe) and _EXPERT_TENSOR.search(name) is not None


def on_gpu(name: str, n_layers: int, gpu_layers: int | None = None, cpu_moe: int | None = 0) -> bool:
    """Where a tensor lives, for the backends (cuda.py, cuda_split.py) and the estimate
    alike: the experts --cpu-moe names on the host; with gpu_layers (--gpu-layers N) the
    first N layers on the GPU, the token embedding on the host, the output norm and head
    on the GPU only when every layer is; without it, everything else on the GPU."""
    if experts_on_host(name, cpu_moe):
        return False
    if gpu_layers is None:
        return True
    i = layer_of(name)
    if i is not None:
        return i < gpu_layers
    if name == "token_embd.weight":
        return False
    return gpu_layers >= n_layers


def tensor_device_bytes(t) -> int:
    """Bytes a tensor takes on the device: matrices as stored, vectors as float32."""
    if len(t.shape) == 1 or getattr(t, "name", "").endswith(".bias"):      # (experts' biases [E, cols] too)
        return 4 * math.prod(t.shape)
    return int(t.nbytes)


def kv_cache_bytes(cfg, n_ctx: int, block_size: int = 16, cache_blocks: int = 0, n_layers=None,
                   cache_type: str = "f16") -> int:
    from ..kv_cache import kv_bytes_per_token_layer
    n_blocks = cache_blocks or 2 * math.ceil(n_ctx / block_size)
    layers = cfg.n_layers if n_layers is None else n_layers
    return n_blocks * block_size * layers * kv_bytes_per_token_layer(cfg.n_kv_heads, cfg.head_dim, cache_type)


def work_bytes(cfg, max_weight_elems: int, experts_on_gpu: bool = True) -> int:
    n = PREFILL_CHUNK
    q = cfg.n_heads * cfg.head_dim
    per_row = cfg.d_model * 2 + cfg.d_ff + q * 2 + cfg.n_kv_heads * cfg.head_dim * 2
    if cfg.n_experts:       # the moe op's rows: each token's k experts, gathered (x, gate, up, down)
        per_row += cfg.n_experts + (cfg.n_experts_used * (2 * cfg.d_model + 2 * cfg.d_ff_expert)
                                    if experts_on_gpu else cfg.d_model)
    acts = ARENA_RING * n * per_row * 4
    tile = min(GEMM_TILE_BYTES, 2 * max_weight_elems)
    x16 = n * max(cfg.d_model, cfg.d_ff) * 2
    return acts + tile + x16 + RUNTIME_BYTES


def estimate_bytes(cfg, tensors: dict, n_ctx: int, block_size: int = 16, cache_blocks: int = 0,
                   gpu_layers: int | None = None, cache_type: str = "f16", cpu_moe: int | None = 0) -> dict:
    """{'weights', 'kv_cache', 'work', 'total'} in GPU bytes for `n_ctx` tokens of context,
    and 'host_weights': the bytes of the tensors that stay in system memory (as stored:
    memory-mapped).  With gpu_layers, only those layers' tensors (and the output head when
    all layers are on the GPU) count; with cpu_moe (--cpu-moe, --n-cpu-moe N), not the
    experts it keeps on the host (on_gpu: the backends' own rule)."""
    gpu = {n: on_gpu(n, cfg.n_layers, gpu_layers, cpu_moe) for n in tensors}
    weights = sum(tensor_device_bytes(t) for n, t in tensors.items() if gpu[n])
    host = sum(int(t.nbytes) for n, t in tensors.items() if not gpu[n])
    biggest = max((math.prod(t.shape) for n, t in tensors.items() if len(t.shape) == 2 and gpu[n]), default=0)
    layers = cfg.n_layers if gpu_layers is None else min(gpu_layers, cfg.n_layers)
    kv = kv_cache_bytes(cfg, n_ctx, block_size, cache_blocks, layers, cache_type)
    experts_gpu = any(gpu[n] for n in tensors if _EXPERT_TENSOR.search(n))
    work = work_bytes(cfg, biggest, experts_gpu)
    return {"weights": weights, "kv_cache": kv, "work": work, "total": weights + kv + work, "host_weights": host}
