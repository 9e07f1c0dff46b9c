"""ModelHost's sizing, without a model: the bound on cached KV blocks that keeps a CPU server's
memory flat (its pools are mapped lazily, so every block ever used stays resident)."""
from __future__ import annotations

from types import SimpleNamespace

from runtime.kv_cache import PagedKVCache
from runtime.server.host import ServeConfig, cached_blocks


def _engine(device="cpu", blocks=5826, n_ctx=4096, bytes_per_token=23040):
    cache = PagedKVCache(blocks, 16, bytes_per_token)
    return SimpleNamespace(cache=cache, block_size=16, n_ctx=n_ctx, backend=SimpleNamespace(name=device))


def test_cpu_server_bounds_its_cached_blocks_by_default():
    eng = _engine()
    assert cached_blocks(ServeConfig(), eng) is None                       # 134 MiB pool: under 8 GiB
    big = _engine(blocks=40000, bytes_per_token=1 << 14)                    # 10 GiB pool
    assert cached_blocks(ServeConfig(), big) == (8192 << 20) // ((1 << 14) * 16)   # llama-server's 8 GiB
    assert cached_blocks(ServeConfig(cache_ram=-1), eng) is None
    assert cached_blocks(ServeConfig(cache_ram=36), eng) == (36 << 20) // (23040 * 16)
    assert cached_blocks(ServeConfig(), _engine(device="cuda")) is None
