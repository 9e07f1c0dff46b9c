"""How much GPU memory a model will take, computed before anything is uploaded
(no CuPy needed: `info` prints it on any machine)."""
from __future__ import annotations

import math

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


def tensor_device_bytes(t) -> int:
    """Bytes a tensor takes on the device: matrices as stored, vectors as float32."""
    if len(t.shape) == 1:
        return 4 * int(t.shape[0])
    return int(t.nbytes)


def kv_cache_bytes(cfg, n_ctx: int, block_size: int = 16, cache_blocks: int = 0, n_layers=None,
                   cache_type: str = "f16") -> int:
    from ..kv_cache import kv_bytes_per_token_layer
    n_blocks = cache_blocks or 2 * math.ceil(n_ctx / block_size)
    layers = cfg.n_layers if n_layers is None else n_layers
    return n_blocks * block_size * layers * kv_bytes_per_token_layer(cfg.n_kv_heads, cfg.head_dim, cache_type)


def work_bytes(cfg, max_weight_elems: int) -> int:
    n = PREFILL_CHUNK
    q = cfg.n_heads * cfg.head_dim
    per_row = cfg.d_model * 2 + cfg.d_ff + q * 2 + cfg.n_kv_heads * cfg.head_dim * 2
    if cfg.n_experts:       # the moe op's rows: each token's k experts, gathered (x, gate, up, down)
        per_row += cfg.n_experts + cfg.n_experts_used * (2 * cfg.d_model + 2 * cfg.d_ff_expert)
    acts = ARENA_RING * n * per_row * 4
    tile = min(GEMM_TILE_BYTES, 2 * max_weight_elems)
    x16 = n * max(cfg.d_model, cfg.d_ff) * 2
    return acts + tile + x16 + RUNTIME_BYTES


def estimate_bytes(cfg, tensors: dict, n_ctx: int, block_size: int = 16, cache_blocks: int = 0,
                   gpu_layers: int | None = None, cache_type: str = "f16") -> dict:
    """{'weights', 'kv_cache', 'work', 'total'} in bytes for `n_ctx` tokens of context.
    With gpu_layers, only those layers' tensors (and the output head when all layers are
    on the GPU) count."""
    def on_gpu(name: str) -> bool:
        if gpu_layers is None:
            return True
        if name.startswith("blk."):
            return int(name.split(".")[1]) < gpu_layers
        return gpu_layers >= cfg.n_layers
    weights = sum(tensor_device_bytes(t) for n, t in tensors.items() if on_gpu(n))
    biggest = max((math.prod(t.shape) for t in tensors.values() if len(t.shape) == 2), default=0)
    layers = cfg.n_layers if gpu_layers is None else min(gpu_layers, cfg.n_layers)
    kv = kv_cache_bytes(cfg, n_ctx, block_size, cache_blocks, layers, cache_type)
    work = work_bytes(cfg, biggest)
    return {"weights": weights, "kv_cache": kv, "work": work, "total": weights + kv + work}
